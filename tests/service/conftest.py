from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from openai import OpenAI

from tests.helpers.server import ServerThread, tiny_config


@pytest.fixture(scope="session")
def server(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    """The shared server: tiny Llama checkpoint, 256-token context, 512 KV blocks of 16."""
    srv = ServerThread(tiny_config(tiny_llama_dir)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def model_name(server: ServerThread) -> str:
    return server.state.model_name


@pytest.fixture()
def client(server: ServerThread) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def real_server(real_model_path: Path) -> Iterator[ServerThread]:
    """The built-in model (SmolLM2-135M-Instruct) behind the service, as `make serve` runs it."""
    from service.config import ServiceConfig
    srv = ServerThread(ServiceConfig.from_flat(max_model_len=2048, num_kv_blocks=256, keepalive_interval=5.0,
                                               shutdown_timeout=5.0)).start(timeout=300)
    yield srv
    srv.stop()


@pytest.fixture()
def real_client(real_server: ServerThread) -> Iterator[OpenAI]:
    with OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c
