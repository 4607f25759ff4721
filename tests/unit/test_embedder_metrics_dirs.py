"""The embedder parent's metrics folders: one of a parent that is gone is removed by the
next embedder to start; live, foreign-named and unrelated folders stay."""

from __future__ import annotations

import os
from pathlib import Path

from controlplane.cli.embedder_procs import METRICS_PREFIX, remove_stale_metrics_dirs

#: Above Linux's largest pid_max (2**22): no process can have it.
NO_SUCH_PID = 2**22 + 12345


def test_only_the_folders_of_gone_parents_are_removed(tmp_path: Path) -> None:
    gone = tmp_path / f"{METRICS_PREFIX}{NO_SUCH_PID}-abc"
    alive = tmp_path / f"{METRICS_PREFIX}{os.getpid()}-def"
    unnamed = tmp_path / f"{METRICS_PREFIX}k3j2h1"  # no pid in the name
    other = tmp_path / "something-else"
    for d in (gone, alive, unnamed, other):
        d.mkdir()
        (d / "counter_1.db").write_bytes(b"\0" * 8)
    assert remove_stale_metrics_dirs(str(tmp_path)) == [str(gone)]
    assert not gone.exists()
    assert alive.is_dir() and unnamed.is_dir() and other.is_dir()
    assert remove_stale_metrics_dirs(str(tmp_path / "missing")) == []
