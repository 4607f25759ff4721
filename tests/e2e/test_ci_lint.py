"""``.ci/lint`` in a git worktree (``git worktree add``), which has no ``.venv`` of its
own: it runs the ruff of the main checkout's ``.venv`` rather than failing with "ruff
not found"."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

LINT = Path(__file__).resolve().parents[2] / ".ci" / "lint"


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                   check=True, capture_output=True)


@pytest.mark.skipif(not shutil.which("luacheck") or not shutil.which("git"),
                    reason="needs luacheck and git")
def test_lint_in_a_worktree_runs_the_main_checkouts_ruff(tmp_path: Path) -> None:
    main = tmp_path / "main"
    (main / ".ci").mkdir(parents=True)
    (main / "lua").mkdir()
    (main / "lua" / "ok.lua").write_text("local x = 1\nreturn x\n")
    shutil.copy(LINT, main / ".ci" / "lint")
    _git(main, "init", "-q")
    _git(main, "add", ".")
    _git(main, "commit", "-q", "-m", "init")
    _git(main, "worktree", "add", "-q", str(tmp_path / "wt"))
    ruff = main / ".venv" / "bin" / "ruff"     # the main checkout's, untracked
    ruff.parent.mkdir(parents=True)
    ruff.write_text(f"#!/bin/sh\necho \"ruff of main in $PWD\" > {tmp_path}/ran\n")
    ruff.chmod(0o755)
    env = {**os.environ, "PATH": "/usr/bin:/bin"}   # no other ruff on PATH
    res = subprocess.run(["bash", ".ci/lint"], cwd=tmp_path / "wt", env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "ruff not found" not in res.stderr
    assert (tmp_path / "ran").read_text().strip() == f"ruff of main in {tmp_path / 'wt'}"
