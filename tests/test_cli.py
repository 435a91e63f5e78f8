"""The real entry points: `python -m service` with flags and PREFIXSERVE_* variables, a graceful
SIGTERM (running streams finish, new connections are refused), and `prefixserve generate`."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import requests

from cli import config_from, parser, usable_cores
from tests.helpers.redis_server import free_port
from tests.helpers.server import status_of


def test_flags_read_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFIXSERVE_REDIS_URL", "redis://cache:6379/0")
    monkeypatch.setenv("PREFIXSERVE_NUM_KV_BLOCKS", "64")
    monkeypatch.setenv("PREFIXSERVE_PORT", "9001")
    cfg = config_from(parser().parse_args(["serve", "--port", "9002"]))
    got = (cfg.redis_url, cfg.engine.num_kv_blocks, cfg.port, cfg.host)
    assert got == ("redis://cache:6379/0", 64, 9002, "127.0.0.1")
    monkeypatch.setenv("PREFIXSERVE_BLOCK_SIZE", "0")
    with pytest.raises(SystemExit, match="block_size"):
        from cli import main
        main(["serve"])


def test_sigterm_lets_streams_finish(tiny_llama_dir: Path) -> None:
    port = free_port()
    env = {**os.environ, "PREFIXSERVE_SERVED_MODEL_NAME": "tiny-test", "PREFIXSERVE_MAX_MODEL_LEN": "512"}
    proc = subprocess.Popen([sys.executable, "-m", "service", "--model", str(tiny_llama_dir), "--port", str(port),
                             "--shutdown-timeout", "60"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            try:
                if status_of(f"{url}/health") == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == "tiny-test"
        body = {"model": "tiny-test", "prompt": "hello", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=60) as resp:
            lines = resp.iter_lines()
            assert next(lines).startswith(b"data: {")
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            with pytest.raises(requests.ConnectionError):    # no longer accepting
                requests.get(f"{url}/health", timeout=5)
            rest = [line for line in lines if line]
        assert rest[-1] == b"data: [DONE]" and b'"finish_reason":"length"' in rest[-2]
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _start(tiny_llama_dir: Path, *args: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "service", "--model", str(tiny_llama_dir), "--port", str(port),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        try:
            if status_of(f"{url}/health") == 200:
                return proc, url
        except OSError:
            pass
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_sigterm_ends_what_still_runs_at_the_shutdown_timeout(tiny_llama_dir: Path) -> None:
    """Issue 34, item 11: after SIGTERM a stream ran for twice --shutdown-timeout (aiohttp waits the timeout for a
    handler, then as long again after cancelling only its payload) and was then cut with no finish_reason and no
    [DONE]. Now what still runs at the timeout is ended by the engine: the SSE stream ends with a finish_reason
    and [DONE], a whole answer comes back with what it had, a WebSocket generation gets its done frame."""
    import asyncio

    import aiohttp
    timeout = 1.0
    proc, url = _start(tiny_llama_dir, "--max-model-len", "1024", "--shutdown-timeout", str(timeout))
    long = {"prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "n": 4}

    async def run() -> tuple[list[str], dict, list[dict], float]:
        async with aiohttp.ClientSession() as s, s.ws_connect(f"{url}/v1/ws") as ws:
            await ws.send_json({"type": "generate", "id": 1, **long})
            whole = asyncio.create_task(s.post(f"{url}/v1/completions", json=long))
            async with s.post(f"{url}/v1/completions", json={**long, "stream": True}) as r:
                lines = [(await r.content.readline()).decode().strip()]
                assert lines[0].startswith("data: {"), lines
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                async for raw in r.content:
                    if raw.strip():
                        lines.append(raw.decode().strip())
                took = time.monotonic() - t0
            answer = await (await whole).json()
            frames = []
            while not frames or frames[-1]["type"] not in ("done", "error"):
                frames.append(await ws.receive_json(timeout=30))
        return lines, answer, frames, took

    try:
        lines, answer, frames, took = asyncio.run(run())
        assert lines[-1] == "data: [DONE]", lines[-3:]
        assert sorted(json.loads(line[6:])["choices"][0]["index"] for line in lines[:-1]
                      if json.loads(line[6:])["choices"][0]["finish_reason"] == "abort") == [0, 1, 2, 3]
        assert timeout <= took < timeout + 3, took
        assert [c["finish_reason"] for c in answer["choices"]] == ["abort"] * 4, answer
        assert frames[-1]["type"] == "done" and frames[-1]["finish_reason"] == "abort", frames[-1]
        assert proc.wait(timeout + 15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_prints_no_traceback(tiny_llama_dir: Path) -> None:
    """Issue 34, item 11: Ctrl-C (SIGINT to the whole foreground process group) printed a KeyboardInterrupt
    traceback from the grammar compiler's helper process. The server shuts down as on SIGTERM, quietly."""
    proc, url = _start(tiny_llama_dir, "--shutdown-timeout", "1")
    try:
        body = {"prompt": "mood:", "max_tokens": 4, "guided_choice": ["yes", "no"]}     # the helper is up
        assert requests.post(f"{url}/v1/completions", json=body, timeout=60).status_code == 200
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(20) == 0
        out = proc.stdout.read().decode() if proc.stdout else ""
        assert "Traceback" not in out and "KeyboardInterrupt" not in out, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_generate_streams_to_terminal(tiny_llama_dir: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "service", "generate", "--model", str(tiny_llama_dir),
                          "--prompt", "hello world", "--max-tokens", "12"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    from engine import LLM, SamplingParams
    ref = LLM(str(tiny_llama_dir), max_model_len=256, num_kv_blocks=64).generate(
        "hello world", SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    assert ref and out.stdout == ref + "\n"


def test_every_config_knob_is_a_flag_and_a_variable(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """One config tree: each field of EngineConfig and ServiceConfig is settable from `serve`, by flag
    and by PREFIXSERVE_* variable, and lands in the config the service is built from."""
    import dataclasses

    from engine.config import EngineConfig
    from service.config import ServiceConfig

    with pytest.raises(SystemExit):
        parser().parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for f in [*dataclasses.fields(EngineConfig), *dataclasses.fields(ServiceConfig)[1:]]:
        assert "--" + f.name.replace("_", "-") in help_text, f.name
    cfg = config_from(parser().parse_args(["serve", "--max-num-batched-tokens", "77", "--pinned-fraction", "0.25",
                                           "--no-enable-prefix-caching", "--kv-cache-memory-gb", "0.5"]))
    assert (cfg.engine.max_num_batched_tokens, cfg.engine.pinned_fraction) == (77, 0.25)
    assert cfg.engine.enable_prefix_caching is False and cfg.engine.kv_cache_memory_gb == 0.5
    monkeypatch.setenv("PREFIXSERVE_MAX_NUM_BATCHED_TOKENS", "7")
    monkeypatch.setenv("PREFIXSERVE_ENABLE_PREFIX_CACHING", "false")
    monkeypatch.setenv("PREFIXSERVE_TORCH_THREADS", "1")
    monkeypatch.setenv("PREFIXSERVE_MAX_WS_GENERATIONS", "3")
    cfg = config_from(parser().parse_args(["serve"]))
    assert cfg.engine.max_num_batched_tokens == 7 and cfg.engine.enable_prefix_caching is False
    assert cfg.engine.torch_threads == 1 and cfg.max_ws_generations == 3


def test_setup_mistakes_are_one_line_of_error(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """A model path that is not a model, a port already taken: one line on stderr, exit status 1."""
    import socket as socket_module
    for model in ("/nonexistent/model", str(tmp_path), str(tmp_path / "x.gguf")):
        out = subprocess.run([sys.executable, "-m", "service", "serve", "--model", model], capture_output=True,
                             text=True, timeout=60)
        assert out.returncode == 1 and out.stderr.count("\n") == 1 and "prefixserve:" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    with socket_module.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "service", "serve", "--model", str(tiny_llama_dir), "--port",
                              str(port)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("prefixserve: cannot listen on 127.0.0.1:") and str(port) in last


def test_serve_uses_the_cores_it_may_use_by_default() -> None:
    """Not torch's default (every core of the machine, which a container's CPU quota does not cap)."""
    cores = usable_cores()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            assert cores <= -(-int(quota) // int(period))
    except OSError:
        pass
    assert config_from(parser().parse_args(["serve"])).engine.torch_threads == cores
    assert config_from(parser().parse_args(["serve", "--torch-threads", "1"])).engine.torch_threads == 1


def _documented_values(f: Any, hint: Any) -> list[tuple[str, Any]]:
    """(text, value) pairs a knob must accept: each of its choices, both spellings of a boolean, a number
    other than its default, and "none" for an optional knob's default (unless "none" is a choice)."""
    import types
    import typing

    from service.flags import _FALSE, _TRUE
    args = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    optional, base = type(None) in args, next(a for a in args if a is not type(None))
    choices = f.metadata.get("choices")
    out: list[tuple[str, Any]] = []
    if choices:
        out += [(c, c) for c in choices]
    elif base is bool:
        out += [(w, True) for w in _TRUE] + [(w, False) for w in _FALSE]
    elif base is int:
        out.append((str((f.default or 0) + 1), (f.default or 0) + 1))
    elif base is float:
        out.append((str((f.default or 1.0) / 2), (f.default or 1.0) / 2))
    if optional and (base in (int, float) or choices) and "none" not in (choices or ()):
        out.append(("none", None))
    return out


def test_every_knob_takes_every_documented_value_by_flag_and_by_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 24, item 21: `--quantization none` was refused (`invalid choice: None`) and
    PREFIXSERVE_QUANTIZATION=none silently served int4: "none" became None before the choice check. Every
    choice, boolean and number knob of both configs is set to each documented value both ways."""
    import dataclasses
    import typing

    from engine.config import EngineConfig
    from service.config import ServiceConfig
    from service.flags import env_name

    walked = 0
    for cls in (EngineConfig, ServiceConfig):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name == "engine":
                continue
            for name in (g.name for g in dataclasses.fields(cls)):
                monkeypatch.delenv(env_name(name), raising=False)
            for text, value in _documented_values(f, hints[f.name]):
                flag = "--" + f.name.replace("_", "-")
                if value is True and hints[f.name] is bool:
                    argv = [flag]
                elif value is False and hints[f.name] is bool:
                    argv = ["--no-" + f.name.replace("_", "-")]
                else:
                    argv = [flag, text]
                expected = usable_cores() if f.name == "torch_threads" and value is None else value
                by_flag = config_from(parser().parse_args(["serve", *argv]))
                got = getattr(by_flag if cls is ServiceConfig else by_flag.engine, f.name)
                assert got == expected and type(got) is type(expected), (argv, got)
                monkeypatch.setenv(env_name(f.name), text)
                by_env = config_from(parser().parse_args(["serve"]))
                got = getattr(by_env if cls is ServiceConfig else by_env.engine, f.name)
                assert got == expected and type(got) is type(expected), (env_name(f.name), text, got)
                monkeypatch.delenv(env_name(f.name))
                walked += 1
    assert walked > 60


@pytest.mark.parametrize("env, value, says", [
    ("PREFIXSERVE_QUANTIZATION", "int3", "expected one of none, int8, int4"),
    ("PREFIXSERVE_LOG_FORMAT", "xml", "expected one of text, json"),
    ("PREFIXSERVE_STRICT_FIELDS", "maybe", "expected a boolean"),
    ("PREFIXSERVE_PORT", "eighty", "invalid literal for int()"),
    ("PREFIXSERVE_PINNED_FRACTION", "half", "could not convert string to float"),
])
def test_a_variable_that_does_not_parse_is_an_error_at_startup(env: str, value: str, says: str) -> None:
    """Never a silent fallback to the default: one line naming the variable, exit status 2."""
    out = subprocess.run([sys.executable, "-m", "service", "serve"], capture_output=True, text=True, timeout=60,
                         env={**os.environ, env: value})
    assert out.returncode in (1, 2) and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().count("\n") == 0 and f"{env}={value!r}" in out.stderr and says in out.stderr, out.stderr
