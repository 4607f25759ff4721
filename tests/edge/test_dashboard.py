"""The Grafana dashboard docs/grafana/infergate.json queries only what the parts export:
with an edge (cache on, semantic lookups through an embedder), a control plane and the
embedder running and some traffic through them, every metric name in the dashboard's
PromQL expressions is a sample of one of their /metrics pages, and every label its
expressions select or group by is a label of those samples."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from controlplane import procs
from controlplane.config import settings_from_dict
from support.stack import edge_settings

pytestmark = pytest.mark.integration

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "infergate.json"
METRIC_RE = re.compile(r"\b(infergate_[a-z0-9_]+)")
SELECTOR_LABEL_RE = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*\"")
BY_RE = re.compile(r"\bby\s*\(([^)]*)\)")


def _panels(doc: dict) -> list[dict]:
    out = []
    for p in doc["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def expressions(doc: dict) -> list[str]:
    return [t["expr"] for p in _panels(doc) for t in p.get("targets", [])]


def test_dashboard_shape() -> None:
    doc = json.loads(DASHBOARD.read_text())
    assert doc["uid"] == "infergate" and doc["schemaVersion"] >= 36
    names = [v["name"] for v in doc["templating"]["list"]]
    assert "datasource" in names
    titles = {p["title"] for p in _panels(doc)}
    for wanted in ("Requests/s by status", "Cache hit rate", "Latency p50 / p99",
                   "Shed, rate-limited and retried", "Edge in-flight by node",
                   "Queue depth by node", "KV-cache usage by node", "Circuit breakers open",
                   "Embedder lookup latency p50 / p99"):
        assert wanted in titles, wanted
    ids = [p["id"] for p in _panels(doc)]
    assert len(ids) == len(set(ids))
    for p in _panels(doc):
        if p["type"] == "row":
            continue
        assert p["targets"], p["title"]
        assert {"x", "y", "w", "h"} <= set(p["gridPos"])
        for t in p["targets"]:
            e = t["expr"]
            assert e.count("(") == e.count(")") and e.count("{") == e.count("}"), e
            assert METRIC_RE.search(e), e


#: sample-name suffixes of a declared family, by type
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
            "summary": ("_sum", "_count"), "gauge": ("",), "untyped": ("",)}


OPERATIONS = DASHBOARD.parents[1] / "operations.md"


def _family_names(text: str) -> set[str]:
    """Names a reader looks up: counters with _total, histograms and gauges bare (the
    _created gauges prometheus_client adds beside counters and histograms left out)."""
    out = set()
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        if not name.endswith("_created"):
            out.add(name)
    return out


def _documented(name: str, doc: str) -> bool:
    """NAME in backquotes, or a shorthand of its tail (`_hits_total`, `..._node_running`)."""
    if f"`{name}`" in doc or f"`{name}{{" in doc:
        return True
    parts = name.split("_")
    tails = {"_" + "_".join(parts[i:]) for i in range(2, len(parts) - 1)}
    return any(f"`{t}`" in doc or f"`{t}{{" in doc or f"`...{t}`" in doc for t in tails)


def _scrape(url: str) -> tuple[dict[str, set[str]], set[str]]:
    """(sample name -> label names seen on it, sample names of families declared with a
    TYPE line: a labelled counter has no series before its first event)."""
    res = requests.get(url, timeout=5)
    assert res.status_code == 200, res.text
    out: dict[str, set[str]] = {}
    declared: set[str] = set()
    for fam in text_string_to_metric_families(res.text):
        declared |= {fam.name + sfx for sfx in SUFFIXES.get(fam.type, ("",))}
        for s in fam.samples:
            out.setdefault(s.name, set()).update(s.labels)
    return out, declared


def test_every_dashboard_metric_is_exported(workdir, redis_server, simnodes, tiny_upstreams,
                                            edge_factory, controlplane_factory) -> None:
    (node,) = simnodes(1, time_scale=0.05)
    (emb_backend,) = tiny_upstreams(names=["embeddings"])
    emb_port = procs.free_port()
    emb = procs.Managed("embedder", procs.infergate_argv(
        "embedder", "--listen", f"127.0.0.1:{emb_port}", "--redis-url", redis_server.url,
        "--embeddings-url", emb_backend.url, "--embeddings-model", "tiny-embed", "--index", "local",
        "--threads", "2"), workdir / "logs" / "embedder.log").start()
    try:
        emb_url = f"http://127.0.0.1:{emb_port}"
        emb.wait_ready(lambda: requests.get(emb_url + "/healthz", timeout=1).ok, 60)
        base = edge_settings(redis_server.url, [node.node_settings()])
        s = settings_from_dict({**base.model_dump(mode="json"),
                                "controlplane": {"poll_interval_s": 0.2, "leader_ttl_s": 2.0},
                                "cache": {"enabled": True, "semantic": True,
                                          "embedder_url": emb_url, "semantic_budget_ms": 2000}})
        cp = controlplane_factory(s)
        edge = edge_factory(s)
        for i in range(3):  # misses, lookups at the embedder, then an exact hit
            res = requests.post(edge.url + "/v1/chat/completions", timeout=20, json={
                "model": "sim-llama", "messages": [{"role": "user", "content": f"dash {i % 2}"}]})
            assert res.status_code == 200, res.text
        edge.wait_idle()

        exported: dict[str, set[str]] = {}
        declared: set[str] = set()
        families: set[str] = set()
        for url in (edge.metrics_url, cp.admin_url + "/metrics", emb_url + "/metrics"):
            families |= _family_names(requests.get(url, timeout=5).text)
            samples, names = _scrape(url)
            declared |= names
            for name, labels in samples.items():
                exported.setdefault(name, set()).update(labels)
    finally:
        emb.stop()

    # the metrics reference in docs/operations.md lists every family the parts export
    ops = OPERATIONS.read_text()
    assert len(families) >= 40, families
    undocumented = sorted(f for f in families if not _documented(f, ops))
    assert not undocumented, f"exported but not in docs/operations.md: {undocumented}"

    doc = json.loads(DASHBOARD.read_text())
    exprs = expressions(doc)
    used = {m for e in exprs for m in METRIC_RE.findall(e)}
    assert len(used) >= 20, used
    missing = sorted(used - set(exported) - declared)
    assert not missing, f"the dashboard queries metrics no part exports: {missing}"
    # with this traffic, every metric but the breaker openings (none here) has series
    assert used - set(exported) <= {"infergate_edge_breaker_opens_total"}, used - set(exported)
    for e in exprs:
        metrics = [m for m in METRIC_RE.findall(e) if m in exported]
        labels = set(SELECTOR_LABEL_RE.findall(e)) - {"job"}  # job: added by Prometheus
        for group in BY_RE.findall(e):
            labels |= {x.strip() for x in group.split(",") if x.strip()}
        if not metrics:
            continue
        have = set().union(*(exported[m] for m in metrics))
        assert labels <= have, (e, labels - have)
