"""``infergate simnode --llamacpp``: the behaviour of llama-cpp-python's server that broke
health checks (one request at a time behind a model lock, no /health, a /v1/models call
that waits for the lock and interrupts the running stream), and the control plane's
poller surviving it: its probe never calls /v1/models, so streams are never cut."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from controlplane.config import NodeSettings
from controlplane.routing.poller import Poller

CHAT = {"model": "sim-llama", "messages": [{"role": "user", "content": "tell me a story"}]}


def _stream(url: str, out: dict) -> None:
    """One streamed chat completion; records its chunks and whether it finished."""
    with requests.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True,
                       "max_tokens": 40}, stream=True, timeout=30) as res:
        chunks = []
        for line in res.iter_lines():
            if line.startswith(b"data: "):
                chunks.append(line[6:])
    events = [json.loads(c) for c in chunks if c != b"[DONE]"]
    out["done"] = chunks[-1:] == [b"[DONE]"]
    out["finished"] = any(e["choices"] and e["choices"][0].get("finish_reason") for e in events)


def test_llamacpp_node_models_call_interrupts_the_stream(simnodes) -> None:
    (node,) = simnodes(1, "--llamacpp", "--output-tokens", "40:40", time_scale=0.5)
    assert requests.get(f"{node.url}/health", timeout=5).status_code == 404
    assert requests.get(f"{node.url}/metrics", timeout=5).status_code == 404
    out: dict = {}
    t = threading.Thread(target=_stream, args=(node.url, out))
    t.start()
    time.sleep(0.3)  # the stream holds the model lock
    t0 = time.monotonic()
    models = requests.get(f"{node.url}/v1/models", timeout=30)
    waited = time.monotonic() - t0
    t.join(30)
    assert models.status_code == 200
    assert out["done"] and not out["finished"], "the stream ended with [DONE] but no final chunk"
    assert node.state()["interrupted_total"] == 1
    print(f"llamacpp simnode: /v1/models answered after {waited * 1000:.0f} ms, stream interrupted")


def test_llamacpp_node_serves_one_request_at_a_time(simnodes) -> None:
    (node,) = simnodes(1, "--llamacpp", "--output-tokens", "20:20", time_scale=0.5)

    def one(_: int) -> float:
        t0 = time.monotonic()
        r = requests.post(f"{node.url}/v1/chat/completions", json={**CHAT, "max_tokens": 20},
                          timeout=30)
        assert r.status_code == 200
        return time.monotonic() - t0

    single = one(0)
    with ThreadPoolExecutor(3) as pool:
        times = sorted(pool.map(one, range(3)))
    assert times[-1] > 2.2 * single, (single, times)


def test_poller_keeps_a_busy_llamacpp_node_healthy_and_its_streams_whole(simnodes) -> None:
    (node,) = simnodes(1, "--llamacpp", "--output-tokens", "40:40", time_scale=0.5)
    p = Poller(timeout_s=0.5)
    ns = NodeSettings(name=node.name, url=node.url, kind="openai")
    try:
        out: dict = {}
        t = threading.Thread(target=_stream, args=(node.url, out))
        t.start()
        results = []
        while t.is_alive():
            results.append(p.poll_all([ns])[ns.name])
            time.sleep(0.2)
        t.join()
        assert out["done"] and out["finished"], "polling never cut the stream"
        assert results and all(r.good for r in results)
        assert node.state()["interrupted_total"] == 0
        assert "/v1/models" not in node.state()["by_path"]
    finally:
        p.close()
