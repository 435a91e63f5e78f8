"""Shared by the benchmark scripts: arguments, the machine description, result files, plots, workloads
and a small driver that steps an LLMEngine by hand.

Every benchmark module has `main(argv) -> int`, takes the arguments of `add_common_args`, writes
`<name>.md`, `<name>.png` and `<name>.json` into --out and prints `RESULT {json}` as its last line.
"""
from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.config import QUANTIZATIONS
from engine.kv import backends as kv_backends

if TYPE_CHECKING:
    from aiohttp import ClientResponse
    from matplotlib.figure import Figure

    from engine.llm_engine import LLMEngine
    from engine.outputs import RequestOutput
    from engine.sequence import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results"


def add_common_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="a small workload: minutes on a 2-core CPU")
    ap.add_argument("--model", default=None, help="checkpoint directory or .gguf file (default: the built-in model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default=None, choices=list(QUANTIZATIONS),
                    help="weights of the engines measured (default: the checkpoint's own: int4 for the built-in model)")
    ap.add_argument("--kv-backend", default="paged", choices=kv_backends.names(),
                    help="KV cache backend of the engines measured (vattention: CPU only)")
    ap.add_argument("--out", type=Path, default=None,
                    help=f"where the .md, .png and .json go (default: a new scratch folder; the committed results "
                         f"are in {RESULTS.relative_to(RESULTS.parents[1])})")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads on CPU (default 1: on a shared 2-core machine two OpenMP "
                         "threads made the demo model ~10x slower, see benchmarks/README.md); 0 = torch's default")
    ap.add_argument("--seed", type=int, default=0)


def setup_torch(args: argparse.Namespace) -> None:
    import torch
    if args.threads > 0 and not str(args.device).startswith("cuda"):
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)


def command_line(prog: str, argv: Sequence[str]) -> str:
    """The command as the user typed it, e.g. `prefixserve bench memory --quick`."""
    return " ".join([prog, *map(shlex.quote, argv)])


def machine() -> dict[str, Any]:
    import torch
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cpu": _cpu_name(), "cpu_info": cpu_info(), "torch_threads": torch.get_num_threads()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
    else:
        import os
        info["device"] = f"CPU: {info['cpu']} ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# The matrix and vector extensions that decide which GEMM kernels a CPU gets: /proc/cpuinfo flag -> name.
ISA_FLAGS = {"avx2": "AVX2", "avx512f": "AVX-512", "avx512_bf16": "AVX-512-BF16", "avx512_vnni": "AVX-512-VNNI",
             "avx_vnni": "AVX-VNNI", "amx_tile": "AMX", "amx_bf16": "AMX-BF16", "amx_int8": "AMX-INT8"}


def cpu_info(cpuinfo: str | None = None) -> dict[str, Any]:
    """The CPU's name, vendor, family / model / stepping numbers and which of ISA_FLAGS it has, from the
    first processor of /proc/cpuinfo (or the text given); plus the kernel level torch's CPU dispatch chose."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            if fields:
                break                                   # the first processor is enough
            continue
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set(fields.get("flags", "").split())
    info: dict[str, Any] = {"name": fields.get("model name") or platform.processor() or platform.machine(),
                            "vendor": fields.get("vendor_id", ""), "family": fields.get("cpu family", ""),
                            "model": fields.get("model", ""), "stepping": fields.get("stepping", ""),
                            "isa": {name: flag in flags for flag, name in ISA_FLAGS.items()}}
    try:
        import torch
        info["torch_capability"] = torch.backends.cpu.get_cpu_capability()
    except (ImportError, AttributeError):
        info["torch_capability"] = None
    return info


def cpu_line(info: dict[str, Any], cores: int | None = None) -> str:
    """`AMD EPYC (AuthenticAMD family 25 model 1 stepping 1), 2 cores; ISA: AVX2 yes, AVX-512 no, ...`."""
    ident = " ".join(x for x in (info["vendor"], info["family"] and f"family {info['family']}",
                                 info["model"] and f"model {info['model']}",
                                 info["stepping"] and f"stepping {info['stepping']}") if x)
    isa = ", ".join(f"{name} {'yes' if has else 'no'}" for name, has in info["isa"].items())
    torch_level = f"; torch's CPU kernels: {info['torch_capability']}" if info.get("torch_capability") else ""
    return (f"{info['name']}" + (f" ({ident})" if ident else "") + (f", {cores} cores" if cores else "") +
            f"; ISA: {isa}{torch_level}")


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


def random_prompts(lengths: Sequence[int], vocab: int, seed: int) -> list[list[int]]:
    """Random token ids in [3, vocab): distinct prompts that never hit each other's blocks."""
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=n).tolist() for n in lengths]


def median_ratio(num: Sequence[float], den: Sequence[float]) -> float:
    """Median of the paired ratios num[i] / den[i] (pairs measured back to back)."""
    return statistics.median(a / b for a, b in zip(num, den))


# -- driving the engine by hand ------------------------------------------------------------------
def run_engine(engine: LLMEngine, prompts: Sequence[list[int]], params: SamplingParams | Sequence[SamplingParams],
               on_step: Callable[[LLMEngine], None] | None = None, prefix: str = "req") -> list[RequestOutput]:
    """Adds every prompt, steps until all finish (calling `on_step` after each step) and returns the
    final outputs in prompt order. Streamed deltas are dropped: only the finished output is kept,
    which for n > 1 / beam search holds the whole sequences and for n == 1 at least the last delta."""
    per = list(params) if isinstance(params, Sequence) else [params] * len(prompts)
    rids = [f"{prefix}-{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, p, sp in zip(rids, prompts, per):
        engine.add_request(rid, list(p), sp)
    done: dict[str, RequestOutput] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if on_step is not None:
            on_step(engine)
    return [done[r] for r in rids]


# -- results -------------------------------------------------------------------------------------
async def sse_events(resp: ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of a streamed response's `data: {...}` events as they arrive (`data: [DONE]`, comments
    and keep-alives skipped): the one SSE reader of the benchmark clients."""
    buf = b""
    async for data in resp.content.iter_any():
        buf += data.replace(b"\r\n", b"\n")
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            event = event.strip()
            if event.startswith(b"data: {"):
                yield json.loads(event[6:])


def new_figure(ncols: int = 1, width: float = 6.0, height: float = 4.0) -> tuple[Figure, Any]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, axes[0]


def write_results(name: str, table_md: str, payload: dict[str, Any], out_dir: Path | None = None,
                  figure: Figure | None = None, command: str | None = None) -> Path:
    """Writes <name>.md (device, command, table, the plot embedded), <name>.png and <name>.json into
    `out_dir`, or a new scratch folder (said on stderr) when it is None."""
    out = Path(out_dir) if out_dir is not None else scratch_dir(name)
    out.mkdir(parents=True, exist_ok=True)
    cmd = command or " ".join([Path(sys.argv[0]).name] + sys.argv[1:])
    png = None
    if figure is not None:
        png = out / f"{name}.png"
        figure.tight_layout()
        figure.savefig(png, dpi=110)
        import matplotlib.pyplot as plt
        plt.close(figure)
    payload = dict(payload, machine=machine(), command=cmd, date=time.strftime("%Y-%m-%d %H:%M:%S"),
                   png=png.name if png else None)
    (out / f"{name}.json").write_text(json.dumps(payload, indent=2))
    m = payload["machine"]
    plot = f"\n![{name}]({png.name})\n" if png else ""
    (out / f"{name}.md").write_text(
        f"# {name}\n\nDevice: {m['device']}; torch {m['torch']}, triton {m['triton']}. Command: "
        f"`{cmd}` ({payload['date']}).\n\n{table_md}\n{plot}")
    return out / f"{name}.md"


def scratch_dir(name: str) -> Path:
    """A new folder for a run's results when no --out was given (the committed ones stay untouched)."""
    path = Path(tempfile.mkdtemp(prefix=f"prefixserve-bench-{name}-"))
    print(f"results go to {path} (pass --out to choose)", file=sys.stderr)
    return path


def print_result(result: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(result), flush=True)
