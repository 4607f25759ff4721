"""Drill: Redis restarts under steady load (8 requests/s through an edge with the
response cache and shared rate limits on, a control plane writing snapshots).

Bound: at least 95 % of the requests answered 200, none with a 5xx, while Redis is down
(fail-static routing, cache BYPASS, per-edge rate limits) and after it comes back
(empty: the control plane seeds the registry and writes snapshots again, the edge reads
them)."""

from __future__ import annotations

import pytest

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.config import settings_from_dict

pytestmark = pytest.mark.integration


def test_redis_restart_under_load(workdir, output_dir, redis_server, simnodes, controlplane_factory,
                                  edge_factory, load_loop) -> None:
    nodes = simnodes(2, time_scale=0.05)
    s = settings_from_dict({
        "redis": {"url": redis_server.url},
        "edge": {"workers": 1, "sync_interval_s": 0.1, "read_timeout_ms": 10000},
        "controlplane": {"poll_interval_s": 0.3, "leader_ttl_s": 2.0},
        "cache": {"enabled": True, "semantic": False},
        "limits": {"global_rpm": 100000},
        "nodes": [n.node_settings().model_dump() for n in nodes],
    })
    controlplane_factory(s)
    edge = edge_factory(s)
    edge.wait_snapshot(1)
    procs.wait_until(lambda: all(n["eligible"] for n in edge.status()["nodes"]), 10,
                     what="both nodes eligible")

    load = load_loop("redis restart", [edge])
    load.wait_sent(8)
    redis_server.stop()
    # labelled once Redis is gone: a request sent while it was still stopping may have
    # read the cache (MISS) and belongs to the phase before
    load.phase("redis down")
    procs.wait_until(lambda: edge.status()["snapshot"]["redis_ok"] is False, 5,
                     what="edge to notice Redis is down")
    load.wait_sent(16)
    load.phase("redis back")
    redis_server.start_again(workdir / "redis")
    r = redis_server.client()
    procs.wait_until(lambda: r.get(keynames.ROUTING) is not None, 10,
                     what="control plane to write a snapshot into the restarted Redis")
    procs.wait_until(lambda: edge.status()["snapshot"]["redis_ok"] is True, 5,
                     what="edge to reach Redis again")
    load.wait_sent(16)
    report = load.stop()
    summary = report.report(output_dir)

    assert report.ok_ratio() >= 0.95, summary
    assert not [k for k in report.by_status() if k.startswith("5")], summary
    during = [x for x in report.results if x.phase == "redis down"]
    assert {x.cache for x in during if x.status == 200} == {"BYPASS"}, summary
    assert edge.status()["admission"]["limits_local"] >= 1  # local buckets while Redis was away
    after = [x for x in report.results if x.phase == "redis back"][-4:]
    assert {x.cache for x in after} == {"MISS"}, summary  # the cache is read again
