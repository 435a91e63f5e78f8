"""Run by tests/service/anthropic/test_clients.py with .venv-clients' python (litellm cannot share .venv): litellm's
Anthropic provider pointed at a server's /v1/messages, as an application uses it; prints one JSON object.

    python litellm_anthropic_client.py BASE_URL MODEL
"""
from __future__ import annotations

import json
import sys
import uuid

import litellm

base, name = sys.argv[1], sys.argv[2]
kw = {"model": f"anthropic/{name}", "api_base": base, "api_key": "unused", "temperature": 0.0, "max_tokens": 12}
ask = {"role": "user", "content": "What is the capital of France?"}
out = {"text": litellm.completion(messages=[ask], **kw).choices[0].message.content}
out["streamed"] = "".join(c.choices[0].delta.content or "" for c in litellm.completion(messages=[ask], stream=True,
                                                                                         **kw))
weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
called = litellm.completion(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[weather],
                            tool_choice="required", **{**kw, "max_tokens": 32})
out["tool"] = called.choices[0].message.tool_calls[0].function.name
system = {"role": "system", "content": [{"type": "text", "text": f"Desk {uuid.uuid4().hex[:6]}. " + "Be brief. " * 40,
                                         "cache_control": {"type": "ephemeral"}}]}
usage = [litellm.completion(messages=[system, ask], **{**kw, "max_tokens": 2}).usage for _ in range(2)]
out["cache_write"] = usage[0].cache_creation_input_tokens or 0
out["cache_read"] = usage[1].prompt_tokens_details.cached_tokens or 0
print(json.dumps(out))
