"""The edge's options: one document, and the spec it is validated against.

``infergate render-nginx`` hands the edge two JSON texts in one ``init_by_lua`` call,
``require("infergate.core.config").init(OPTIONS, SPEC)``:

- the options document (:func:`edge_document`): the
  :data:`~controlplane.config.EDGE_SECTIONS` of the settings as pydantic dumps them, each
  option under its own name in its own section (as in the TOML file), plus the resolved
  static node list::

      {"edge": {"edge_id": "gpu-edge:8080", "redis_timeout_ms": 200, ...},
       "redis": {"url": "redis://...", ...}, "scoring": {...}, ..., "cache": {...},
       "nodes": [{"name", "host", "port", "weight", "max_concurrency", "kind"}, ...]}

- the spec (:func:`option_spec`): pydantic's JSON schema of those sections, in the
  shape ``lua/infergate/core/options.lua`` reads (a new field shows up by itself)::

      {"type": "object", "fields": {"edge": {"type": "object", "fields": {
          "redis_timeout_ms": {"type": "integer", "default": 200,
                               "minimum": 1, "maximum": 60000}, ...}}, ...}}

  Per field: ``type``, ``default``, ``nullable`` (``null`` allowed), bounds
  ``minimum``/``maximum`` (inclusive) and ``exclusiveMinimum``/``exclusiveMaximum``,
  ``enum``, ``fields`` (an object's known members), ``values`` (spec of every member of
  a map), ``items`` (of a list) and ``keys`` (``{"enum": [...], "name": "path"}``, the
  keys a map allows). The ``nodes`` list is not part of the spec (the edge checks each
  node itself).

Python has one validator, pydantic (:func:`controlplane.config.check_settings`), whose
refusals read as the edge's (``edge.redis_timeout_ms: 100000 is above the maximum
60000``); tests/parity/test_options_parity.py holds the two to the same verdicts.

Also here: the template values of the response cache (:func:`render_context`).
"""

from __future__ import annotations

import copy
import functools
import json

from controlplane.config import (
    EDGE_SECTIONS,
    ConfigError,
    HostPort,
    Settings,
    check_settings,
)
from controlplane.errors import InfergateError

#: Size of the ``infergate_cache`` shared dict (coalescing locks: ~200 bytes each).
CACHE_DICT_SIZE = "2m"
#: Members of a JSON-schema node that a spec entry keeps as they are.
SPEC_KEYS = ("type", "enum", "default", "minimum", "exclusiveMinimum", "maximum",
             "exclusiveMaximum", "keys")
#: Fields of the edge sections that stay out of the options document: secrets that go
#: into their own nginx directive (``cache.embedder_token``: the lookup location's
#: Authorization header), not into the options every worker keeps.
NOT_IN_DOCUMENT: dict[str, tuple[str, ...]] = {"cache": ("embedder_token",)}


class OptionError(InfergateError, ValueError):
    """The settings break the spec (message: ``<path>: <what is wrong>``)."""


def _spec(node: dict, defs: dict) -> dict:
    """Spec entry of one node of pydantic's JSON schema (``$ref`` resolved, a ``null``
    alternative as ``nullable``, a section's default left to its own fields)."""
    if "$ref" in node:
        node = {**defs[node["$ref"].rsplit("/", 1)[-1]], **node}
    out: dict = {}
    alternatives = [a for a in node.get("anyOf", []) if a.get("type") != "null"]
    if len(alternatives) == 1:
        out = {**_spec(alternatives[0], defs), "nullable": True}
    out.update((k, node[k]) for k in SPEC_KEYS if k in node)
    if "properties" in node:
        out["fields"] = {k: _spec(v, defs) for k, v in node["properties"].items()}
        out.pop("default", None)
    elif isinstance(node.get("additionalProperties"), dict):
        out["values"] = _spec(node["additionalProperties"], defs)
    if "items" in node:
        out["items"] = _spec(node["items"], defs)
    if out.get("default", 0) is None:
        del out["default"]
    return out


@functools.cache
def _option_spec() -> dict:
    schema = Settings.model_json_schema()
    fields = {name: _spec(schema["properties"][name], schema.get("$defs", {}))
              for name in EDGE_SECTIONS}
    for section, names in NOT_IN_DOCUMENT.items():
        for name in names:
            fields[section]["fields"].pop(name, None)
    return {"type": "object", "fields": fields}


def option_spec() -> dict:
    """The spec of the edge's options document (every field of the edge sections but
    :data:`NOT_IN_DOCUMENT`); a new dict on each call."""
    return copy.deepcopy(_option_spec())


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
    when ``settings`` break the spec (the edge would refuse to start)."""
    try:
        settings = check_settings(settings)
    except ConfigError as exc:
        raise OptionError("; ".join(exc.fields) or str(exc)) from None
    options = json.dumps(edge_document(settings, edge_id, nodes), separators=(",", ":"))
    spec_json = json.dumps(option_spec(), separators=(",", ":"))
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
