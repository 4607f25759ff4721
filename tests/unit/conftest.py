"""Unit tests: pure logic, no processes of ours. Starting one here is a test bug, so
the process helpers of :mod:`controlplane.procs` and :class:`subprocess.Popen` (behind
``subprocess.run``, ``lua_eval``, ...) refuse (fakeredis and in-process fakes are
fine). The refusal is in place for each whole module, so module-scoped fixtures are
covered too, and is lifted after it (integration tests may run in the same session)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator

import pytest

from controlplane import procs

MESSAGE = "unit tests start no process; move this test out of tests/unit/"


def _refuse(*args: object, **kwargs: object) -> None:
    raise AssertionError(MESSAGE)


@pytest.fixture(autouse=True, scope="module")
def _no_processes() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(procs.Managed, "start", _refuse)
        mp.setattr(subprocess.Popen, "__init__", _refuse)
        yield
