"""bench.realnode without building or starting anything: the cache folder, the binary
lookup with its override, llama-server's command line, and a port another process holds."""

from __future__ import annotations

import os
import signal
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from bench.realnode import MODEL_ALIAS, VERSION, BuildError, cache_dir, find_binary, server_argv
from bench.realnode import launch
from bench.realnode.__main__ import main as realnode_main
from bench.realnode.build import BINARY_ENV
from controlplane.procs import StartError


def test_cache_folder_is_outside_the_repository_and_keyed_by_version(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_dir() == tmp_path / "infergate" / "llama-server" / VERSION
    monkeypatch.delenv(BINARY_ENV, raising=False)
    assert find_binary() is None
    binary = cache_dir() / "llama-server"
    binary.parent.mkdir(parents=True)
    binary.write_text("#!/bin/sh\n")
    assert find_binary() is None  # not executable
    os.chmod(binary, 0o755)
    assert find_binary() == binary


def test_override_names_an_executable(monkeypatch, tmp_path):
    monkeypatch.setenv(BINARY_ENV, str(tmp_path / "missing"))
    with pytest.raises(BuildError, match=BINARY_ENV):
        find_binary()
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    os.chmod(exe, 0o755)
    monkeypatch.setenv(BINARY_ENV, str(exe))
    assert find_binary() == exe


def test_server_argv():
    argv = server_argv(Path("/b/llama-server"), Path("/m.gguf"), 9000, parallel=3, threads=2)
    text = " ".join(argv)
    assert argv[0] == "/b/llama-server"
    for part in ("--model /m.gguf", f"--alias {MODEL_ALIAS}", "--host 127.0.0.1",
                 "--port 9000", "--parallel 3", "--ctx-size 6144", "--threads 2",
                 "--metrics", "--slots"):
        assert part in text
    # a Jinja template with Gemma's turn markers (with Jinja on, a built-in name would be
    # taken as the whole template text)
    tmpl = argv[argv.index("--chat-template") + 1]
    assert "<start_of_turn>" in tmpl and "add_generation_prompt" in tmpl and "{%" in tmpl
    assert "--no-jinja" not in argv
    assert "--metrics" not in server_argv(Path("b"), Path("m"), 1, metrics=False)


def test_a_build_held_by_another_process_is_announced_then_waited_for(monkeypatch, tmp_path):
    """While another process holds the build lock, ensure_binary says it waits (and
    where that build logs), then takes the binary that build left."""
    import fcntl
    import threading

    from bench.realnode.build import ensure_binary

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv(BINARY_ENV, raising=False)
    folder = cache_dir()
    folder.mkdir(parents=True)
    said: list[str] = []
    announced = threading.Event()

    def say(line: str) -> None:
        said.append(line)
        announced.set()

    with open(folder / "build.lock", "w") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        waiter = threading.Thread(target=lambda: said.append(str(ensure_binary(say=say).path)))
        waiter.start()
        assert announced.wait(10), "no word while waiting for the other build"
        binary = folder / "llama-server"
        binary.write_text("#!/bin/sh\n")
        os.chmod(binary, 0o755)
    waiter.join(10)
    assert not waiter.is_alive()
    assert said[0].startswith("waiting for another process's build") and "build.log" in said[0]
    assert said[1] == str(binary)


class _Healthy(BaseHTTPRequestHandler):
    """Another server on the port that answers ``GET /health`` with 200, as a running
    llama-server does."""

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: object) -> None:
        pass


def test_a_port_in_use_is_refused_before_anything_starts(monkeypatch, capsys):
    """``serve --port P`` on a port another server holds says so and prints no ``ready``
    line: that server's ``/health`` 200 is not taken for the new llama-server's (which
    then fails to bind), and nothing is built or started."""
    def no_build(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing is built or started on a port in use")

    monkeypatch.setattr(launch, "ensure_binary", no_build)
    server = HTTPServer(("127.0.0.1", 0), _Healthy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    port = server.server_address[1]
    try:
        with pytest.raises(StartError, match="address already in use"):
            launch.RealNode(port=port).start()
        assert realnode_main(["serve", "--port", str(port)]) == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        server.shutdown()
        server.server_close()
    out = capsys.readouterr()
    assert "ready" not in out.out
    assert f"127.0.0.1:{port}: address already in use" in out.err
