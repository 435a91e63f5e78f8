"""prefixserve's HTTP face: aiohttp on uvloop, OpenAI-compatible SSE, a multiplexed WebSocket, metrics, demo page.

    app.py        the application: middlewares, routes, the engine's lifetime (cleanup_ctx)
    state.py      ServiceState: the engine once loaded, the registry, the drain flag; `ready()` per request
    tokenizer_threads.py  where bodies are parsed and tokenized: a small bodies' thread, a large ones' thread
    config.py     ServiceConfig (holding the EngineConfig); flags.py: flags and PREFIXSERVE_* from both
    errors.py     the OpenAI error shape and the one mapping of domain errors to HTTP
    logs.py       text or JSON log lines
    tenants.py    Caller: a request's tenant, and the cache salts that keep tenants apart
    usage.py      Usage: the tokens a request used (counted by a generation, summed by the access log)
    token_text.py TokenText: a token id's string and bytes, for logprobs (one per loaded engine)
    middleware/   access log, metrics, cross-site, keys, security headers
    openai/       the generation API: the request pipeline, schema, chat and completions
    routes/       prefixes, WebSocket, tokenize, status, the router's worker API, OpenAPI
    static/       the demo page

The service talks to the engine through AsyncEngine's public API only, and to the named-prefix domain
(prefix_store/) through its registry. `python -m service` runs the `prefixserve` CLI (cli.py).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("prefixserve")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"
