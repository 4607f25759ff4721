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
    """``infergate`` when the name is on PATH; else the script beside the interpreter:
    ``.venv/bin/infergate`` from the project's folder, by its absolute path from any
    other."""
    up_mod = up

    venv_bin = tmp_path / "proj" / ".venv" / "bin"
    venv_bin.mkdir(parents=True)
    (venv_bin / "infergate").write_text("#!/bin/sh\n")
    monkeypatch.setattr(up_mod.sys, "executable", str(venv_bin / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path / "proj")
    assert up_mod.cli_name() == ".venv/bin/infergate"
    # from a folder above the project (or /) the path in full: it works pasted anywhere
    monkeypatch.chdir(tmp_path)
    assert up_mod.cli_name() == str(venv_bin / "infergate")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert up_mod.cli_name() == str(venv_bin / "infergate")
    monkeypatch.setenv("PATH", str(venv_bin))
    (venv_bin / "infergate").chmod(0o755)
    assert up_mod.cli_name() == "infergate"


def test_a_busy_metrics_port_of_the_file_is_said_and_moved(capsys) -> None:
    """``edge.metrics_listen`` names a port another process listens on: ``up`` takes a
    free one and says so in a line of its own (not only in the banner)."""
    import socket
    from types import SimpleNamespace

    from controlplane.cli.up import edge as up_edge

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        s = settings_from_dict({"edge": {"metrics_listen": f"127.0.0.1:{port}"}})
        run = SimpleNamespace(settings=s, metrics_desc="", metrics_moved=False)
        up_edge.choose_metrics_port(run)
    moved = s.edge.metrics_listen
    assert run.metrics_moved and moved != f"127.0.0.1:{port}"
    assert run.metrics_desc == f"http://{moved}/metrics"
    out = capsys.readouterr().out
    assert f"metrics port {port} is taken by another process" in out and moved in out


def test_a_metrics_port_taken_meanwhile_is_said_and_moved(tmp_path, monkeypatch, capsys) -> None:
    """The edge's metrics port, free when chosen, is taken by another process before
    nginx binds it: ``up`` says so, renders again with a new port and starts nginx on it
    (nginx is replaced by a recorder: no process runs)."""
    from types import SimpleNamespace

    from controlplane.cli.up import edge as up_edge
    from controlplane.edge import render

    tries: list[str] = []

    def fake_render(settings, out, prefix):
        tries.append(settings.edge.metrics_listen)
        return SimpleNamespace(nginx_conf=out / "nginx.conf")

    def fake_start(conf, prefix):
        if len(tries) == 1:
            raise procs.StartError("nginx: [emerg] bind() to 127.0.0.1:9145 failed "
                                   "(98: Address already in use)")
        return SimpleNamespace()

    monkeypatch.setattr(render, "render_nginx", fake_render)
    monkeypatch.setattr(render, "start_nginx", fake_start)
    s = settings_from_dict({"edge": {"metrics_listen": "127.0.0.1:9145"}})
    run = SimpleNamespace(settings=s, wd=tmp_path, edge_host="127.0.0.1", edge_port=8080,
                          stack=_Stack(), metrics_desc="", metrics_moved=False)
    up_edge.start_edge(run)
    assert len(tries) == 2 and tries[0] == "127.0.0.1:9145" and tries[1] != tries[0]
    assert run.metrics_moved and run.metrics_desc == f"http://{tries[1]}/metrics"
    out = capsys.readouterr().out
    assert "metrics port 9145 was taken by another process meanwhile" in out
    assert f"metrics on {tries[1]}" in out


def test_an_embedder_port_taken_meanwhile_is_said_and_moved(tmp_path: Path, monkeypatch,
                                                            capsys) -> None:
    """The embedder's port, free when checked, is bound by another process before the
    embedder binds it: ``up`` starts it on a free port and says so, so that its progress
    lines do not name the address it lost (the banner names the new one)."""

    class _LostPort(_Recorder):
        def wait_ready(self, fn, timeout: float) -> None:
            if len(_Recorder.started) == 1:
                raise procs.StartError("embedder exited")

        def stop(self) -> None:
            return None

        def log_tail(self, n: int) -> str:
            return "Error: cannot listen on 127.0.0.1:8090: Address already in use"

    monkeypatch.setattr(procs, "Managed", _LostPort)
    monkeypatch.setattr(procs, "port_open", lambda host, port: False)
    _Recorder.started = []
    s = settings_from_dict({"cache": {"enabled": True, "embedder_url": "http://127.0.0.1:8090"}})
    desc = up._start_embedder(s, tmp_path, _Stack())
    first, second = (st["argv"][st["argv"].index("--listen") + 1] for st in _Recorder.started)
    assert first == "127.0.0.1:8090" and second != first
    assert desc.startswith(f"http://{second} ") and s.cache.embedder_url == f"http://{second}"
    out = capsys.readouterr().out
    assert (f"the embedder's port 8090 was taken by another process meanwhile: starting it "
            f"on http://{second}") in out, out


def test_the_port_range_variable_moves_the_default_ports_into_it(monkeypatch) -> None:
    """``INFERGATE_PORT_RANGE``: the embedder's and the edge metrics' default ports come
    from the range too; ports the file names stay; without the variable the defaults
    stay; a malformed value stops ``up`` before anything starts."""
    import click

    from controlplane.cli.up import plan as up_plan

    lo = procs.free_port()
    monkeypatch.setenv(procs.PORT_RANGE_ENV, f"{lo}-{lo + 40}")
    s = settings_from_dict({})
    up_plan._defaults_in_port_range(s)
    emb = int(s.cache.embedder_url.rsplit(":", 1)[1])
    met = int(s.edge.metrics_listen.rsplit(":", 1)[1])
    assert lo <= emb <= lo + 40 and lo <= met <= lo + 40 and emb != met
    s = settings_from_dict({"edge": {"metrics_listen": "127.0.0.1:9999"},
                            "cache": {"embedder_url": "http://127.0.0.1:9998"}})
    up_plan._defaults_in_port_range(s)
    assert s.edge.metrics_listen == "127.0.0.1:9999"
    assert s.cache.embedder_url == "http://127.0.0.1:9998"
    monkeypatch.delenv(procs.PORT_RANGE_ENV)
    s = settings_from_dict({})
    up_plan._defaults_in_port_range(s)
    assert s.edge.metrics_listen == "127.0.0.1:9145"
    monkeypatch.setenv(procs.PORT_RANGE_ENV, "9000")
    with pytest.raises(click.ClickException, match="is not a port range"):
        up_plan.make_plan(None, (), "vllm", None, None, None, None, None, 1.0, False, None)
