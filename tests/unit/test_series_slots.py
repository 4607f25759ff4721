"""Overview slots (controlplane.routing.series.overview): points written a little more
than one step apart never leave a slot empty between them."""

from __future__ import annotations

import json

from controlplane.routing import series


def _edges(ts: float, requests: int) -> dict[str, str]:
    return {"e1": json.dumps({
        "edge_id": "e1", "ts": ts,
        "nodes": {"sim-a": {"inflight": 0, "requests": requests, "failures": 0,
                            "breaker": "closed", "latency_ewma_ms": 100.0}},
        "admission": {"auth_rejected": 0, "auth_unavailable": 0, "rate_limited": 0,
                      "limits_local": 0, "shed": 0, "deadline_exceeded": 0, "waiting": 0}})}


def test_points_6_s_apart_fill_every_5_s_slot():
    rec = series.SeriesRecorder(stale_s=60.0)
    points = []
    t, n = 1000.0, 0
    for _ in range(60):  # one point every 6.05 s (a 1 s poll cycle that runs a bit late)
        p = rec.point(_edges(t, n), {}, t)
        if p is not None:
            points.append(p)
        t += 6.05
        n += 12
    view = series.overview(points, 300.0, t - 6.05)
    rps = view["series"]["rps"]
    assert view["slot_s"] == 5.0
    assert all(v is not None for v in rps[1:]), rps
    assert all(abs(v - 12 / 6.05) < 0.01 for v in rps[1:]), rps
