"""prefixserve's HTTP face: aiohttp on uvloop, OpenAI-compatible SSE, a multiplexed WebSocket, metrics, demo page."""
