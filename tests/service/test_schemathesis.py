"""schemathesis fuzzes every operation in /openapi.json against a live server: no 5xx, ever, with one
documented exception: POST /v1/prefixes answers 507 (insufficient storage) when pinning the prefix would
pass the pinned-block cap. That answer is the API contract (issue 5), not a server fault, so it alone is
allowed, for that operation alone, through schemathesis' per-operation `expected-statuses`; every other
5xx on any operation, that one included, still fails the run."""
from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from service.routes import worker_api
from tests.helpers.server import ServerThread, tiny_config

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"


@pytest.fixture(scope="module")
def fuzz_target(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    """Small limits (64-token context, 4 choices) keep each fuzzed generation cheap; the spec says so."""
    srv = ServerThread(tiny_config(tiny_llama_dir, max_model_len=64, max_choices=4, max_num_seqs=16)).start()
    yield srv
    srv.stop()


def _answers(url: str) -> dict[tuple[str, str], float]:
    text = requests.get(f"{url}/metrics", timeout=10).text
    return {(s.labels["route"], s.labels["status"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "prefixserve_http_requests_total"}


# Read by schemathesis from its working directory (tmp_path).
CONFIG = """
[[operations]]
include-path = "/v1/prefixes"
include-method = "POST"
checks.not_a_server_error.expected-statuses = ["2xx", "3xx", "4xx", "507"]
"""
ALLOWED_5XX = {("/v1/prefixes", "507")}    # metrics count by route, not method: only POST answers 507


def test_no_server_errors(fuzz_target: ServerThread, tmp_path: Path) -> None:
    before = _answers(fuzz_target.url)     # /health said 503 while the model loaded
    spec = requests.get(f"{fuzz_target.url}/openapi.json", timeout=10).json()
    worker_paths = len(worker_api.GETS) + len(worker_api.POSTS)
    assert spec["openapi"].startswith("3.") and len(spec["paths"]) == 18 + worker_paths
    (tmp_path / "schemathesis.toml").write_text(CONFIG)
    proc = subprocess.run(
        [str(SCHEMATHESIS), "run", f"{fuzz_target.url}/openapi.json", "--checks", "not_a_server_error",
         "--max-examples", "25", "--seed", "1", "--phases", "coverage,fuzzing", "--workers", "1",
         "--request-timeout", "30", "--no-color"],
        # its cache dir goes to tmp_path; 540 s: the run took 212-262 s on a busy 2-core machine, which a 300 s limit
        # left too little room for; pytest's own limit is 600 s a test
        capture_output=True, text=True, timeout=540, cwd=tmp_path)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    answers = {k: v - before.get(k, 0) for k, v in _answers(fuzz_target.url).items()}
    assert not {k: v for k, v in answers.items() if k[1].startswith("5") and v and k not in ALLOWED_5XX}, answers
    # it reached the generation logic, not just the validation: successful completions and chats
    assert answers.get(("/v1/completions", "200"), 0) >= 20, answers
    assert answers.get(("/v1/chat/completions", "200"), 0) >= 20, answers
    assert answers.get(("/v1/responses", "200"), 0) >= 10, answers
    assert answers.get(("/v1/prefixes", "201"), 0) >= 1, answers        # and registered prefixes
    assert sum(answers.values()) >= 300
    st = fuzz_target.state.engine.stats()
    assert st.requests_running == st.requests_waiting == 0 and st.kv_blocks_used == st.kv_blocks_pinned
    assert st.kv_blocks_pinned <= fuzz_target.state.engine._core.pool.max_pinned_blocks
