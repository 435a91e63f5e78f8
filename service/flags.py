"""Command-line flags and PREFIXSERVE_* environment variables, generated from the config dataclasses.

Every field of EngineConfig and ServiceConfig becomes `--field-name` (underscores to dashes), read also
from `PREFIXSERVE_FIELD_NAME`, typed from the field's annotation, with the field's default and
`metadata["help"]`. A flag given on the command line wins over the variable. A `tuple[str, ...]` field
(several API keys, origins) is written comma-separated: `--api-key a,b`.

An optional field (`int | None`) accepts "none" (or an empty value) for None, its default, unless "none"
is one of its own choices: `--quantization none` is the choice "none" (no quantization), not the default
(the checkpoint's own). A variable is checked exactly like the flag (type, choices, booleans): a value
that does not parse is an error at startup naming the variable, never a silent fallback to the default.
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


def _converter(annotation: Any, choices: tuple[str, ...] | None = None) -> tuple[Callable[[str], Any], bool]:
    """(string -> value, is_bool) for a field annotation such as `int`, `str | None`, `bool`,
    `tuple[str, ...]`; "none" means None only when it is not one of the field's `choices`."""
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
    none_words = ("",) if choices is not None and "none" in choices else ("", "none")

    def parse(text: str) -> Any:
        return None if text.lower() in none_words else base(text)
    parse.__name__ = getattr(base, "__name__", "value")
    return parse, False


def _from_env(env: str, raw: str, convert: Callable[[str], Any], choices: tuple[str, ...] | None) -> Any:
    """The variable's value, checked as argparse checks the flag's; ArgumentTypeError naming the variable."""
    try:
        value = convert(raw)
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise argparse.ArgumentTypeError(f"{env}={raw!r}: {exc}") from None
    if choices is not None and value is not None and value not in choices:
        raise argparse.ArgumentTypeError(f"{env}={raw!r}: expected one of {', '.join(choices)}")
    return value


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass `cls` (nested dataclass fields and `skip` excepted). A
    PREFIXSERVE_* variable that does not parse ends the program here: one line of error, exit status 2."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip or dataclasses.is_dataclass(hints[f.name]):
            continue
        choices = f.metadata.get("choices")
        convert, is_bool = _converter(hints[f.name], choices)
        env = env_name(f.name)
        default = f.default
        help_text = f"{f.metadata.get('help', '')} [env {env}; default {default}]"
        flag = "--" + f.name.replace("_", "-")
        raw = os.environ.get(env)
        if raw is not None:
            try:
                default = _from_env(env, raw, convert, choices)
            except argparse.ArgumentTypeError as exc:
                parser.exit(2, f"{parser.prog}: error: {exc}\n")
        if is_bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:
            group.add_argument(flag, type=convert, default=default, choices=_Choices(choices) if choices else None,
                               help=help_text, dest=f.name)


class _Choices(tuple[str, ...]):
    """A field's choices for argparse, which checks the converted value: None (an optional field's "none")
    passes, as it is the field's default."""

    def __contains__(self, value: object) -> bool:
        return value is None or super().__contains__(value)


def values(args: argparse.Namespace, cls: type, skip: tuple[str, ...] = ()) -> dict[str, Any]:
    """The parsed values of `cls`'s flags, by field name."""
    hints = typing.get_type_hints(cls)
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
            if f.name not in skip and not dataclasses.is_dataclass(hints[f.name])}
