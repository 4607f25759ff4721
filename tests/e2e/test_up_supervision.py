"""`infergate up` stays alone: two stacks on one host never touch each other's Redis or
registry, a stack refuses a registry another live stack owns (or takes it over when
told), no part outlives it, and a stop lets streams in flight finish. Restarts of its
parts: test_up_restarts.py."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from controlplane import procs
from support.upstack import NO_CACHE, UpStack, first_answer, registry


def test_two_stacks_side_by_side_stay_apart(workdir: Path) -> None:
    a = UpStack.start(workdir / "a", NO_CACHE)
    b = None
    try:
        assert a.proc.poll() is None, a.text()
        first_answer(a)
        reg_a = registry(a.redis_url)
        b = UpStack.start(workdir / "b", NO_CACHE)
        assert b.proc.poll() is None, b.text()
        first_answer(b)
        assert a.redis_url != b.redis_url
        assert ":6379/" not in a.redis_url and ":6379/" not in b.redis_url
        reg_b = registry(b.redis_url)
        assert registry(a.redis_url) == reg_a          # b never touched a's registry
        assert set(reg_a.values()).isdisjoint(reg_b.values())
        for up in (a, b):
            for i in range(5):
                res = up.post_chat(f"side by side {i}")
                assert res.status_code == 200, res.text
            assert up.proc.poll() is None

        # a third stack pointed at a's Redis refuses to take a's registry over
        c = UpStack.start(workdir / "c", NO_CACHE, redis_url=a.redis_url)
        try:
            rc = c.proc.wait(timeout=60)
        finally:
            c.kill()
        assert rc != 0
        assert "belongs to another running infergate up" in c.text(), c.text()
        assert "--take-over" in c.text() and "leave out --redis-url" in c.text()
        assert registry(a.redis_url) == reg_a
        assert a.post_chat("still mine").status_code == 200
    finally:
        rcs = [s.stop() for s in (a, b) if s is not None]
    assert rcs == [0] * len(rcs)


def test_every_part_echoes_the_instance_id(workdir: Path, monkeypatch, r) -> None:
    """simnode ``/health``, embedder ``/healthz`` and admin ``/healthz`` carry the id
    ``up`` hands down (``INFERGATE_INSTANCE_ID``), which is how ``up`` tells its own
    processes from another stack's on a raced port."""
    from types import SimpleNamespace

    from controlplane.admin import create_app as admin_app
    from controlplane.config import Settings
    from controlplane.embedder.app import create_app as embedder_app
    from controlplane.simnode import launch

    monkeypatch.setenv(procs.INSTANCE_ENV, "up-test-1234")
    node = launch.start_node("sim-id", workdir / "logs", "--time-scale", "0.05", control=False)
    try:
        assert procs.http_instance(f"{node.url}/health") == "up-test-1234"
    finally:
        node.stop()
    assert procs.http_instance(f"http://127.0.0.1:{procs.free_port()}/health") is None

    res = admin_app(Settings(), r, secret_key="x").test_client().get("/healthz")
    assert res.headers[procs.INSTANCE_HEADER] == "up-test-1234"
    assert res.get_json()["instance_id"] == "up-test-1234"

    engine = SimpleNamespace(
        r=r, model=SimpleNamespace(model_id="fake", dim=4), index=SimpleNamespace(backend="local"),
        pool=SimpleNamespace(models=lambda: []),
        default_min_similarity=0.9, verifier_active=False, thresholds=lambda _d: (0.9, None),
        policy=SimpleNamespace(current=lambda: SimpleNamespace(domains=[])))
    res = embedder_app(engine).test_client().get("/healthz")  # type: ignore[arg-type]
    assert res.status_code == 200
    assert res.headers[procs.INSTANCE_HEADER] == "up-test-1234"
    assert res.get_json()["instance_id"] == "up-test-1234"


def test_a_restart_revokes_the_demo_key_of_the_run_before(workdir: Path) -> None:
    first = UpStack.start(workdir, NO_CACHE)
    try:
        first_answer(first)
        old_key = first.key
    finally:
        assert first.stop() == 0
    second = UpStack.start(workdir, NO_CACHE)
    try:
        assert second.key != old_key
        assert "revoked the demo key of an earlier run" in second.text(), second.text()
        first_answer(second)
        res = requests.post(f"{second.base}/v1/chat/completions", timeout=10,
                            headers={"Authorization": f"Bearer {old_key}"},
                            json={"model": "sim-llama", "messages": [{"role": "user", "content": "x"}]})
        assert res.status_code == 401, res.text
    finally:
        assert second.stop() == 0


def test_take_over_replaces_the_owner(workdir: Path) -> None:
    a = UpStack.start(workdir / "a", NO_CACHE)
    c = None
    try:
        assert a.proc.poll() is None, a.text()
        reg_a = registry(a.redis_url)
        c = UpStack.start(workdir / "c", NO_CACHE, "--take-over", redis_url=a.redis_url)
        assert c.proc.poll() is None, c.text()
        first_answer(c)
        reg_c = registry(a.redis_url)
        assert set(reg_c) == set(reg_a) and set(reg_c.values()).isdisjoint(reg_a.values())
        # the old owner notices at its next refresh, says so and keeps running (c uses
        # its Redis)
        procs.wait_until(lambda: "registry was taken over by instance" in a.text(),
                         timeout=15, what="a notices the take-over")
        assert a.proc.poll() is None
        assert c.post_chat("after the take-over").status_code == 200
    finally:
        rc_c = c.stop() if c is not None else 0
        rc_a = a.stop()
    assert rc_c == 0 and rc_a == 0


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGKILL], ids=["hangup", "killed"])
def test_no_part_outlives_up(workdir: Path, sig: int) -> None:
    """A closed terminal (SIGHUP) stops the stack as Ctrl-C does; ``up`` killed outright
    (SIGKILL: no handler runs) still takes its parts with it (the kernel's parent-death
    signal), so nothing keeps serving on the stack's ports."""
    from support.upstack import alive, children

    up = UpStack.start(workdir, NO_CACHE)
    kids: set[int] = set()
    try:
        assert up.proc.poll() is None, up.text()
        first_answer(up)
        kids = children(up.proc.pid)
        assert len(kids) >= 5, kids                      # redis, 3 nodes, control plane, nginx
        up.proc.send_signal(sig)
        rc = up.proc.wait(timeout=30)
        assert rc == (0 if sig == signal.SIGHUP else -signal.SIGKILL), up.text()
        procs.wait_until(lambda: not any(alive(k) for k in kids), timeout=15,
                         what="every part of the stack to stop")
        assert not procs.port_open("127.0.0.1", up.edge)
        assert not procs.port_open("127.0.0.1", up.admin)
    finally:
        up.kill()
        for k in kids:  # what a failed check left (each part leads its own group)
            try:
                os.killpg(k, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def test_a_second_up_on_the_same_work_folder_touches_nothing(workdir: Path) -> None:
    """Refused before it starts anything: the first stack's Redis keeps its password file
    (a second Redis with another password there broke the first at its next restart)."""
    a = UpStack.start(workdir / "a", NO_CACHE)
    try:
        assert a.proc.poll() is None, a.text()
        conf = workdir / "a" / "stack" / "redis" / "redis.conf"
        before = conf.read_text()
        # its own log and config, the first one's --workdir (given last: it wins)
        b = UpStack.start(workdir / "b", NO_CACHE, "--workdir", str(workdir / "a" / "stack"),
                          wait=False)
        rc = b.proc.wait(timeout=30)
        b.kill()
        assert rc != 0
        assert "is in use by another infergate up (pid" in b.text()
        assert conf.read_text() == before
        assert a.post_chat("still served").status_code == 200
    finally:
        a.stop()


def _open_stream(up: UpStack, tokens: int) -> requests.Response:
    res = requests.post(f"{up.base}/v1/chat/completions", stream=True, timeout=30,
                        headers={"Authorization": f"Bearer {up.key}"},
                        json={"model": "sim-llama", "stream": True, "min_tokens": tokens,
                              "max_tokens": tokens,
                              "messages": [{"role": "user", "content": "Tell a long story."}]})
    assert res.status_code == 200, res.text
    return res


def _read_stream(lines: Iterator[bytes]) -> tuple[int, bool]:
    """(content chunks read, whether ``data: [DONE]`` came) until the stream ends."""
    chunks, done = 0, False
    try:
        for line in lines:
            if line == b"data: [DONE]":
                done = True
            elif line.startswith(b"data: "):
                chunks += 1
    except requests.RequestException:
        pass
    return chunks, done


def test_a_stop_lets_streams_in_flight_finish_and_a_second_one_cuts_them(workdir: Path) -> None:
    """Ctrl-C stops nginx as ``nginx -s quit`` does: a stream in flight (100 tokens at
    20 ms, real speed) ends complete, with ``[DONE]``, and no new connection is accepted meanwhile;
    a second Ctrl-C cuts the streams at once."""
    up = UpStack.start(workdir, NO_CACHE, "--time-scale", "1")
    try:
        assert up.proc.poll() is None, up.text()
        first_answer(up)
        res = _open_stream(up, 100)
        lines = res.iter_lines()
        assert next(line for line in lines if line.startswith(b"data: "))
        up.proc.send_signal(signal.SIGINT)
        procs.wait_until(lambda: not procs.port_open("127.0.0.1", up.edge), timeout=10,
                         what="the edge to stop accepting connections")
        chunks, done = _read_stream(lines)
        assert done and chunks > 0, (chunks, up.text())
        assert up.proc.wait(timeout=30) == 0, up.text()
        assert "Ctrl-C again cuts them" in up.text()
    finally:
        up.kill()

    up = UpStack.start(workdir, NO_CACHE, "--time-scale", "1")
    try:
        first_answer(up)
        lines = _open_stream(up, 1000).iter_lines()  # 20 s
        assert next(line for line in lines if line.startswith(b"data: "))
        up.proc.send_signal(signal.SIGINT)
        procs.wait_until(lambda: "Ctrl-C again" in up.text(), timeout=10, what="the stop")
        up.proc.send_signal(signal.SIGINT)
        chunks, done = _read_stream(lines)
        assert not done, chunks
        assert up.proc.wait(timeout=15) == 0, up.text()
    finally:
        up.kill()
