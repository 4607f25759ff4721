"""The edge's options: one document, and the spec it is validated against.

``infergate render-nginx`` hands the edge two JSON texts in one ``init_by_lua`` call,
``require("infergate.core.config").init(OPTIONS, SPEC)``:

- the options document (:func:`edge_document`): the :data:`~controlplane.config.EDGE_SECTIONS`
  of the settings, named and nested as in the TOML file, plus the resolved static node
  list::

      {"edge": {"edge_id": "gpu-edge:8080", "redis_timeout_ms": 200, ...},
       "redis": {"url": "redis://...", ...}, "scoring": {...}, "auth": {...},
       "limits": {...}, "admission": {...}, "deadlines": {...}, "cache": {...},
       "nodes": [{"name", "host", "port", "weight", "max_concurrency", "kind"}, ...]}

- the spec (:func:`option_spec`), generated from the pydantic fields of
  :mod:`controlplane.config` (a new field shows up in both by itself)::

      {"type": "object", "fields": {"edge": {"type": "object", "fields": {
          "redis_timeout_ms": {"type": "integer", "default": 200,
                               "minimum": 1, "maximum": 60000}, ...}}, ...}}

  Per field: ``type`` (``number``, ``integer``, ``boolean``, ``string``, ``array``,
  ``object``; absent = any), ``default``, ``nullable`` (``null`` allowed), bounds
  ``minimum``/``maximum`` (inclusive) and ``exclusiveMinimum``/``exclusiveMaximum``,
  ``enum`` (allowed values), ``fields`` (an object's known members: anything else is
  refused), ``values`` (spec of every member of a map) and ``keys`` (``{"enum": [...],
  "name": "path"}``, the keys a map allows). The ``nodes`` list is not part of the spec
  (the edge checks each node itself).

The edge's validator is ``lua/infergate/core/options.lua``; :func:`validate_document`
is the same walk in Python (same order of checks, same messages), so ``render-nginx``
refuses exactly what the edge would refuse, in the same words
(``edge.redis_timeout_ms: 100000 is above the maximum 60000``). Units are those of the
field names (``_s`` seconds, ``_ms`` milliseconds).

Also here: the template values of the response cache (:func:`cache_render_context`).
"""

from __future__ import annotations

import json
import math
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from controlplane.config import (
    EDGE_SECTIONS,
    TYPE_WORDS,
    HostPort,
    Settings,
    bound_message,
    enum_message,
    key_message,
    key_path,
)
from controlplane.errors import InfergateError

#: Size of the ``infergate_cache`` shared dict (coalescing locks: ~200 bytes each).
CACHE_DICT_SIZE = "2m"
#: Bound names of a spec entry, in the order they are checked.
BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
_CONSTRAINTS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "lt": "exclusiveMaximum"}


class OptionError(InfergateError, ValueError):
    """The options document breaks the spec (message: ``<path>: <what is wrong>``)."""


# --------------------------------------------------------------------------- the spec

def _bounds(metadata: typing.Iterable[Any]) -> dict:
    """Spec bounds from pydantic/annotated-types constraints (``Ge(1)`` -> minimum 1)."""
    out: dict = {}
    for m in metadata:
        if isinstance(m, FieldInfo):
            out.update(_bounds(m.metadata))
            continue
        for attr, name in _CONSTRAINTS.items():
            value = getattr(m, attr, None)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[name] = value
    return out


def _type_spec(ann: Any) -> dict:
    """Spec of a value of annotation ``ann`` (bounds of ``Annotated[...]`` included)."""
    meta: list = []
    nullable = False
    while True:
        origin = typing.get_origin(ann)
        if origin is typing.Annotated:
            ann, *extra = typing.get_args(ann)
            meta.extend(extra)
            continue
        if origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(ann) if a is not type(None)]
            if len(args) == 1:
                nullable = True
                ann = args[0]
                continue
        break
    spec: dict = {}
    origin = typing.get_origin(ann)
    if origin is Literal:
        choices = list(typing.get_args(ann))
        spec["type"] = "string" if all(isinstance(c, str) for c in choices) else None
        spec["enum"] = choices
    elif ann is bool:
        spec["type"] = "boolean"
    elif ann is int:
        spec["type"] = "integer"
    elif ann is float:
        spec["type"] = "number"
    elif isinstance(ann, type) and issubclass(ann, str):  # str, HostPort
        spec["type"] = "string"
    elif isinstance(ann, type) and issubclass(ann, BaseModel):
        spec = model_spec(ann)
    elif origin is dict:
        spec = {"type": "object", "values": _type_spec(typing.get_args(ann)[1])}
    elif origin is list:
        spec = {"type": "array", "items": _type_spec(typing.get_args(ann)[0])}
    spec = {k: v for k, v in spec.items() if v is not None}
    spec.update(_bounds(meta))
    if nullable:
        spec["nullable"] = True
    return spec


def field_spec(field: FieldInfo) -> dict:
    """Spec entry of one pydantic field: type, bounds, enum, default, nullable, keys."""
    spec = _type_spec(field.annotation)
    spec.update(_bounds(field.metadata))
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "keys" in extra:
        spec["keys"] = extra["keys"]
    if not field.is_required():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            pass  # a section: its own fields carry the defaults
        elif default is not None:
            spec["default"] = json.loads(json.dumps(default, default=str))
    return spec


def model_spec(model: type[BaseModel]) -> dict:
    """``{"type": "object", "fields": {name: field_spec}}`` of a pydantic model."""
    return {"type": "object",
            "fields": {name: field_spec(f) for name, f in model.model_fields.items()}}


#: Fields of the edge sections that stay out of the options document: secrets that go
#: into their own nginx directive (``cache.embedder_token``: the lookup location's
#: Authorization header), not into the options every worker keeps.
NOT_IN_DOCUMENT: dict[str, tuple[str, ...]] = {"cache": ("embedder_token",)}


def option_spec() -> dict:
    """The spec of the edge's options document (every field of the edge sections but
    :data:`NOT_IN_DOCUMENT`)."""
    spec = {"type": "object",
            "fields": {name: model_spec(Settings.model_fields[name].annotation)
                       for name in EDGE_SECTIONS}}
    for section, names in NOT_IN_DOCUMENT.items():
        for name in names:
            spec["fields"][section]["fields"].pop(name, None)
    return spec


# --------------------------------------------------------------------------- the document

def edge_document(settings: Settings, edge_id: str | None = None,
                  nodes: list[dict] | None = None) -> dict:
    """The options document of ``settings`` (see the module docstring). ``edge_id``
    replaces an empty ``edge.edge_id``; ``nodes`` is the resolved static node list."""
    doc = {name: getattr(settings, name).model_dump(mode="json") for name in EDGE_SECTIONS}
    for section, names in NOT_IN_DOCUMENT.items():
        for name in names:
            doc[section].pop(name, None)
    if edge_id is not None:
        doc["edge"]["edge_id"] = edge_id
    doc["nodes"] = list(nodes or [])
    return doc


# --------------------------------------------------------------------------- the validator

def _json_type(v: Any) -> str:
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, (int, float)):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    if isinstance(v, dict):
        return "object"
    return "null"


def _type_ok(kind: str | None, v: Any) -> bool:
    if kind is None:
        return True
    if kind in ("number", "integer"):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            return False
        return kind == "number" or float(v).is_integer()
    # the edge cannot tell an empty [] from an empty {}: both are tables
    if kind == "object":
        return isinstance(v, dict) or v == []
    if kind == "array":
        return isinstance(v, list) or v == {}
    return _json_type(v) == kind


def check_value(path: str, spec: dict, v: Any) -> Any:
    """``v`` checked against ``spec`` (defaults filled into objects); returns the value
    (``None`` for an allowed null). Raises :class:`OptionError` with the edge's message.
    Order: null, type, enum, bounds, then an object's members."""
    if v is None:
        if spec.get("nullable"):
            return None
        raise OptionError(f"{path}: must be {TYPE_WORDS.get(spec.get('type'), 'a value')}")
    kind = spec.get("type")
    if not _type_ok(kind, v):
        raise OptionError(f"{path}: must be {TYPE_WORDS[kind]}")
    if "enum" in spec and v not in spec["enum"]:
        raise OptionError(enum_message(path, v, spec["enum"]))
    if kind in ("number", "integer"):
        for name in BOUNDS:
            b = spec.get(name)
            if b is None:
                continue
            if ((name == "minimum" and v < b) or (name == "exclusiveMinimum" and v <= b)
                    or (name == "maximum" and v > b) or (name == "exclusiveMaximum" and v >= b)):
                raise OptionError(bound_message(path, v, name, b))
    if kind == "object" and "fields" in spec:
        return _check_fields(path, spec["fields"], v or {})
    if kind == "object" and ("values" in spec or "keys" in spec):
        out = {}
        allowed = (spec.get("keys") or {}).get("enum")
        for k in sorted(v or {}):
            if allowed is not None and k not in allowed:
                raise OptionError(key_message(path, k, allowed, spec["keys"].get("name", "key")))
            out[k] = check_value(key_path(path, k), spec.get("values") or {}, v[k])
        return out
    return v


def _check_fields(path: str, fields: dict, v: dict) -> dict:
    for k in sorted(v):
        if k not in fields:
            raise OptionError(f"{path + '.' if path else ''}{k}: unknown option")
    out = {}
    for k in sorted(fields):
        fs, where = fields[k], f"{path + '.' if path else ''}{k}"
        if k in v:
            out[k] = check_value(where, fs, v[k])
        elif "default" in fs:
            out[k] = json.loads(json.dumps(fs["default"]))
        elif fs.get("type") == "object" and "fields" in fs:
            out[k] = check_value(where, fs, {})
    return out


def validate_document(doc: dict, spec: dict | None = None) -> dict:
    """The document checked against ``spec`` (default :func:`option_spec`), defaults
    filled in, ``nodes`` passed through. Raises :class:`OptionError`."""
    spec = spec or option_spec()
    body = {k: v for k, v in doc.items() if k != "nodes"}
    out = check_value("", spec, body)
    if "nodes" in doc:
        out["nodes"] = doc["nodes"]
    return out


# --------------------------------------------------------------------------- rendering

#: Longest piece of one Lua string literal in the rendered ``init_by_lua_block``: nginx
#: reads a block token by token into a 4 KiB buffer, so a longer literal does not load.
LUA_CHUNK = 2000


def lua_string(text: str, indent: str = "        ") -> str:
    """``text`` as a Lua expression for an nginx ``*_by_lua_block``: long-bracket
    literals of at most :data:`LUA_CHUNK` characters joined with ``..``, one per line.

    The bracket level (at least 1) occurs nowhere in ``text``, and a piece never ends with
    ``]`` or ``=`` (which could run into the closing bracket)."""
    level = 1
    while f"]{'=' * level}]" in text:
        level += 1
    eq = "=" * level
    pieces, start = [], 0
    while start < len(text):
        end = min(start + LUA_CHUNK, len(text))
        while end < len(text) and end > start + 1 and text[end - 1] in "]=":
            end -= 1
        pieces.append(f"[{eq}[{text[start:end]}]{eq}]")
        start = end
    return f" ..\n{indent}".join(pieces or [f"[{eq}[]{eq}]"])


def rendered_options(http_conf_text: str) -> tuple[dict, dict]:
    """(options document, spec) from the text of a rendered ``infergate-http.conf`` (the
    two arguments of ``infergate.core.config.init``). Raises ``ValueError`` when absent."""
    import re

    m = re.search(r'require\("infergate\.core\.config"\)\.init\((.*?)\)\n\s*if not ok',
                  http_conf_text, re.S)
    if not m:
        raise ValueError("no infergate.core.config.init(...) call in this configuration")
    args, level = [], None
    for lit in re.finditer(r"\[(=+)\[(.*?)\]\1\]|(,)", m.group(1), re.S):
        if lit.group(3):
            args.append("")
            continue
        if not args:
            args.append("")
        args[-1] += lit.group(2)
        level = lit.group(1)
    if len(args) != 2 or level is None:
        raise ValueError("infergate.core.config.init(...) does not have two string arguments")
    return json.loads(args[0]), json.loads(args[1])


def embedder_server(url: str) -> str:
    """``host:port`` (``[v6]:port``) of the embedder root URL, for an nginx ``server``
    line (port 80 when the URL has none)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    return HostPort.parse(f"{f'[{host}]' if ':' in host else host}:{parts.port or 80}",
                          "cache.embedder_url")


def render_context(settings: Settings, edge_id: str, nodes: list[dict]) -> dict:
    """Template variables of the options: ``options_lua`` (the document) and
    ``spec_lua`` (the spec), JSON as Lua string expressions (:func:`lua_string`), and the cache's
    ``cache_enabled``, ``cache_semantic``, ``cache_dict_size``, ``embedder_server``,
    ``cache_budget`` (an nginx time, the semantic budget). Raises :class:`OptionError`
    when the document breaks the spec (the edge would refuse to start)."""
    spec = option_spec()
    doc = edge_document(settings, edge_id, nodes)
    validate_document(doc, spec)
    options = json.dumps(doc, separators=(",", ":"))
    spec_json = json.dumps(spec, separators=(",", ":"))
    c = settings.cache
    return {
        "options_lua": lua_string(options),
        "spec_lua": lua_string(spec_json),
        "cache_enabled": c.enabled,
        "cache_semantic": c.enabled and c.semantic,
        "cache_dict_size": CACHE_DICT_SIZE,
        "embedder_server": embedder_server(c.embedder_url),
        "cache_budget": f"{c.semantic_budget_ms}ms",
    }
