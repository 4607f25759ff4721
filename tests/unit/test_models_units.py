"""Model-aware routing and slow start in the control plane, without processes: the
served-model list of a node (configured, read from ``/v1/models`` in the background,
unknown), its place in the snapshot, and the slow-start ramp from ``ramp_since``."""

from __future__ import annotations

import threading

import pytest

from controlplane.config import NodeSettings, settings_from_dict
from controlplane.routing import models as models_mod
from controlplane.routing.models import ModelsPoller, parse_models, takes_any_model
from controlplane.routing.registry import NodeState
from controlplane.routing.snapshot import build_snapshot, effective_weight
from controlplane.routing.wire import RoutingSnapshot, SnapshotNode


def test_parse_models_reads_openai_lists_and_refuses_others() -> None:
    body = '{"object":"list","data":[{"id":"m-b","object":"model"},{"id":"m-a"},{"id":"m-b"}]}'
    assert parse_models(body) == ["m-b", "m-a"]
    assert parse_models('{"object":"list","data":[]}') == []
    for bad in ("not json", "[]", '{"data": {}}', '{"data": [{"name": "x"}]}',
                '{"data": [{"id": 3}]}'):
        with pytest.raises(ValueError):
            parse_models(bad)


#: llama-server's /v1/models in single-model mode (as the engine the tests build answers,
#: "meta" trimmed), and in router mode (a "status" per model: llama.cpp tools/server).
LLAMACPP_ONE = ('{"models":[{"name":"gemma","model":"gemma"}],"object":"list","data":[{"id":'
                '"gemma","aliases":["gemma"],"object":"model","created":1,"owned_by":"llamacpp",'
                '"meta":{"n_vocab":262144}}]}')
LLAMACPP_ROUTER = ('{"object":"list","data":[{"id":"a","object":"model","owned_by":"llamacpp",'
                   '"status":{"value":"loaded"}}]}')


def test_a_single_model_llamacpp_server_takes_any_model() -> None:
    assert parse_models(LLAMACPP_ONE) == ["gemma"]
    assert takes_any_model(LLAMACPP_ONE) is True
    assert takes_any_model(LLAMACPP_ROUTER) is False        # routes by name
    two = ('{"data":[{"id":"a","owned_by":"llamacpp"},{"id":"b","owned_by":"llamacpp"}]}')
    assert takes_any_model(two) is False
    for other in ('{"object":"list","data":[{"id":"m","object":"model","owned_by":"vllm"}]}',
                  '{"data":[{"id":"m","owned_by":"sglang"}]}', '{"data":[{"id":"m"}]}',
                  '{"data":[]}', "not json", "[]", '{"data":["llamacpp"]}'):
        assert takes_any_model(other) is False, other


def test_which_nodes_are_polled_for_models() -> None:
    def node(**kw):
        return NodeSettings(name="n", url="http://127.0.0.1:1", **kw)

    assert node().polls_models() is True
    assert node(kind="openai").polls_models() is False           # llama-cpp-python safe
    assert node(kind="openai", poll_models=True).polls_models() is True
    assert node(models=["m"]).polls_models() is False            # configured wins
    assert node(poll_models=False).polls_models() is False
    assert node(models=["a", "b", "a"]).models == ["a", "b"]
    for bad in ([""], ["x" * 300], ["bad\nid"]):
        with pytest.raises(ValueError):
            node(models=bad)
    cp = settings_from_dict({"controlplane": {}}).controlplane
    assert cp.models_refresh_s == 60.0 and cp.models_timeout_s == 2.0
    with pytest.raises(ValueError):
        settings_from_dict({"controlplane": {"models_refresh_s": 1}})


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_models_poller_reads_in_the_background_rarely_and_keeps_the_last_list(monkeypatch) -> None:
    clock = FakeClock()
    mp = ModelsPoller(refresh_s=60.0, timeout_s=1.0, clock=clock)
    answers = [((["m-1"], False), None), (None, "HTTP 500"), ((["m-1", "m-2"], True), None)]
    calls: list[str] = []
    gate = threading.Event()

    def read(url: str):
        calls.append(url)
        gate.wait(5)
        return answers[len(calls) - 1]

    monkeypatch.setattr(mp, "_read", read)
    node = NodeSettings(name="v", url="http://127.0.0.1:9")
    try:
        assert mp.served(node) is None                  # first read started, not waited for
        assert mp.served(node) is None and len(calls) == 1   # still running: not started again
        gate.set()
        mp.wait_idle()
        assert mp.served(node) == ["m-1"]
        assert calls == ["http://127.0.0.1:9/v1/models"]
        clock.t += 59
        assert mp.served(node) == ["m-1"] and len(calls) == 1   # not due yet
        clock.t += 2
        mp.served(node)                                  # due: second read (fails)
        mp.wait_idle()
        assert mp.served(node) == ["m-1"]                # failure keeps the last list
        assert mp.takes_any_model(node) is False
        assert mp.error("v") == "HTTP 500"
        clock.t += models_mod.RETRY_S + 0.1              # a failure is retried sooner
        mp.served(node)
        mp.wait_idle()
        assert mp.served(node) == ["m-1", "m-2"] and len(calls) == 3
        assert mp.error("v") is None
        # what the last good read said: takes any model (never with configured models)
        assert mp.takes_any_model(node) is True
        assert mp.takes_any_model(node.model_copy(update={"models": ["cfg"]})) is False
        # configured models win and no read happens; openai nodes are never read
        assert mp.served(node.model_copy(update={"models": ["cfg"]})) == ["cfg"]
        assert mp.served(NodeSettings(name="o", url="http://127.0.0.1:9", kind="openai")) is None
        assert len(calls) == 3
        mp.forget(set())
        assert mp.error("v") is None
    finally:
        mp.close()


def test_snapshot_carries_models_and_parses_them_tolerantly() -> None:
    nodes = [NodeSettings(name="a", url="http://10.0.0.1:8000"),
             NodeSettings(name="b", url="http://10.0.0.2:8000")]
    snap = build_snapshot(version=1, now=100.0, leader="cp", nodes=nodes, states={},
                          statuses={}, hosts={"a": "10.0.0.1", "b": "10.0.0.2"},
                          slow_start_s=30, models={"a": ["m-a"]})
    again = RoutingSnapshot.from_json(snap.to_json())
    assert again.node("a").models == ["m-a"] and again.node("b").models is None
    assert again.node("a").models_any is False
    # takes any model: only a node with a list says so
    snap = build_snapshot(version=1, now=100.0, leader="cp", nodes=nodes, states={},
                          statuses={}, hosts={}, slow_start_s=30, models={"a": ["m-a"]},
                          models_any={"a", "b"})
    again = RoutingSnapshot.from_json(snap.to_json())
    assert again.node("a").models_any is True and again.node("b").models_any is False
    assert SnapshotNode.from_dict({"name": "x", "models_any": True}).models_any is False
    assert SnapshotNode.from_dict({"name": "x", "models": ["ok", 3, None]}).models == ["ok"]
    assert SnapshotNode.from_dict({"name": "x", "models": "m"}).models is None


def test_slow_start_from_ramp_since() -> None:
    active = NodeState("active", 0.0, "")
    assert effective_weight(2.0, active, 100.0, 30.0) == 2.0
    # added at run time / healthy again 15 s ago: half way up the ramp
    assert effective_weight(2.0, active, 100.0, 30.0, ramp_since=85.0) == pytest.approx(1.0)
    assert effective_weight(2.0, active, 100.0, 30.0, ramp_since=100.0) == pytest.approx(0.2)
    assert effective_weight(2.0, active, 100.0, 30.0, ramp_since=60.0) == 2.0
    # the later of undrain and ramp_since counts
    undrained = NodeState("active", 97.0, "op")
    assert effective_weight(1.0, undrained, 100.0, 30.0, ramp_since=85.0) == pytest.approx(0.1)
    # draining nodes are not ramped (they get no traffic anyway)
    assert effective_weight(1.0, NodeState("draining", 99.0), 100.0, 30.0, ramp_since=99.0) == 1.0
    snap = build_snapshot(version=1, now=100.0, leader="cp",
                          nodes=[NodeSettings(name="a", url="http://10.0.0.1:8000")],
                          states={}, statuses={}, hosts={"a": "10.0.0.1"}, slow_start_s=30,
                          ramps={"a": 94.0})
    assert snap.node("a").effective_weight == pytest.approx(0.2)


def test_a_nodes_models_list_is_bounded() -> None:
    """The registry's nodes are validated again at every control-plane cycle: a node
    given 20,000 model ids through the API was accepted, and each validation then took
    seconds (a quadratic duplicate check), past the leader's 5 s lease, so leadership
    changed hands every few seconds and the admin API took 17 s to answer. More than
    1000 ids are refused, duplicates are dropped in one pass."""
    with pytest.raises(ValueError, match="at most 1000 model ids, got 20000"):
        NodeSettings(name="a", url="http://127.0.0.1:9001",
                     models=[f"m{i:05d}" for i in range(20000)])
    many = [f"m{i:04d}-" + "x" * 250 for i in range(999)] + ["m0000-" + "x" * 250]
    n = NodeSettings(name="a", url="http://127.0.0.1:9001", models=many)
    assert n.models == many[:-1]
    with pytest.raises(ValueError, match="at most 1000 model ids"):
        settings_from_dict({"nodes": [{"name": "a", "url": "http://127.0.0.1:9001",
                                       "models": [str(i) for i in range(1001)]}]})
