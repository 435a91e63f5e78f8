"""Scheduling: which sequences run each step, and the request shapes that fork.

    scheduler.py     continuous batching: decodes, chunked prefills, admissions, preemption by recompute
    queues.py        the waiting requests, one queue per tenant taking turns; whom to preempt
    forks.py         n > 1 samples and beam search sharing their prompt's blocks (copy-on-write)
    beam_search.py   the beam search itself (scores, length penalty, early stopping)
"""
