from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checkpoints import build_tiny

ARCHS = ["llama", "mistral", "qwen2"]


@pytest.fixture(scope="session")
def checkpoints_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model_dir(request: pytest.FixtureRequest, checkpoints_root: Path) -> Path:
    """A tiny random checkpoint of each architecture (parametrized)."""
    return build_tiny(checkpoints_root, request.param)


@pytest.fixture(scope="session")
def tiny_llama_dir(checkpoints_root: Path) -> Path:
    return build_tiny(checkpoints_root, "llama")
