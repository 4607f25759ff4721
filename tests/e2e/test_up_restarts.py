"""`infergate up` stays up: a part that dies is restarted (the edge keeps answering while
the control plane restarts), a frozen control plane is killed and restarted, nginx dying
again and again stops the stack with a non-zero exit naming it, while any other part is
restarted on (after a back-off) and the edge serves."""

from __future__ import annotations

import os
import signal
import stat
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import redis

from controlplane import procs
from support.upstack import NO_CACHE, UpStack, first_answer, registry


def test_controlplane_killed_is_restarted_without_losing_requests(workdir: Path) -> None:
    up = UpStack.start(workdir, NO_CACHE)
    try:
        assert up.proc.poll() is None, up.text()
        first_answer(up)
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
        first_answer(up)
        url = up.redis_url
        before = registry(url)
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
        assert registry(url) == before                   # the append-only file kept it
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
        first_answer(up)
        pid_file = workdir / "stack" / "nginx" / "nginx.pid"
        # killed once: restarted on the same port, answering again
        first = int(pid_file.read_text())
        os.kill(first, signal.SIGKILL)
        procs.wait_until(lambda: pid_file.exists() and pid_file.read_text().strip().isdigit()
                         and int(pid_file.read_text()) != first, timeout=15, what="nginx restarted")
        first_answer(up)
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


def test_a_control_plane_that_keeps_dying_leaves_the_edge_serving(workdir: Path) -> None:
    up = UpStack.start(workdir, NO_CACHE)
    try:
        first_answer(up)
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


def test_a_part_kept_trying_is_restarted_on_past_the_limit(workdir: Path) -> None:
    """procs.Supervisor with keep_trying (every part of ``up`` but nginx and the
    embedder): past max_failures it is reported once and restarted on at the longest
    back-off, and tick never asks to stop everything."""
    import sys

    lines: list[str] = []
    policy = procs.RestartPolicy(initial_s=0.02, max_s=0.1, max_failures=3, window_s=60)
    sup = procs.Supervisor(lines.append, policy)
    cp = procs.Managed("controlplane", [sys.executable, "-c",
                                        "import sys; print('Error: x.toml: invalid configuration: "
                                        "controlplane.poll_interval_s: -1 is below the minimum "
                                        "0.01', file=sys.stderr); raise SystemExit(5)"],
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
    # each exit line says why, from the part's own last log line
    reason = ": Error: x.toml: invalid configuration: controlplane.poll_interval_s: -1 is below"
    exits = [ln for ln in lines if ln.startswith("controlplane exited")]
    assert exits and all(reason in ln for ln in exits), exits


def test_a_frozen_control_plane_is_killed_and_restarted(workdir: Path) -> None:
    """A control plane that lives but does not answer (SIGSTOP) never exits: after three
    failed health checks 5 s apart up kills it, and the restarted one publishes again."""
    up = UpStack.start(workdir, NO_CACHE)
    frozen = None
    try:
        assert up.proc.poll() is None, up.text()
        first_answer(up)
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


def test_admin_logins_and_forms_outlive_a_control_plane_restart(workdir: Path) -> None:
    """up signs admin sessions with one key per work folder (admin-secret.key, the
    owner's only): a login and a form opened before the control plane was killed still
    work with the restarted one."""
    import re

    import requests

    up = UpStack.start(workdir, NO_CACHE)
    try:
        assert up.proc.poll() is None, up.text()
        key_file = workdir / "stack" / "admin-secret.key"
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        token = re.search(r"token: (\S+)", up.text()).group(1)
        admin = f"http://127.0.0.1:{up.admin}"
        s = requests.Session()

        def csrf_of(page: requests.Response) -> str:
            return re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)

        res = s.post(admin + "/login", allow_redirects=False, timeout=10,
                     data={"token": token, "csrf_token": csrf_of(s.get(admin + "/login"))})
        assert res.status_code == 303, res.text
        page = s.get(admin + "/keys", allow_redirects=False, timeout=10)
        assert page.status_code == 200, page.status_code
        csrf = csrf_of(page)

        cp_pid = up.part_pid("controlplane --config")
        assert cp_pid
        os.kill(cp_pid, signal.SIGKILL)
        procs.wait_until(lambda: up.part_pid("controlplane --config") not in (None, cp_pid)
                         and procs.http_instance(admin + "/healthz") not in (None, ""),
                         timeout=30, what="control plane restarted")
        again = s.get(admin + "/keys", allow_redirects=False, timeout=10)
        assert again.status_code == 200, (again.status_code, again.headers.get("Location"))
        # the form filled in before the restart is taken
        res = s.post(admin + "/keys", data={"csrf_token": csrf, "tenant": "after-restart"},
                     allow_redirects=False, timeout=10)
        assert res.status_code == 303 and res.headers["Location"].endswith("/keys"), res.text
        listing = s.get(admin + "/api/v1/keys", timeout=10).json()
        assert "after-restart" in {k["tenant"] for k in listing["keys"]}
    finally:
        rc = up.stop()
    assert rc == 0
