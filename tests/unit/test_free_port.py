"""procs.free_port: ports below the kernel's ephemeral range, checked free, never the
same one twice to concurrent callers of one process."""

from __future__ import annotations

import socket
import threading

import pytest

from controlplane import procs


def test_ports_are_below_the_ephemeral_range_and_bindable() -> None:
    low, high = procs.ephemeral_range()
    assert 1024 <= low <= high <= 65535
    for _ in range(20):
        port = procs.free_port()
        assert procs.FREE_PORT_MIN <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ephemeral_range_is_read_from_the_kernel_file(tmp_path) -> None:
    f = tmp_path / "range"
    f.write_text("40000\t50000\n")
    assert procs.ephemeral_range(str(f)) == (40000, 50000)
    assert procs.ephemeral_range(str(tmp_path / "missing")) == (32768, 60999)


def test_a_busy_port_is_skipped(monkeypatch) -> None:
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    busy = held.getsockname()[1]
    try:
        # the only candidate below the range is busy: the kernel's choice instead
        monkeypatch.setattr(procs, "FREE_PORT_MIN", busy)
        monkeypatch.setattr(procs, "ephemeral_range", lambda: (busy + 2, 60999))
        monkeypatch.setattr(procs, "FREE_PORT_TRIES", 8)
        monkeypatch.setattr(procs._rng, "randint", lambda a, b: busy)
        assert procs.free_port() != busy
    finally:
        held.close()


def test_no_range_below_falls_back_to_the_kernel(monkeypatch) -> None:
    monkeypatch.setattr(procs, "ephemeral_range", lambda: (1025, 60999))
    assert procs.free_port() >= 1024


def test_concurrent_callers_get_distinct_ports() -> None:
    got: list[int] = []
    lock = threading.Lock()

    def take() -> None:
        ports = [procs.free_port() for _ in range(25)]
        with lock:
            got.extend(ports)

    threads = [threading.Thread(target=take) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 200 and len(set(got)) == 200


def test_on_free_port_tries_a_new_port_when_the_address_is_taken() -> None:
    tried: list[int] = []

    def start(port: int) -> str:
        tried.append(port)
        if len(tried) < 3:
            raise procs.StartError(f"x exited early:\nbind 127.0.0.1:{port}: Address already in use"
                                  if len(tried) == 1 else
                                  f"couldn't bind HTTP server socket, hostname: 127.0.0.1, port: {port}")
        return f"on {port}"

    assert procs.on_free_port(start) == f"on {tried[-1]}"
    assert len(tried) == 3 and len(set(tried)) == 3


def test_on_free_port_gives_up_after_its_attempts_and_on_other_errors() -> None:
    calls: list[int] = []

    def taken(port: int) -> None:
        calls.append(port)
        raise procs.StartError("Address already in use")

    with pytest.raises(procs.StartError, match="in use"):
        procs.on_free_port(taken, attempts=2)
    assert len(calls) == 2

    calls.clear()

    def broken(port: int) -> None:
        calls.append(port)
        raise procs.StartError("x exited early: bad config")

    with pytest.raises(procs.StartError, match="bad config"):
        procs.on_free_port(broken)
    assert len(calls) == 1
