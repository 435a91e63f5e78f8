"""`prefixserve serve` (the HTTP service) and `prefixserve generate` (offline, streams to the terminal).

Every flag also reads an environment variable: --redis-url <- PREFIXSERVE_REDIS_URL, and so on.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from typing import Any

from service.config import ServiceConfig


def _opt_int(value: str) -> int | None:
    return None if value.lower() in ("", "none") else int(value)


def _opt_str(value: str) -> str | None:
    return None if value.lower() in ("", "none") else value


def _add(p: argparse.ArgumentParser, flag: str, type: Any, default: Any, help: str) -> None:
    env = "PREFIXSERVE_" + flag.lstrip("-").replace("-", "_").upper()
    p.add_argument(flag, type=type, default=os.environ.get(env, default), help=f"{help} [env {env}]")


def _engine_flags(p: argparse.ArgumentParser) -> None:
    _add(p, "--model", _opt_str, None, "checkpoint directory (default: the built-in demo model)")
    _add(p, "--device", str, "cpu", "torch device")
    _add(p, "--dtype", str, "float32", "float32 | bfloat16 | float16")
    _add(p, "--block-size", int, 16, "KV cache block size in tokens")
    _add(p, "--num-kv-blocks", _opt_int, None, "KV cache blocks (default: sized from memory)")
    _add(p, "--max-num-seqs", int, 128, "max running sequences per step")
    _add(p, "--max-model-len", _opt_int, None, "context length cap (default: the model's)")
    _add(p, "--attention-backend", _opt_str, None, "torch | triton (default: triton on CUDA)")
    _add(p, "--torch-threads", _opt_int, None, "torch intra-op threads (default: torch's; 1 is faster on "
         "CPUs shared with other work)")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="prefixserve", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = root.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP service")
    _engine_flags(serve)
    _add(serve, "--host", str, "127.0.0.1", "address to listen on")
    _add(serve, "--port", int, 8000, "port to listen on")
    _add(serve, "--redis-url", _opt_str, None, "Redis for the prefix registry (default: embedded store)")
    _add(serve, "--served-model-name", _opt_str, None, "model name in the API (default: the checkpoint's)")
    _add(serve, "--max-num-waiting", int, 1024, "waiting queue cap; beyond it requests get 429")
    _add(serve, "--shutdown-timeout", float, 30.0, "seconds running streams may finish after SIGTERM")
    sub.add_parser("bench", help="run a benchmark (prefixserve bench --help for the list)", add_help=False)
    gen = sub.add_parser("generate", help="generate offline and stream the text to the terminal")
    _engine_flags(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    return root


def config_from(args: argparse.Namespace) -> ServiceConfig:
    return ServiceConfig(
        model=args.model, host=args.host, port=args.port, device=args.device, dtype=args.dtype,
        block_size=args.block_size, num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, attention_backend=args.attention_backend,
        max_num_waiting=args.max_num_waiting, redis_url=args.redis_url,
        served_model_name=args.served_model_name, shutdown_timeout=args.shutdown_timeout)


def serve(config: ServiceConfig) -> None:
    import uvloop
    from aiohttp import web

    from service.app import create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    web.run_app(create_app(config), host=config.host, port=config.port, loop=uvloop.new_event_loop(),
                handler_cancellation=True, shutdown_timeout=config.shutdown_timeout, access_log=None,
                print=lambda msg: logging.getLogger("service").info(msg.strip()))


async def _generate(args: argparse.Namespace) -> None:
    from engine.async_engine import AsyncEngine
    from engine.sequence import SamplingParams

    config = ServiceConfig(model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                           num_kv_blocks=args.num_kv_blocks, max_num_seqs=args.max_num_seqs,
                           max_model_len=args.max_model_len, attention_backend=args.attention_backend)
    engine = AsyncEngine(config.engine_config())
    tok = engine.tokenizer
    if args.chat:
        text = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                       tokenize=False)
        ids = list(tok.encode(text, add_special_tokens=False))
    else:
        ids = list(tok.encode(args.prompt))
    await engine.start()
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
        async for out in engine.generate(ids, params):
            sys.stdout.write(out.outputs[0].text)
            sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        await engine.shutdown()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from benchmarks.cli import main as bench_main
        raise SystemExit(bench_main(argv[1:]))
    args = parser().parse_args(argv)
    if args.torch_threads is not None:
        if args.torch_threads < 1:
            raise SystemExit("prefixserve: --torch-threads must be >= 1")
        import torch
        torch.set_num_threads(args.torch_threads)
    if args.command == "serve":
        try:
            config = config_from(args)
        except ValueError as exc:  # a config that does not validate
            raise SystemExit(f"prefixserve: {exc}") from None
        serve(config)
    else:
        asyncio.run(_generate(args))
