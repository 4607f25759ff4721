"""``infergate embedder`` as a process: it listens on the address of
``cache.embedder_url`` from the config file (so the edge and the embedder agree), a port
already in use ends it at once with one line, before Redis or the model, and a lookup
whose caller has gone before a thread took it up is not run."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

from controlplane import procs

MODEL = "use-multilingual-v3"  # pure numpy, loads in seconds


def _config(path: Path, redis_url: str, embedder_url: str) -> Path:
    path.write_text(f'[redis]\nurl = "{redis_url}"\n\n[cache]\nenabled = true\n'
                    f'embedder_url = "{embedder_url}"\n', encoding="utf-8")
    return path


def test_listens_on_cache_embedder_url(redis_server, workdir) -> None:
    port = procs.free_port()
    cfg = _config(workdir / "infergate.toml", redis_server.url, f"http://127.0.0.1:{port}")
    m = procs.Managed("embedder", procs.infergate_argv("embedder", "--config", str(cfg),
                                                       "--model", MODEL, "--no-queue"),
                      workdir / "embedder.log").start()
    try:
        def healthy() -> bool:
            try:
                return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
            except requests.RequestException:
                return False

        m.wait_ready(healthy, 90)
        doc = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=5).json()
        assert doc["status"] == "ok" and doc["model_id"] == MODEL
    finally:
        m.stop()


def test_port_taken_is_one_line_before_the_model(workdir) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        dead_redis = f"redis://127.0.0.1:{procs.free_port()}/0"  # never reached
        cfg = _config(workdir / "infergate.toml", dead_redis, f"http://127.0.0.1:{port}")
        started = time.monotonic()
        res = subprocess.run([sys.executable, "-m", "controlplane.cli", "embedder",
                              "--config", str(cfg), "--model", MODEL],
                             capture_output=True, text=True, timeout=60)
        elapsed = time.monotonic() - started
    assert res.returncode == 1, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith(f"Error: cannot listen on 127.0.0.1:{port}: ")
    assert "in use" in lines[0] and "cache.embedder_url" in lines[0]
    assert "Traceback" not in res.stderr and "model" not in res.stdout
    assert elapsed < 10, elapsed  # no Redis wait, no model load


def test_lookups_whose_caller_left_are_not_run(redis_server, workdir, tiny_upstreams) -> None:
    """One thread, a model that takes 0.3 s a call (a remote embeddings server) and 12
    lookups whose callers give up after 0.1 s (as the edge does after its budget): the
    ones still queued when their caller closed the connection are skipped, not embedded
    for nobody."""
    (emb,) = tiny_upstreams(names=["embeddings"])
    emb.delay_s = 0.3
    port = procs.free_port()
    m = procs.Managed("embedder", procs.infergate_argv(
        "embedder", "--listen", f"127.0.0.1:{port}", "--redis-url", redis_server.url,
        "--embeddings-url", emb.url, "--embeddings-model", "tiny-embed", "--index", "local",
        "--no-queue", "--threads", "1", "--processes", "1"), workdir / "embedder.log")
    url = f"http://127.0.0.1:{port}"
    try:
        m.start().wait_ready(lambda: requests.get(url + "/healthz", timeout=2).ok, 60)
        before = emb.hits
        from concurrent.futures import ThreadPoolExecutor

        def give_up_soon(i: int) -> str:
            try:
                requests.post(url + "/v1/lookup", timeout=0.1,
                              json={"namespace": "ab" * 32, "text": f"question {i}?"})
                return "answered"
            except requests.RequestException:
                return "gave up"

        with ThreadPoolExecutor(12) as ex:
            outcomes = list(ex.map(give_up_soon, range(12)))
        assert outcomes.count("gave up") == 12
        # one more lookup, waited for: the one thread reaches it only after everything
        # queued before it was run or skipped
        r = requests.post(url + "/v1/lookup", timeout=30,
                          json={"namespace": "ab" * 32, "text": "the last question?"})
        assert r.status_code == 200
        # at most the lookups a thread had taken up before their callers left (+ this one)
        assert emb.hits - before - 1 <= 3, emb.hits - before - 1
    finally:
        m.stop()
