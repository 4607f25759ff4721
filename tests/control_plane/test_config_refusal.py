"""A number out of its bounds stops ``render-nginx``, ``controlplane`` and ``up`` at once,
with one line naming the field and the bound, before anything is started or connected."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane import procs

MESSAGE = "controlplane.poll_interval_s: -1 is below the minimum 0.01"


@pytest.fixture
def trap() -> socket.socket:
    """A listening loopback socket standing in for Redis: nothing may connect to it."""
    s = socket.socket()
    s.bind(("127.0.0.1", procs.free_port()))
    s.listen(8)
    s.settimeout(0)
    yield s
    s.close()


def _bad_config(folder: Path, trap: socket.socket) -> Path:
    port = trap.getsockname()[1]
    cfg = folder / "bad.toml"
    cfg.write_text(f'[redis]\nurl = "redis://127.0.0.1:{port}/0"\n\n'
                   f'[controlplane]\nlisten = "127.0.0.1:{procs.free_port()}"\n'
                   "poll_interval_s = -1\n")
    return cfg


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "controlplane.cli", *args],
                          capture_output=True, text=True, timeout=60)


def _assert_refused(res: subprocess.CompletedProcess, cfg: Path, trap: socket.socket) -> None:
    assert res.returncode != 0, res.stdout + res.stderr
    assert res.stderr.splitlines() == [f"Error: {cfg}: invalid configuration: {MESSAGE}"], \
        res.stderr
    with pytest.raises(BlockingIOError):
        trap.accept()  # nobody connected to "Redis"


@pytest.mark.parametrize("command", ["controlplane", "render-nginx", "up"])
def test_an_out_of_range_number_is_refused_in_one_line(workdir: Path, trap: socket.socket,
                                                      command: str) -> None:
    cfg = _bad_config(workdir, trap)
    extra = {"controlplane": [],
             "render-nginx": ["--out", str(workdir / "out"), "--prefix", str(workdir / "run")],
             "up": ["--workdir", str(workdir / "up")]}[command]
    res = _run([command, "--config", str(cfg), *extra])
    _assert_refused(res, cfg, trap)
    assert not (workdir / "out").exists() and not (workdir / "up").exists()
