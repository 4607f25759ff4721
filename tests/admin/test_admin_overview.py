"""The overview time series (controlplane.routing.series), its API and page, the
post/redirect/get of the forms and how failing nodes show on the nodes page (real
redis-server, Flask test client)."""

from __future__ import annotations

import json
import re
import time

import pytest

from controlplane.admin import apikeys, create_app
from controlplane.config import NodeSettings, Settings
from controlplane.redisdb import keynames
from controlplane.routing import registry, series
from controlplane.routing.service import ControlPlane

TOKEN = "overview-admin-token-321"
LE = list(series.DEFAULT_LE)


def make_app(r):
    s = Settings.model_validate({"controlplane": {"admin_token": TOKEN}})
    return create_app(s, r, secret_key="fixed-test-secret")


def csrf_of(html: str) -> str:
    m = re.search(r'name="csrf_token" value="([^"]+)"', html)
    assert m, "no CSRF field in the page"
    return m.group(1)


@pytest.fixture
def client(r):
    registry.put_node(r, NodeSettings(name="sim-a", url="http://127.0.0.1:9001"))
    registry.put_node(r, NodeSettings(name="sim-b", url="http://127.0.0.1:9002"))
    c = make_app(r).test_client()
    page = c.get("/login")
    resp = c.post("/login", data={"token": TOKEN, "csrf_token": csrf_of(page.text)})
    assert resp.status_code == 303 and resp.location == "/"  # the overview comes first
    c.csrf = csrf_of(c.get("/keys").text)
    return c


def edge_doc(ts: float, *, a=(0, 0), b=(0, 0), shed=0, rl=0, hist=None, lat_a=800.0,
             edge_id="e1") -> str:
    counts = [0] * (len(LE) + 1)
    for i, n in (hist or {}).items():
        counts[i] = n
    return json.dumps({
        "edge_id": edge_id, "ts": ts,
        "nodes": {"sim-a": {"inflight": 2, "requests": a[0], "failures": a[1],
                            "breaker": "closed", "latency_ewma_ms": lat_a},
                  "sim-b": {"inflight": 0, "requests": b[0], "failures": b[1],
                            "breaker": "closed", "latency_ewma_ms": None}},
        "admission": {"auth_rejected": 0, "auth_unavailable": 0, "rate_limited": rl,
                      "limits_local": 0, "shed": shed, "deadline_exceeded": 0, "waiting": 0},
        "duration": {"le": LE, "counts": counts, "sum": 1.0}})


def test_quantile_interpolates_inside_buckets():
    counts = [0] * (len(LE) + 1)
    counts[7] = 10  # (0.5, 1] s
    assert series.quantile(0.5, counts) == pytest.approx(0.75)
    assert series.quantile(0.99, counts) == pytest.approx(0.995)
    counts[-1] = 90  # over 120 s: the highest finite bound
    assert series.quantile(0.5, counts) == 120.0
    assert series.quantile(0.5, [0] * (len(LE) + 1)) is None
    assert series.increase(5, 3) == 2 and series.increase(2, 9) == 2 and series.increase(4, None) == 0


def test_point_is_the_increase_since_the_previous_one():
    rec = series.SeriesRecorder(stale_s=30.0)
    t0 = time.time()
    cache0 = {"lookups": "10", "hits_exact": "2", "hits_semantic": "1", "misses": "7"}
    assert rec.point({"e1": edge_doc(t0, a=(100, 1), shed=5, hist={6: 50})}, cache0, t0) is None
    edges = {"e1": edge_doc(t0 + 5, a=(130, 4), b=(10, 0), shed=7, rl=3, hist={6: 70, 7: 10}),
             "old": edge_doc(t0 - 100, a=(999, 999), edge_id="old")}  # stale: left out
    p = rec.point(edges, {"lookups": "30", "hits_exact": "8", "hits_semantic": "3",
                          "misses": "19"}, t0 + 5)
    assert p["dt"] == pytest.approx(5.0) and p["edges"] == 1
    assert p["requests"] == 30  # 20 + 10 new observations in the histogram
    assert p["h"] == [0] * 6 + [20, 10] and "le" not in p
    assert (p["lookups"], p["hits_exact"], p["hits_semantic"]) == (20, 6, 2)
    assert (p["shed"], p["rate_limited"], p["proxied"], p["failures"]) == (2, 3, 40, 3)
    assert p["nodes"]["sim-a"] == {"requests": 30, "failures": 3, "inflight": 2,
                                   "latency_ms": 800.0}
    assert p["nodes"]["sim-b"]["requests"] == 10 and p["nodes"]["sim-b"]["latency_ms"] is None
    # a node the edge did not report before is a baseline (its counters may be old)
    doc = json.loads(edge_doc(t0 + 7, a=(130, 4), b=(10, 0), hist={6: 70, 7: 10}))
    doc["nodes"]["sim-new"] = {"inflight": 0, "requests": 500, "failures": 0}
    rec2 = series.SeriesRecorder(stale_s=30.0)
    rec2.point({"e1": edge_doc(t0, a=(100, 1))}, {}, t0)
    p2 = rec2.point({"e1": json.dumps(doc)}, {}, t0 + 7)
    assert p2["nodes"]["sim-new"]["requests"] == 0 and p2["proxied"] == 40
    # nginx restarted: counters start again from zero, the current value is the increase
    p = rec.point({"e1": edge_doc(t0 + 10, a=(4, 0), b=(12, 1), hist={6: 4})},
                  {"lookups": "30", "hits_exact": "8", "hits_semantic": "3"}, t0 + 10)
    assert p["nodes"]["sim-a"]["requests"] == 4 and p["nodes"]["sim-b"]["requests"] == 2
    assert p["requests"] == 4 and p["lookups"] == 0


def write_points(r, t0: float, n: int = 6) -> None:
    """n+1 edge reports 5 s apart through the recorder, as the leader writes them."""
    rec = series.SeriesRecorder(stale_s=1e9)
    for i in range(n + 1):
        ts = t0 + 5 * i
        r.hset(keynames.EDGES, "e1", edge_doc(ts, a=(10 * i, i // 2), b=(5 * i, 0),
                                              shed=i, rl=2 * i, hist={5: 12 * i, 8: 3 * i}))
        r.hset(keynames.CACHE_STATS, mapping={"lookups": 10 * i, "hits_exact": 3 * i,
                                              "hits_semantic": i, "misses": 6 * i})
        rec.maybe_record(r, r.hgetall(keynames.EDGES), ts)
    assert r.llen(keynames.OVERVIEW_SERIES) == n
    assert 0 < r.ttl(keynames.OVERVIEW_SERIES) <= series.TTL_S  # cache-kind key: a TTL


def test_overview_api_shape_and_units(client, r):
    write_points(r, time.time() - 40)
    assert client.get("/api/v1/overview").status_code == 200  # the page's session may read
    c = make_app(r).test_client()
    assert c.get("/api/v1/overview").status_code == 401
    resp = c.get("/api/v1/overview", headers={"Authorization": f"Bearer {TOKEN}"})
    assert resp.status_code == 200
    d = resp.get_json()
    assert set(d) == {"ts", "window_s", "slot_s", "points", "series", "totals", "nodes"}
    assert d["window_s"] == 300 and d["slot_s"] == 5.0 and d["points"] == 6
    s = d["series"]
    assert set(s) == {"ts", *series.SERIES_FIELDS}
    assert all(len(v) == 60 for v in s.values())
    assert s["ts"] == sorted(s["ts"]) and s["ts"][-1] == pytest.approx(d["ts"], abs=0.01)
    known = [v for v in s["rps"] if v is not None]
    assert len(known) == 6 and known[0] == pytest.approx(3.0)  # 15 requests in 5 s
    t = d["totals"]
    assert t["requests"] == 90 and t["seconds"] == pytest.approx(30.0)
    assert t["rps"] == pytest.approx(3.0)
    assert t["hit_rate"] == pytest.approx(0.4) and t["hit_rate_exact"] == pytest.approx(0.3)
    assert t["hit_rate_semantic"] == pytest.approx(0.1)
    assert t["shed"] == 6 and t["shed_rps"] == pytest.approx(0.2)
    assert t["rate_limited"] == 12 and t["rate_limited_share"] == pytest.approx(12 / 90, abs=1e-4)
    assert t["proxied"] == 90 and t["failures"] == 3 and t["error_rate"] == pytest.approx(3 / 90, abs=1e-4)
    # 72 in (100, 250] ms and 18 in (1, 2.5] s: p50 inside the first, p99 inside the second
    assert 100 < t["p50_ms"] <= 250 and 1000 < t["p99_ms"] <= 2500
    a = d["nodes"]["sim-a"]
    assert set(a) == {"series", "totals"} and set(a["series"]) == {"ts", *series.NODE_SERIES_FIELDS}
    assert a["totals"]["requests"] == 60 and a["totals"]["rps"] == pytest.approx(2.0)
    assert a["totals"]["latency_ms"] == 800.0 and a["totals"]["inflight"] == 2
    assert d["nodes"]["sim-b"]["totals"]["error_rate"] == 0.0
    d60 = c.get("/api/v1/overview?window=3600",
                headers={"Authorization": f"Bearer {TOKEN}"}).get_json()
    assert d60["slot_s"] == 30.0 and len(d60["series"]["rps"]) == 120
    assert d60["totals"]["requests"] == 90
    bad = c.get("/api/v1/overview?window=60", headers={"Authorization": f"Bearer {TOKEN}"})
    assert bad.status_code == 400
    assert bad.get_json()["error"]["type"] == "invalid_request_error"


def test_overview_page_and_panel(client, r):
    empty = client.get("/")
    assert empty.status_code == 200 and 'id="ov-empty"' in empty.text
    write_points(r, time.time() - 40)
    page = client.get("/")
    assert page.status_code == 200
    for tile in ("t-rps", "t-hit", "t-lat", "t-err", "t-shed", "t-rl"):
        assert f'id="{tile}"' in page.text, tile
    assert page.text.count('class="chart"') == 4 and "ov-empty" not in page.text
    assert "3/s" in page.text and "40 %" in page.text  # requests/s, hit rate
    row = re.search(r'<tr id="ov-node-sim-a".*?</tr>', page.text, re.S).group(0)
    assert "2/s" in row and "800 ms" in row and row.count('class="spark"') == 3
    assert "What the figures are" in page.text
    assert not re.search(r'<(script|link|img)[^>]+(src|href)="(https?:)?//', page.text)
    nonce = re.search(r"script-src 'nonce-([^']+)'", page.headers["Content-Security-Policy"]).group(1)
    assert f'<script nonce="{nonce}">' in page.text and "/overview/panel?window=300" in page.text
    panel = client.get("/overview/panel?window=3600")
    assert panel.status_code == 200 and "<html" not in panel.text and 'id="t-rps"' in panel.text
    assert "Last 60 min" in panel.text


def test_controlplane_leader_writes_the_series(r):
    settings = Settings.model_validate({"controlplane": {"poll_interval_s": 0.2}})
    cp = ControlPlane(settings, r, ident="cp-test")
    cp.series.step_s = 0.0
    try:
        t0 = time.time()
        r.hset(keynames.EDGES, "e1", edge_doc(t0, a=(10, 0), hist={5: 10}))
        assert cp.run_cycle().wrote and r.llen(keynames.OVERVIEW_SERIES) == 0  # baseline
        r.hset(keynames.EDGES, "e1", edge_doc(time.time(), a=(25, 1), hist={5: 25}))
        assert cp.run_cycle().wrote
        p = json.loads(r.lindex(keynames.OVERVIEW_SERIES, 0))
        assert p["requests"] == 15 and p["nodes"]["sim-a"] == {
            "requests": 15, "failures": 1, "inflight": 2, "latency_ms": 800.0}
    finally:
        cp.shutdown()


def test_create_key_redirects_and_a_reload_adds_nothing(client, r):
    resp = client.post("/keys", data={"csrf_token": client.csrf, "tenant": "acme", "rpm": "5"})
    assert resp.status_code == 303 and resp.location == "/keys"
    assert len(apikeys.list_keys(r)) == 1
    page = client.get("/keys")
    key = re.search(r'id="new-key">(ig-[^<]+)<', page.text).group(1)
    assert apikeys.lookup(r, key).tenant == "acme"
    again = client.get("/keys")  # the reload after the redirect is a GET
    assert again.status_code == 200 and key not in again.text and 'id="new-key"' not in again.text
    assert len(apikeys.list_keys(r)) == 1
    bad = client.post("/keys", data={"csrf_token": client.csrf, "tenant": ""})
    assert bad.status_code == 303 and len(apikeys.list_keys(r)) == 1
    assert "No key created" in client.get(bad.location).text


def test_every_changing_form_redirects(client, r):
    f = {"csrf_token": client.csrf}
    for path, data in (("/nodes", {"name": "gpu-1", "url": "http://10.0.0.9:8000"}),
                       ("/nodes/gpu-1/edit", {"weight": "2"}),
                       ("/nodes/gpu-1/drain", {}), ("/nodes/gpu-1/undrain", {}),
                       ("/nodes/gpu-1/remove", {"sure": "yes"}),
                       ("/cache/purge", {"scope": "all"}),
                       ("/cache/purge/confirm", {"scope": "all", "confirm": "yes"})):
        resp = client.post(path, data={**f, **data})
        assert resp.status_code == 303, path
    rec = apikeys.create_key(r, "t")[1]
    for path in (f"/keys/{rec.id}/limits", f"/keys/{rec.id}/revoke"):
        assert client.post(path, data={**f, "rpm": "9"}).status_code == 303, path


def row_of(html: str, name: str) -> str:
    return re.search(rf'<tr id="node-{name}".*?</tr>', html, re.S).group(0)


def test_failing_node_score_reads_as_failing_and_sorts_last(client, r):
    now = time.time()
    registry.put_node(r, NodeSettings(name="sim-0", url="http://127.0.0.1:9000"))
    # sim-0 polled unhealthy with a held score of 0 (would read as the best)
    r.set(keynames.node_metrics("sim-0"), json.dumps({"ts": now, "healthy": False, "score": 0.0,
                                                      "last_error": "connection refused"}))
    r.set(keynames.node_metrics("sim-a"), json.dumps({"ts": now, "healthy": True, "score": 0.4}))
    # sim-b: healthy, no metrics, but the edge knows its latency and errors; sim-c: breaker open
    registry.put_node(r, NodeSettings(name="sim-c", url="http://127.0.0.1:9003"))
    r.set(keynames.node_metrics("sim-b"), json.dumps({"ts": now, "healthy": True, "score": None,
                                                      "has_metrics": False}))
    r.set(keynames.node_metrics("sim-c"), json.dumps({"ts": now, "healthy": True, "score": 0.1}))
    r.hset(keynames.EDGES, "e1", json.dumps({"ts": now, "nodes": {
        "sim-b": {"inflight": 1, "requests": 40, "failures": 2, "breaker": "closed",
                  "latency_ewma_ms": 640.0},
        "sim-c": {"inflight": 0, "requests": 9, "failures": 9, "breaker": "open",
                  "latency_ewma_ms": 30.0}}}))
    page = client.get("/nodes").text
    order = re.findall(r'<tr id="node-([^"]+)"', page)
    assert order == ["sim-a", "sim-b", "sim-0", "sim-c"]
    score = re.compile(r'data-field="score">(.*?)</td>', re.S)
    for name in ("sim-0", "sim-c"):
        cell = score.search(row_of(page, name)).group(1)
        assert "failing" in cell and not re.search(r">\s*0(\.0+)?\s*<", f">{cell}<"), cell
    assert score.search(row_of(page, "sim-a")).group(1).strip() == "0.40"
    b = row_of(page, "sim-b")
    assert re.search(r'data-field="latency"[^>]*>640 ms<', b)
    assert re.search(r'data-field="errors"[^>]*>5.0 %<', b)
    assert 'title="no metrics' in score.search(b).group(1)
    # the live refresh sorts and marks the same way
    assert "function failing(n)" in page and 'n.breaker === "open"' in page
