"""``infergate up`` hands the operator's config file to the embedder it starts, so the
``[cache]`` thresholds and calibrated ``semantic_domains`` apply under ``up`` too (the
process start is replaced by a recorder: no process runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from controlplane import procs
from controlplane.cli import up
from controlplane.config import settings_from_dict


class _Recorder:
    started: list[dict] = []

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict | None = None) -> None:
        self.argv, self.env, self.log_path = argv, env or {}, log_path

    def start(self) -> "_Recorder":
        _Recorder.started.append({"argv": self.argv, "env": self.env})
        return self

    def wait_ready(self, fn, timeout: float) -> None:
        return None


class _Stack:
    def add(self, m):
        return m


@pytest.mark.parametrize("with_config", [True, False])
def test_embedder_gets_the_config_file(tmp_path: Path, monkeypatch, with_config: bool) -> None:
    cfg = tmp_path / "infergate.toml"
    cfg.write_text("[cache]\nenabled = true\n", encoding="utf-8")
    monkeypatch.setattr(procs, "Managed", _Recorder)
    monkeypatch.setattr(procs, "port_open", lambda host, port: False)
    monkeypatch.setenv("INFERGATE_CONFIG", "/elsewhere/other.toml")
    _Recorder.started = []
    s = settings_from_dict({"cache": {"enabled": True}})
    desc = up._start_embedder(s, tmp_path, _Stack(),
                              config_path=str(cfg) if with_config else None)
    assert "model" in desc
    env = _Recorder.started[0]["env"]
    if with_config:
        assert env["INFERGATE_CONFIG"] == str(cfg.resolve())
    else:
        assert "INFERGATE_CONFIG" not in env
    assert env["INFERGATE_REDIS_URL"] == s.redis.url


def test_the_banner_names_a_runnable_cli(tmp_path, monkeypatch) -> None:
    """``infergate`` when the name is on PATH; else the script beside the interpreter, as
    the user can type it from where up was started."""
    up_mod = up

    venv_bin = tmp_path / "proj" / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "infergate").write_text("#!/bin/sh\n")
    monkeypatch.setattr(up_mod.sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path / "proj")
    assert up_mod.cli_name() == ".venv/bin/infergate"
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert up_mod.cli_name() == str(venv_bin / "infergate")
    monkeypatch.setenv("PATH", str(venv_bin))
    (venv_bin / "infergate").chmod(0o755)
    assert up_mod.cli_name() == "infergate"
