"""JSON schemas the grammar tests compile."""
from __future__ import annotations


def patterns_schema(n: int, bound: int, step: int = 1) -> dict:
    """n required strings, each matching its own length-bounded pattern (`[a-z0-9]{1,bound + step i}`: each a rule of
    its own): seconds of CPU to compile with xgrammar 0.2.8 and 0.2.9 alike (20 x 2,000: 7 s on the tiny
    checkpoint's vocabulary, 10 s on SmolLM2's; 40 x 2,000: 15 s on the tiny one). 0.2.9 compiles long maxLength
    strings at once (0.03 s for 200 x 10,000, two minutes on 0.2.8), so those no longer make a slow schema."""
    return {"type": "object",
            "properties": {f"p{i}": {"type": "string", "pattern": f"[a-z0-9]{{1,{bound + step * i}}}"}
                           for i in range(n)},
            "required": [f"p{i}" for i in range(n)], "additionalProperties": False}
