"""The base of every settings section and the words of a refused option, shared with
lua/infergate/core/options.lua: a value refused by pydantic and by the edge's validator
reads the same (``<path>: <value> <words> <bound>``)."""

from __future__ import annotations

import typing
from typing import Any

from pydantic import BaseModel, ConfigDict

from controlplane.errors import InfergateError


class ConfigError(InfergateError, ValueError):
    """The configuration file or a value in it is invalid.

    ``fields``: one message per refused field (``controlplane.poll_interval_s: -1 is below
    the minimum 0.01``), empty for a file that cannot be read."""

    def __init__(self, message: str, fields: typing.Sequence[str] = ()) -> None:
        super().__init__(message)
        self.fields = list(fields)


#: Spec bound name -> words of the refusal ("<path>: <value> <words> <bound>").
BOUND_WORDS = {
    "minimum": "is below the minimum",
    "exclusiveMinimum": "is not above the exclusive minimum",
    "maximum": "is above the maximum",
    "exclusiveMaximum": "is not below the exclusive maximum",
}
#: Spec type -> the words of "<path>: must be ...".
TYPE_WORDS = {"number": "a number", "integer": "an integer", "boolean": "a boolean",
              "string": "a string", "object": "an object", "array": "an array"}


def number_text(v: float) -> str:
    """A number as the edge prints it (C ``%.15g``: ``100000``, ``0.005``, ``1e+15``)."""
    return format(v, ".15g")


def value_text(v: Any) -> str:
    """A value in a message: strings in double quotes, numbers as :func:`number_text`."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return number_text(v)
    if isinstance(v, str):
        return f'"{v}"'
    return repr(v)


def bound_message(path: str, value: float, bound_kind: str, bound: float) -> str:
    """``edge.redis_timeout_ms: 100000 is above the maximum 60000``; ``bound_kind`` is a
    key of :data:`BOUND_WORDS`."""
    return f"{path}: {number_text(value)} {BOUND_WORDS[bound_kind]} {number_text(bound)}"


def enum_message(path: str, value: Any, choices: typing.Sequence[Any]) -> str:
    """``auth.mode: "maybe" is not one of "off", "required"``."""
    return f"{path}: {value_text(value)} is not one of {', '.join(value_text(c) for c in choices)}"


def key_message(path: str, key: str, choices: typing.Sequence[str], name: str = "key") -> str:
    """``deadlines.routes: unknown path 'x' (one of /v1/chat/completions, ...)``."""
    return f"{path}: unknown {name} '{key}' (one of {', '.join(choices)})"


def key_path(path: str, key: str) -> str:
    """Path of a map entry: ``cache.min_similarity_models["m"]``."""
    return f'{path}["{key}"]'


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)
