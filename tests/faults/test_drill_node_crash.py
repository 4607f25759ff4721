"""Drill: a node crashes (SIGKILL) in the middle of a streamed answer, under steady load
(8 requests/s) through an edge with the response cache on.

Bound: the streaming client gets one whole stream, never a hang or a cut: the edge's
stream relay continues it on the other node (docs/streams.md); the continued answer is
not cached (the same prompt is a MISS again, no entry in Redis); in-flight counters
return to zero; at least 95 % of the load answered 200 and no 5xx (requests caught on
the dead node are retried on the other one)."""

from __future__ import annotations

import signal
import time

import pytest
import requests

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.cache.key import keys_for
from controlplane.config import settings_from_dict
from support.stack import edge_settings

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


def test_node_crash_mid_stream(output_dir, redis_server, simnodes, edge_factory, load_loop) -> None:
    nodes = simnodes(2, time_scale=0.05)
    s = edge_settings(redis_server.url, [n.node_settings() for n in nodes], read_timeout_ms=10000)
    s = settings_from_dict({**s.model_dump(mode="json"), "cache": {"enabled": True, "semantic": False}})
    edge = edge_factory(s)
    r = redis_server.client()
    load = load_loop("node crash mid-stream", [edge])
    load.wait_sent(8)

    body = {"model": "sim-llama", "stream": True, "sim_output_tokens": 1000,
            "messages": [{"role": "user", "content": "a long story that will be cut"}]}
    res = requests.post(edge.url + CHAT, json=body, stream=True, timeout=10)
    assert res.status_code == 200 and res.headers["X-Cache-Status"] == "MISS"
    victim = next(n for n in nodes if n.name == res.headers["X-Infergate-Node"])
    lines = res.iter_lines()
    first = next(line for line in lines if line.startswith(b"data:"))
    assert first != b"data: [DONE]"
    load.phase("node crashed")
    victim.managed.signal(signal.SIGKILL)
    t0 = time.monotonic()
    received, error = [first], None
    try:
        for line in lines:
            if line:
                received.append(line)
    except requests.RequestException as exc:
        error = type(exc).__name__
    took = time.monotonic() - t0
    assert error is None and received[-1] == b"data: [DONE]", "continued to its end"
    assert received.count(b"data: [DONE]") == 1
    assert took < 5, f"the continued stream took {took:.1f} s to end"

    load.wait_sent(16)
    report = load.stop()
    summary = report.report(output_dir, stream_events_before_cut=len(received),
                            stream_client_saw=error or "closed stream",
                            stream_end_after_kill_ms=round(took * 1000))
    edge.wait_idle()
    assert all(n["inflight"] == 0 for n in edge.status()["nodes"])

    # the log timer of every request ran (counters are written after any store) ...
    misses = sum(1 for x in report.results if x.cache == "MISS") + 1
    procs.wait_until(lambda: int(r.hget(keynames.CACHE_STATS, "misses") or 0) >= misses, 10,
                     what="cache counters of every request")
    # ... and the continued answer was not stored
    assert not r.exists(keynames.cache_entry(keys_for(CHAT, body).exact))
    again = requests.post(edge.url + CHAT, json=body, timeout=30)  # the same request, whole
    assert again.status_code == 200 and again.headers["X-Cache-Status"] == "MISS"
    assert again.text.rstrip().endswith("data: [DONE]")

    assert report.ok_ratio() >= 0.95, summary
    assert not [k for k in report.by_status() if k.startswith("5")], summary
