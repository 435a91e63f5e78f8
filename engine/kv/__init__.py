"""KV memory: which blocks hold which tokens, and the memory behind them.

    block_pool.py       blocks, ref counts, pins, content hashes, the LRU free queue (stdlib only)
    block_manager.py    per-sequence block tables over the pool: prefix-cache lookup, growth, forks (stdlib only)
    events.py           vLLM-format KV cache events: the pool's sink and the wire encoding
    event_publisher.py  the ZMQ publisher thread (PUB + replay ROUTER)
    backends/           the memory itself: a registry of KV backends (paged, vattention)
    tier/               the KV tier below the cache: evicted and pinned blocks on disk, loaded back verified
"""
