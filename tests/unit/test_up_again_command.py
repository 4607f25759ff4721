"""The command `up` prints at its stop to start on its state again: the options as
typed, the Redis password hidden, the config file by its absolute path (pasted from any
folder), the work folder named."""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from controlplane.cli.up.banner import _again_command


def test_again_command_names_the_config_by_its_absolute_path(monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", ["infergate", "up", "--config", "../ports.toml",
                                      "--redis-url", "redis://:secret@127.0.0.1:7000/0",
                                      "--listen", "127.0.0.1:18480", "--workdir", "old"])
    words = shlex.split(_again_command(Path("/tmp/wd")))
    assert words[words.index("--config") + 1] == os.path.abspath("../ports.toml")
    assert "secret" not in " ".join(words)
    assert words[-2:] == ["--workdir", "/tmp/wd"] and "old" not in words
    monkeypatch.setattr(sys, "argv", ["infergate", "up", "--config=cfg.toml"])
    assert f"--config={os.path.abspath('cfg.toml')}" in shlex.split(_again_command(Path("/w")))
