"""The lookup count shared by the processes of one embedder (controlplane/embedder/
activity.py): each process counts in its own slot of shared memory, any process sees
the sum, a dead process's slot is reset by its supervisor."""

from __future__ import annotations

import os
import threading
import time

import pytest

from controlplane.embedder.activity import LookupActivity


def test_counts_nested_and_concurrent_lookups() -> None:
    a = LookupActivity()
    assert not a.busy()
    with a.lookup():
        assert a.busy()
        with a.lookup():
            assert a.busy()
        assert a.busy()
    assert not a.busy()
    started, release = threading.Event(), threading.Event()

    def worker() -> None:
        with a.lookup():
            started.set()
            release.wait(5)

    t = threading.Thread(target=worker)
    t.start()
    started.wait(5)
    assert a.busy()
    release.set()
    t.join(5)
    assert not a.busy()


def test_a_forked_process_is_seen_and_its_slot_reset() -> None:
    a = LookupActivity(2)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a lookup that never ends, then killed
        try:
            a.bind(1)
            cm = a.lookup()
            cm.__enter__()
            os.write(w, b"x")
            time.sleep(30)
        finally:
            os._exit(0)
    try:
        assert os.read(r, 1) == b"x"
        assert a.busy()                        # the parent sees the child's lookup
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        assert a.busy()                        # a killed process leaves its count...
        a.reset(1)
        assert not a.busy()                    # ...until its supervisor resets the slot
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(ValueError):
        a.bind(2)


def test_wait_idle_is_bounded_and_stoppable() -> None:
    a = LookupActivity()
    assert a.wait_idle(1.0) < 0.05            # idle: no wait
    with a.lookup():
        t0 = time.monotonic()
        waited = a.wait_idle(0.2)
        assert 0.19 <= waited and time.monotonic() - t0 < 1.0
        stop = threading.Event()
        stop.set()
        assert a.wait_idle(5.0, stop) < 0.5  # a stopping consumer does not wait
    done = threading.Event()

    def end_soon() -> None:
        with a.lookup():
            done.wait(0.1)

    t = threading.Thread(target=end_soon)
    t.start()
    time.sleep(0.02)
    assert a.wait_idle(5.0) < 1.0             # returns when the lookup ends
    t.join(5)
