"""Usage: the tokens a request used, in OpenAI's `usage` object. A Generation counts them
(openai/generation.py); the access log sums a request's (a WebSocket's generations) into its line
(middleware/access_log.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_write_tokens: int = 0     # prompt tokens this request wrote into the prefix cache (OpenAI's name)

    def as_dict(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens,
                                          "cache_write_tokens": self.cache_write_tokens}}
