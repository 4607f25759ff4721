"""The command `up` prints at its stop to start on its state again: the options as
typed, a Redis URL with a password named by the variable the banner exports (pasted back
masked, it started the stack's Redis with the password ``***``), the config file by its
absolute path (pasted from any folder), the work folder named."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from controlplane.cli.up.banner import REDIS_URL_FROM_ENV, _again_command


def test_again_command_names_the_config_by_its_absolute_path(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["infergate", "up", "--config", "../ports.toml",
                                      "--redis-url", "redis://:secret@127.0.0.1:7000/0",
                                      "--listen", "127.0.0.1:18480", "--workdir", "old"])
    line = _again_command(Path("/tmp/wd"))
    words = shlex.split(line)
    assert words[words.index("--config") + 1] == os.path.abspath("../ports.toml")
    assert "secret" not in line and "***" not in line
    assert '--redis-url "$INFERGATE_REDIS_URL"' in line   # expanded by the shell it is pasted in
    assert words[-2:] == ["--workdir", "/tmp/wd"] and "old" not in words
    monkeypatch.setattr(sys, "argv", ["infergate", "up", "--config=cfg.toml"])
    assert f"--config={os.path.abspath('cfg.toml')}" in shlex.split(_again_command(Path("/w")))


def test_again_command_runs_as_printed_in_a_shell(monkeypatch) -> None:
    """Pasted into a shell that exported the banner's URL, the command gets the URL with
    its password (the shell's expansion of a double-quoted variable: one word, as is); a
    URL without a password is printed as typed."""
    url = "redis://default:s3cr%2Ft@127.0.0.1:7000/0"
    monkeypatch.setattr(sys, "argv", ["infergate", "up", f"--redis-url={url}", "--listen",
                                      "127.0.0.1:18480"])
    line = _again_command(Path("/tmp/w d"))
    assert line.count(REDIS_URL_FROM_ENV) == 1
    words = shlex.split(line.replace(REDIS_URL_FROM_ENV, shlex.quote(url)))
    assert words[1:] == ["up", "--redis-url", url, "--listen", "127.0.0.1:18480",
                         "--workdir", "/tmp/w d"]
    monkeypatch.setattr(sys, "argv", ["infergate", "up", "--redis-url",
                                      "redis://127.0.0.1:7000/0"])
    assert "--redis-url redis://127.0.0.1:7000/0 " in _again_command(Path("/w"))
