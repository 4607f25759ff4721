"""``infergate embedder --processes N``: N forked processes serve one socket; an entry
indexed through one is found through the others, ``/metrics`` sums them, a process that
dies is replaced, SIGTERM stops them all, and a start failure ends the command with the
single-process status and message."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from controlplane import procs
from controlplane.redisdb import keynames

MODEL = "use-multilingual-v3"


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    try:
        return {int(x) for x in path.read_text().split()}
    except FileNotFoundError:
        return set()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _start(redis_server, workdir: Path, n: int = 2, attempts: int = 3) -> tuple[procs.Managed, str]:
    for attempt in range(attempts):
        # a free port can be taken by another test's process before the embedder binds
        port = procs.free_port()
        m = procs.Managed("embedder", procs.infergate_argv(
            "embedder", "--listen", f"127.0.0.1:{port}", "--redis-url", redis_server.url,
            "--model", MODEL, "--index", "local", "--no-queue", "--processes", str(n)),
            workdir / f"embedder-{attempt}.log").start()
        url = f"http://127.0.0.1:{port}"

        def ready(m: procs.Managed = m, url: str = url) -> bool:
            # one process answering is not all of them: each logs when it serves
            ok = requests.get(url + "/healthz", timeout=1).status_code == 200
            return ok and m.log_path.read_text().count("embedder listening on") == n

        try:
            m.wait_ready(ready, 120)
        except procs.StartError as e:
            m.stop()
            if "Address already in use" not in str(e) or attempt == attempts - 1:
                raise
            continue
        return m, url
    raise AssertionError("unreachable")


def test_processes_share_index_and_metrics(redis_server, workdir) -> None:
    m, url = _start(redis_server, workdir)
    try:
        kids = _children(m.proc.pid)
        assert len(kids) == 2
        ns, text = "ab" * 8, "How do I reset my password?"
        key = hashlib.sha256(text.encode()).hexdigest()
        redis_server.client().set(keynames.cache_entry(key), b"{}", ex=60)
        resp = requests.post(url + "/v1/index", json={"key": key, "namespace": ns,
                                                      "text": text, "ttl_s": 60}, timeout=30)
        assert resp.status_code == 200 and resp.json()["indexed"] is True

        def lookup() -> dict:
            # a new connection each time: the kernel hands it to either process
            with requests.Session() as s:
                r = s.post(url + "/v1/lookup", json={"namespace": ns, "text": text},
                           headers={"Connection": "close"}, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()

        # the other process learns the vector over pub/sub: wait for it, then every
        # lookup, whichever process takes it, is a hit
        deadline = time.monotonic() + 20
        streak = 0
        while streak < 20 and time.monotonic() < deadline:
            streak = streak + 1 if lookup()["hit"] else 0
        assert streak >= 20, "lookups through some process miss the indexed entry"
        before = _metric(requests.get(url + "/metrics", timeout=5).text,
                         "infergate_embedder_lookups_total")
        for _ in range(30):
            assert lookup()["hit"] is True
        after = [_metric(requests.get(url + "/metrics", headers={"Connection": "close"},
                                      timeout=5).text, "infergate_embedder_lookups_total")
                 for _ in range(6)]
        # whichever process answers /metrics, it reports the sum over both
        assert all(a - before == 30 for a in after), (before, after)
    finally:
        m.stop()
    assert not any(Path(f"/proc/{k}").exists() for k in kids)


def test_dead_process_is_replaced_and_sigterm_stops_all(redis_server, workdir) -> None:
    m, url = _start(redis_server, workdir)
    try:
        kids = _children(m.proc.pid)
        victim = min(kids)
        os.kill(victim, signal.SIGKILL)
        procs.wait_until(lambda: len(_children(m.proc.pid) - {victim}) == 2, 60,
                         interval=0.1, what="a replacement process")
        procs.wait_until(lambda: requests.get(url + "/healthz", timeout=2).status_code == 200,
                         30, interval=0.1, what="the embedder answering")
        assert "starting another" in m.log_path.read_text()
        kids = _children(m.proc.pid)
        os.kill(m.proc.pid, signal.SIGTERM)
        assert m.proc.wait(timeout=20) == 0
        for k in kids:
            procs.wait_until(lambda k=k: not Path(f"/proc/{k}").exists(), 5, interval=0.05,
                             what=f"process {k} gone")
    finally:
        m.stop()


def _metrics_folders(tmp: Path, before: set[Path], kids: set[int]) -> list[Path]:
    """The metrics folders made since ``before`` that hold files of the processes ``kids``
    (prometheus_client names each process's files by its pid): the parent's folder."""
    return [d for d in set(tmp.glob("infergate-embedder-metrics-*")) - before
            if any(f.name.endswith(f"_{k}.db") for k in kids for f in d.iterdir())]


def test_children_of_a_killed_parent_stop_and_remove_its_metrics_folder(redis_server,
                                                                        workdir) -> None:
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("infergate-embedder-metrics-*"))
    m, _ = _start(redis_server, workdir)
    try:
        kids = _children(m.proc.pid)
        ours = _metrics_folders(tmp, before, kids)
        assert len(ours) == 1
        os.kill(m.proc.pid, signal.SIGKILL)  # the parent only: no SIGTERM reaches them
        for k in kids:
            procs.wait_until(lambda k=k: not Path(f"/proc/{k}").exists()
                             or Path(f"/proc/{k}/stat").read_text().split()[2] == "Z",
                             15, interval=0.1, what=f"process {k} gone")
        assert not ours[0].exists()
    finally:
        m.stop()


def test_a_second_signal_while_stopping_still_removes_the_metrics_folder(redis_server,
                                                                         workdir) -> None:
    """A parent started by a multi-threaded process with PR_SET_PDEATHSIG (as ``infergate
    up`` starts it) gets its SIGTERM once per thread of that process when it is killed
    outright: the second one, a few ms after the first, must not kill the embedder halfway
    through its stop, leaving its metrics folder in the temp directory."""
    tmp = Path(tempfile.gettempdir())
    before = set(tmp.glob("infergate-embedder-metrics-*"))
    m, _ = _start(redis_server, workdir)
    try:
        kids = _children(m.proc.pid)
        ours = _metrics_folders(tmp, before, kids)
        assert len(ours) == 1
        os.kill(m.proc.pid, signal.SIGTERM)
        time.sleep(0.02)
        os.kill(m.proc.pid, signal.SIGTERM)
        assert m.proc.wait(timeout=20) == 0
        for k in kids:
            procs.wait_until(lambda k=k: not Path(f"/proc/{k}").exists(), 5, interval=0.05,
                             what=f"process {k} gone")
        assert not ours[0].exists()
    finally:
        m.stop()


def test_start_failure_ends_the_command(workdir) -> None:
    dead_redis = f"redis://127.0.0.1:{procs.free_port()}/0"
    port = procs.free_port()
    res = subprocess.run([sys.executable, "-m", "controlplane.cli", "embedder",
                          "--listen", f"127.0.0.1:{port}", "--redis-url", dead_redis,
                          "--redis-wait-s", "0.5", "--model", MODEL, "--processes", "2"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr
    assert f"Redis at {dead_redis}" in res.stderr
    assert "before it served" in res.stderr
    assert "Traceback" not in res.stderr
