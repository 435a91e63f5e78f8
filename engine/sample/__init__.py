"""From logits to tokens.

    sampler.py            greedy, temperature, top-k, top-p, min-p, per-request seeds, log-probabilities
    logits_processors.py  logit_bias, min_tokens, repetition / presence / frequency penalties, batched
    structured.py         structured output: xgrammar grammars (compiled once, cached) and their masks
    grammar_probe.py      a grammar's first compile, in a child process killed at the timeout or on cancel
    grammar_cache.py      compiled grammars kept for reuse, LRU, bounded by count and bytes
"""
