"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens): a shaper over the chat request
pipeline. schema (the request bodies), translate (to a chat request; cache_control breakpoints), messages
(the handlers, usage, diagnostics), events (the event stream)."""
