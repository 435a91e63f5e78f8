"""The OpenAI-compatible generation API: one request pipeline, and each surface's shape of the answer.

    pipeline.py      ready -> read -> parse -> prefix -> limits -> tokenize -> grammar -> submit -> answer
    schema.py        one typed model per request body (validation and /openapi.json)
    params.py        a validated body's meaning: SamplingParams and the response options
    render.py        token ids: chat templates, completion prompts, the named prefix composed in
    generation.py    one request's engine requests as OpenAI choices (deltas, Usage: service/usage.py)
    chat.py, completions.py   the two surfaces' shaping (chunks and bodies)
    responses/       the Responses API: its requests as chat requests (api.py), its items and events
                     (shaper.py), the stored responses shared between tenants (store.py), prompt_cache.py
    sse.py, logprobs.py, tools.py   server-sent events, logprobs in both shapes (TokenText: service/token_text.py),
                     tool calls
"""
