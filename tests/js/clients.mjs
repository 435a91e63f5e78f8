// Run by tests/service/test_js_clients.py: the JavaScript clients against a running server, as an application
// uses them; prints one JSON object of what each got (the test asserts on it).
//     node clients.mjs BASE_URL MODEL
import Anthropic from "@anthropic-ai/sdk";
import OpenAI from "openai";
import { generateObject, streamText } from "ai";
import { createOpenAI } from "@ai-sdk/openai";
import { createAnthropic } from "@ai-sdk/anthropic";
import { z } from "zod";

const [base, model] = process.argv.slice(2);
const out = {};
const ask = "What is the capital of France?";

// the anthropic SDK: create, stream, count_tokens, cache_control (both TTLs), a tool round trip
const claude = new Anthropic({ baseURL: base, apiKey: "unused", maxRetries: 0 });
const msg = await claude.messages.create({ model, max_tokens: 12, temperature: 0, messages: [{ role: "user", content: ask }] });
out.anthropic_text = msg.content.map((b) => b.text ?? "").join("");
const stream = claude.messages.stream({ model, max_tokens: 12, temperature: 0, messages: [{ role: "user", content: ask }] });
const events = [];
stream.on("streamEvent", (e) => events.push(e.type));
out.anthropic_streamed = await stream.finalText();
out.anthropic_events = [...new Set(events)];
out.anthropic_count = (await claude.messages.countTokens({ model, messages: [{ role: "user", content: ask }] })).input_tokens;
const system = [{ type: "text", text: `Desk ${Math.random().toString(36).slice(2)}: ` + "You answer questions about Acme Rockets. ".repeat(12), cache_control: { type: "ephemeral", ttl: "1h" } }];
const notes = [{ role: "user", content: [{ type: "text", text: "Order notes: ".concat("engine, pad, rocket; ".repeat(10)), cache_control: { type: "ephemeral", ttl: "5m" } }, { type: "text", text: "Summarize." }] }];
out.cache = [];
for (let i = 0; i < 2; i++) {
  const r = await claude.messages.create({ model, max_tokens: 4, system, messages: notes });
  out.cache.push(r.usage);
}
const weather = { name: "get_weather", description: "The current weather of a city", input_schema: { type: "object", properties: { city: { type: "string" } }, required: ["city"] } };
const convo = [{ role: "user", content: "What is the weather in Paris?" }];
const call = await claude.messages.create({ model, max_tokens: 32, temperature: 0, tools: [weather], tool_choice: { type: "any" }, messages: convo });
const use = call.content.find((b) => b.type === "tool_use");
out.tool = { stop_reason: call.stop_reason, name: use?.name, input: use?.input };
convo.push({ role: "assistant", content: call.content });
convo.push({ role: "user", content: [{ type: "tool_result", tool_use_id: use.id, content: "18 C and sunny" }] });
const after = await claude.messages.create({ model, max_tokens: 8, temperature: 0, tools: [weather], messages: convo });
out.tool_after = after.content.map((b) => b.type);

// the openai SDK
const openai = new OpenAI({ baseURL: `${base}/v1`, apiKey: "unused", maxRetries: 0 });
const chat = await openai.chat.completions.create({ model, max_tokens: 12, temperature: 0, messages: [{ role: "user", content: ask }] });
out.openai_text = chat.choices[0].message.content;
out.openai_cached = chat.usage.prompt_tokens_details.cached_tokens;

// the Vercel AI SDK: generateObject with each provider's defaults, streamText
const schema = z.object({ name: z.string(), country: z.string() });
const providers = { openai: createOpenAI({ baseURL: `${base}/v1`, apiKey: "unused" })(model),
                    anthropic: createAnthropic({ baseURL: `${base}/v1`, apiKey: "unused" })(model) };
out.objects = {};
for (const [name, m] of Object.entries(providers)) {
  const r = await generateObject({ model: m, schema, prompt: "Which city is the capital of France? Give its name and country.", maxOutputTokens: 40, temperature: 0 });
  out.objects[name] = r.object;
}
const st = streamText({ model: providers.anthropic, prompt: ask, maxOutputTokens: 8, temperature: 0 });
let streamed = "";
for await (const piece of st.textStream) streamed += piece;
out.vercel_streamed = streamed;
console.log(JSON.stringify(out));
