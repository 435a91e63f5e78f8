"""Token ids of what the model reads: chat messages through the model's template, completion prompts, and
a named prefix composed in.

A named prefix composes at the level its source was registered at:
- registered with `messages`, named by a chat request: the chat template renders the prefix's messages
  followed by the request's, once (a template's default system prompt or BOS appears once); the
  registration checked that such a rendering starts with the prefix's pinned tokens;
- registered with `messages` or a `prompt`, named by a completion: the prefix's tokens, then the
  prompt's, encoded without the tokenizer's special tokens (no second BOS);
- registered with a `prompt`, named by a chat request: refused (400); there is no message to put first.

NOTE: runs on the tokenizer thread (service/openai/pipeline.py), the one thread that encodes with
`AsyncEngine.tokenizer`: a Hugging Face fast tokenizer reconfigures itself on each encode (the split special
tokens below), so it is never encoded with from two threads (engine/async_engine.py, "Who owns what").
"""
from __future__ import annotations

from typing import Any

from prefix_store.local import PrefixSnapshot
from service.errors import ApiError, invalid
from service.openai.params import Parsed
from service.openai.schema import ChatCompletionRequest, ChatMessage, CompletionRequest
from service.openai.segments import SegmentTokens


def tokenize(parsed: Parsed, tokenizer: Any, prefix: PrefixSnapshot | None, segments: SegmentTokens | None = None,
             salt: str | None = None) -> list[list[int]]:
    """The prompts' token ids, the named prefix composed in (see the module docstring). `segments`: the long
    stretches of a chat rendering looked up there (under the caller's cache `salt`) rather than encoded again."""
    body = parsed.body
    if isinstance(body, ChatCompletionRequest):
        messages = template_messages(body.messages)
        if prefix is not None:
            if prefix.messages is None:
                raise invalid(f"prefix {prefix.name!r} was registered with a prompt; a chat request can only name "
                              "a prefix registered with messages", "prefix")
            messages = [dict(m) for m in prefix.messages] + messages
        plan = parsed.req.tools
        if plan is not None and plan.mode == "auto" and not template_renders_tools(tokenizer):
            raise invalid("this model's chat template does not show tools to the model, so it cannot choose to call "
                          "one: start the server with --chat-template <a template that renders tools>, or use "
                          "tool_choice \"required\" or name a function", "tool_choice")
        tools = plan.template_tools() if plan is not None else None
        cont = bool(body.continue_final_message)
        extra = template_kwargs(body.chat_template_kwargs)
        return [render_messages(messages, tokenizer, add_generation_prompt=body.add_generation_prompt is not False
                                and not cont, tools=tools, continue_final=cont, extra=extra, segments=segments,
                                salt=salt)]
    if prefix is None:
        return parse_prompts(body, tokenizer)
    head = list(prefix.token_ids)
    prompt = body.prompt
    if isinstance(prompt, str):
        return [head + encode_prompt(tokenizer, prompt, special_tokens=False)]
    if all(isinstance(p, str) for p in prompt):
        return [head + encode_prompt(tokenizer, p, special_tokens=False) for p in prompt]  # type: ignore[arg-type]
    return [head + p for p in parse_prompts(body, tokenizer)]


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the chat template shows `tools` to the model (it renders differently with one)."""
    probe = [{"role": "user", "content": "hi"}]
    tool = {"type": "function", "function": {"name": "probe_tool_7f3a", "description": "probe",
                                             "parameters": {"type": "object", "properties": {}}}}
    try:
        with_tools = tokenizer.apply_chat_template(probe, tools=[tool], tokenize=False, add_generation_prompt=True)
        without = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    except Exception:
        return False
    return bool(with_tools != without and "probe_tool_7f3a" in with_tools)


def parse_prompts(req: CompletionRequest, tokenizer: Any) -> list[list[int]]:
    """`prompt` as a string, a list of strings, token ids, or a list of token-id lists: one entry each."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [encode_prompt(tokenizer, prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [encode_prompt(tokenizer, p) for p in prompt]  # type: ignore[arg-type]
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [list(p) for p in prompt]  # type: ignore[arg-type]


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: role and text content (plus tool fields when set)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


# Template variables a request's chat_template_kwargs may not set: the request's own fields, and what would
# change how the rendering is tokenized or returned.
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                                      "continue_final_message", "tokenize", "return_dict", "return_tensors",
                                      "chat_template", "padding", "truncation", "max_length", "tokenizer_kwargs",
                                      "return_assistant_tokens_mask", "bos_token", "eos_token"})


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's chat_template_kwargs: more variables for the chat template (a template that does not use one
    renders as without it); the reserved names are refused."""
    if not kwargs:
        return {}
    bad = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise invalid(f"chat_template_kwargs may not set {bad[0]!r} (use the request field)", "chat_template_kwargs")
    return dict(kwargs)


def render_text(clean: list[dict[str, Any]], tokenizer: Any, add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None, continue_final: bool = False,
                extra: dict[str, Any] | None = None) -> str:
    """The chat template's rendering of `clean` messages (and `tools`, for templates that take them).
    `continue_final`: the last message is left open, for the model to go on with it. `extra`: more template
    variables (chat_template_kwargs)."""
    try:
        return str(tokenizer.apply_chat_template(clean, tools=tools, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final, tokenize=False,
                                                 **(extra or {})))
    except Exception as exc:  # a template that raises on this input (jinja's raise_exception, bad roles)
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None


def render_messages(clean: list[dict[str, Any]], tokenizer: Any, add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None, continue_final: bool = False,
                    extra: dict[str, Any] | None = None, segments: SegmentTokens | None = None,
                    salt: str | None = None) -> list[int]:
    """Token ids of the chat template's rendering; the template adds the special tokens. `segments`: where the
    rendering's long stretches (a system prompt sent with every request) are kept, under the caller's `salt`.

    NOTE: message content is text. A message holding the text of a special token (a user typing
    `<|im_end|>\n<|im_start|>system ...` to forge a system turn) gets that text encoded as ordinary
    tokens, never as the control token: the template's own parts and each content are encoded apart,
    the contents with the special tokens split. Content without such text (nearly all) is encoded with
    the whole rendering at once, exactly as before."""
    text = render_text(clean, tokenizer, add_generation_prompt, tools, continue_final, extra)
    specials = _special_texts(tokenizer)
    contents = [m["content"] for m in clean]
    if not any(s in c for c in contents for s in specials):
        if segments is not None:
            return segments.encode(tokenizer, text, salt)
        return list(tokenizer.encode(text, add_special_tokens=False))
    marks = [f"\ue000{i}\ue001" for i in range(len(clean))]          # private-use code points
    marked = render_text([{**m, "content": mark} for m, mark in zip(clean, marks)], tokenizer,
                         add_generation_prompt, tools, continue_final, extra)
    pieces, rest = [], marked
    for mark in marks:
        if rest.count(mark) != 1:
            raise _unrenderable(specials)
        head, rest = rest.split(mark)
        pieces.append(head)
    if "".join(p + c for p, c in zip(pieces, contents)) + rest != text:   # the template changed content
        raise _unrenderable(specials)
    ids: list[int] = []
    for piece, content in zip(pieces, contents):
        ids += tokenizer.encode(piece, add_special_tokens=False)
        ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids + tokenizer.encode(rest, add_special_tokens=False)


def _special_texts(tokenizer: Any) -> list[str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted({t.content for t in decoder.values() if getattr(t, "special", False)} |
                  set(getattr(tokenizer, "all_special_tokens", [])))


def _unrenderable(specials: list[str]) -> ApiError:
    return invalid("a message contains the text of a special token (one of " + ", ".join(specials[:5]) +
                   ") and this model's chat template does not keep message content as written, so it "
                   "cannot be encoded as plain text", "messages")


def encode_prompt(tokenizer: Any, text: str, special_tokens: bool = True) -> list[int]:
    """A completion prompt's tokens. NOTE: like vLLM, a prompt gets the tokenizer's own special tokens (e.g.
    Llama's BOS), unless it follows a prefix (`special_tokens=False`), which already starts the sequence."""
    return list(tokenizer.encode(text, add_special_tokens=special_tokens))
