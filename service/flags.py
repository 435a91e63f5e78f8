"""Command-line flags and PREFIXSERVE_* environment variables, generated from the config dataclasses.

Every field of EngineConfig and ServiceConfig becomes `--field-name` (underscores to dashes), read also
from `PREFIXSERVE_FIELD_NAME`, typed from the field's annotation (`int | None` accepts "none"), with
the field's default and `metadata["help"]`. A flag given on the command line wins over the variable.
A `tuple[str, ...]` field (several API keys, origins) is written comma-separated: `--api-key a,b`.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from collections.abc import Callable
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def env_name(field_name: str) -> str:
    return "PREFIXSERVE_" + field_name.upper()


def _parse_bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)}), got {text!r}")


def _parse_list(text: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _converter(annotation: Any) -> tuple[Callable[[str], Any], bool]:
    """(string -> value, is_bool) for a field annotation such as `int`, `str | None`, `bool`,
    `tuple[str, ...]`."""
    if typing.get_origin(annotation) is tuple:
        assert typing.get_args(annotation) == (str, ...), f"unsupported config annotation {annotation!r}"
        return _parse_list, False
    optional = False
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        assert len(args) == 1, f"unsupported config annotation {annotation!r}"
        annotation = args[0]
    if annotation is bool:
        return _parse_bool, True
    base: Callable[[str], Any] = annotation
    if not optional:
        return base, False

    def parse(text: str) -> Any:
        return None if text.lower() in ("", "none") else base(text)
    parse.__name__ = getattr(base, "__name__", "value")
    return parse, False


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass `cls` (nested dataclass fields and `skip` excepted)."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip or dataclasses.is_dataclass(hints[f.name]):
            continue
        convert, is_bool = _converter(hints[f.name])
        env = env_name(f.name)
        default = f.default
        help_text = f"{f.metadata.get('help', '')} [env {env}; default {default}]"
        flag = "--" + f.name.replace("_", "-")
        raw = os.environ.get(env)
        if is_bool:
            if raw is not None:
                default = _parse_bool(raw)
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            group.add_argument(flag, type=convert, default=raw if raw is not None else default,
                               choices=f.metadata.get("choices"), help=help_text, dest=f.name)


def values(args: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The parsed values of `cls`'s flags, by field name."""
    hints = typing.get_type_hints(cls)
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.name not in skip and not dataclasses.is_dataclass(hints[f.name])}
