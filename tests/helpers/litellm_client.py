"""Run by tests/service/openai/test_real_model_http.py with .venv-clients' python (litellm cannot share .venv):
litellm against a server as an application uses it; prints what it got as one JSON object.

    python litellm_client.py BASE_URL MODEL
"""
from __future__ import annotations

import json
import sys

import litellm

base, name = sys.argv[1], sys.argv[2]
kw = {"model": f"openai/{name}", "api_base": f"{base}/v1", "api_key": "unused", "temperature": 0.0, "max_tokens": 16}
ask = {"role": "user", "content": "What is the capital of France?"}
first = litellm.completion(messages=[ask], **kw)
out = {"text": first.choices[0].message.content}
# its own message object sent back as history (it carries provider_specific_fields)
second = litellm.completion(messages=[ask, first.choices[0].message, {"role": "user", "content": "And of Italy?"}],
                            **kw)
out["second"] = second.choices[0].message.content
out["streamed"] = "".join(c.choices[0].delta.content or "" for c in litellm.completion(messages=[ask], stream=True,
                                                                                         **kw))
weather = {"type": "function", "function": {"name": "get_weather", "description": "The weather of a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
called = litellm.completion(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[weather],
                            tool_choice="required", **{**kw, "max_tokens": 48})
out["tool"] = called.choices[0].message.tool_calls[0].function.name
out["usage"] = called.usage.prompt_tokens
print(json.dumps(out))
