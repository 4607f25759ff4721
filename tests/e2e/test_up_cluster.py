"""`infergate up --redis-cluster`: the stack on its own loopback Redis Cluster (3 masters
+ 3 replicas) answers with its demo key, caches, stops every process on SIGTERM, refuses
to start when a node's port is taken (naming it), and starts again on the cluster's
files: same ports, the data kept, the old demo key revoked."""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import pytest
import requests

from controlplane import procs
from support.upstack import UpStack, alive, children

CONFIG = "[cache]\nenabled = true\nsemantic = false\n"
QUESTION = "What is the capital of France?"


def cluster_ports(up: UpStack) -> list[int]:
    ports = re.search(r"Redis Cluster on 127\.0\.0\.1 ports ([\d,]+)", up.text()).group(1)
    return [int(p) for p in ports.split(",")]


def hit_after_store(up: UpStack) -> str:
    """Ask QUESTION until the answer comes from the cache (stored by the flush timer just
    after the first answer). Returns the last X-Cache-Status."""
    last: list[str] = []

    def hit() -> bool:
        r = up.post_chat(QUESTION)
        assert r.status_code == 200, r.text
        last.append(r.headers.get("X-Cache-Status", ""))
        return last[-1] == "HIT"

    procs.wait_until(hit, 15, what="a cache hit on the cluster")
    return last[-1]


def stop_clean(up: UpStack) -> None:
    kids = children(up.proc.pid)
    assert len(kids) >= 6 + 5                       # 6 redis-servers, 3 nodes, cp, nginx
    assert up.stop() == 0, up.text()
    deadline = time.monotonic() + 10
    while any(alive(k) for k in kids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(k) for k in kids), "processes left after SIGTERM"


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_up_on_its_own_cluster_serves_stops_and_comes_back_on_its_data(workdir: Path) -> None:
    first = UpStack.start(workdir, CONFIG, "--redis-cluster")
    try:
        assert first.proc.poll() is None, first.text()
        ports = cluster_ports(first)
        assert len(ports) == 6
        old_key = first.key
        assert hit_after_store(first) == "HIT"
    finally:
        stop_clean(first)
    assert not any(procs.port_open("127.0.0.1", p) for p in ports)

    # a node's cluster bus port (its port + 10000) taken meanwhile: one clear line, no
    # traceback, nothing left running
    squatter = socket.socket()
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("127.0.0.1", ports[1] + 10000))
    squatter.listen(1)
    try:
        refused = UpStack.start(workdir, CONFIG, "--redis-cluster")
        assert refused.proc.wait(timeout=60) == 1
        text = refused.text()
        assert f"cluster bus port {ports[1] + 10000} is in use" in text, text
        assert "Traceback" not in text
        refused.stop()
    finally:
        squatter.close()
    assert not any(procs.port_open("127.0.0.1", p) for p in ports)

    again = UpStack.start(workdir, CONFIG, "--redis-cluster")
    try:
        assert again.proc.poll() is None, again.text()
        assert cluster_ports(again) == ports          # the cluster came back where it was
        assert "revoked the demo key of an earlier run" in again.text()
        r = again.post_chat(QUESTION)
        assert r.status_code == 200 and r.headers.get("X-Cache-Status") == "HIT"  # data kept
        revoked = requests.post(f"{again.base}/v1/chat/completions", timeout=10,
                                headers={"Authorization": f"Bearer {old_key}"},
                                json={"model": "sim-llama",
                                      "messages": [{"role": "user", "content": QUESTION}]})
        assert revoked.status_code == 401
    finally:
        stop_clean(again)
