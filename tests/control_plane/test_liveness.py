"""procs.Liveness: a part that misses its health checks is killed when it is frozen
(stopped, or idle like a deadlock), not while it works (a flood of its port), and a
working one only after BUSY_MAX_S. Real child processes; the clock is the test's."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

from controlplane import procs

pytestmark = pytest.mark.integration


@pytest.fixture
def child():
    started: list[subprocess.Popen] = []

    def start(code: str) -> subprocess.Popen:
        p = subprocess.Popen([sys.executable, "-c", code])
        started.append(p)
        return p

    yield start
    for p in started:
        p.kill()
        p.wait(10)


def test_a_working_process_is_not_killed_while_busy(child) -> None:
    p = child("while True: pass")
    said: list[str] = []
    now = [100.0]
    live = procs.Liveness("controlplane", 3, said.append, clock=lambda: now[0])
    cpu0 = procs.cpu_state(p.pid)
    assert live.missed(p.pid) is False
    # one second of the test's clock; the child burns real CPU meanwhile
    procs.wait_until(lambda: procs.cpu_state(p.pid)[0] - cpu0[0] >= 0.5, 20,
                     what="the child used CPU")
    now[0] += 1.0
    assert live.missed(p.pid) is False
    assert live.missed(p.pid) is False          # third miss: working, held back
    assert len(said) == 1 and "is working" in said[0] and "controlplane" in said[0]
    assert live.missed(p.pid) is False and len(said) == 1  # said once


def test_a_stopped_or_idle_process_is_killed_after_its_misses(child) -> None:
    busy = child("while True: pass")
    idle = child("import time; time.sleep(600)")
    procs.wait_until(lambda: procs.cpu_state(busy.pid)[0] > 0.2, 20, what="the child runs")
    busy.send_signal(signal.SIGSTOP)
    procs.wait_until(lambda: procs.cpu_state(busy.pid)[1] == "T", 10, what="stopped")
    for pid in (busy.pid, idle.pid):
        said: list[str] = []
        now = [100.0]
        live = procs.Liveness("embedder", 3, said.append, clock=lambda: now[0])
        got = []
        for _ in range(3):
            got.append(live.missed(pid))
            now[0] += 5.0
        assert got == [False, False, True] and said == []


def test_an_answer_starts_the_count_afresh() -> None:
    live = procs.Liveness("x", 2, lambda _s: None, clock=lambda: 0.0)
    assert live.missed(None) is False
    live.answered()
    assert live.missed(None) is False and live.missed(None) is True


def test_cpu_state_of_a_process_gone_is_none(child) -> None:
    p = child("pass")
    p.wait(10)
    assert procs.cpu_state(p.pid) is None and procs.cpu_state(None) is None


def test_a_working_process_holding_many_sockets_is_a_flood_never_killed(child,
                                                                       monkeypatch) -> None:
    """Busy past BUSY_MAX_S: killed (a stuck loop), unless it holds FLOOD_SOCKETS sockets
    or more (a flood of its port, which a restart would not end)."""
    monkeypatch.setattr(procs, "BUSY_MAX_S", 0.5)
    code = "while True: pass"
    flood = child(f"import socket\nsocks = [socket.socket() for _ in "
                  f"range({procs.FLOOD_SOCKETS})]\n{code}")
    loop = child(code)
    procs.wait_until(lambda: procs.socket_count(flood.pid) >= procs.FLOOD_SOCKETS, 20,
                     what="the child opened its sockets")
    assert procs.socket_count(loop.pid) < procs.FLOOD_SOCKETS
    for p, killed in ((flood, False), (loop, True)):
        now = [100.0]
        live = procs.Liveness("controlplane", 3, lambda _s: None, clock=lambda: now[0])
        cpu0 = procs.cpu_state(p.pid)[0]
        assert live.missed(p.pid) is False
        procs.wait_until(lambda: procs.cpu_state(p.pid)[0] - cpu0 >= 0.6, 20, what="CPU used")
        now[0] += 1.0                  # past BUSY_MAX_S, with 0.6 s of CPU in it: busy
        assert live.missed(p.pid) is False
        assert live.missed(p.pid) is killed
