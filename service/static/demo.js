// prefixserve demo page: streams a chat answer token by token over the WebSocket (/v1/ws) or SSE
// (/v1/chat/completions with stream: true) and shows time to first token, tokens/s and cached tokens.
"use strict";
const $ = (id) => document.getElementById(id);
const history = [];       // the conversation, as chat messages
let model = null;         // served model name
let current = null;       // the running generation: {stop(), view, t0, tFirst, tokens}
let socket = null;
let nextId = 1;
const pending = new Map(); // WebSocket generation id -> handlers

// The API key, when the server has --api-key: kept for this tab (sessionStorage), sent as a Bearer
// header, and on the WebSocket as the subprotocol "openai-insecure-api-key.<key>" next to
// "prefixserve" (a browser cannot set headers on a WebSocket; the server selects "prefixserve").
const apiKey = () => sessionStorage.getItem("prefixserve-api-key") || "";
function authed(init = {}) {
  const key = apiKey();
  return key ? { ...init, headers: { ...(init.headers || {}), Authorization: "Bearer " + key } } : init;
}

function addMessage(role, text) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  el.innerHTML = '<span class="who"></span><span class="body"></span>';
  el.querySelector(".who").textContent = role;
  el.querySelector(".body").textContent = text;
  $("log").appendChild(el);
  $("log").scrollTop = $("log").scrollHeight;
  return el;
}

// Markdown, safely: the model's text only ever becomes text nodes (never HTML), inside the few elements
// built here: fenced code blocks, paragraphs, bullet lists, `code`, **bold** and *italic*.
function inline(parent, text) {
  const re = /(`[^`\n]+`|\*\*[^*\n]+\*\*|\*[^*\n]+\*)/g;
  let at = 0;
  for (const m of text.matchAll(re)) {
    if (m.index > at) parent.appendChild(document.createTextNode(text.slice(at, m.index)));
    const tok = m[0];
    const [tag, inner] = tok.startsWith("`") ? ["code", tok.slice(1, -1)]
      : tok.startsWith("**") ? ["strong", tok.slice(2, -2)] : ["em", tok.slice(1, -1)];
    const el = document.createElement(tag);
    el.textContent = inner;
    parent.appendChild(el);
    at = m.index + tok.length;
  }
  if (at < text.length) parent.appendChild(document.createTextNode(text.slice(at)));
}

function renderMarkdown(target, text) {
  const frag = document.createDocumentFragment();
  const parts = text.split(/^```[^\n]*\n?/m);          // even: prose, odd: code (an open fence streams as code)
  parts.forEach((part, i) => {
    if (i % 2 === 1) {
      const pre = document.createElement("pre");
      const code = document.createElement("code");
      code.textContent = part.replace(/\n$/, "");
      pre.appendChild(code);
      frag.appendChild(pre);
      return;
    }
    for (const block of part.split(/\n{2,}/)) {
      if (!block.trim()) continue;
      const lines = block.replace(/^\n+|\n+$/g, "").split("\n");
      if (lines.every((l) => /^\s*[-*] /.test(l))) {
        const ul = document.createElement("ul");
        for (const l of lines) { const li = document.createElement("li"); inline(li, l.replace(/^\s*[-*] /, "")); ul.appendChild(li); }
        frag.appendChild(ul);
      } else {
        const p = document.createElement("p");
        lines.forEach((l, j) => { if (j) p.appendChild(document.createElement("br")); inline(p, l); });
        frag.appendChild(p);
      }
    }
  });
  target.replaceChildren(frag);
}
window.markdownHTML = (text) => { const d = document.createElement("div"); renderMarkdown(d, text); return d.innerHTML; };

function showStats(g, usage) {
  const now = performance.now();
  if (g.tFirst !== null) $("ttft").textContent = (g.tFirst - g.t0).toFixed(0) + " ms";
  $("ntok").textContent = String(g.tokens);
  if (g.tFirst !== null && g.tokens > 1 && now > g.tFirst) {
    $("tps").textContent = ((g.tokens - 1) / ((now - g.tFirst) / 1000)).toFixed(1);
  }
  if (usage) $("cached").textContent = usage.prompt_tokens_details.cached_tokens + " / " + usage.prompt_tokens;
}

function onDelta(g, text, nTokens) {
  if (g.tFirst === null) g.tFirst = performance.now();
  g.tokens += nTokens;
  g.text += text;
  renderMarkdown(g.view.querySelector(".body"), g.text);
  $("log").scrollTop = $("log").scrollHeight;
  showStats(g, null);
}

function finish(g, usage, error, reason) {
  if (current !== g) return;
  current = null;
  g.view.classList.remove("streaming");
  if (error) {
    // an error is the server's, not the model's: its own bubble, and the question that failed is not sent
    // again with the next one (it stays on screen, marked)
    g.view.className = "msg error";
    g.view.querySelector(".who").textContent = "error";
    g.view.querySelector(".body").textContent = error;
    if (history.length && history[history.length - 1].role === "user") history.pop();
    if (g.question) g.question.classList.add("failed");
  } else if (g.text) {
    history.push({ role: "assistant", content: g.text });
    if (reason === "length") {                   // cut, not finished: say so
      const note = document.createElement("span");
      note.className = "cut";
      note.textContent = "cut at max tokens";
      g.view.appendChild(note);
    }
  } else {
    // stopped (or ended) before the first token: no empty bubble, and the question is not sent again
    g.view.remove();
    if (history.length && history[history.length - 1].role === "user") history.pop();
  }
  if (!error) showStats(g, usage);
  for (const id of ["ttft", "tps", "ntok", "cached"]) if ($(id).textContent === "…") $(id).textContent = "–";
  $("send").disabled = false;
  $("stop").disabled = true;
}

function request(messages) {
  const body = {
    model, messages, stream: true, max_tokens: Number($("max-tokens").value) || 128,
    temperature: Number($("temperature").value),
  };
  if ($("prefix").value) body.prefix = $("prefix").value;
  return body;
}

function connect() {
  if (socket && socket.readyState <= WebSocket.OPEN) return Promise.resolve(socket);
  return new Promise((resolve, reject) => {
    const protocols = apiKey() ? ["prefixserve", "openai-insecure-api-key." + apiKey()] : [];
    const ws = new WebSocket((location.protocol === "https:" ? "wss://" : "ws://") + location.host + "/v1/ws", protocols);
    ws.onopen = () => { socket = ws; resolve(ws); };
    ws.onerror = () => reject(new Error("WebSocket connection failed"));
    ws.onclose = () => {
      socket = null;
      for (const h of pending.values()) h.error("connection closed");
      pending.clear();
    };
    ws.onmessage = (ev) => {
      const m = JSON.parse(ev.data);
      const h = pending.get(m.id);
      if (!h) return;
      if (m.type === "delta") h.delta(m.text, m.token_ids.length);
      else { pending.delete(m.id); m.type === "done" ? h.done(m.usage, m.finish_reason) : h.error(m.error.message); }
    };
  });
}

async function viaWebSocket(g, body) {
  const ws = await connect();
  const id = nextId++;
  pending.set(id, { delta: (t, n) => onDelta(g, t, n), done: (u, r) => finish(g, u, null, r),
                    error: (e) => finish(g, null, e) });
  g.stop = () => ws.send(JSON.stringify({ type: "cancel", id }));
  const { stream, ...fields } = body;
  ws.send(JSON.stringify({ type: "generate", id, ...fields }));
}

async function viaSSE(g, body) {
  const abort = new AbortController();
  g.stop = () => abort.abort();
  let usage = null;
  let reason = null;
  try {
    const resp = await fetch("/v1/chat/completions", authed({
      method: "POST", headers: { "Content-Type": "application/json" }, signal: abort.signal,
      body: JSON.stringify({ ...body, stream_options: { include_usage: true }, return_token_ids: true }),
    }));
    if (!resp.ok) throw new Error((await resp.json()).error.message);
    const reader = resp.body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true });
      let cut;
      while ((cut = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, cut);
        buf = buf.slice(cut + 2);
        if (!event.startsWith("data: ") || event === "data: [DONE]") continue;
        const chunk = JSON.parse(event.slice(6));
        if (chunk.error) throw new Error(chunk.error.message);
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices) {
          onDelta(g, c.delta.content || "", (c.token_ids || []).length);
          if (c.finish_reason) reason = c.finish_reason;
        }
      }
    }
    finish(g, usage, null, reason);
  } catch (err) {
    if (abort.signal.aborted) finish(g, usage, null); else finish(g, null, err.message);
  }
}

async function send(ev) {
  ev.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || current) return;
  history.push({ role: "user", content: text });
  const question = addMessage("user", text);
  $("prompt").value = "";
  // a chosen prefix supplies the system turn: the free system field is off then (see syncSystem)
  const system = !$("prefix").value && $("system").value.trim();
  const messages = (system ? [{ role: "system", content: system }] : []).concat(history);
  const g = { t0: performance.now(), tFirst: null, tokens: 0, text: "", stop: () => {}, question,
              view: addMessage("assistant", "") };
  g.view.classList.add("streaming");
  current = g;
  $("send").disabled = true;
  $("stop").disabled = false;
  for (const id of ["ttft", "tps", "ntok", "cached"]) $(id).textContent = "…";
  try {
    await ($("transport").value === "ws" ? viaWebSocket(g, request(messages)) : viaSSE(g, request(messages)));
  } catch (err) {
    finish(g, null, err.message);
  }
}

async function init() {
  $("form").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => { if (e.key === "Enter" && !e.shiftKey) send(e); });
  $("stop").addEventListener("click", () => current && current.stop());
  // the prefix list follows the registry: reloaded when the page or the list gets focus
  window.addEventListener("focus", loadPrefixes);
  $("prefix").addEventListener("focus", loadPrefixes);
  $("prefix").addEventListener("change", syncSystem);
  $("clear").addEventListener("click", () => { history.length = 0; $("log").textContent = ""; });
  for (let i = 0; i < 600; i++) {
    const health = await fetch("/health").then((r) => r.json()).catch(() => ({ status: "down" }));
    $("health").textContent = health.status;
    $("health").className = "pill " + (health.status === "ok" ? "ok" : "bad");
    if (health.status === "ok") break;
    await new Promise((r) => setTimeout(r, 1000));
  }
  $("api-key").addEventListener("change", () => {
    sessionStorage.setItem("prefixserve-api-key", $("api-key").value.trim());
    if (socket) socket.close();
    loadModel();
  });
  await loadModel();
}

async function loadModel() {
  const resp = await fetch("/v1/models", authed());
  if (resp.status === 401) {
    $("model").textContent = "API key needed";
    $("api-key").hidden = false;
    $("api-key").focus();
    return;
  }
  const models = await resp.json();
  model = models.data[0].id;
  $("model").textContent = model + " · " + models.data[0].max_model_len + " ctx";
  document.title = "prefixserve · " + model;
  // leave room for the conversation: at most a quarter of the context by default
  const ctx = models.data[0].max_model_len;
  const cap = Math.max(16, Math.floor(ctx / 4));
  $("max-tokens").max = String(ctx);
  if (Number($("max-tokens").value) > cap) $("max-tokens").value = String(cap);
  await loadPrefixes();
}

// With a prefix chosen, the prefix is the system turn: the free system field is disabled (and not sent).
function syncSystem() {
  const on = Boolean($("prefix").value);
  $("system").disabled = on;
  $("system").title = on ? "the chosen prefix supplies the system prompt" : "";
}

// The prefix dropdown: registered prefixes chat can use on this replica, from GET /v1/prefixes: loaded
// (records of another model are listed as not loaded) and registered with messages (a prompt prefix is
// for completions: a chat request naming it is refused).
async function loadPrefixes() {
  const listing = await fetch("/v1/prefixes", authed()).then((r) => (r.ok ? r.json() : null)).catch(() => null);
  const loaded = listing && Array.isArray(listing.data)
    ? listing.data.filter((p) => p.loaded !== false && p.kind !== "prompt") : [];
  const select = $("prefix");
  const key = loaded.map((p) => p.name + ":" + p.num_tokens).join(",");
  if (select.dataset.key === key) return;      // unchanged: leave an open list alone
  select.dataset.key = key;
  const chosen = select.value;
  select.replaceChildren(new Option("none", ""));
  for (const p of loaded) {
    const opt = new Option(p.name + " · " + p.num_tokens + " tokens", p.name);
    if (p.description) opt.title = p.description;
    select.appendChild(opt);
  }
  if (loaded.some((p) => p.name === chosen)) select.value = chosen;
  $("prefix-label").hidden = loaded.length === 0;
  syncSystem();
}

init();
