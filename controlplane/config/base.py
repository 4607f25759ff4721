"""The base of every settings section and the words of a refused option, shared with
lua/infergate/core/options.lua: a value refused by pydantic and by the edge's validator
reads the same (``<path>: <value> <words> <bound>``)."""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

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


def _is_number(ann: Any) -> bool:
    """A field annotated ``int`` or ``float`` (also ``| None``, ``Annotated``)."""
    if typing.get_origin(ann) is typing.Annotated:
        return _is_number(typing.get_args(ann)[0])
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        return len(args) == 1 and _is_number(args[0])
    return ann in (int, float)


def _bool_text(value: Any) -> Any:
    """``true``/``false`` for a boolean, else ``value``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        """A JSON or TOML ``true``/``false`` given for a number (a field, or a value of a
        map of numbers) is refused: pydantic's lax mode read it as 1 or 0
        (``{"max_concurrency": true}`` became 1). A field's refusal is a type error
        ("not a boolean"); a map's value is validated as its text, which is no number, so
        the refusal names the key too. On the file's path both read as the edge
        validator's ``must be an integer`` / ``must be a number``."""
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        ann = field.annotation
        if isinstance(value, bool) and _is_number(ann):
            if int in (ann, *typing.get_args(ann)):
                raise PydanticCustomError("int_type", "Input should be a valid integer, "
                                          "not a boolean")
            raise PydanticCustomError("float_type", "Input should be a valid number, "
                                      "not a boolean")
        if isinstance(value, dict) and typing.get_origin(ann) is dict \
                and _is_number(typing.get_args(ann)[1]):
            return {k: _bool_text(v) for k, v in value.items()}
        return value
