"""Drill: the semantic-cache embedder is killed (SIGKILL) under steady load (8 requests/s,
every prompt new, so each one asks the embedder after its exact miss).

The embedder runs for real (``infergate embedder``) with a remote embeddings backend (a
small in-process OpenAI-compatible server) so it starts in about a second, and without
its index consumer, so every lookup is a miss.

Bound: at least 95 % answered 200, none with a 5xx; MISS while the embedder answers,
BYPASS (straight to a node, within the time budget) once it is gone."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import pytest
import requests

from controlplane import procs
from controlplane.cli.embedder_procs import METRICS_PREFIX
from controlplane.config import settings_from_dict
from support.stack import edge_settings

pytestmark = pytest.mark.integration


def test_embedder_killed_under_load(workdir, output_dir, redis_server, tiny_upstreams, edge_factory,
                                    load_loop) -> None:
    node, embeddings = tiny_upstreams(names=["node", "embeddings"])
    eport = procs.free_port()
    emb = procs.Managed("embedder", procs.infergate_argv(
        "embedder", "--listen", f"127.0.0.1:{eport}", "--redis-url", redis_server.url,
        "--embeddings-url", embeddings.url, "--embeddings-model", "tiny-embed", "--index", "local",
        "--no-queue", "--threads", "4"), workdir / "logs" / "embedder.log").start()
    try:
        emb.wait_ready(lambda: requests.get(f"http://127.0.0.1:{eport}/healthz", timeout=1).ok, 60)
        s = edge_settings(redis_server.url, [node.node_settings()])
        s = settings_from_dict({**s.model_dump(mode="json"), "cache": {
            "enabled": True, "semantic": True, "embedder_url": f"http://127.0.0.1:{eport}",
            "semantic_budget_ms": 1000}})
        edge = edge_factory(s)
        load = load_loop("embedder killed", [edge])
        load.wait_sent(8)
        load.phase("embedder killed")
        emb.signal(signal.SIGKILL)
        procs.wait_until(lambda: not emb.alive(), 5, what="embedder to exit")
        load.wait_sent(16)
        report = load.stop()
    finally:
        emb.stop()
        # killed with its whole group, it could not remove its metrics folder (the next
        # embedder to start would); this drill's own is removed here
        for d in Path(tempfile.gettempdir()).glob(f"{METRICS_PREFIX}{emb.pid}-*"):
            shutil.rmtree(d, ignore_errors=True)
    summary = report.report(output_dir)

    assert report.ok_ratio() >= 0.95, summary
    assert not [k for k in report.by_status() if k.startswith("5")], summary
    before = [x for x in report.results if x.phase == "before"]
    assert {x.cache for x in before} == {"MISS"}, summary
    after = [x for x in report.results if x.phase == "embedder killed"][-8:]
    assert {x.cache for x in after} == {"BYPASS"}, summary
    assert embeddings.hits >= len(before)  # the lookups really went through the embedder
