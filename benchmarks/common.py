"""Shared by the benchmark scripts: the machine description, result files and synthetic workloads."""
from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict[str, Any]:
    import torch
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cpu": platform.processor() or platform.machine()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    else:
        import os
        info["device"] = f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    return info


def sharegpt_like_lengths(n: int, seed: int, mean_in: float = 161, mean_out: float = 338, scale: float = 1.0,
                          max_len: int = 1024) -> list[tuple[int, int]]:
    """Input/output lengths shaped like ShareGPT (vLLM paper: mean 161 in, 338 out): log-normal with
    sigma 1.0 and the given means, times `scale`, clipped to [4, max_len]. Deterministic for a seed."""
    rng = np.random.default_rng(seed)
    sigma = 1.0
    def draw(mean: float) -> np.ndarray:
        mu = np.log(mean * scale) - sigma ** 2 / 2
        return np.clip(np.round(rng.lognormal(mu, sigma, n)), 4, max_len).astype(int)
    return list(zip(draw(mean_in).tolist(), draw(mean_out).tolist()))


def write_results(name: str, table_md: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    out = out_dir or RESULTS
    out.mkdir(parents=True, exist_ok=True)
    payload = dict(payload, machine=machine(), command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]),
                   date=time.strftime("%Y-%m-%d %H:%M:%S"))
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2))
    m = payload["machine"]
    (out / f"{name}.md").write_text(
        f"# {name}\n\nDevice: {m['device']}; torch {m['torch']}, triton {m['triton']}. Command: "
        f"`{payload['command']}` ({payload['date']}).\n\n{table_md}\n")
    return out / f"{name}.md"
