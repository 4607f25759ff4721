"""Several edges and control planes on one Redis: two control planes (one leader writes
the snapshot, the other stands by) and two nginx edges. Both edges route on the same
snapshot version from the same leader, an answer cached through edge A is a hit on edge
B, and when the leader is killed (SIGKILL: no release, the lock must expire) the
follower takes over within the lock TTL plus two poll intervals while both edges keep
answering.

Rate limits shared by two edges are covered by test_ratelimit.py
(test_two_edges_share_one_global_limit)."""

from __future__ import annotations

import json
import signal
import time

import pytest
import requests

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.config import settings_from_dict

pytestmark = pytest.mark.integration

TTL_S, POLL_S = 1.5, 0.3


def chat(edge, content: str) -> requests.Response:
    return requests.post(edge.url + "/v1/chat/completions", timeout=10,
                         json={"model": "sim-llama", "messages": [{"role": "user", "content": content}]})


def test_two_edges_two_controlplanes_one_redis(redis_server, simnodes, edge_factory,
                                               controlplane_factory) -> None:
    nodes = simnodes(2, time_scale=0.02)
    s = settings_from_dict({
        "redis": {"url": redis_server.url},
        "edge": {"workers": 1, "sync_interval_s": 0.1, "read_timeout_ms": 10000},
        "controlplane": {"poll_interval_s": POLL_S, "leader_ttl_s": TTL_S},
        "cache": {"enabled": True, "semantic": False},
        "nodes": [n.node_settings().model_dump() for n in nodes],
    })
    r = redis_server.client()
    cps = [controlplane_factory(s), controlplane_factory(s)]
    procs.wait_until(lambda: r.get(keynames.LEADER) is not None, 10, what="a leader")
    leader_id = r.get(keynames.LEADER)
    by_pid = {cp.managed.pid: cp for cp in cps}
    leader = by_pid[int(leader_id.split(":")[-2])]
    follower = next(cp for cp in cps if cp is not leader)

    a, b = edge_factory(s), edge_factory(s)

    def snapshot() -> dict:
        return json.loads(r.get(keynames.ROUTING))

    def same_version() -> bool:
        sa, sb = a.status()["snapshot"], b.status()["snapshot"]
        cur = snapshot()
        return (sa["source"] == sb["source"] == "redis" and sa["version"] == sb["version"] == cur["version"]
                and sa["leader"] == sb["leader"] == cur["leader"] == leader_id)

    procs.wait_until(same_version, 10, interval=0.02, what="both edges on the leader's current snapshot")
    assert all(n["eligible"] for n in a.status()["nodes"] + b.status()["nodes"])

    # the cache is shared: stored through A, a hit on B
    first = chat(a, "scale-out shared cache")
    assert first.status_code == 200 and first.headers["X-Cache-Status"] == "MISS"
    deadline = time.monotonic() + 5
    while True:
        hit = chat(b, "scale-out shared cache")
        if hit.headers.get("X-Cache-Status") == "HIT":
            break
        assert time.monotonic() < deadline, "edge B never served the answer stored through edge A"
    assert hit.json()["choices"][0]["message"]["content"] == first.json()["choices"][0]["message"]["content"]

    # SIGKILL the leader: the follower takes the lock once it expires
    before = snapshot()["version"]
    killed_at = time.monotonic()
    leader.managed.signal(signal.SIGKILL)
    codes = []

    def taken_over() -> bool:
        codes.append(chat((a, b)[len(codes) % 2], f"during takeover {len(codes)}").status_code)
        holder = r.get(keynames.LEADER)
        return holder is not None and holder != leader_id and snapshot()["leader"] == holder

    procs.wait_until(taken_over, TTL_S + 10, interval=0.05, what="the follower to take over")
    took = time.monotonic() - killed_at
    new_id = r.get(keynames.LEADER)
    assert int(new_id.split(":")[-2]) == follower.managed.pid
    assert took <= TTL_S + 2 * POLL_S + 1.0, f"takeover took {took:.2f} s"
    assert snapshot()["version"] > before
    assert set(codes) == {200}, codes  # the edges answered all along
    leader_id = new_id
    procs.wait_until(same_version, 10, interval=0.02, what="both edges on the new leader's snapshot")
    print(f"takeover after SIGKILL: {took:.2f} s (lock TTL {TTL_S} s, poll {POLL_S} s); "
          f"{len(codes)} requests meanwhile, all 200")
