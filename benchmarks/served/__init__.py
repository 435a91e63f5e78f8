"""Benchmarks over HTTP: servers started as processes on loopback, clients in this one (and peers beside ours)."""
