"""logthrottle.OncePer: one record per interval, the dropped ones counted into the next."""

from __future__ import annotations

import logging

from controlplane.logthrottle import OncePer


def record(msg: str, *args) -> logging.LogRecord:
    return logging.LogRecord("waitress.queue", logging.WARNING, __file__, 1, msg, args, None)


def test_one_record_per_interval_and_the_dropped_counted() -> None:
    now = [0.0]
    f = OncePer(30.0, clock=lambda: now[0])
    assert f.filter(record("Task queue depth is %d", 1))
    assert [f.filter(record("Task queue depth is %d", n)) for n in range(2, 6)] == [False] * 4
    now[0] = 29.9
    assert not f.filter(record("Task queue depth is %d", 6))
    now[0] = 30.0
    r = record("Task queue depth is %d", 7)
    assert f.filter(r)
    assert r.getMessage() == "Task queue depth is 7 (5 more like it since)"
    now[0] = 61.0
    r = record("Task queue depth is %d", 8)
    assert f.filter(r) and r.getMessage() == "Task queue depth is 8"
