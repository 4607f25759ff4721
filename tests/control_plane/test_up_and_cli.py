"""`infergate up` and the CLI on a shared host: the registry claim on a shared Redis (real
redis-server), the banner's example model, the actor name of CLI changes."""

from __future__ import annotations

import subprocess

import click
import pytest

from controlplane.cli.up import _owner_doc, claim_registry
from controlplane.cli.up.owner import OWNER_KEEP_S, OWNER_TTL_S
from controlplane.redisdb import keynames


def test_a_second_stack_is_refused_and_told_what_pointed_it_there(r) -> None:
    """The refusal names the stack that owns the registry and what to leave out: the
    banner's ``export INFERGATE_REDIS_URL=...`` line is the usual way into this trap."""
    first = _owner_doc("up-first")
    claim_registry(r, first, False, "127.0.0.1:1/0")
    assert r.get(keynames.STACK_OWNER) == first
    with pytest.raises(click.ClickException) as exc:
        claim_registry(r, _owner_doc("up-second"), False, "127.0.0.1:1/0",
                       "INFERGATE_REDIS_URL (unset it: the banner's export line sets it)")
    msg = exc.value.message
    assert "belongs to another running infergate up: instance up-first" in msg
    assert "leave out INFERGATE_REDIS_URL (unset it" in msg and "--take-over" in msg
    assert r.get(keynames.STACK_OWNER) == first          # the owner keeps its claim
    claim_registry(r, first, False, "127.0.0.1:1/0")      # and may renew it
    claim_registry(r, _owner_doc("up-third"), True, "127.0.0.1:1/0")
    assert "up-third" in r.get(keynames.STACK_OWNER)      # --take-over replaces it


def test_the_banner_example_names_a_model_the_nodes_serve() -> None:
    """`up --node URL`: the curl line of the banner uses a configured model, else the first
    model the nodes list on GET /v1/models (a node that does not answer is skipped)."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from controlplane import procs
    from controlplane.cli.up import _first_model
    from controlplane.config import NodeSettings

    class Models(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = json.dumps({"object": "list", "data": [{"id": "qwen-7b", "object": "model"}]})
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        down = NodeSettings(name="down", url=f"http://127.0.0.1:{procs.free_port()}", kind="vllm")
        up = NodeSettings(name="up", url=f"http://127.0.0.1:{srv.server_address[1]}/", kind="vllm")
        assert _first_model([down, up], timeout=1) == "qwen-7b"
        assert _first_model([down], timeout=1) is None
        # never asked: a kind "openai" node (llama-cpp-python's /v1/models can end a
        # running stream); a configured list answers without asking
        openai = NodeSettings(name="o", url=up.url, kind="openai")
        assert _first_model([openai], timeout=1) is None
        listed = NodeSettings(name="l", url=up.url, kind="openai", models=["mine"])
        assert _first_model([listed, up], timeout=1) == "mine"
    finally:
        srv.shutdown()
        srv.server_close()


def test_cli_actor_is_always_writable(monkeypatch) -> None:
    """A login name that is not UTF-8 (LOGNAME of other bytes: surrogates in Python) is
    shown with '?' for those characters, never a traceback half-way through a change."""
    from controlplane.cli.common import actor

    monkeypatch.setenv("LOGNAME", "ops\udcff\udcfe")
    assert actor() == "cli:ops??"
    actor().encode("utf-8")
    monkeypatch.setenv("LOGNAME", "jos\u00e9")
    assert actor() == "cli:jos\u00e9"


def test_a_claim_left_by_a_killed_up_of_this_host_is_taken_over(r) -> None:
    """An ``up`` killed outright (SIGKILL) leaves its claim until it goes stale; a new
    ``up`` on the same host sees that the pid in it is gone and takes the registry over at
    once. A fresh claim of a live process, or of another host, is still refused."""
    import json
    import socket
    import subprocess
    import sys

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    gone = json.dumps({"instance_id": "up-killed", "pid": dead.pid,
                       "host": socket.gethostname(), "since": 0})
    r.set(keynames.STACK_OWNER, gone, ex=OWNER_KEEP_S)
    mine = _owner_doc("up-next")
    claim_registry(r, mine, False, "127.0.0.1:1/0")
    assert r.get(keynames.STACK_OWNER) == mine
    elsewhere = json.dumps({"instance_id": "up-far", "pid": dead.pid, "host": "another-host",
                            "since": 0})
    r.set(keynames.STACK_OWNER, elsewhere, ex=OWNER_KEEP_S)
    with pytest.raises(click.ClickException, match="up-far"):
        claim_registry(r, mine, False, "127.0.0.1:1/0")
    live = json.dumps({"instance_id": "up-live", "pid": 1, "host": socket.gethostname(),
                       "since": 0})
    r.set(keynames.STACK_OWNER, live, ex=OWNER_KEEP_S)
    with pytest.raises(click.ClickException, match="up-live"):
        claim_registry(r, mine, False, "127.0.0.1:1/0")


def test_a_stale_claim_is_free_unless_its_up_still_runs_here(r) -> None:
    """A claim not refreshed for OWNER_TTL_S: free when its ``up`` ran on another host or
    its pid is now another program's; kept, with the refusal saying how to resume it, when
    its ``up`` still exists on this host (stopped with SIGSTOP, while the stack it started
    serves on: another ``up`` must not repoint that stack's nodes)."""
    import json
    import os
    import signal
    import socket
    import subprocess
    import sys

    stale = OWNER_KEEP_S - OWNER_TTL_S - 5
    mine = _owner_doc("up-next")
    far = json.dumps({"instance_id": "up-far", "pid": 12345, "host": "another-host", "since": 0})
    r.set(keynames.STACK_OWNER, far, ex=stale)
    claim_registry(r, mine, False, "127.0.0.1:1/0")
    assert r.get(keynames.STACK_OWNER) == mine
    assert r.ttl(keynames.STACK_OWNER) > OWNER_KEEP_S - 5
    other_program = json.dumps({"instance_id": "up-reused", "pid": 1,
                                "host": socket.gethostname(), "since": 0})
    r.set(keynames.STACK_OWNER, other_program, ex=stale)
    claim_registry(r, mine, False, "127.0.0.1:1/0")
    assert r.get(keynames.STACK_OWNER) == mine
    frozen = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)",
                               "infergate-up-test"])
    try:
        os.kill(frozen.pid, signal.SIGSTOP)
        doc = json.dumps({"instance_id": "up-frozen", "pid": frozen.pid,
                          "host": socket.gethostname(), "since": 0})
        r.set(keynames.STACK_OWNER, doc, ex=stale)
        with pytest.raises(click.ClickException) as exc:
            claim_registry(r, mine, False, "127.0.0.1:1/0")
        assert "up-frozen" in exc.value.message
        assert f"kill -CONT {frozen.pid}" in exc.value.message
        assert r.get(keynames.STACK_OWNER) == doc       # kept, not refreshed by the refusal
        assert r.ttl(keynames.STACK_OWNER) <= stale
        claim_registry(r, mine, True, "127.0.0.1:1/0")  # --take-over still replaces it
        assert r.get(keynames.STACK_OWNER) == mine
    finally:
        frozen.kill()
        frozen.wait()


def test_a_work_folder_is_held_by_one_up(tmp_path) -> None:
    """A second ``up`` on a folder another one holds stops at once, naming its pid (before
    it writes anything there); the lock goes with the process that held it."""
    import os
    import socket

    from controlplane.cli.up import _lock_workdir

    held = _lock_workdir(tmp_path)
    with pytest.raises(click.ClickException) as exc:
        _lock_workdir(tmp_path)
    assert f"in use by another infergate up (pid {os.getpid()})" in exc.value.message
    # `up` on that folder says so before it finds the ports of that up's stack in use
    from click.testing import CliRunner

    from controlplane.cli.up import up_cmd

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        edge = f"127.0.0.1:{taken.getsockname()[1]}"
        res = CliRunner().invoke(up_cmd, ["--workdir", str(tmp_path), "--listen", edge])
    assert res.exit_code != 0
    assert f"in use by another infergate up (pid {os.getpid()})" in res.output, res.output
    assert "already in use" not in res.output
    held.close()  # the holder ends
    _lock_workdir(tmp_path).close()


def test_up_refuses_bad_arguments_before_it_makes_a_folder(tmp_path, monkeypatch) -> None:
    """A bad Redis URL, --node URL or --time-scale is refused with one line, before a work
    folder is made or a part started; busy edge and admin addresses are named together."""
    import os
    import socket
    import tempfile

    from click.testing import CliRunner

    from controlplane import procs
    from controlplane.cli.up import up_cmd

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("INFERGATE_REDIS_URL", raising=False)
    monkeypatch.delenv(procs.INSTANCE_ENV, raising=False)      # up sets it; restored after
    runner = CliRunner()
    cases = {
        ("--redis-url", "http://127.0.0.1:6379"): "invalid Redis URL http://127.0.0.1:6379: "
                                                  "unsupported redis url scheme 'http'",
        ("--node", "127.0.0.1:8000"): "--node 127.0.0.1:8000: url: node url must be http://",
        ("--time-scale", "0"): "Invalid value for '--time-scale'",
    }
    for args, expected in cases.items():
        res = runner.invoke(up_cmd, list(args))
        assert res.exit_code != 0 and expected in res.output, res.output
        assert "Traceback" not in res.output and "pydantic" not in res.output
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        a.listen()
        b.listen()
        edge, admin = (f"127.0.0.1:{s.getsockname()[1]}" for s in (a, b))
        res = runner.invoke(up_cmd, ["--listen", edge, "--admin-listen", admin])
    assert res.exit_code != 0
    assert f"edge address {edge} is already in use by pid {os.getpid()} (" in res.output
    assert f"admin address {admin} is already in use" in res.output
    assert list(tmp_path.iterdir()) == []                 # no folder made by any of them


def test_up_names_a_redis_that_refuses_its_password(tmp_path) -> None:
    """A Redis that answers but refuses the URL's password is a Redis: the error says so
    (not "taken by something that is not Redis"), and none is started in its place."""
    from controlplane import procs
    from controlplane.cli.up.store import _ensure_redis
    from controlplane.config import Settings

    m, port = procs.start_redis_free_port(tmp_path / "redis", password="right-one")
    try:
        for url in (f"redis://:wrong-one@127.0.0.1:{port}/0", f"redis://127.0.0.1:{port}/0"):
            s = Settings()
            s.redis.url = url
            stack = procs.ProcessSet()
            with pytest.raises(click.ClickException) as exc:
                _ensure_redis(s, tmp_path, stack)
            assert "refuses this stack" in exc.value.message and "password" in exc.value.message
            assert "wrong-one" not in exc.value.message           # the URL shown redacted
            assert stack.items == []
        s = Settings()
        s.redis.url = f"redis://:right-one@127.0.0.1:{port}/0"
        assert "already running" in _ensure_redis(s, tmp_path, procs.ProcessSet())
    finally:
        m.stop()


def test_a_named_loopback_redis_that_does_not_answer_is_started_there(tmp_path) -> None:
    """A banner's export line left in the shell after its stack stopped: `up` starts a
    redis-server on that URL's port with its password, its files in the new work folder
    (so it starts empty), and the banner says it started it."""
    import redis as redis_lib

    from controlplane import procs
    from controlplane.cli.up.store import _ensure_redis
    from controlplane.config import Settings

    port = procs.free_port()
    s = Settings()
    s.redis.url = f"redis://default:left-in-shell@127.0.0.1:{port}/0"
    stack = procs.ProcessSet()
    try:
        said = _ensure_redis(s, tmp_path, stack)
        assert "local redis-server started" in said and "password from the URL" in said
        assert "left-in-shell" not in said                     # shown redacted
        assert str(tmp_path / "redis") in said
        assert (tmp_path / "redis").is_dir()
        r = redis_lib.Redis.from_url(s.redis.url)
        assert r.dbsize() == 0
        with pytest.raises(redis_lib.AuthenticationError):
            redis_lib.Redis(host="127.0.0.1", port=port, password="other").ping()
    finally:
        stack.stop_all()


def test_a_restart_on_the_same_folder_keeps_its_redis_url(tmp_path) -> None:
    """`up` again on a folder: its own Redis comes back on the port and with the password
    of the earlier run (the banner's `export INFERGATE_REDIS_URL=...` stays good), unless
    that port is taken; a URL the folder's Redis never had is not taken over."""
    import socket

    from controlplane import procs
    from controlplane.cli.up.store import _earlier_own_redis, _own_redis
    from controlplane.config import Settings

    first = Settings()
    stack = procs.ProcessSet()
    _own_redis(first, tmp_path, stack)
    (tmp_path / "infergate.toml").write_text(f'[redis]\nurl = "{first.redis.url}"\n')
    stack.stop_all()
    again = Settings()
    stack = procs.ProcessSet()
    try:
        _own_redis(again, tmp_path, stack)
        assert again.redis.url == first.redis.url
        # the banner's URL works in redis-cli too (7.0 refuses an empty user name)
        cli = subprocess.run(["redis-cli", "-u", again.redis.url, "ping"], capture_output=True,
                             text=True, timeout=10)
        assert cli.stdout.strip() == "PONG", cli.stdout + cli.stderr
    finally:
        stack.stop_all()
    port = _earlier_own_redis(tmp_path)[0]
    with socket.socket() as s:                            # the port taken: another one
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
        s.listen()
        other = Settings()
        stack = procs.ProcessSet()
        try:
            _own_redis(other, tmp_path, stack)
            assert other.redis.url != first.redis.url and f":{port}/" not in other.redis.url
        finally:
            stack.stop_all()
    (tmp_path / "infergate.toml").write_text('[redis]\nurl = "redis://:guess@127.0.0.1:6390/0"\n')
    assert _earlier_own_redis(tmp_path) is None


def test_redis_on_a_free_port_moves_on_when_the_port_was_taken(tmp_path, monkeypatch) -> None:
    """A port chosen free and bound by another process before redis-server starts: Redis
    is started again on a new port; a failure of another kind is not retried."""
    import socket

    from controlplane import procs

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    first = taken.getsockname()[1]
    real = procs.free_port
    ports = iter([first])
    monkeypatch.setattr(procs, "free_port", lambda host="127.0.0.1": next(ports, None) or real(host))
    try:
        m, port = procs.start_redis_free_port(tmp_path / "redis")
        try:
            assert port != first and procs.port_open("127.0.0.1", port)
        finally:
            m.stop()
        tries: list[int] = []

        def broken(workdir, port, **kw):
            tries.append(port)
            raise procs.StartError("redis exited early:\nbad option")

        monkeypatch.setattr(procs, "start_redis", broken)
        with pytest.raises(procs.StartError, match="bad option"):
            procs.start_redis_free_port(tmp_path / "redis2")
        assert len(tries) == 1
    finally:
        taken.close()


def test_up_help_says_where_its_redis_comes_from() -> None:
    """`up --help` names what picks the Redis when --redis-url is not given: the
    environment, the file, else a redis-server of the stack's own (not just redis.url,
    whose default 127.0.0.1:6379 `up` never joins)."""
    from click.testing import CliRunner

    from controlplane.cli.up import up_cmd

    text = " ".join(CliRunner().invoke(up_cmd, ["--help"]).output.split())
    assert "INFERGATE_REDIS_URL" in text
    assert "this stack's own redis-server on a free port" in text
