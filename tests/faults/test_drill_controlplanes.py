"""Drill: control planes die under steady load (8 requests/s alternating over two edges).

1. The leader is killed (SIGKILL, its lock must expire): the follower takes over within
   the lock TTL plus two poll intervals.
2. The follower is stopped too: no control plane at all. The edges keep routing on the
   last snapshot, which turns stale after ``edge.stale_after_s``.
3. Still without a control plane, one node starts failing every request: the edges steer
   away on their own signals (retries, failure rate, circuit breaker).

Bound: at least 95 % answered 200 and no 5xx over the whole drill; in phase 3 the last
requests are all served by the healthy node."""

from __future__ import annotations

import json
import signal
import time

import pytest

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.config import settings_from_dict

pytestmark = pytest.mark.integration

TTL_S, POLL_S = 1.5, 0.3


def test_controlplanes_die_under_load(output_dir, redis_server, simnodes, edge_factory,
                                      controlplane_factory, load_loop) -> None:
    nodes = simnodes(2, time_scale=0.05)
    s = settings_from_dict({
        "redis": {"url": redis_server.url},
        "edge": {"workers": 1, "sync_interval_s": 0.1, "stale_after_s": 1.5, "read_timeout_ms": 10000,
                 "breaker_failures": 2, "breaker_cooldown_s": 30.0},
        "controlplane": {"poll_interval_s": POLL_S, "leader_ttl_s": TTL_S},
        "nodes": [n.node_settings().model_dump() for n in nodes],
    })
    r = redis_server.client()
    cps = [controlplane_factory(s), controlplane_factory(s)]
    procs.wait_until(lambda: r.get(keynames.LEADER) is not None, 10, what="a leader")
    leader_id = r.get(keynames.LEADER)
    leader = next(cp for cp in cps if cp.managed.pid == int(leader_id.split(":")[-2]))
    follower = next(cp for cp in cps if cp is not leader)
    edges = [edge_factory(s), edge_factory(s)]
    for e in edges:
        procs.wait_until(lambda e=e: all(n["eligible"] for n in e.wait_snapshot(1)["nodes"]), 10,
                         what="both nodes eligible")

    load = load_loop("control planes die", edges)
    load.wait_sent(8)

    load.phase("leader killed")
    killed = time.monotonic()
    leader.managed.signal(signal.SIGKILL)

    def taken_over() -> bool:
        holder = r.get(keynames.LEADER)
        return holder not in (None, leader_id) and json.loads(r.get(keynames.ROUTING))["leader"] == holder

    procs.wait_until(taken_over, TTL_S + 10, interval=0.05, what="the follower to take over")
    took = time.monotonic() - killed
    load.wait_sent(8)

    load.phase("no control plane")
    follower.stop()
    last = json.loads(r.get(keynames.ROUTING))
    for e in edges:
        procs.wait_until(lambda e=e: e.status()["snapshot"]["stale"] is True, 10,
                         what="the snapshot to turn stale")
    load.wait_sent(8)

    load.phase("node fails, no control plane")
    nodes[0].set_faults(error_rate=1.0)
    load.wait_sent(16)
    report = load.stop()
    summary = report.report(output_dir, takeover_s=round(took, 2), leader_ttl_s=TTL_S,
                            poll_interval_s=POLL_S)

    assert took <= TTL_S + 2 * POLL_S + 1.0, summary
    assert report.ok_ratio() >= 0.95, summary
    assert not [k for k in report.by_status() if k.startswith("5")], summary
    tail = [x for x in report.results if x.phase == "node fails, no control plane"][-8:]
    assert {x.node for x in tail} == {nodes[1].name}, summary
    for e in edges:
        st = e.status()
        assert st["snapshot"]["version"] == last["version"] and st["snapshot"]["stale"] is True
    # the edges saw the failures themselves (failure rate, breaker): no snapshot told them
    assert sum(e.node_status(nodes[0].name)["failures"] for e in edges) >= 1
