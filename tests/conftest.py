from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.checkpoints import build_tiny
from tests.helpers.kernels import ensure_built

ensure_built()      # the C++ kernels of a source checkout (pip install builds them; a bare worktree may not have)

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


@pytest.fixture(scope="session")
def real_model_path() -> Path:
    """The built-in model's GGUF (SmolLM2-135M-Instruct); `make test` installs its wheel."""
    from engine.models.default import default_model_path
    try:
        return default_model_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def real_llm(real_model_path: Path):  # type: ignore[no-untyped-def]
    """One engine on the real model, weights dequantized to float32 (`quantization="none"`: the exact
    comparison with transformers), 2k context."""
    from engine import LLM
    return LLM(str(real_model_path), max_model_len=2048, num_kv_blocks=512, quantization="none")
