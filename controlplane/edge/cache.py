"""The ``[cache]`` settings as the edge needs them: the options handed to
``require("infergate.cache.lookup").init`` (``lua/infergate/cache/lookup.lua``) and the values the nginx
templates use (shared dict, embedder upstream, subrequest timeouts).

With ``cache.enabled = false`` nothing cache-related is rendered: the edge runs exactly as
without the cache.
"""

from __future__ import annotations

import json
from urllib.parse import urlsplit

from controlplane.config import Settings

#: Size of the ``infergate_cache`` shared dict (coalescing locks: ~200 bytes each).
CACHE_DICT_SIZE = "2m"


def edge_cache_options(settings: Settings) -> dict:
    """The JSON options of ``infergate.cache.lookup.init`` (names as in lua/infergate/cache/lookup.lua;
    ``min_similarity`` ``false`` = the embedder model's default)."""
    c = settings.cache
    return {
        "enabled": c.enabled,
        "ttl_s": c.ttl_s,
        "max_entry_bytes": c.max_entry_bytes,
        "max_temperature": float(c.max_temperature),
        "semantic": c.semantic,
        "semantic_budget_ms": c.semantic_budget_ms,
        "min_similarity": False if c.min_similarity is None else float(c.min_similarity),
        "min_similarity_routes": {k: float(v) for k, v in c.min_similarity_routes.items()},
        "min_similarity_models": {k: float(v) for k, v in c.min_similarity_models.items()},
        "coalesce": c.coalesce,
        "coalesce_wait_s": float(c.coalesce_wait_s),
        "coalesce_poll_ms": c.coalesce_poll_ms,
    }


def embedder_server(url: str) -> str:
    """``host:port`` (``[v6]:port``) of the embedder root URL, for an nginx ``server`` line."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    return f"{host}:{parts.port or 80}"


def _long_bracket(text: str) -> str:
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    return "=" * level


def render_context(settings: Settings) -> dict:
    """Template variables: ``cache_enabled``, ``cache_semantic``, ``cache_options_json``,
    ``cache_bracket``, ``cache_dict_size``, ``embedder_server``, ``cache_budget`` (an nginx
    time, the semantic budget)."""
    c = settings.cache
    options = json.dumps(edge_cache_options(settings), separators=(",", ":"))
    return {
        "cache_enabled": c.enabled,
        "cache_semantic": c.enabled and c.semantic,
        "cache_options_json": options,
        "cache_bracket": _long_bracket(options),
        "cache_dict_size": CACHE_DICT_SIZE,
        "embedder_server": embedder_server(c.embedder_url),
        "cache_budget": f"{c.semantic_budget_ms}ms",
    }
