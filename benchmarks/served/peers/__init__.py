"""`prefixserve bench peers`: prefixserve beside vLLM's CPU backend and llama.cpp's server on this machine
(bench.py; the servers, the client, the prompts, the workloads, the contention run, the oneDNN kernel record
and the report each in a module of its own)."""
from benchmarks.served.peers.bench import main

__all__ = ["main"]
