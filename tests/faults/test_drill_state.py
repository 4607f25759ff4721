"""Drills: the state in Redis (API keys, nodes added at run time, drain states, events)
survives what a production Redis meets, under steady load with API keys required.

- Redis SIGKILLed and restarted from its own files (append-only file, as ``infergate up``
  runs it): 0 x 401 once it is back; keys, the run-time node and the drain state intact.
- Redis filled to ``maxmemory`` with cache entries (``volatile-lru``): cache entries are
  evicted, no state key is, 0 x 401.
- Every key the running stack writes (cache, keys, drain, events, edge stats, node
  metrics) is a known state key without TTL or carries a TTL.
- A Redis that comes back empty (nginx restarted meanwhile) is noticed by the control
  plane: ERROR log line, ``state_lost`` event, Prometheus counter, and the state it last
  read written back (``state_restored``); a control plane restarted meanwhile has no copy:
  the configured nodes are seeded, the edges keep the keys they knew.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
import redis
import requests
from prometheus_client.parser import text_string_to_metric_families

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.cache import store
from controlplane.config import NodeSettings, Settings, settings_from_dict
from controlplane.redisdb import keynames
from controlplane.routing import registry

pytestmark = pytest.mark.integration


class OwnRedis:
    """A redis-server of the drill's own, started as ``infergate up`` starts it."""

    def __init__(self, d: Path, maxmemory: str = "256mb", persistent: bool = True) -> None:
        self.dir, self.maxmemory, self.persistent = d, maxmemory, persistent
        self.port = procs.free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.managed = self._start()

    def _start(self) -> procs.Managed:
        return procs.start_redis(self.dir, self.port, maxmemory=self.maxmemory,
                                 persistent=self.persistent)

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True, socket_timeout=2)

    def kill(self) -> None:
        self.managed.signal(signal.SIGKILL)
        procs.wait_until(lambda: not self.managed.alive(), 5, what="redis to die")

    def restart(self) -> None:
        self.managed = self._start()

    def stop(self) -> None:
        self.managed.stop()


@pytest.fixture
def own_redis(workdir):
    made: list[OwnRedis] = []

    def make(**kw) -> OwnRedis:
        r = OwnRedis(workdir / f"own-redis-{len(made)}", **kw)
        made.append(r)
        return r

    try:
        yield make
    finally:
        for r in made:
            r.stop()


def _settings(url: str, nodes: list[NodeSettings], **extra) -> Settings:
    return settings_from_dict({
        "redis": {"url": url},
        "auth": {"mode": "required"},
        "edge": {"workers": 1, "sync_interval_s": 0.1, "read_timeout_ms": 10000},
        "controlplane": {"poll_interval_s": 0.3, "leader_ttl_s": 2.0},
        "cache": {"enabled": True, "semantic": False},
        "nodes": [n.model_dump() for n in nodes],
        **extra,
    })


def _stack(r_url: str, simnodes, controlplane_factory, edge_factory, **extra):
    """Two configured simnodes, a third added at run time through the registry, the first
    drained; control plane and edge with API keys required. Returns (edge, cp, nodes, key,
    key record)."""
    nodes = simnodes(3, time_scale=0.05)
    s = _settings(r_url, [n.node_settings() for n in nodes[:2]], **extra)
    cp = controlplane_factory(s)
    edge = edge_factory(s)
    r = redis.Redis.from_url(r_url, decode_responses=True, socket_timeout=2)
    key, rec = apikeys.create_key(r, "drill", label="state drill")
    registry.put_node(r, nodes[2].node_settings())           # added at run time
    registry.set_state(r, nodes[0].name, "draining", actor="drill")
    procs.wait_until(lambda: {n["name"] for n in edge.status()["nodes"]} >= {n.name for n in nodes},
                     15, what="the run-time node at the edge")
    return edge, cp, nodes, key, rec


def _state_ok(r: redis.Redis, nodes, rec) -> dict:
    keys = {k.id for k in apikeys.list_keys(r)}
    states = registry.get_states(r)
    return {
        "key_present": rec.id in keys,
        "runtime_node_present": nodes[2].name in {n.name for n in registry.list_nodes(r)},
        # draining turns into drained by itself once nothing is in flight
        "node_drained": nodes[0].name in states and states[nodes[0].name].state in ("draining", "drained"),
    }


def test_redis_sigkill_restart_from_its_files_keeps_every_key(
        own_redis, simnodes, controlplane_factory, edge_factory, load_loop, output_dir) -> None:
    rs = own_redis()
    edge, cp, nodes, key, rec = _stack(rs.url, simnodes, controlplane_factory, edge_factory)
    time.sleep(1.5)  # appendfsync everysec: the state is on disk
    load = load_loop("redis sigkill", [edge], rate_per_s=10,
                     headers={"Authorization": f"Bearer {key}"})
    load.wait_sent(10)
    load.phase("redis killed")
    t_kill = time.monotonic()
    rs.kill()
    load.wait_sent(15)
    load.phase("redis back")
    rs.restart()
    t_back = time.monotonic()
    r = rs.client()
    procs.wait_until(lambda: edge.status()["snapshot"]["redis_ok"] is True, 10, what="edge back on Redis")
    load.wait_sent(30)
    report = load.stop()
    state = _state_ok(r, nodes, rec)
    summary = report.report(output_dir, down_s=round(t_back - t_kill, 2), **state,
                            events=len(registry.recent_events(r, 1000)))
    after = report.by_status("redis back")
    assert after.get("401", 0) == 0, summary
    assert report.by_status().get("401", 0) == 0, summary
    assert report.ok_ratio("redis back") >= 0.95, summary
    assert state == {"key_present": True, "runtime_node_present": True, "node_drained": True}, summary
    assert not any(e["kind"] == "state_lost" for e in registry.recent_events(r, 1000))
    # the drained node got no traffic after Redis came back
    assert nodes[0].name not in {x.node for x in report.results if x.phase == "redis back"}


def test_redis_full_of_cache_evicts_no_state_key(
        own_redis, simnodes, controlplane_factory, edge_factory, load_loop, output_dir) -> None:
    rs = own_redis(maxmemory="24mb")
    edge, cp, nodes, key, rec = _stack(rs.url, simnodes, controlplane_factory, edge_factory)
    load = load_loop("redis full", [edge], rate_per_s=10, headers={"Authorization": f"Bearer {key}"})
    load.wait_sent(5)
    load.phase("filling")
    r = rs.client()
    blob = "x" * 100_000
    for i in range(600):  # 60 MB of cache entries into 24 MB
        store.store(r, f"{i:064x}", tenant="filler", model="sim-llama", namespace="n" * 8, body=blob,
                  ttl=3600)
    info = r.info()
    load.wait_sent(20)
    report = load.stop()
    state = _state_ok(r, nodes, rec)
    summary = report.report(output_dir, evicted_keys=info["evicted_keys"],
                            used_memory_mb=round(info["used_memory"] / 2**20, 1),
                            maxmemory_policy=r.config_get("maxmemory-policy")["maxmemory-policy"],
                            **state)
    assert info["evicted_keys"] > 0, "the cache filled Redis up"
    assert state == {"key_present": True, "runtime_node_present": True, "node_drained": True}, summary
    for k in (keynames.APIKEYS, keynames.APIKEY_IDS, keynames.NODES, keynames.NODE_STATES,
              keynames.EVENTS, keynames.STATE_MARKER):
        assert r.exists(k), k
    assert report.by_status().get("401", 0) == 0, summary
    assert report.ok_ratio() >= 0.95, summary


def test_every_key_the_stack_writes_is_state_or_has_a_ttl(
        own_redis, simnodes, controlplane_factory, edge_factory, output_dir) -> None:
    rs = own_redis()
    edge, cp, nodes, key, rec = _stack(
        rs.url, simnodes, controlplane_factory, edge_factory,
        limits={"global_rpm": 6000, "global_tpm": 10**7})
    r = rs.client()
    apikeys.set_limits(r, rec.id, rpm=600, tpm=10**6)  # buckets live until they refill
    h = {"Authorization": f"Bearer {key}"}
    for i in range(12):
        body = {"model": "sim-llama", "sim_output_tokens": 3,
                "messages": [{"role": "user", "content": f"ttl check {i % 4}"}]}
        res = requests.post(edge.url + "/v1/chat/completions", json=body, headers=h, timeout=30)
        assert res.status_code == 200, res.text
    store.count(r, "lookups")
    registry.set_state(r, nodes[1].name, "draining", actor="drill")
    registry.add_event(r, "drill", nodes[1].name, actor="drill")
    time.sleep(1.0)  # a few control-plane cycles and edge syncs
    seen: dict[str, int] = {}
    bad = []
    for k in r.scan_iter(match="infergate:*", count=1000):
        ttl = r.ttl(k)
        if ttl == -2:
            continue  # expired between the scan and this read
        kind = "state" if k in keynames.STATE_KEYS else "cache"
        seen[kind] = seen.get(kind, 0) + 1
        if kind == "state" and ttl != -1:
            bad.append((k, ttl, "a state key must not expire"))
        if kind == "cache" and ttl < 0 and k != keynames.LEADER:
            bad.append((k, ttl, "a cache key needs a TTL"))
    assert r.ttl(keynames.LEADER) > 0, "the leader lock has its own TTL"
    print(f"\n[drill] keys in Redis after traffic: {seen}")
    assert not bad, bad
    assert seen.get("cache", 0) >= 8 and seen.get("state", 0) >= 7, seen
    for prefix in (keynames.CACHE_ENTRY_PREFIX, keynames.CACHE_INDEX_PREFIX, keynames.RATELIMIT_PREFIX):
        assert any(k.startswith(prefix) for k in r.scan_iter(match=prefix + "*")), prefix
    assert r.exists(keynames.CACHE_STATS, keynames.EDGES) == 2


def _metric(cp, name: str) -> float:
    text = requests.get(cp.admin_url + "/metrics", timeout=5).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    return fams[name].samples[0].value


def _restart_edge(edge) -> None:
    """nginx stopped and started again (its master killed, ``up`` restarts it)."""
    edge.managed.stop()
    edge.managed.start()

    def answers() -> bool:
        try:
            return edge.status() is not None
        except requests.RequestException:
            return False

    procs.wait_until(answers, 10, what="nginx back")


def _empty_redis_drill(own_redis, simnodes, controlplane_factory, edge_factory):
    """The stack of :func:`_stack` on a Redis without persistence, a second key revoked
    (the edge refuses it), then Redis killed. Returns (rs, edge, cp, nodes, key, rec,
    revoked key, ask)."""
    rs = own_redis(persistent=False)  # a shared Redis run without persistence
    edge, cp, nodes, key, rec = _stack(rs.url, simnodes, controlplane_factory, edge_factory,
                                       auth={"mode": "required", "cache_ttl_s": 0.5},
                                       controlplane={"poll_interval_s": 0.3, "leader_ttl_s": 2.0,
                                                     "admin_token": "drill-admin-token"})
    revoked, rev_rec = apikeys.create_key(rs.client(), "drill")
    chat = {"model": "sim-llama", "messages": [{"role": "user", "content": "state drill"}],
            "max_tokens": 4}

    def ask(k: str) -> int:
        return requests.post(f"{edge.url}/v1/chat/completions", json=chat, timeout=10,
                             headers={"Authorization": f"Bearer {k}"}).status_code

    assert ask(key) == 200 and ask(revoked) == 200
    apikeys.revoke_key(rs.client(), rev_rec.id)
    procs.wait_until(lambda: ask(revoked) == 401, 5, what="the revocation at the edge")
    # the edge saved the records (each worker reads them every 5 s) and the control plane
    # ran two more cycles (its copy holds the revocation)
    saved = edge.rendered.prefix / "infergate-state" / "apikeys.json"

    def records_saved() -> bool:
        recs = json.loads(saved.read_text()) if saved.exists() else {}
        rev = recs.get(apikeys.hash_key(revoked))
        return apikeys.hash_key(key) in recs and rev is not None \
            and json.loads(rev)["revoked"] is not None

    procs.wait_until(records_saved, 15, what="the edge's saved records")
    cycles = _metric(cp, "infergate_controlplane_cycles")
    procs.wait_until(lambda: _metric(cp, "infergate_controlplane_cycles") >= cycles + 2, 10,
                     what="two control-plane cycles")
    rs.kill()
    return rs, edge, cp, nodes, key, rec, revoked, ask


def test_redis_back_empty_the_control_plane_writes_the_state_back(
        own_redis, simnodes, controlplane_factory, edge_factory, output_dir) -> None:
    """Redis without persistence dies, nginx restarts meanwhile, Redis comes back empty:
    the keys keep working all along (the edge's saved records), the revoked one stays
    refused; the control plane notices the loss and writes back what it last read (the
    key and its revocation, the run-time node, the drain), says so (ERROR log,
    ``state_lost`` and ``state_restored`` events, counters) and the edge's saved records
    were never replaced by the empty store."""
    rs, edge, cp, nodes, key, rec, revoked, ask = _empty_redis_drill(
        own_redis, simnodes, controlplane_factory, edge_factory)
    _restart_edge(edge)
    assert ask(key) == 200 and ask(revoked) == 401
    rs.restart()
    r = rs.client()
    procs.wait_until(lambda: any(e["kind"] == "state_restored"
                                 for e in registry.recent_events(r, 100)),
                     10, what="the state_restored event")
    assert _state_ok(r, nodes, rec) == {"key_present": True, "runtime_node_present": True,
                                        "node_drained": True}
    log_text = cp.managed.log_path.read_text()
    assert "REDIS STATE LOST" in log_text and "REDIS STATE RESTORED" in log_text
    assert _metric(cp, "infergate_controlplane_state_lost") == 1
    assert _metric(cp, "infergate_controlplane_state_lost_timestamp_seconds") > 0
    assert _metric(cp, "infergate_controlplane_state_restored") == 1
    assert _metric(cp, "infergate_controlplane_apikeys_missing") == 0
    (lost,) = [e for e in registry.recent_events(r, 100) if e["kind"] == "state_lost"]
    (restored,) = [e for e in registry.recent_events(r, 100) if e["kind"] == "state_restored"]
    print(f"\n[drill] Redis back empty: {json.dumps(lost['detail'])}")
    assert restored["detail"]["apikeys"] == 2 and restored["detail"]["revoked"] == 1
    # longer than a refresh of the edge's records (5 s): the keys decide as before
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        assert ask(key) == 200
        assert ask(revoked) == 401
        time.sleep(0.1)
    saved = (edge.rendered.prefix / "infergate-state" / "apikeys.json").read_text()
    assert apikeys.hash_key(key) in saved and apikeys.hash_key(revoked) in saved
    # the drained node gets nothing, the run-time node is routed to again
    st = {n["name"]: n for n in edge.status()["nodes"]}
    assert nodes[2].name in st and st[nodes[0].name]["state"] in ("draining", "drained")


def test_redis_back_empty_without_a_copy_the_edges_keep_the_keys(
        own_redis, simnodes, controlplane_factory, edge_factory, output_dir) -> None:
    """The control plane restarted while Redis was down has read nothing: it writes
    nothing back, the configured nodes are seeded again. The edge keeps the valid key it
    knew (never the revoked one) and says so; the control plane and the admin API report
    the key store missing until the keys are imported."""
    rs, edge, cp, nodes, key, rec, revoked, ask = _empty_redis_drill(
        own_redis, simnodes, controlplane_factory, edge_factory)
    cp.managed.stop()
    cp.managed.start()
    rs.restart()
    r = rs.client()

    def missing_reported() -> bool:
        assert ask(key) == 200   # the edge's keeping is what the control plane reads
        return any(e["kind"] == "apikeys_missing" for e in registry.recent_events(r, 100))

    procs.wait_until(missing_reported, 15, what="the apikeys_missing event")
    assert {n.name for n in registry.list_nodes(r)} == {nodes[0].name, nodes[1].name}, \
        "the configured nodes are seeded again; the run-time one is gone"
    assert not any(e["kind"] == "state_restored" for e in registry.recent_events(r, 100))
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:  # several cache intervals of the edge
        assert ask(key) == 200
        assert ask(revoked) == 401
    adm = edge.status()["admission"]
    assert adm["auth_store_missing"] == 1 and adm["auth_kept"] >= 1
    assert "API KEY STORE MISSING" in edge.error_log()
    assert "API KEYS MISSING" in cp.managed.log_path.read_text()
    assert _metric(cp, "infergate_controlplane_apikeys_missing") == 1
    admin = {"Authorization": "Bearer drill-admin-token"}
    listing = requests.get(cp.admin_url + "/api/v1/keys", headers=admin, timeout=5).json()
    assert listing["store_missing"] is True and listing["edges_keeping"] == [edge.status()["edge_id"]]

    # a key created before the import: it works, and the keys the edge kept still do
    # (the store stays "missing" until the import; the control plane does not mark it)
    new_key, _ = apikeys.create_key(r, "late")
    procs.wait_until(lambda: ask(new_key) == 200, 10, what="the key created after the loss")
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        assert ask(key) == 200 and ask(revoked) == 401
    assert apikeys.store_missing(r)

    # restored by hand: Redis decides again
    backup_doc = {"format": apikeys.EXPORT_FORMAT, "version": apikeys.EXPORT_VERSION,
                  "exported": time.time(),
                  "keys": [{"hash": apikeys.hash_key(key), **rec.to_dict()}]}
    apikeys.import_keys(r, backup_doc)
    procs.wait_until(lambda: any(e["kind"] == "apikeys_restored" for e in registry.recent_events(r, 100)),
                     10, what="the apikeys_restored event")
    assert ask(key) == 200
    assert requests.get(cp.admin_url + "/api/v1/keys", headers=admin,
                        timeout=5).json()["store_missing"] is False
