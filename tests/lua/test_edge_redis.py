"""The edge's RESP client (lua/infergate/redis/client.lua) against a real redis-server, run
inside a real nginx (cosockets exist only there): URL parsing, AUTH + SELECT,
pipelining, error replies, nil replies, keepalive reuse, refused connections and
read timeouts."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import requests

from controlplane import paths, procs
from controlplane.edge.render import default_modules_dir, start_nginx
from support.stack import LuaError, lua_eval


@pytest.fixture
def lua_runner(workdir: Path) -> Iterator[Callable[[str], object]]:
    """An nginx whose /run?case=NAME runs workdir/cases/NAME.lua (a function body that
    returns a value) in the content phase and answers its JSON."""
    cases = workdir / "cases"
    cases.mkdir()
    cases.chmod(0o755)
    (workdir / "logs").mkdir(exist_ok=True)
    port = procs.free_port()
    mods = default_modules_dir()
    conf = workdir / "runner.conf"
    conf.write_text(f"""
load_module {mods}/ndk_http_module.so;
load_module {mods}/ngx_http_lua_module.so;
worker_processes 1;
pid {workdir}/runner.pid;
error_log {workdir}/logs/error.log warn;
events {{}}
http {{
    access_log off;
    client_body_temp_path {workdir}/cbt;
    lua_package_path "{paths.lua_dir()}/?.lua;;";
    lua_socket_log_errors off;
    server {{
        listen 127.0.0.1:{port};
        location = /run {{
            default_type application/json;
            content_by_lua_block {{
                local cjson = require("cjson.safe")
                local name = ngx.var.arg_case
                if not name or not name:match("^[%w_]+$") then
                    ngx.status = 400
                    return ngx.say("bad case")
                end
                local fn, err = loadfile("{cases}/" .. name .. ".lua")
                if not fn then
                    return ngx.say(cjson.encode({{ ok = false, result = err }}))
                end
                local ok, res = pcall(fn)
                ngx.say(cjson.encode({{ ok = ok, result = res }}) or
                        cjson.encode({{ ok = false, result = "not JSON-encodable" }}))
            }}
        }}
    }}
}}
""")
    m = start_nginx(conf, workdir)

    def run(code: str) -> object:
        name = "c" + uuid.uuid4().hex[:10]
        f = cases / f"{name}.lua"
        f.write_text(code)
        f.chmod(0o644)
        res = requests.get(f"http://127.0.0.1:{port}/run", params={"case": name}, timeout=15)
        res.raise_for_status()
        data = res.json()
        if not data["ok"]:
            raise LuaError(str(data["result"]))
        return data["result"]

    try:
        yield run
    finally:
        m.stop()
        log = (workdir / "logs" / "error.log").read_text(errors="replace")
        assert "[alert]" not in log and "[crit]" not in log and "writing a global" not in log, log


@pytest.fixture
def redis_auth(workdir: Path):
    """redis-server with requirepass on a free port: (port, password)."""
    port = procs.free_port()
    pw = "s3cret:with@odd/chars"
    m = procs.start_redis(workdir / "redis-auth", port)
    import redis as redis_lib

    redis_lib.Redis(port=port).config_set("requirepass", pw)
    try:
        yield port, pw
    finally:
        m.stop()


def test_auth_select_pipeline_and_replies(lua_runner, redis_auth) -> None:
    import redis as redis_lib

    port, pw = redis_auth
    enc = requests.utils.quote(pw, safe="")
    res = lua_runner(f"""
        local redis = require("infergate.redis.client")
        local conf = assert(redis.parse_url("redis://:{enc}@127.0.0.1:{port}/3"))
        local c = assert(redis.connect(conf, 1000))
        local out = {{}}
        out.set = assert(c:command("SET", "k1", "v1"))
        out.get = c:command("GET", "k1")
        out.missing = c:command("GET", "nope") == ngx.null
        local v, err = c:command("NOSUCHCMD")
        out.cmd_err = err
        out.pipe = assert(c:pipeline({{
            {{"INCR", "n"}}, {{"INCRBY", "n", 41}}, {{"HSET", "h", "f", "x"}},
            {{"LPUSH", "k1", "boom"}}, {{"HGETALL", "h"}}, {{"GET", "nope"}},
        }}))
        out.pipe[6] = out.pipe[6] == ngx.null and "NULL" or "?"
        out.binary = c:command("SET", "bin", "a\\r\\nb\\0c") and c:command("GET", "bin") == "a\\r\\nb\\0c"
        c:keepalive()
        local c2 = assert(redis.connect(conf, 1000))
        out.reused = c2.sock:getreusedtimes()
        out.still_db3 = c2:command("GET", "k1")
        c2:keepalive()
        return out
    """)
    assert res["set"] == "OK" and res["get"] == "v1" and res["missing"] is True
    assert res["cmd_err"].startswith("ERR unknown command")
    pipe = res["pipe"]
    assert pipe[0] == 1 and pipe[1] == 42 and pipe[2] == 1
    assert pipe[3]["err"].startswith("WRONGTYPE")
    assert pipe[4] == ["f", "x"] and pipe[5] == "NULL"
    assert res["binary"] is True
    assert res["reused"] >= 1 and res["still_db3"] == "v1"
    # the keys landed in db 3
    r3 = redis_lib.Redis(port=port, password=pw, db=3, decode_responses=True)
    assert r3.get("k1") == "v1" and r3.get("n") == "42"
    assert redis_lib.Redis(port=port, password=pw, db=0).get("k1") is None


def test_wrong_password_is_an_error(lua_runner, redis_auth) -> None:
    port, _ = redis_auth
    res = lua_runner(f"""
        local redis = require("infergate.redis.client")
        local c, err = redis.connect(assert(redis.parse_url("redis://:wrong@127.0.0.1:{port}/0")), 1000)
        return {{ client = c ~= nil, err = err }}
    """)
    assert res["client"] is False
    assert "AUTH" in res["err"] and ("WRONGPASS" in res["err"] or "invalid" in res["err"])


def test_refused_connection_is_an_error(lua_runner) -> None:
    port = procs.free_port()
    res = lua_runner(f"""
        local redis = require("infergate.redis.client")
        local t0 = ngx.now()
        local c, err = redis.connect(assert(redis.parse_url("redis://127.0.0.1:{port}")), 500)
        ngx.update_time()
        return {{ client = c ~= nil, err = err, took = ngx.now() - t0 }}
    """)
    assert res["client"] is False and "connection refused" in res["err"]
    assert res["took"] < 0.5


def test_read_timeout_is_bounded(lua_runner) -> None:
    """A server that accepts but never answers: the command fails after the timeout."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    try:
        t0 = time.monotonic()
        res = lua_runner(f"""
            local redis = require("infergate.redis.client")
            local c = assert(redis.connect(assert(redis.parse_url("redis://127.0.0.1:{port}")), 300))
            local v, err = c:command("GET", "x")
            local v2, err2 = c:command("GET", "x")
            return {{ v = v, err = err, err2 = err2 }}
        """)
        took = time.monotonic() - t0
    finally:
        srv.close()
    assert res.get("v") is None and "timeout" in res["err"]
    assert "closed" in res["err2"]  # a connection that failed is not reused
    assert took < 3


@pytest.mark.parametrize("url,expect", [
    ("redis://127.0.0.1:6379/0", {"host": "127.0.0.1", "port": 6379, "db": 0}),
    ("redis://localhost", {"host": "127.0.0.1", "port": 6379, "db": 0}),
    ("redis://:pw@10.0.0.5:7000/12", {"host": "10.0.0.5", "port": 7000, "db": 12, "password": "pw"}),
    ("redis://user:p%40ss@h:1/", {"host": "h", "port": 1, "db": 0, "password": "p@ss", "username": "user"}),
    ("redis://[::1]:6380/2", {"host": "::1", "port": 6380, "db": 2}),
    ("REDIS://h:2/1?timeout=3", {"host": "h", "port": 2, "db": 1}),
])
def test_parse_url(workdir: Path, url: str, expect: dict) -> None:
    got = lua_eval(workdir, f"""
            local c, err = require("infergate.redis.client").parse_url("{url}")
            if not c then error(err, 0) end
            c.pool = nil
            return c
    """)
    assert got == expect


@pytest.mark.parametrize("url,message", [
    ("", "non-empty"),
    ("127.0.0.1:6379", "redis://"),
    ("rediss+sentinel://h:1/m", "TLS"),
    ("http://h:1", "unsupported"),
    ("redis://h:99999/0", "port out of range"),
    ("redis://h:1/x", "db number"),
    ("redis:///0", "no host"),
])
def test_parse_url_rejects(workdir: Path, url: str, message: str) -> None:
    with pytest.raises(LuaError, match=message):
        lua_eval(workdir, f"""
            local c, err = require("infergate.redis.client").parse_url("{url}")
            if not c then error(err, 0) end
            return c
        """)


def test_resp_encoding(workdir: Path) -> None:
    got = lua_eval(workdir, """
            return require("infergate.redis.client")._encode({"SET", "k", 12, "a\\r\\nb"})
    """)
    assert got == "*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n12\r\n$4\r\na\r\nb\r\n"


def test_url_errors_never_show_the_password(workdir) -> None:
    from support.stack import lua_eval

    got = lua_eval(workdir, """
        local redis = require("infergate.redis.client")
        local _, err = redis.parse_url("redis://:hunter2@127.0.0.1:99999/0")
        return { err = err }
    """)
    assert "out of range" in got["err"] and "hunter2" not in got["err"]
