"""``infergate cache stats|purge`` against a real redis-server; the [cache] settings, their
example file and what the edge is handed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from controlplane.cache import store as cache_store
from controlplane.redisdb import keynames
from controlplane.routing import registry
from controlplane.cli import cache as cache_cli
from controlplane.cli.cache import cache_cmd
from controlplane.edge.options import edge_document, embedder_server, render_context
from controlplane.config import ConfigError, load_settings, settings_from_dict

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "infergate.example.toml"


def hexkey(i: int) -> str:
    return f"{i:064x}"


@pytest.fixture
def filled(redis_server):
    r = redis_server.client()
    for i, (tenant, model) in enumerate([("a", "m1"), ("a", "m2"), ("b", "m1")]):
        cache_store.store(r, hexkey(i), tenant=tenant, model=model, namespace="ab" * 32,
                          body="{}", ttl=60)
        r.hset(keynames.cache_vec("minilm", 4, hexkey(i)), mapping={"key": hexkey(i), "vec": b"\0" * 16})
    cache_store.count(r, "lookups", 4)
    cache_store.count(r, "hits_exact", 1)
    return r


def invoke(redis_server, *args: str, input: str | None = None):
    return CliRunner().invoke(cache_cmd, ["--redis-url", redis_server.url, *args], input=input)


def test_stats_text_and_json(redis_server, filled) -> None:
    res = invoke(redis_server, "stats")
    assert res.exit_code == 0, res.output
    assert "entries" in res.output and "25.0%" in res.output
    res = invoke(redis_server, "stats", "--json")
    doc = json.loads(res.output)
    assert doc["entries"] == 3 and doc["lookups"] == 4 and doc["stores"] == 3
    assert doc["hit_rate"] == 0.25


def test_purge_by_tenant_and_model_writes_an_event(redis_server, filled) -> None:
    res = invoke(redis_server, "purge", "--tenant", "a", "--model", "m1")
    assert res.exit_code == 0, res.output
    assert "purged 1 entries, 1 vectors" in res.output
    assert not filled.exists(keynames.cache_entry(hexkey(0)))
    # the purged entry's vector is gone, the others' stay
    assert not filled.exists(keynames.cache_vec("minilm", 4, hexkey(0)))
    assert filled.exists(keynames.cache_vec("minilm", 4, hexkey(1)))
    assert filled.exists(keynames.cache_entry(hexkey(1))) and filled.exists(keynames.cache_entry(hexkey(2)))
    ev = registry.recent_events(filled, 5)[0]
    assert ev["kind"] == "cache_purge" and ev["actor"].startswith("cli:")
    assert ev["detail"] == {"tenant": "a", "model": "m1", "purged": 1}


def test_purge_all_removes_entries_and_vectors(redis_server, filled, monkeypatch) -> None:
    # no terminal to ask on: refused, naming --yes
    refused = invoke(redis_server, "purge", "--all")
    assert refused.exit_code == 2 and "--yes" in refused.output
    assert filled.exists(keynames.cache_entry(hexkey(0)))
    monkeypatch.setattr(cache_cli, "can_ask", lambda: True)
    aborted = invoke(redis_server, "purge", "--all", input="n\n")
    assert aborted.exit_code != 0 and "Delete all 3 cache entries?" in aborted.output
    assert filled.exists(keynames.cache_entry(hexkey(0)))
    res = invoke(redis_server, "purge", "--all", "--yes")
    assert res.exit_code == 0, res.output
    assert "purged 3 entries, 3 vectors" in res.output
    assert not list(filled.scan_iter(match="infergate:v1:cache:*entry*"))
    assert not list(filled.scan_iter(match=keynames.CACHE_VEC_PREFIX + "*"))
    assert int(filled.hget(keynames.CACHE_STATS, "lookups")) == 4  # counters are kept
    # nothing left to delete: no question asked, even without a terminal
    monkeypatch.setattr(cache_cli, "can_ask", lambda: False)
    again = invoke(redis_server, "purge", "--all")
    assert again.exit_code == 0 and "purged 0 entries" in again.output, again.output


@pytest.mark.parametrize("args, msg", [
    ((), "give --tenant"),
    (("--all", "--tenant", "a"), "cannot be combined"),
])
def test_purge_needs_one_scope(redis_server, args, msg) -> None:
    res = invoke(redis_server, "purge", *args)
    assert res.exit_code == 2 and msg in res.output


def test_unreachable_redis_is_a_clean_error() -> None:
    res = CliRunner().invoke(cache_cmd, ["--redis-url", "redis://127.0.0.1:1/0", "stats"])
    assert res.exit_code == 1 and "cannot reach Redis" in res.output


def test_example_cache_section_matches_defaults() -> None:
    assert load_settings(EXAMPLE).cache == load_settings(None).cache


def test_cache_is_off_by_default_and_renders_nothing() -> None:
    ctx = render_context(load_settings(None), "edge", [])
    assert ctx["cache_enabled"] is False and ctx["cache_semantic"] is False


@pytest.mark.parametrize("cache, msg", [
    ({"embedder_url": "https://x:1"}, "http://host:port"),
    ({"embedder_url": "http://x:1/v1"}, "without a path"),
    ({"min_similarity": 1.5}, "cache.min_similarity: 1.5 is above the maximum 1"),
    ({"min_similarity_routes": {"/v1/embeddings": 0.9}}, "unknown path"),
    ({"min_similarity_routes": {"/v1/completions": 1.1}}, "1.1 is above the maximum 1"),
    ({"min_similarity_models": {"m": -0.1}}, "-0.1 is below the minimum 0"),
    ({"ttl_s": 0}, "cache.ttl_s: 0 is below the minimum 1"),
    ({"semantic_index_max_rows": 10},
     "cache.semantic_index_max_rows: 10 is below the minimum 1000"),
    ({"bogus": 1}, "cache.bogus: unknown option"),
])
def test_bad_cache_settings_are_named(cache, msg) -> None:
    with pytest.raises(ConfigError, match=msg):
        settings_from_dict({"cache": cache})


def test_edge_options_carry_every_setting() -> None:
    s = settings_from_dict({"cache": {"enabled": True, "min_similarity": 0,
                                      "min_similarity_models": {"m": 0.9},
                                      "embedder_url": "http://[::1]:9000"}})
    o = edge_document(s)["cache"]
    assert o["min_similarity"] == 0.0 and o["min_similarity"] is not None  # 0 is a value
    assert o["min_similarity_models"] == {"m": 0.9}
    assert set(o) == {"enabled", "ttl_s", "max_entry_bytes", "max_temperature", "stream_usage",
                      "semantic",
                      "embedder_url", "semantic_budget_ms", "min_similarity",
                      "min_similarity_routes", "min_similarity_models", "coalesce",
                      "coalesce_wait_s", "coalesce_stream_wait_s", "coalesce_poll_ms",
                      "local_ttl_ms", "embedder_model",
                      "semantic_index_max_rows",
                      "verifier", "verifier_file", "semantic_domains", "max_request_bytes",
                      "max_request_members",
                      "verify_fraction", "verify_answer_similarity", "verify_max_wrong",
                      "verify_threshold_step", "verify_max_raise", "verify_queue_max",
                      "verify_timeout_s", "explain", "semantic_languages"}
    # unset: null in the document, the embedder model's default at the edge
    assert edge_document(settings_from_dict({}))["cache"]["min_similarity"] is None
    assert embedder_server("http://[::1]:9000") == "[::1]:9000"
    assert embedder_server("http://emb") == "emb:80"
