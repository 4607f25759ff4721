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


def _held_ports(n: int) -> tuple[list[socket.socket], int]:
    """``n`` consecutive ports bound by this process (a window the kernel picked, retried
    until all of it binds): the sockets and the first port."""
    for _ in range(50):
        first = procs.free_port()
        held: list[socket.socket] = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                held.append(s)
                s.bind(("127.0.0.1", port))
            return held, first
        except OSError:
            for s in held:
                s.close()
    raise AssertionError("no window of consecutive free ports")


def test_the_port_range_variable_keeps_every_pick_inside_it(monkeypatch) -> None:
    """``INFERGATE_PORT_RANGE``: every port picked is of the range and bindable, a busy
    one is skipped even when the random candidates all hit it, and a range with nothing
    free is an error naming the variable, not a port outside it."""
    held, first = _held_ports(4)
    try:
        # ports first .. first+3 are held: only first+3 is let go, the one free port
        held.pop().close()
        monkeypatch.setenv(procs.PORT_RANGE_ENV, f"{first}-{first + 3}")
        monkeypatch.setattr(procs, "_recent_ports", {})
        assert procs.port_range() == (first, first + 3)
        assert procs.free_port() == first + 3
        # returned once, not again within FREE_PORT_REUSE_S: the range is now full
        with pytest.raises(procs.StartError, match=procs.PORT_RANGE_ENV) as err:
            procs.free_port()
        assert "(4 port(s), 1 of them given to this run's other parts" in str(err.value)
        assert "give it a wider range" in str(err.value)
    finally:
        for s in held:
            s.close()
    monkeypatch.setattr(procs, "_recent_ports", {})
    monkeypatch.setenv(procs.PORT_RANGE_ENV, f" {first} - {first + 3} ")
    assert {procs.free_port() for _ in range(4)} == set(range(first, first + 4))


@pytest.mark.parametrize("raw", ["21000", "21000-", "abc-def", "30000-20000", "80-90",
                                 "60000-70000", "21000:21999"])
def test_a_malformed_port_range_is_refused(monkeypatch, raw: str) -> None:
    monkeypatch.setenv(procs.PORT_RANGE_ENV, raw)
    with pytest.raises(procs.StartError, match="is not a port range"):
        procs.port_range()
    with pytest.raises(procs.StartError, match="is not a port range"):
        procs.free_port()


def test_an_empty_port_range_variable_is_no_range(monkeypatch) -> None:
    monkeypatch.setenv(procs.PORT_RANGE_ENV, " ")
    assert procs.port_range() is None
    assert procs.FREE_PORT_MIN <= procs.free_port()
