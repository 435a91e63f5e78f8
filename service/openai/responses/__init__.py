"""The Responses API (POST /v1/responses and the stored-response routes): a shaper over the chat request
pipeline. api (requests as chat requests, the handlers), shaper (items and events), store (the stored
responses, shared fairly between tenants), prompt_cache (the prompt-cache options beyond the lease: retention,
diagnostics of a miss against an earlier response)."""
