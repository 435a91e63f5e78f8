"""prefixserve engine: paged KV cache, prefix sharing, continuous batching. No HTTP, no Redis."""
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
