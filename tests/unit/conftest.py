"""Unit tests: pure logic, no processes of ours. Starting one here is a test bug, so
the process helpers of :mod:`controlplane.procs` refuse (fakeredis and in-process fakes
are fine)."""

from __future__ import annotations

import pytest

from controlplane import procs


@pytest.fixture(autouse=True)
def _no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("unit tests start no process; move this test out of tests/unit/")

    monkeypatch.setattr(procs.Managed, "start", refuse)
