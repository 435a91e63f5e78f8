"""prefixserve engine: paged KV cache, prefix sharing, continuous batching. No HTTP, no Redis.

The four faces, from the inside out:
    core.py          EngineCore: tokens in, tokens out (schedule, run, sample, token-level stops)
                     admission.py: the checks a request passes before it waits (fixed inputs, the cache)
    llm_engine.py    LLMEngine: the core + text (output processor) + pins, driven by one thread
                     pinning.py: the pin state machine it drives (compute a prefix, pin it, undo it)
    async_engine.py  AsyncEngine: the asyncio face the service uses (an engine thread, streams)
                     request_stream.py: RequestStream, a caller's outputs merged while it lags
    llm.py           LLM: the offline, vLLM-shaped user API
and config.py (EngineConfig: every knob), sequence.py (SamplingParams and its ranges, requests,
sequences), outputs.py (what comes back), errors.py (the engine's refusals).

By concern: kv/ (blocks, block tables, KV backends), sched/ (scheduler, forks), sample/ (sampler,
logits processors, structured output), output/ (detokenizer, output processor), worker/ (model runner,
compiled decode), models/ (model code, loaders, quantization).
"""
from engine.config import EngineConfig
from engine.errors import EngineDead, EngineError, InvalidRequest, PinCapExceeded, QueueFull
from engine.outputs import CompletionOutput, RequestOutput
from engine.sequence import SamplingParams

__all__ = [
    "AsyncEngine", "CompletionOutput", "EngineConfig", "EngineDead", "EngineError", "InvalidRequest", "LLM",
    "LLMEngine", "PinCapExceeded", "QueueFull", "RequestOutput", "SamplingParams",
]


def __getattr__(name: str):  # heavy modules (torch, transformers) load on first use
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncEngine":
        from engine.async_engine import AsyncEngine
        return AsyncEngine
    raise AttributeError(name)
