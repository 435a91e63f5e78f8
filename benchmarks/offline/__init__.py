"""Benchmarks that drive the engine in this process (LLM / LLMEngine), one per module."""
