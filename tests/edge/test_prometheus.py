"""Prometheus metrics: the edge's GET /metrics (lua/infergate/metrics/exposition.lua on
edge.metrics_listen) and the control plane's GET /metrics (controlplane/routing/exporter.py),
read with prometheus_client's own parser after real traffic: names, types, labels and
values that match what happened (retries, breaker openings, cache results, 404s, rate
limits, in-flight back to zero, Redis going away, the time to first byte and the wait for
a free slot)."""

from __future__ import annotations

import threading
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from controlplane import procs
from controlplane.config import settings_from_dict
from support.stack import edge_settings, write_snapshot

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


class Scrape:
    """One parsed exposition: ``types[family]`` and ``value(sample, **labels)``."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.types: dict[str, str] = {}
        self.samples: list[tuple[str, dict, float]] = []
        for fam in text_string_to_metric_families(text):
            self.types[fam.name] = fam.type
            for s in fam.samples:
                self.samples.append((s.name, dict(s.labels), s.value))

    def value(self, name: str, **labels: str) -> float | None:
        for n, lab, v in self.samples:
            if n == name and lab == labels:
                return v
        return None

    def series(self, name: str) -> list[tuple[dict, float]]:
        return [(lab, v) for n, lab, v in self.samples if n == name]


def scrape(url: str) -> Scrape:
    res = requests.get(url, timeout=5)
    assert res.status_code == 200, res.text
    assert res.headers["Content-Type"].startswith("text/plain")
    return Scrape(res.text)


def chat(edge, content: str, headers: dict | None = None) -> requests.Response:
    return requests.post(edge.url + CHAT, timeout=10, headers=headers or {},
                         json={"model": "m", "messages": [{"role": "user", "content": content}]})


def test_edge_metrics_follow_the_traffic(redis_server, tiny_upstreams, edge_factory) -> None:
    good, bad = tiny_upstreams(names=["good", "bad"])
    bad.mode = "fail"
    s = edge_settings(redis_server.url, [good.node_settings(), bad.node_settings()],
                      breaker_failures=1, breaker_cooldown_s=60.0, max_tries=2)
    s = settings_from_dict({**s.model_dump(mode="json"),
                            "cache": {"enabled": True, "semantic": False},
                            "limits": {"global_rpm": 12}})
    # the failing node looks best, so the first request tries it and is retried
    snap = write_snapshot(redis_server.client(), [good.snapshot_node(score=0.9),
                                                  bad.snapshot_node(score=0.0)])
    edge = edge_factory(s)
    edge.wait_snapshot(snap["version"])
    assert edge.metrics_url

    first = chat(edge, "metrics one")
    assert first.status_code == 200 and first.headers["X-Infergate-Node"] == "good"
    for i in range(3):
        assert chat(edge, f"metrics other {i}").status_code == 200
    # the same prompt again: an exact hit once the first answer is stored
    deadline = time.monotonic() + 5
    while chat(edge, "metrics one").headers.get("X-Cache-Status") != "HIT":
        assert time.monotonic() < deadline, "no cache hit"
    assert chat(edge, "metrics bypass", {"Cache-Control": "no-store"}).headers["X-Cache-Status"] == "BYPASS"
    # a /v1 path the nodes do not serve: the node's 404; a path the edge refuses: its own
    assert requests.get(edge.url + "/v1/nope", timeout=5).status_code == 404
    assert requests.post(edge.url + "/v1/load_lora_adapter", timeout=5).status_code == 404
    limited = 0
    for i in range(15):
        limited += chat(edge, f"metrics limit {i}").status_code == 429
    assert limited >= 1
    edge.wait_idle()

    m = scrape(edge.metrics_url)
    assert m.types == {
        "infergate_edge_requests": "counter", "infergate_edge_retries": "counter",
        "infergate_edge_breaker_opens": "counter", "infergate_edge_shed": "counter",
        "infergate_edge_rate_limited": "counter", "infergate_edge_cache_requests": "counter",
        "infergate_edge_affinity_picks": "counter", "infergate_edge_flush_dropped": "counter",
        "infergate_edge_semantic_lookups": "counter", "infergate_edge_semantic_calls": "counter",
        "infergate_edge_semantic_call_lookups": "counter", "infergate_edge_stream_relay": "counter",
        "infergate_edge_request_duration_seconds": "histogram",
        "infergate_edge_time_to_first_byte_seconds": "histogram",
        "infergate_edge_admission_wait_seconds": "histogram", "infergate_edge_inflight": "gauge",
        "infergate_edge_breaker_open": "gauge", "infergate_edge_snapshot_age_seconds": "gauge",
        "infergate_edge_snapshot_version": "gauge", "infergate_edge_redis_up": "gauge",
        "infergate_edge_info": "gauge",
    }
    assert list(m.series("infergate_edge_info")) == [
        ({"edge_id": edge.status()["edge_id"], "config_dir": str(edge.rendered.out_dir)}, 1.0)]
    status = edge.status()
    req = {(lab["node"], lab["status"]): v for lab, v in m.series("infergate_edge_requests_total")}
    assert req[("good", "200")] >= 4
    assert req[("cache", "200")] >= 1
    assert req[("none", "404")] == 1 and req[("good", "404")] == 1
    assert req[("none", "429")] == limited == status["admission"]["rate_limited"]
    assert ("bad", "200") not in req and ("bad", "500") not in req  # every failure was retried
    assert m.value("infergate_edge_retries_total") >= 1
    assert m.value("infergate_edge_breaker_opens_total", node="bad") == 1
    assert m.value("infergate_edge_breaker_open", node="bad") == 1
    assert m.value("infergate_edge_breaker_open", node="good") == 0
    assert m.value("infergate_edge_rate_limited_total") == limited
    assert m.value("infergate_edge_shed_total") == status["admission"]["shed"] == 0
    cache = {lab["result"]: v for lab, v in m.series("infergate_edge_cache_requests_total")}
    assert cache["hit_exact"] >= 1 and cache["miss"] >= 4 and cache["bypass"] == 1
    assert "hit_semantic" not in cache
    # one histogram observation per finished request, cumulative buckets
    total = sum(req.values())
    assert m.value("infergate_edge_request_duration_seconds_count") == total
    buckets = [(float(lab["le"]), v) for lab, v in m.series("infergate_edge_request_duration_seconds_bucket")]
    assert buckets == sorted(buckets) and buckets[-1] == (float("inf"), total)
    assert 0 < m.value("infergate_edge_request_duration_seconds_sum") < total * 10
    # requests a node answered: an admission wait each (none waited: every one in the
    # first bucket); a first byte each that was 2xx (not the 404s, not the retried 500s)
    to_nodes = sum(v for (node, _), v in req.items() if node not in ("none", "cache"))
    assert m.value("infergate_edge_admission_wait_seconds_count") == to_nodes
    assert m.value("infergate_edge_admission_wait_seconds_bucket", le="0.005") == to_nodes
    assert m.value("infergate_edge_admission_wait_seconds_sum") == 0
    answered = sum(v for (node, st), v in req.items() if node == "good" and st.startswith("2"))
    assert m.value("infergate_edge_time_to_first_byte_seconds_count") == answered
    assert m.value("infergate_edge_inflight", node="good") == 0
    assert m.value("infergate_edge_inflight", node="bad") == 0
    assert 0 <= m.value("infergate_edge_snapshot_age_seconds") < 60
    assert m.value("infergate_edge_snapshot_version") == snap["version"]
    assert m.value("infergate_edge_redis_up") == 1

    # only GET; other paths 404
    assert requests.post(edge.metrics_url, timeout=5).status_code == 405
    assert requests.get(edge.metrics_url.replace("/metrics", "/other"), timeout=5).status_code == 404

    redis_server.stop()
    procs.wait_until(lambda: scrape(edge.metrics_url).value("infergate_edge_redis_up") == 0, 5,
                     what="redis_up to drop to 0")


def test_edge_metrics_time_the_first_byte_and_the_wait_for_a_slot(
        redis_server, tiny_upstreams, edge_factory) -> None:
    """A node with one known slot: a stream whose first chunk comes 0.3 s after its
    headers (a prefill) holds the slot; a second request waits at the edge until the
    stream ends. The first byte is timed from the arrival to the stream's first chunk
    (not its headers) and to the waiting request's answer (its wait included); the wait
    is observed for both (0 for the stream)."""
    (up,) = tiny_upstreams(names=["one"])
    up.gate, up.chunks, up.head_first_s = threading.Event(), 2, 0.3
    s = edge_settings(redis_server.url, [], stale_after_s=3600, read_timeout_ms=60000)
    edge = edge_factory(s)
    snap = write_snapshot(redis_server.client(), [up.snapshot_node(
        slots=1, slots_source="server", score=None, has_metrics=False)])
    edge.wait_snapshot(snap["version"])
    body = {"model": "m", "messages": [{"role": "user", "content": "timed"}]}
    held = requests.post(edge.url + CHAT, json={**body, "stream": True}, stream=True, timeout=30)
    assert held.status_code == 200
    waiter: dict = {}
    t = threading.Thread(target=lambda: waiter.update(
        res=requests.post(edge.url + CHAT, json=body, timeout=30)))
    t.start()
    procs.wait_until(lambda: edge.status()["admission"]["waiting"] == 1, 10,
                     what="the second request to wait for the slot")
    seen = time.monotonic()
    time.sleep(0.2)  # the wait to be timed
    up.gate.set()
    assert b"[DONE]" in b"".join(held.iter_content(None))
    t.join(30)
    assert waiter["res"].status_code == 200
    edge.wait_idle()
    waited = time.monotonic() - seen

    m = scrape(edge.metrics_url)
    assert m.value("infergate_edge_admission_wait_seconds_count") == 2
    assert m.value("infergate_edge_admission_wait_seconds_bucket", le="0.005") == 1
    assert m.value("infergate_edge_admission_wait_seconds_bucket", le="0.1") == 1
    assert 0.2 <= m.value("infergate_edge_admission_wait_seconds_sum") <= waited + 1
    assert m.value("infergate_edge_time_to_first_byte_seconds_count") == 2
    assert m.value("infergate_edge_time_to_first_byte_seconds_bucket", le="0.1") == 0
    assert m.value("infergate_edge_time_to_first_byte_seconds_sum") >= 0.5


def test_edge_metrics_server_can_be_turned_off(redis_server, tiny_upstreams, edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    s = edge_settings(redis_server.url, [up.node_settings()], metrics_listen="")
    edge = edge_factory(s)
    assert edge.metrics_url == ""
    assert "infergate.metrics.exposition\").serve" not in edge.rendered.http_conf.read_text()
    assert chat(edge, "no metrics").status_code == 200


def test_controlplane_metrics(redis_server, simnodes, controlplane_factory) -> None:
    (node,) = simnodes(1, time_scale=0.05)
    s = settings_from_dict({"redis": {"url": redis_server.url},
                            "controlplane": {"poll_interval_s": 0.2, "leader_ttl_s": 2.0},
                            "nodes": [node.node_settings().model_dump()]})
    cp = controlplane_factory(s)
    url = cp.admin_url + "/metrics"

    def ready() -> bool:
        m = scrape(url)
        return (m.value("infergate_controlplane_node_healthy", node=node.name) == 1
                and m.value("infergate_controlplane_node_score", node=node.name) is not None)

    procs.wait_until(ready, 15, what="healthy node with a score in the control plane metrics")
    m = scrape(url)
    assert m.types["infergate_controlplane_poll_duration_seconds"] == "histogram"
    assert m.types["infergate_controlplane_snapshot_writes"] == "counter"
    assert m.types["infergate_controlplane_leader"] == "gauge"
    assert m.value("infergate_controlplane_leader") == 1
    assert m.value("infergate_controlplane_redis_up") == 1
    assert m.value("infergate_controlplane_snapshot_writes_total") >= 1
    assert m.value("infergate_controlplane_snapshot_version") >= 1
    assert m.value("infergate_controlplane_poll_duration_seconds_count") >= 1
    assert m.value("infergate_controlplane_node_queue_depth", node=node.name) == 0
    assert m.value("infergate_controlplane_node_running", node=node.name) == 0
    assert 0 <= m.value("infergate_controlplane_node_kv_cache_usage_ratio", node=node.name) <= 1
    assert m.value("infergate_controlplane_redis_errors_total") == 0
    # the admin app around it is untouched
    health = requests.get(cp.admin_url + "/healthz", timeout=5).json()
    assert health["ok"] is True and "instance_id" in health

    redis_server.stop()

    def redis_gone() -> bool:
        m = scrape(url)
        return (m.value("infergate_controlplane_redis_up") == 0
                and m.value("infergate_controlplane_redis_errors_total") >= 1)

    procs.wait_until(redis_gone, 10, what="redis_up 0 and redis errors counted")


def test_embedder_metrics_parse(workdir, redis_server, tiny_upstreams) -> None:
    """The embedder's own /metrics (controlplane/embedder) is valid exposition text with
    the documented families; a remote embeddings backend keeps its start fast."""
    (emb_backend,) = tiny_upstreams(names=["embeddings"])
    port = procs.free_port()
    emb = procs.Managed("embedder", procs.infergate_argv(
        "embedder", "--listen", f"127.0.0.1:{port}", "--redis-url", redis_server.url,
        "--embeddings-url", emb_backend.url, "--embeddings-model", "tiny-embed", "--index", "local",
        "--no-queue", "--threads", "2"), workdir / "logs" / "embedder.log").start()
    try:
        base = f"http://127.0.0.1:{port}"
        emb.wait_ready(lambda: requests.get(base + "/healthz", timeout=1).ok, 60)
        res = requests.post(base + "/v1/lookup", json={"namespace": "0" * 64, "text": "hello"}, timeout=10)
        assert res.status_code == 200, res.text
        m = scrape(base + "/metrics")
    finally:
        emb.stop()
    assert m.types["infergate_embedder_lookups"] == "counter"
    assert m.types["infergate_embedder_lookup_seconds"] == "histogram"
    assert m.value("infergate_embedder_lookups_total") == 1
    assert m.value("infergate_embedder_lookup_seconds_count") == 1
