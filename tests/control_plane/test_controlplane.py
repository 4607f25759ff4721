"""The control plane against a real redis-server and real simulated nodes, cycles driven
directly with ControlPlane.run_cycle(): snapshot shape, metrics and history keys,
latency windows, registry changes at run time, drain and slow start.

Also holds the small helpers (simulated node processes, settings) the other
test_controlplane_* files import."""

from __future__ import annotations

import json
import time

import pytest

from controlplane.redisdb import keynames
from controlplane.routing.leader import LeaderElector
from controlplane.routing import registry
from controlplane.config import NodeSettings, Settings
from controlplane.routing.service import ControlPlane
from support.controlplane import Sim, cp_settings, routing, start_sim

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def sims(tmp_path_factory: pytest.TempPathFactory):
    """Three simulated nodes for the module: vLLM with two engine ranks, TGI, and one
    without metrics (an OpenAI-compatible server such as Ollama)."""
    folder = tmp_path_factory.mktemp("sims")
    started: list[Sim] = []
    try:
        for name, dialect, engines in (("sim-v", "vllm", 2), ("sim-t", "tgi", 1),
                                       ("sim-o", "none", 1)):
            started.append(start_sim(folder, name, dialect, engines))
        yield {s.name: s for s in started}
    finally:
        for s in started:
            s.managed.stop()


@pytest.fixture
def pool(sims):
    for s in sims.values():
        s.clear()
    return [sims["sim-v"].node("vllm", weight=2.0), sims["sim-t"].node("tgi"),
            sims["sim-o"].node("openai", max_concurrency=4)]


@pytest.fixture
def cp_factory(redis_server):
    made: list[ControlPlane] = []

    def make(settings: Settings, ident: str | None = None) -> ControlPlane:
        cp = ControlPlane(settings, redis_server.client(), ident=ident)
        made.append(cp)
        return cp

    yield make
    for cp in made:
        cp.shutdown()


# -- tests ---------------------------------------------------------------------------

NODE_KEYS = {"name", "url", "host", "port", "kind", "state", "healthy", "weight",
             "effective_weight", "max_concurrency", "slots", "slots_source", "ctx_tokens", "score",
             "saturated", "queue_depth", "running", "polled_at", "restarted_after",
             "back_at", "kv_cache_usage", "has_metrics", "models", "models_any", "connects"}
METRICS_KEYS = {"name", "ts", "healthy", "reachable", "dialect", "queue_depth", "running",
                "kv_cache_usage", "e2e_avg_s", "ttft_avg_s", "prompt_tokens_total",
                "generation_tokens_total", "score", "saturated", "consecutive_failures",
                "consecutive_successes", "last_error", "poll_ms", "has_metrics", "stalled", "busy"}


def test_snapshot_shape_and_per_node_keys(redis_server, sims, pool, cp_factory):
    r = redis_server.client()
    cp = cp_factory(cp_settings(pool), ident="cp-test-1")
    t0 = time.time()
    rep = cp.run_cycle()
    assert rep.leader and rep.wrote and rep.version == 1

    # The registry was seeded from the configuration.
    assert [n.name for n in registry.list_nodes(r)] == ["sim-o", "sim-t", "sim-v"]

    snap = routing(r)
    assert set(snap) == {"version", "generated_at", "leader", "nodes"}
    assert snap["version"] == 1 and snap["leader"] == "cp-test-1"
    assert t0 <= snap["generated_at"] <= time.time()
    by = {n["name"]: n for n in snap["nodes"]}
    assert [n["name"] for n in snap["nodes"]] == ["sim-o", "sim-t", "sim-v"]
    for n in snap["nodes"]:
        assert set(n) == NODE_KEYS
        assert n["host"] == "127.0.0.1" and n["state"] == "active" and n["healthy"] is True
        assert n["port"] == sims[n["name"]].port
    v, t, o = by["sim-v"], by["sim-t"], by["sim-o"]
    assert v["kind"] == "vllm" and v["has_metrics"] and v["weight"] == 2.0
    assert v["effective_weight"] == 2.0
    assert v["queue_depth"] == 0 and v["running"] == 0 and v["kv_cache_usage"] == 0
    assert t0 <= v["polled_at"] <= snap["generated_at"]   # the poll its figures are from
    assert v["score"] == 0.0 and v["saturated"] is False
    assert t["kind"] == "tgi" and t["has_metrics"] and t["kv_cache_usage"] is None
    assert t["score"] == 0.0
    # No metrics endpoint: routable on the edge's own signals.
    assert o["kind"] == "openai" and o["has_metrics"] is False and o["score"] is None
    assert o["healthy"] is True and o["max_concurrency"] == 4

    m = json.loads(r.get(keynames.node_metrics("sim-v")))
    assert set(m) == METRICS_KEYS
    assert m["dialect"] == "vllm" and m["reachable"] and m["last_error"] is None
    assert m["e2e_avg_s"] is None  # first poll: no window yet
    assert 0 < r.pttl(keynames.node_metrics("sim-v")) <= 30000
    assert json.loads(r.get(keynames.node_metrics("sim-t")))["dialect"] == "tgi"
    assert json.loads(r.get(keynames.node_metrics("sim-o")))["dialect"] is None

    rep2 = cp.run_cycle()
    assert rep2.version == 2 and routing(r)["version"] == 2
    hist = [json.loads(x) for x in r.lrange(keynames.node_history("sim-v"), 0, -1)]
    assert len(hist) == 2 and hist[0]["ts"] >= hist[1]["ts"]
    assert set(hist[0]) == {"ts", "queue_depth", "running", "kv_cache_usage", "e2e_avg_s",
                            "ttft_avg_s", "score", "healthy"}
    for _ in range(6):
        cp.run_cycle()
    assert r.llen(keynames.node_history("sim-v")) == 5  # history_points

    leader_events = [e for e in registry.recent_events(r) if e["kind"] == "leader"]
    assert len(leader_events) == 1 and leader_events[0]["detail"] == {"id": "cp-test-1"}


def test_hostname_resolved_to_ip_literal(redis_server, sims, cp_factory):
    r = redis_server.client()
    s = sims["sim-v"]
    node = NodeSettings(name="by-name", url=f"http://localhost:{s.port}")
    cp_factory(cp_settings([node])).run_cycle()
    (n,) = routing(r)["nodes"]
    assert n["host"] == "127.0.0.1" and n["url"] == f"http://localhost:{s.port}"


def test_recent_latency_window(redis_server, sims, pool, cp_factory):
    r = redis_server.client()
    cp = cp_factory(cp_settings(pool))
    cp.run_cycle()
    sims["sim-v"].chat(4)
    sims["sim-t"].chat(2)
    cp.run_cycle()
    v = json.loads(r.get(keynames.node_metrics("sim-v")))
    t = json.loads(r.get(keynames.node_metrics("sim-t")))
    assert v["e2e_avg_s"] is not None and v["e2e_avg_s"] > 0
    assert v["ttft_avg_s"] is not None and v["ttft_avg_s"] > 0
    assert t["e2e_avg_s"] is not None and t["ttft_avg_s"] is None  # TGI: no TTFT histogram
    assert v["generation_tokens_total"] >= 4
    # Nothing finished since: no recent latency (null, not 0).
    cp.run_cycle()
    v = json.loads(r.get(keynames.node_metrics("sim-v")))
    assert v["e2e_avg_s"] is None and v["ttft_avg_s"] is None


def test_registry_changes_are_picked_up_next_cycle(redis_server, sims, pool, cp_factory):
    r = redis_server.client()
    cp = cp_factory(cp_settings(pool[:1]))
    cp.run_cycle()
    assert [n["name"] for n in routing(r)["nodes"]] == ["sim-v"]
    registry.put_node(r, pool[1])
    cp.run_cycle()
    assert [n["name"] for n in routing(r)["nodes"]] == ["sim-t", "sim-v"]
    registry.remove_node(r, "sim-v")
    cp.run_cycle()
    assert [n["name"] for n in routing(r)["nodes"]] == ["sim-t"]
    # A run-time edit survives a restart, and so does a run-time removal of a node of the
    # file (each configured node is seeded once); a node new in the file is added.
    registry.put_node(r, pool[1].model_copy(update={"weight": 3.0}))
    cp.shutdown()
    cp2 = cp_factory(cp_settings(pool[:2]))
    cp2.run_cycle()
    by = {n["name"]: n for n in routing(r)["nodes"]}
    assert sorted(by) == ["sim-t"] and by["sim-t"]["weight"] == 3.0


def edge_stats(r, inflight: int, ts: float | None = None, edge_id: str = "e1") -> None:
    r.hset(keynames.EDGES, edge_id, json.dumps({
        "edge_id": edge_id, "ts": time.time() if ts is None else ts,
        "nodes": {"sim-v": {"inflight": inflight, "requests": 10, "failures": 0,
                            "breaker": "closed", "latency_ewma_ms": 50.0}}}))


def test_drain_waits_for_inflight_then_drained(redis_server, sims, pool, cp_factory):
    r = redis_server.client()
    cp = cp_factory(cp_settings(pool))
    cp.run_cycle()
    registry.set_state(r, "sim-v", "draining", actor="op", now=time.time() - 5)
    edge_stats(r, inflight=2)
    edge_stats(r, inflight=0, edge_id="e2")
    rep = cp.run_cycle()
    assert rep.drained == []
    assert {n["name"]: n["state"] for n in routing(r)["nodes"]}["sim-v"] == "draining"

    # A stale edge's in-flight count is ignored (3 x stale_after_s = 30 s).
    edge_stats(r, inflight=2, ts=time.time() - 31)
    rep = cp.run_cycle()
    assert rep.drained == ["sim-v"]
    assert registry.get_state(r, "sim-v").state == "drained"
    assert {n["name"]: n["state"] for n in routing(r)["nodes"]}["sim-v"] == "drained"
    ev = [e for e in registry.recent_events(r) if e["kind"] == "drained"]
    assert len(ev) == 1 and ev[0]["node"] == "sim-v" and ev[0]["detail"] == {"reason": "idle"}
    cp.run_cycle()
    assert len([e for e in registry.recent_events(r) if e["kind"] == "drained"]) == 1


def test_drain_not_before_grace_and_timeout(redis_server, sims, pool, cp_factory):
    r = redis_server.client()
    cp = cp_factory(cp_settings(pool, drain_timeout_s=60.0))
    registry.seed_nodes(r, pool)
    # Just began: edges may not have seen it yet (grace = 2 x 0.05 s sync interval).
    registry.set_state(r, "sim-t", "draining", now=time.time() + 5)
    assert cp.run_cycle().drained == []
    # Busy, but past drain_timeout_s.
    edge_stats(r, inflight=3)
    registry.set_state(r, "sim-v", "draining", now=time.time() - 61)
    rep = cp.run_cycle()
    assert rep.drained == ["sim-v"]
    ev = [e for e in registry.recent_events(r) if e["kind"] == "drained"]
    assert ev[0]["detail"] == {"reason": "timeout"}


def test_slow_start_after_undrain(redis_server, sims, pool, cp_factory):
    r = redis_server.client()
    cp = cp_factory(cp_settings(pool, slow_start_s=30.0))
    registry.seed_nodes(r, pool)
    start = time.time()
    registry.set_state(r, "sim-v", "active", actor="op", now=start - 15)
    registry.set_state(r, "sim-t", "active", actor="op", now=time.time() - 1)
    cp.run_cycle()
    took = time.time() - start      # the ramp goes on while the cycle runs
    by = {n["name"]: n for n in routing(r)["nodes"]}
    # weight 2 x 15 s of 30 s, plus what the ramp gained while this ran
    assert 2.0 * 0.5 - 0.001 <= by["sim-v"]["effective_weight"] <= 2.0 * (15 + took) / 30 + 0.001
    assert by["sim-t"]["effective_weight"] == pytest.approx(0.1, abs=0.001)
    assert by["sim-o"]["effective_weight"] == 1.0


def test_a_replaced_leader_does_not_overwrite_the_snapshot(redis_server, sims, pool, cp_factory):
    r = redis_server.client()
    cp = cp_factory(cp_settings(pool), ident="cp-old")
    cp.run_cycle()
    first = routing(r)["version"]
    # The lock moves to another control plane while this one is inside its write (e.g.
    # stalled past its lease): the snapshot it built must not land.
    real = cp.resolver.resolve_url

    def stall_and_lose_the_lock(url, now):
        r.set(keynames.LEADER, "cp-new")
        return real(url, now)

    cp.resolver.resolve_url = stall_and_lose_the_lock
    cp.run_cycle()
    assert routing(r)["version"] == first
    assert routing(r)["leader"] == "cp-old"


def test_a_leadership_lost_in_a_failover_is_fenced(redis_server, sims, pool, cp_factory):
    """The lease vanishes (a master failed over before replicating it), another control
    plane takes it and gives it up, and the first takes it again under the same id: its
    snapshot writes with the old fencing token are refused; the new token writes."""
    r = redis_server.client()
    cp = cp_factory(cp_settings(pool), ident="cp-a")
    cp.run_cycle()
    first, token = routing(r)["version"], cp.elector.fence
    assert token >= 1 and int(r.get(keynames.LEADER_FENCE)) == token
    real = cp.resolver.resolve_url

    def lose_and_retake(url, now):
        if r.get(keynames.LEADER_FENCE) == str(token):  # once per cycle (called per node)
            r.delete(keynames.LEADER)
            other = LeaderElector(r, "cp-b", ttl_s=5)
            assert other.tick() == (True, True) and other.fence == token + 1
            other.release()
            r.set(keynames.LEADER, "cp-a", px=5000)  # the same id again, no new token
        return real(url, now)

    cp.resolver.resolve_url = lose_and_retake
    cp.run_cycle()
    assert routing(r)["version"] == first      # the stale token was refused
    cp.resolver.resolve_url = real
    r.delete(keynames.LEADER)
    cp.run_cycle()                             # takes it again: a new token, writes again
    assert cp.elector.fence == token + 2
    assert routing(r)["version"] > first


def test_long_gone_edges_are_forgotten(redis_server, sims, pool, cp_factory):
    r = redis_server.client()
    edge_stats(r, 0, edge_id="live")
    edge_stats(r, 0, ts=time.time() - 2 * 3600, edge_id="gone")
    r.hset(keynames.EDGES, "junk", "not json")
    cp = cp_factory(cp_settings(pool))
    cp.run_cycle()
    assert set(r.hkeys(keynames.EDGES)) == {"live"}


def test_a_new_leader_keeps_the_llama_cpp_slots_of_the_snapshot_it_takes_over(
        redis_server, cp_factory):
    """A control plane that starts (or takes the lead) has read no node's /props yet: its
    first snapshots keep the slots a llama.cpp server had in the snapshot it takes over
    (the edges' hard limit; without them a one-slot server got the edge's whole backlog
    for the second its first read took), until its own read says otherwise. Here the
    server does not answer at all, so the kept slots stay; a node whose address changed
    is not given another's slots."""
    from controlplane import procs

    port = procs.free_port()                 # nothing listens: no read ever finishes
    node = NodeSettings(name="llama", url=f"http://127.0.0.1:{port}", kind="openai")
    moved = NodeSettings(name="moved", url=f"http://127.0.0.1:{procs.free_port()}",
                         kind="openai")
    r = redis_server.client()
    old = {"version": 7, "generated_at": time.time(), "leader": "cp-old", "nodes": [
        {"name": "llama", "url": node.url, "slots": 1, "slots_source": "server",
         "ctx_tokens": 2048, "max_concurrency": 1},
        {"name": "moved", "url": "http://127.0.0.1:1", "slots": 1, "slots_source": "server"}]}
    r.set(keynames.ROUTING, json.dumps(old))
    cp = cp_factory(cp_settings([node, moved]), ident="cp-new")
    rep = cp.run_cycle()
    assert rep.leader and rep.wrote
    snap = {n["name"]: n for n in routing(r)["nodes"]}
    assert snap["llama"]["slots"] == 1 and snap["llama"]["slots_source"] == "server"
    assert snap["llama"]["max_concurrency"] == 1 and snap["llama"]["ctx_tokens"] == 2048
    assert snap["moved"]["slots"] is None
    cp.run_cycle()
    assert {n["name"]: n for n in routing(r)["nodes"]}["llama"]["slots"] == 1
