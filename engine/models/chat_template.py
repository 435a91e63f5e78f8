"""`--chat-template`: a Jinja chat template that replaces the checkpoint's (as vLLM's flag does), for
checkpoints without one or with one that does not suit.

The template is part of the model's identity for the prefix registry: it changes how messages become
tokens, so the tokenizer version and the fingerprint (which keys the registry's records) include it.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from engine.models.loader import LoadedModel


def read_chat_template(spec: str) -> str:
    """`spec` is a path to a Jinja file, or the template itself (anything holding "{{" or "{%")."""
    if "{{" in spec or "{%" in spec:
        return spec
    path = Path(spec).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"chat template {spec!r} is neither a file nor a Jinja template")
    return path.read_text()


def override_chat_template(loaded: LoadedModel, template: str) -> None:
    """Installs `template` on the loaded tokenizer; tokenizer version and fingerprint follow it."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    try:
        ImmutableSandboxedEnvironment().parse(template)
    except TemplateSyntaxError as exc:
        raise ValueError(f"the chat template does not parse: {exc}") from exc
    loaded.tokenizer.chat_template = template
    digest = hashlib.sha256(template.encode()).hexdigest()
    loaded.tokenizer_version = hashlib.sha256(f"{loaded.tokenizer_version}|{digest}".encode()).hexdigest()
    loaded.fingerprint = hashlib.sha256(f"{loaded.fingerprint}|{digest}".encode()).hexdigest()[:32]
