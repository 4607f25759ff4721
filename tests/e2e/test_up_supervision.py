"""`infergate up` stays up and stays alone: a part that dies is restarted (the edge keeps
answering while the control plane restarts), nginx dying again and again stops the stack
with a non-zero exit naming it while any other part is restarted on and the edge serves, two stacks on one host never touch each other's Redis
or registry, and a stack refuses a registry another live stack owns."""

from __future__ import annotations

import json
import os
import signal
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis
import requests

from controlplane import procs
from controlplane.redisdb import keynames
from support.upstack import UpStack

NO_CACHE = '[edge]\nmetrics_listen = ""\n[cache]\nenabled = false\n'


def _registry(url: str) -> dict[str, str]:
    r = redis.Redis.from_url(url, decode_responses=True, socket_timeout=2)
    try:
        return {name: json.loads(doc)["url"] for name, doc in r.hgetall(keynames.NODES).items()}
    finally:
        r.close()


def _first_answer(up: UpStack) -> None:
    procs.wait_until(lambda: up.post_chat("warm up").status_code == 200, timeout=30,
                     what="first answer through the edge")


def test_controlplane_killed_is_restarted_without_losing_requests(workdir: Path) -> None:
    up = UpStack.start(workdir, NO_CACHE)
    try:
        assert up.proc.poll() is None, up.text()
        _first_answer(up)
        cp_pid = up.part_pid("controlplane --config")
        assert cp_pid
        results: list[int] = []
        errors: list[str] = []
        stop = threading.Event()

        def load(i: int) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    results.append(up.post_chat(f"steady load {i} {n}").status_code)
                except Exception as exc:  # noqa: BLE001 - every failure counts as lost
                    errors.append(repr(exc))
                time.sleep(0.02)

        threads = [threading.Thread(target=load, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.0)
        killed_at = time.monotonic()
        os.kill(cp_pid, signal.SIGKILL)
        # restarted by up, answering with this stack's id again
        procs.wait_until(lambda: up.part_pid("controlplane --config") not in (None, cp_pid)
                         and procs.http_instance(f"http://127.0.0.1:{up.admin}/healthz") not in (None, ""),
                         timeout=30, what="control plane restarted")
        back_after = time.monotonic() - killed_at
        time.sleep(1.5)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        text = up.text()
        assert "controlplane exited (code -9" in text, text
        assert "controlplane restarted" in text, text
        assert up.proc.poll() is None
        lost = [s for s in results if s != 200]
        print(f"control plane SIGKILL: back after {back_after:.1f} s; {len(results)} requests "
              f"through the edge, {len(lost) + len(errors)} lost")
        assert results and not lost and not errors, (len(results), lost[:5], errors[:5])
        assert len(results) > 40
    finally:
        rc = up.stop()
    assert rc == 0


def test_redis_killed_is_restarted_with_its_data(workdir: Path) -> None:
    up = UpStack.start(workdir, NO_CACHE)
    try:
        assert up.proc.poll() is None, up.text()
        _first_answer(up)
        url = up.redis_url
        before = _registry(url)
        assert len(before) == 3
        # its own Redis wants the password of the banner's URL, and its files are the
        # owner's alone (the append-only file holds stored prompts and answers)
        parts = urlsplit(url)
        assert parts.password
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(host="127.0.0.1", port=parts.port, socket_timeout=2).get("x")
        rdir = workdir / "stack" / "redis"
        assert stat.S_IMODE(rdir.stat().st_mode) == 0o700
        assert stat.S_IMODE((rdir / "redis.conf").stat().st_mode) == 0o600
        assert parts.password not in " ".join(
            Path(f"/proc/{up.part_pid('redis-server')}/cmdline").read_text().split("\0"))
        # no wait for appendfsync: a SIGKILL loses what was not yet written(), not what
        # was not yet fsynced, and Redis writes the append-only buffer before it replies
        pid = up.part_pid("redis-server")
        assert pid
        os.kill(pid, signal.SIGKILL)
        procs.wait_until(lambda: up.part_pid("redis-server") not in (None, pid)
                         and redis.Redis.from_url(url, socket_timeout=1).ping(),
                         timeout=20, what="redis restarted")
        assert _registry(url) == before                   # the append-only file kept it
        # the demo key (state in Redis) still works and the edge answers
        procs.wait_until(lambda: up.post_chat("after the redis restart").status_code == 200,
                         timeout=20, what="answer after the redis restart")
        assert "redis exited (code -9" in up.text() and "redis restarted" in up.text()
        assert up.proc.poll() is None
    finally:
        rc = up.stop()
    assert rc == 0


def test_a_part_that_keeps_dying_stops_the_stack(workdir: Path) -> None:
    up = UpStack.start(workdir, NO_CACHE)
    try:
        assert up.proc.poll() is None, up.text()
        _first_answer(up)
        pid_file = workdir / "stack" / "nginx" / "nginx.pid"
        # killed once: restarted on the same port, answering again
        first = int(pid_file.read_text())
        os.kill(first, signal.SIGKILL)
        procs.wait_until(lambda: pid_file.exists() and pid_file.read_text().strip().isdigit()
                         and int(pid_file.read_text()) != first, timeout=15, what="nginx restarted")
        _first_answer(up)
        assert "nginx exited (code -9" in up.text()
        # killed again and again: up gives up, stops everything and exits non-zero
        seen = {first}
        deadline = time.monotonic() + 60
        while up.proc.poll() is None and time.monotonic() < deadline:
            try:
                pid = int(pid_file.read_text())
            except (OSError, ValueError):
                pid = 0
            if pid and pid not in seen and os.path.exists(f"/proc/{pid}"):
                seen.add(pid)
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        rc = up.proc.wait(timeout=30)
    finally:
        up.kill()
    text = up.text()
    assert rc != 0, text
    assert "nginx exited (code -9) 5 times within 60 s" in text, text
    assert not procs.port_open("127.0.0.1", up.edge)
    assert not procs.port_open("127.0.0.1", up.admin)


def test_two_stacks_side_by_side_stay_apart(workdir: Path) -> None:
    a = UpStack.start(workdir / "a", NO_CACHE)
    b = None
    try:
        assert a.proc.poll() is None, a.text()
        _first_answer(a)
        reg_a = _registry(a.redis_url)
        b = UpStack.start(workdir / "b", NO_CACHE)
        assert b.proc.poll() is None, b.text()
        _first_answer(b)
        assert a.redis_url != b.redis_url
        assert ":6379/" not in a.redis_url and ":6379/" not in b.redis_url
        reg_b = _registry(b.redis_url)
        assert _registry(a.redis_url) == reg_a          # b never touched a's registry
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
        assert _registry(a.redis_url) == reg_a
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


def test_a_control_plane_that_keeps_dying_leaves_the_edge_serving(workdir: Path) -> None:
    up = UpStack.start(workdir, NO_CACHE)
    try:
        _first_answer(up)
        seen: set[int] = set()
        deadline = time.monotonic() + 60
        while "the rest runs on without it" not in up.text() and time.monotonic() < deadline:
            pid = up.part_pid("controlplane --config")
            if pid and pid not in seen:
                seen.add(pid)
                os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        text = up.text()
        assert "controlplane exited (code -9) 5 times within 60 s" in text, text
        assert up.proc.poll() is None, text
        # the edge answers on its last snapshot, and the control plane comes back
        assert up.post_chat("still served").status_code == 200
        procs.wait_until(lambda: up.part_pid("controlplane --config") not in (None, *seen),
                         timeout=30, what="control plane restarted after the back-off")
        assert "stopped everything" not in up.text()
    finally:
        rc = up.stop()
    assert rc == 0


def test_a_restart_revokes_the_demo_key_of_the_run_before(workdir: Path) -> None:
    first = UpStack.start(workdir, NO_CACHE)
    try:
        _first_answer(first)
        old_key = first.key
    finally:
        assert first.stop() == 0
    second = UpStack.start(workdir, NO_CACHE)
    try:
        assert second.key != old_key
        assert "revoked the demo key of an earlier run" in second.text(), second.text()
        _first_answer(second)
        res = requests.post(f"{second.base}/v1/chat/completions", timeout=10,
                            headers={"Authorization": f"Bearer {old_key}"},
                            json={"model": "sim-llama", "messages": [{"role": "user", "content": "x"}]})
        assert res.status_code == 401, res.text
    finally:
        assert second.stop() == 0


def test_supervisor_backs_off_and_gives_up(workdir: Path) -> None:
    """procs.Supervisor on a part that exits at once: restarts after 0.05, 0.1, 0.2 s
    (doubling), then gives up on the 4th exit within the window; an optional part is
    left stopped instead of stopping everything."""
    import sys

    lines: list[str] = []
    policy = procs.RestartPolicy(initial_s=0.05, max_s=0.2, max_failures=4, window_s=60)
    sup = procs.Supervisor(lines.append, policy)
    flaky = procs.Managed("flaky", [sys.executable, "-c", "raise SystemExit(3)"],
                          workdir / "flaky.log").start()
    extra = procs.Managed("extra", [sys.executable, "-c", "raise SystemExit(4)"],
                          workdir / "extra.log").start()
    sup.watch(flaky)
    sup.watch(extra, optional=True)
    t0 = time.monotonic()
    failed = None
    while failed is None and time.monotonic() - t0 < 20:
        failed = sup.tick()
        time.sleep(0.01)
    elapsed = time.monotonic() - t0
    assert failed and "flaky exited (code 3) 4 times within 60 s" in failed
    assert sup.restarts("flaky") == 3
    assert elapsed >= 0.05 + 0.1 + 0.2
    assert [ln for ln in lines if ln.startswith("flaky exited")][0].startswith(
        "flaky exited (code 3, restarts so far 0, log ")
    assert any("restarting in 0.1 s" in ln for ln in lines)
    # the optional part goes on being restarted until it, too, has failed 4 times
    while not any(ln.startswith("extra gave up") for ln in lines) and time.monotonic() - t0 < 20:
        assert sup.tick() is None
        time.sleep(0.01)
    assert any(ln.startswith("extra gave up after 4 exits") for ln in lines)
    assert sup.tick() is None
    assert policy.delay(1) == 0.05 and policy.delay(10) == 0.2
    assert procs.RestartPolicy().delay(1) == 0.5 and procs.RestartPolicy().delay(9) == 10.0


def test_take_over_replaces_the_owner(workdir: Path) -> None:
    a = UpStack.start(workdir / "a", NO_CACHE)
    c = None
    try:
        assert a.proc.poll() is None, a.text()
        reg_a = _registry(a.redis_url)
        c = UpStack.start(workdir / "c", NO_CACHE, "--take-over", redis_url=a.redis_url)
        assert c.proc.poll() is None, c.text()
        _first_answer(c)
        reg_c = _registry(a.redis_url)
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


def test_a_part_kept_trying_is_restarted_on_past_the_limit(workdir: Path) -> None:
    """procs.Supervisor with keep_trying (every part of ``up`` but nginx and the
    embedder): past max_failures it is reported once and restarted on at the longest
    back-off, and tick never asks to stop everything."""
    import sys

    lines: list[str] = []
    policy = procs.RestartPolicy(initial_s=0.02, max_s=0.1, max_failures=3, window_s=60)
    sup = procs.Supervisor(lines.append, policy)
    cp = procs.Managed("controlplane", [sys.executable, "-c", "raise SystemExit(5)"],
                       workdir / "cp.log").start()
    sup.watch(cp, keep_trying=True)
    t0 = time.monotonic()
    while sup.restarts("controlplane") < 6 and time.monotonic() - t0 < 20:
        assert sup.tick() is None
        time.sleep(0.01)
    assert sup.restarts("controlplane") >= 6
    degraded = [ln for ln in lines if "the rest runs on without it" in ln]
    assert len(degraded) == 1, lines
    assert degraded[0].startswith("controlplane exited (code 5) 3 times within 60 s")
    assert "restarting in 0.1 s" in lines[-1] or "restarted" in lines[-1]


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
        _first_answer(up)
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
        _first_answer(up)
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
        _first_answer(up)
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


def test_a_frozen_control_plane_is_killed_and_restarted(workdir: Path) -> None:
    """A control plane that lives but does not answer (SIGSTOP) never exits: after three
    failed health checks 5 s apart up kills it, and the restarted one publishes again."""
    up = UpStack.start(workdir, NO_CACHE)
    frozen = None
    try:
        assert up.proc.poll() is None, up.text()
        _first_answer(up)
        frozen = up.part_pid("controlplane --config")
        assert frozen
        os.kill(frozen, signal.SIGSTOP)
        procs.wait_until(lambda: "did not answer its health check 3 times in a row" in up.text(),
                         timeout=40, what="the frozen control plane to be killed")
        procs.wait_until(lambda: (up.part_pid("controlplane --config") or frozen) != frozen,
                         timeout=30, what="a new control plane")
        procs.wait_until(lambda: procs.http_instance(f"http://127.0.0.1:{up.admin}/healthz")
                         not in (None, ""), timeout=30, what="the admin page to answer again")
        assert up.post_chat("after the restart").status_code == 200
    finally:
        if frozen:
            try:
                os.kill(frozen, signal.SIGCONT)
            except ProcessLookupError:
                pass
        up.stop()
