"""The Redis wire documents (controlplane/routing/wire.py): the bytes written stay what the
Lua edge and docs/internals.md expect, parsing is tolerant, edge freshness is one rule."""

from __future__ import annotations

import dataclasses
import json

import pytest

from controlplane.admin.nodeview import edge_stats
from controlplane.config import NodeSettings
from controlplane.routing.poller import NodeStatus
from controlplane.routing.registry import NodeState
from controlplane.routing.snapshot import build_snapshot, fresh_inflight, stale_edges
from controlplane.routing.wire import (
    EDGE_FRESH_FACTOR,
    EdgeReport,
    NodeMetricsDoc,
    RoutingSnapshot,
    SnapshotNode,
    WireError,
    edge_fresh_s,
    fresh_edge_reports,
)


def status(name: str = "a", **kw) -> NodeStatus:
    base = {"name": name, "ts": 100.5, "healthy": True, "reachable": True, "dialect": "vllm",
            "queue_depth": 1.0, "running": 2.0, "kv_cache_usage": 0.25, "e2e_avg_s": 1.5,
            "ttft_avg_s": 0.1, "prompt_tokens_total": 10.0, "generation_tokens_total": 20.0,
            "score": 0.3, "saturated": False, "consecutive_failures": 0,
            "consecutive_successes": 4, "last_error": None, "poll_ms": 3.14159,
            "has_metrics": True}
    return NodeStatus(**{**base, **kw})


def test_the_snapshot_json_is_the_documented_bytes():
    nodes = [NodeSettings(name="b", url="http://10.0.0.2:8001", weight=2.0),
             NodeSettings(name="a", url="http://10.0.0.1:8000", kind="tgi", max_concurrency=8)]
    snap = build_snapshot(version=3, now=100.12345, leader="cp-1", nodes=nodes,
                          states={"b": NodeState("draining", 50.0, "admin")},
                          statuses={"a": status("a").metrics()},
                          hosts={"a": "10.0.0.1", "b": None}, slow_start_s=30,
                          models={"a": ["m-1", "m-2"]})
    assert snap.to_json() == (
        '{"version":3,"generated_at":100.123,"leader":"cp-1","nodes":['
        '{"name":"a","url":"http://10.0.0.1:8000","host":"10.0.0.1","port":8000,"kind":"tgi",'
        '"state":"active","healthy":true,"weight":1.0,"effective_weight":1.0,'
        '"max_concurrency":8,"slots":8,"slots_source":"config","ctx_tokens":null,'
        '"score":0.3,"saturated":false,"queue_depth":1.0,"running":2.0,"polled_at":100.5,'
        '"restarted_after":null,"back_at":null,'
        '"kv_cache_usage":0.25,"has_metrics":true,"models":["m-1","m-2"],"models_any":false,"connects":false},'
        '{"name":"b","url":"http://10.0.0.2:8001","host":null,"port":8001,"kind":"vllm",'
        '"state":"draining","healthy":true,"weight":2.0,"effective_weight":2.0,'
        '"max_concurrency":64,"slots":null,"slots_source":null,"ctx_tokens":null,'
        '"score":null,"saturated":false,"queue_depth":null,'
        '"running":null,"polled_at":null,"restarted_after":null,"back_at":null,"kv_cache_usage":null,"has_metrics":false,"models":null,"models_any":false,"connects":false}]}')
    again = RoutingSnapshot.from_json(snap.to_json())
    assert again == snap and again.to_json() == snap.to_json()
    assert again.node("b").state == "draining" and again.node("zz") is None


def test_a_node_connects_when_unhealthy_and_its_last_poll_connected():
    """``connects`` (the edge holds requests for such a node while none is eligible): an
    unhealthy node whose last poll connected and timed out (frozen), that an edge found
    stalled, or whose last poll was good (coming back); not a refused one, not one that
    answers and fails, not a healthy one."""
    nodes = [NodeSettings(name=n, url=f"http://10.0.0.{i}:8000") for i, n in enumerate("abcd", 1)]
    nodes.append(NodeSettings(name="e", url="http://10.0.0.5:8000"))
    down = {"healthy": False, "consecutive_successes": 0}
    snap = build_snapshot(version=1, now=1.0, leader="cp", nodes=nodes, states={},
                          statuses={"a": status("a", **down, busy=True).metrics(),
                                    "b": status("b", **down, reachable=True).metrics(),
                                    "c": status("c", **down, stalled=True).metrics(),
                                    "d": status("d", healthy=True, busy=True).metrics(),
                                    "e": status("e", healthy=False,
                                                consecutive_successes=1).metrics()},
                          hosts={}, slow_start_s=0)
    # b: answered and failed (an engine that is down behind a live server): not waited for
    assert [(n.name, n.connects) for n in snap.nodes] == [
        ("a", True), ("b", False), ("c", True), ("d", False), ("e", True)]
    again = RoutingSnapshot.from_json(snap.to_json())
    assert again.node("a").connects and not again.node("b").connects
    assert NodeMetricsDoc.from_dict(status("a", busy=True).metrics_doc()).busy is True


def test_slots_come_from_the_server_or_a_configured_max_concurrency():
    nodes = [NodeSettings(name="cpp", url="http://10.0.0.3:8080", kind="openai"),
             NodeSettings(name="cpp4", url="http://10.0.0.4:8080", max_concurrency=4),
             NodeSettings(name="set", url="http://10.0.0.5:8000", max_concurrency=3),
             NodeSettings(name="plain", url="http://10.0.0.6:8000")]
    snap = build_snapshot(version=1, now=1.0, leader="cp", nodes=nodes, states={},
                          statuses={}, hosts={}, slow_start_s=0,
                          slots={"cpp": 2, "cpp4": 8})
    got = {n.name: (n.slots, n.slots_source) for n in snap.nodes}
    assert got == {"cpp": (2, "server"), "cpp4": (4, "server"), "set": (3, "config"),
                   "plain": (None, None)}
    again = RoutingSnapshot.from_json(snap.to_json())
    assert again.node("cpp").slots == 2 and again.node("cpp").slots_source == "server"


def test_the_metrics_doc_keeps_every_field_of_a_poll():
    assert [f.name for f in dataclasses.fields(NodeMetricsDoc)] == \
        [f.name for f in dataclasses.fields(NodeStatus)]
    st = status()
    legacy = {**dataclasses.asdict(st), "poll_ms": 3.1}
    assert json.dumps(st.metrics_doc()) == json.dumps(legacy)
    assert NodeMetricsDoc.from_json(json.dumps(st.metrics_doc())) == st.metrics()


def test_parsing_is_tolerant_of_unknown_missing_and_mistyped_fields():
    snap = RoutingSnapshot.from_json(json.dumps({
        "version": 9, "future_field": {"x": 1},
        "nodes": [{"name": "a", "weight": "heavy", "healthy": "yes", "port": 81.0, "new": 1},
                  {"url": "no name"}, "junk", {"name": ""}]}))
    assert snap.version == 9 and snap.generated_at is None and snap.leader == ""
    assert snap.nodes == [SnapshotNode(name="a", port=81)]
    assert RoutingSnapshot.from_json('{"nodes": "nope"}').nodes == []
    for bad in ("{not json", "[1, 2]", "", None):
        with pytest.raises(WireError):
            RoutingSnapshot.from_json(bad)
        assert RoutingSnapshot.parse(bad) is None and NodeMetricsDoc.parse(bad) is None
    m = NodeMetricsDoc.from_json('{"name": "a", "healthy": 1, "score": NaN, "last_error": 5}')
    assert m.healthy is None and m.score is None and m.last_error == "5"
    assert m.consecutive_failures == 0 and m.has_metrics is False
    with pytest.raises(ValueError):  # WireError is a ValueError too
        NodeMetricsDoc.from_json("[]")


LUA_REPORT = {
    "edge_id": "host:8080", "ts": 1000.0,
    "nodes": {"a": {"inflight": 2, "requests": 100, "failures": 3, "breaker": "half_open",
                    "latency_ewma_ms": 850.0},
              "b": {"inflight": 0, "requests": 5, "failures": 0, "breaker": "closed"},
              "c": 4},
    "admission": {"shed": 1, "waiting": 0, "bogus": "x"},
    "duration": {"le": [0.1, 1], "counts": [3, 4]},
}


def test_edge_report_reads_what_the_lua_edge_writes():
    rep = EdgeReport.from_dict(LUA_REPORT)
    assert rep.edge_id == "host:8080" and rep.ts == 1000.0
    assert EdgeReport.from_field("field-id", json.dumps(LUA_REPORT)).edge_id == "field-id"
    assert set(rep.nodes) == {"a", "b"}
    assert rep.nodes["a"].breaker == "half_open" and rep.nodes["a"].latency_ewma_ms == 850.0
    assert rep.nodes["b"].latency_ewma_ms is None
    assert rep.admission == {"shed": 1, "waiting": 0}
    assert rep.extra == {"duration": {"le": [0.1, 1], "counts": [3, 4]}}
    assert rep.to_dict()["duration"] == LUA_REPORT["duration"]
    odd = EdgeReport.from_field("e9", '{"ts": "late", "nodes": {"a": {"breaker": "weird"}}}')
    assert odd.edge_id == "e9" and odd.ts is None and odd.nodes["a"].breaker is None
    assert EdgeReport.from_field("e9", "not json") is None


def test_edge_freshness_is_one_rule_for_drain_and_admin():
    stale_after_s = 10.0
    limit = edge_fresh_s(stale_after_s)
    assert limit == EDGE_FRESH_FACTOR * stale_after_s == 30.0
    now = 1000.0
    raw = {"edge": json.dumps({**LUA_REPORT, "ts": now - limit}),          # just fresh
           "old": json.dumps({**LUA_REPORT, "ts": now - limit - 0.01}),    # just stale
           "junk": "{"}
    assert [r.edge_id for r in fresh_edge_reports(raw, now, limit)] == ["edge"]
    assert fresh_inflight(raw, now, limit) == {"a": 2.0, "b": 0.0}
    agg = edge_stats(raw, now, limit)
    assert agg["a"].edges == 1 and agg["a"].inflight == 2 and agg["a"].breaker == "half_open"
    assert agg["a"].breakers == {"edge": "half_open"}
    assert sorted(stale_edges(raw, now, limit)) == ["junk", "old"]
