"""The endpoints beyond the two generation surfaces.

    prefixes.py     POST/GET/DELETE /v1/prefixes: the named-prefix registry's HTTP face
    websocket.py    GET /v1/ws: generations multiplexed on one socket (through the request pipeline)
    tokens.py       POST /tokenize, /detokenize
    status.py       /health, /metrics, /v1/models, /version
    worker_api.py   what a router asks of a worker (render, server info, load, KV event sources, flush)
    openapi.py      GET /openapi.json, from the request models
"""
