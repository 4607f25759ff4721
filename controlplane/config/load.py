"""The whole settings (:class:`Settings`), read from TOML and checked, with refusals
worded as the edge words them."""

from __future__ import annotations

import os
import tomllib
import types
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ValidationError, field_validator

from controlplane.config.admission import (
    AdmissionSettings,
    AuthSettings,
    DeadlineSettings,
    LimitSettings,
)
from controlplane.config.base import (
    TYPE_WORDS,
    ConfigError,
    _Section,
    bound_message,
    enum_message,
    key_path,
)
from controlplane.config.cache import CacheSettings
from controlplane.config.edge import EdgeSettings, RedisSettings
from controlplane.config.routing import ControlPlaneSettings, NodeSettings, ScoringSettings


class Settings(_Section):
    redis: RedisSettings = RedisSettings()
    edge: EdgeSettings = EdgeSettings()
    auth: AuthSettings = AuthSettings()
    limits: LimitSettings = LimitSettings()
    admission: AdmissionSettings = AdmissionSettings()
    deadlines: DeadlineSettings = DeadlineSettings()
    controlplane: ControlPlaneSettings = ControlPlaneSettings()
    scoring: ScoringSettings = ScoringSettings()
    cache: CacheSettings = CacheSettings()
    nodes: list[NodeSettings] = []

    @field_validator("nodes")
    @classmethod
    def _unique(cls, v: list[NodeSettings]) -> list[NodeSettings]:
        # names that differ only in case are one name (the registry refuses the second)
        names = [n.name.casefold() for n in v]
        dup = {n.name for n in v if names.count(n.name.casefold()) > 1}
        if dup:
            raise ValueError(f"duplicate node names (case aside): {sorted(dup)}")
        return v


#: The sections of :class:`Settings` that the edge receives (its options document and
#: spec, :mod:`controlplane.edge.options`); their refusals read as the edge words them.
EDGE_SECTIONS = ("edge", "redis", "scoring", "auth", "limits", "admission", "deadlines", "cache")

_BOUND_ERRORS = {"greater_than_equal": ("minimum", "ge"), "greater_than": ("exclusiveMinimum", "gt"),
                 "less_than_equal": ("maximum", "le"), "less_than": ("exclusiveMaximum", "lt")}
_TYPE_ERRORS = {"int_type": "integer", "int_parsing": "integer", "int_from_float": "integer",
                "float_type": "number", "float_parsing": "number", "finite_number": "number",
                "bool_type": "boolean", "bool_parsing": "boolean", "string_type": "string",
                "dict_type": "object", "model_type": "object", "model_attributes_type": "object",
                "list_type": "array"}


def unwrap_annotation(ann: Any) -> Any:
    """``ann`` without ``Annotated[...]`` and without ``| None``."""
    while True:
        origin = typing.get_origin(ann)
        if origin is Annotated:
            ann = typing.get_args(ann)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            if len(args) != 1:
                return ann
            ann = args[0]
        else:
            return ann


def _locate(loc: tuple) -> tuple[str, Any]:
    """(path as the edge spells it, annotation) of a pydantic error location."""
    ann: Any = Settings
    path = ""
    for part in loc:
        ann = unwrap_annotation(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            path = f"{path}.{part}" if path else str(part)
            field = ann.model_fields.get(str(part))
            ann = field.annotation if field else None
        elif typing.get_origin(ann) is dict:
            path, ann = key_path(path, str(part)), typing.get_args(ann)[1]
        elif typing.get_origin(ann) is list:
            path, ann = f"{path}[{part}]", typing.get_args(ann)[0]
    return path, unwrap_annotation(ann)


def edge_message(error: dict) -> str | None:
    """The edge's wording of one pydantic error of a field of a section (the words of
    lua/infergate/core/options.lua, e.g. ``controlplane.poll_interval_s: -1 is below the
    minimum 0.01``), or ``None`` for other errors (those of ``nodes``)."""
    loc = error.get("loc") or ()
    if not loc or loc[0] not in Settings.model_fields or loc[0] == "nodes":
        return None
    path, ann = _locate(loc)
    kind, ctx, value = error["type"], error.get("ctx") or {}, error.get("input")
    if kind in _BOUND_ERRORS:
        bound_kind, key = _BOUND_ERRORS[kind]
        return bound_message(path, value, bound_kind, ctx[key])
    if kind == "literal_error" and typing.get_origin(ann) is Literal:
        return enum_message(path, value, typing.get_args(ann))
    if kind == "extra_forbidden":
        return f"{path}: unknown option"
    if kind in _TYPE_ERRORS:
        return f"{path}: must be {TYPE_WORDS[_TYPE_ERRORS[kind]]}"
    if kind == "value_error" and "error" in ctx:
        msg = str(ctx["error"])
        return msg if msg.startswith(path) else f"{path}: {msg}"
    return None


def _refusal(exc: ValidationError, source: str) -> ConfigError:
    """The :class:`ConfigError` of a refused document: one line naming the field for one
    refused field (``f.toml: invalid configuration: controlplane.poll_interval_s: -1 is
    below the minimum 0.01``), one line per field below a heading for several."""
    lines = [edge_message(e) or f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}"
             for e in exc.errors()]
    if len(lines) == 1:
        return ConfigError(f"{source}: invalid configuration: {lines[0]}", lines)
    return ConfigError(f"{source}: invalid configuration:\n  " + "\n  ".join(lines), lines)


def _apply_env(data: dict) -> dict:
    url = os.environ.get("INFERGATE_REDIS_URL")
    if url:
        data.setdefault("redis", {})["url"] = url
    token = os.environ.get("INFERGATE_ADMIN_TOKEN")
    if token:
        data.setdefault("controlplane", {})["admin_token"] = token
    etoken = os.environ.get("INFERGATE_EMBEDDER_TOKEN")
    if etoken:
        data.setdefault("cache", {})["embedder_token"] = etoken
    return data


def settings_from_dict(data: dict, source: str = "<dict>") -> Settings:
    """Validate a plain dict (the TOML document) into :class:`Settings`.

    Raises :class:`ConfigError` with every invalid field listed, the fields of the edge's
    sections in the edge's words (:func:`edge_message`)."""
    try:
        return Settings.model_validate(_apply_env(dict(data)))
    except ValidationError as exc:
        raise _refusal(exc, source) from None


def check_settings(settings: Settings, source: str = "<settings>") -> Settings:
    """``settings`` validated again, as a new :class:`Settings` (pydantic checks fields on
    loading only: a value assigned afterwards, e.g. ``settings.edge.listen = ...``, is
    checked here). No environment overrides. Raises :class:`ConfigError` like
    :func:`settings_from_dict`."""
    try:
        return Settings.model_validate(settings.model_dump())
    except ValidationError as exc:
        raise _refusal(exc, source) from None


def load_settings(path: str | Path | None) -> Settings:
    """Read the TOML file at ``path`` (``None``: defaults plus environment)."""
    if path is None:
        return settings_from_dict({}, "<defaults>")
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such configuration file") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{p}: not UTF-8 text (TOML must be): {exc.reason} at byte "
                          f"{exc.start}") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    return settings_from_dict(data, str(p))
