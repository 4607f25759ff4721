"""The edge's Redis layer (lua/infergate/redis/client.lua and pool.lua) against a real
redis-server, run inside a real nginx (cosockets exist only there): URL parsing, AUTH +
SELECT, pipelining, error replies (false, err) against transport errors (nil, err),
nil replies, keepalive reuse, refused connections and read timeouts, the shared
back-off after a failure, and separate pools per Redis URL."""

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


def _start_runner(workdir: Path, *, workers: int = 1):
    """An nginx whose /run?case=NAME runs workdir/cases/NAME.lua (a function body that
    returns a value) in the content phase and answers its JSON. ``workers`` nginx workers
    share the listening port (reuseport: new connections spread over them) and the shared
    dict infergate_snapshot. No edge options are loaded: the Redis layer runs on its
    defaults (back-off 1 s). Returns (run, stop)."""
    cases = workdir / "cases"
    cases.mkdir(exist_ok=True)
    cases.chmod(0o755)
    (workdir / "logs").mkdir(exist_ok=True)
    port = procs.free_port()
    mods = default_modules_dir()
    conf = workdir / "runner.conf"
    conf.write_text(f"""
load_module {mods}/ndk_http_module.so;
load_module {mods}/ngx_http_lua_module.so;
worker_processes {workers};
pid {workdir}/runner.pid;
error_log {workdir}/logs/error.log warn;
events {{}}
http {{
    access_log off;
    client_body_temp_path {workdir}/cbt;
    lua_package_path "{paths.lua_dir()}/?.lua;;";
    lua_socket_log_errors off;
    lua_shared_dict infergate_snapshot 1m;
    server {{
        listen 127.0.0.1:{port} reuseport;
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

    def stop() -> None:
        m.stop()
        log = (workdir / "logs" / "error.log").read_text(errors="replace")
        assert "[alert]" not in log and "[crit]" not in log and "writing a global" not in log, log

    return run, stop


@pytest.fixture
def lua_runner(workdir: Path) -> Iterator[Callable[[str], object]]:
    """One worker, default options: see :func:`_start_runner`."""
    run, stop = _start_runner(workdir)
    try:
        yield run
    finally:
        stop()


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


@pytest.mark.integration  # starts a serving nginx and redis-server
def test_auth_select_pipeline_and_replies(lua_runner, redis_auth) -> None:
    import redis as redis_lib

    port, pw = redis_auth
    enc = requests.utils.quote(pw, safe="")
    res = lua_runner(f"""
        local redis = require("infergate.redis.client")
        local pool = require("infergate.redis.pool")
        local url = "redis://:{enc}@127.0.0.1:{port}/3"
        local c = assert(pool.connect(url, 1000))
        local out = {{}}
        out.set = assert(c:command("SET", "k1", "v1"))
        out.get = c:command("GET", "k1")
        out.missing = c:command("GET", "nope") == ngx.null
        local v, err = c:command("NOSUCHCMD")
        out.cmd_v, out.cmd_err = v, err
        local pipe = assert(c:pipeline({{
            {{"INCR", "n"}}, {{"INCRBY", "n", 41}}, {{"HSET", "h", "f", "x"}},
            {{"LPUSH", "k1", "boom"}}, {{"HGETALL", "h"}}, {{"GET", "nope"}},
        }}))
        out.pipe_err = redis.error_of(pipe[4])
        out.pipe_err_of_value = redis.error_of(pipe[5]) == nil
        pipe[6] = pipe[6] == ngx.null and "NULL" or "?"
        out.pipe = pipe
        out.binary = c:command("SET", "bin", "a\\r\\nb\\0c") and c:command("GET", "bin") == "a\\r\\nb\\0c"
        out.first_reused = c:reused()
        pool.release(c)
        local c2 = assert(pool.connect(url, 1000))
        out.reused = c2:reused()
        out.still_db3 = c2:command("GET", "k1")
        pool.release(c2)
        out.usable = pool.usable(url)
        return out
    """)
    assert res["set"] == "OK" and res["get"] == "v1" and res["missing"] is True
    # an error reply is false, err (not nil): the connection stays usable
    assert res["cmd_v"] is False and res["cmd_err"].startswith("ERR unknown command")
    pipe = res["pipe"]
    assert pipe[0] == 1 and pipe[1] == 42 and pipe[2] == 1
    assert pipe[3] == [False, res["pipe_err"]] and res["pipe_err"].startswith("WRONGTYPE")
    assert res["pipe_err_of_value"] is True
    assert pipe[4] == ["f", "x"] and pipe[5] == "NULL"
    assert res["binary"] is True
    assert res["first_reused"] == 0 and res["reused"] >= 1 and res["still_db3"] == "v1"
    assert res["usable"] is True  # error replies do not back off
    # the keys landed in db 3
    r3 = redis_lib.Redis(port=port, password=pw, db=3, decode_responses=True)
    assert r3.get("k1") == "v1" and r3.get("n") == "42"
    assert redis_lib.Redis(port=port, password=pw, db=0).get("k1") is None


@pytest.mark.integration  # starts a serving nginx and redis-server
def test_error_reply_is_false_and_keeps_the_connection(lua_runner, redis_server) -> None:
    """WRONGTYPE through command, pool.run and a pipeline: false / {false, err}, no back-off,
    and the same connection goes on serving."""
    redis_server.client().rpush("alist", "x")
    res = lua_runner(f"""
        local redis = require("infergate.redis.client")
        local pool = require("infergate.redis.pool")
        local url = "{redis_server.url}"
        local out = {{}}
        local v, err = pool.run(function(c) return c:command("GET", "alist") end, url)
        out.run_v, out.run_err = v, err
        local c = assert(pool.connect(url))
        v, err = c:command("HGET", "alist", "f")
        out.cmd_v, out.cmd_err = v, err
        out.after = c:command("LLEN", "alist")
        out.closed = c:closed()
        pool.release(c)
        out.usable = pool.usable(url)
        return out
    """)
    assert res["run_v"] is False and res["run_err"].startswith("WRONGTYPE")
    assert res["cmd_v"] is False and res["cmd_err"].startswith("WRONGTYPE")
    assert res["after"] == 1 and res["closed"] is False and res["usable"] is True


@pytest.mark.integration  # starts a serving nginx and redis-server
def test_wrong_password_is_an_error(lua_runner, redis_auth) -> None:
    port, _ = redis_auth
    res = lua_runner(f"""
        local pool = require("infergate.redis.pool")
        local c, err = pool.connect("redis://:wrong@127.0.0.1:{port}/0", 1000)
        return {{ client = c ~= nil, err = err }}
    """)
    assert res["client"] is False
    assert "AUTH" in res["err"] and ("WRONGPASS" in res["err"] or "invalid" in res["err"])


@pytest.mark.integration  # starts a serving nginx
def test_refused_connection_is_an_error(lua_runner) -> None:
    port = procs.free_port()
    res = lua_runner(f"""
        local pool = require("infergate.redis.pool")
        local t0 = ngx.now()
        local c, err = pool.connect("redis://127.0.0.1:{port}", 500)
        local v, rerr = pool.run(function(c) return c:command("PING") end, "redis://127.0.0.1:{port}/1")
        ngx.update_time()
        return {{ client = c ~= nil, err = err, run_v = v == nil, run_err = rerr,
                  took = ngx.now() - t0 }}
    """)
    assert res["client"] is False and "connection refused" in res["err"]
    assert res["run_v"] is True and "connection refused" in res["run_err"]
    assert res["took"] < 0.5


@pytest.mark.integration  # starts a serving nginx
def test_read_timeout_is_bounded(lua_runner) -> None:
    """A server that accepts but never answers: the command fails with nil, err after the
    timeout, the connection is closed, and the target is backed off."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    try:
        t0 = time.monotonic()
        res = lua_runner(f"""
            local pool = require("infergate.redis.pool")
            local url = "redis://127.0.0.1:{port}"
            local c = assert(pool.connect(url, 300))
            local v, err = c:command("GET", "x")
            local v2, err2 = c:command("GET", "x")
            local closed = c:closed()
            pool.release(c)
            local t1 = ngx.now()
            local c3, err3 = pool.connect(url, 300)
            ngx.update_time()
            return {{ v = v == nil, err = err, v2 = v2 == nil, err2 = err2, closed = closed,
                      c3 = c3 ~= nil, err3 = err3, took3 = ngx.now() - t1 }}
        """)
        took = time.monotonic() - t0
    finally:
        srv.close()
    assert res["v"] is True and "timeout" in res["err"]
    assert res["v2"] is True and "closed" in res["err2"]  # a connection that failed is not reused
    assert res["closed"] is True
    # the timeout started the back-off: the next connect does not wait on the silent server
    assert res["c3"] is False and "backing off" in res["err3"] and "timeout" in res["err3"]
    assert res["took3"] < 0.1
    assert took < 3


@pytest.mark.integration  # starts a serving nginx and two redis-servers
def test_backoff_is_shared_by_the_workers_and_ends(workdir: Path) -> None:
    """One refused connect backs the target off (limits.redis_retry_s, 1 s by default) in
    every worker: calls return at once with the back-off error, even once Redis listens
    again, and go through after it; another Redis URL is not affected."""
    backoff = 1.0
    run, stop = _start_runner(workdir, workers=2)
    port = procs.free_port()
    other_port = procs.free_port()
    other = procs.start_redis(workdir / "redis-other", other_port)
    server = None
    try:
        url = f"redis://127.0.0.1:{port}/0"
        probe = f"""
            local pool = require("infergate.redis.pool")
            local t0 = ngx.now()
            local v, err = pool.run(function(c) return c:command("PING") end, "{url}")
            local ov, oerr = pool.run(function(c) return c:command("PING") end,
                                      "redis://127.0.0.1:{other_port}/0")
            ngx.update_time()
            return {{ worker = ngx.worker.id(), v = v, err = err, took = ngx.now() - t0,
                      other = ov, other_err = oerr,
                      left = pool.backoff_left("{url}"), backoff_s = pool.backoff_s() }}
        """
        t_fail = time.monotonic()
        first = run(probe)
        assert first.get("v") is None and "connection refused" in first["err"], first
        assert first["backoff_s"] == backoff
        assert 0 < first["left"] <= backoff
        # the other worker sees the same back-off (connections spread over the workers)
        seen = {first["worker"]: first}
        for _ in range(60):
            r = run(probe)
            seen.setdefault(r["worker"], r)
            assert r.get("v") is None and "backing off" in r["err"], r
            assert "connection refused" in r["err"] and r["took"] < 0.05, r
            assert r["other"] == "PONG", r  # another URL is not backed off
            if len(seen) == 2:
                break
        assert len(seen) == 2, "requests never reached the second worker"
        # Redis answers again, but the back-off still holds: no attempt is made
        server = procs.start_redis(workdir / "redis-back", port)
        if time.monotonic() - t_fail < backoff - 0.3:
            r = run(probe)
            assert r.get("v") is None and "backing off" in r["err"], r
        # after the back-off calls go through, in every worker
        time.sleep(max(0.0, backoff - (time.monotonic() - t_fail)) + 0.2)
        ok: dict = {}
        for _ in range(60):
            r = run(probe)
            assert r["v"] == "PONG", r
            ok[r["worker"]] = r
            if len(ok) == 2:
                break
        assert len(ok) == 2
    finally:
        stop()
        other.stop()
        if server:
            server.stop()


@pytest.mark.integration  # starts a serving nginx and redis-server
def test_two_urls_do_not_share_a_pool(lua_runner, redis_server) -> None:
    """Two databases of one server (and the same one with other credentials) get their own
    keepalive pools: a pooled connection SELECTed to db 1 never serves db 2."""
    base = f"redis://127.0.0.1:{redis_server.port}"
    res = lua_runner(f"""
        local pool = require("infergate.redis.pool")
        local u1, u2, u3 = "{base}/1", "{base}/2", "redis://user1:pw@127.0.0.1:{redis_server.port}/1"
        local out = {{}}
        local c = assert(pool.connect(u1))
        assert(c:command("SET", "k", "one"))
        pool.release(c)
        c = assert(pool.connect(u2))
        out.db2_new = c:reused() == 0
        out.db2_get = c:command("GET", "k") == ngx.null
        assert(c:command("SET", "k", "two"))
        pool.release(c)
        c = assert(pool.connect(u1))
        out.db1_reused = c:reused()
        out.db1_get = c:command("GET", "k")
        pool.release(c)
        c = assert(pool.connect(u2))
        out.db2_reused = c:reused()
        out.db2_get2 = c:command("GET", "k")
        pool.release(c)
        out.names = {{ pool.pool_name(pool.conf(u1)), pool.pool_name(pool.conf(u2)),
                       pool.pool_name(pool.conf(u3)) }}
        out.same = pool.pool_name(pool.conf(u1)) == pool.pool_name(pool.conf("{base}/1"))
        return out
    """)
    assert res["db2_new"] is True and res["db2_get"] is True
    assert res["db1_reused"] >= 1 and res["db1_get"] == "one"
    assert res["db2_reused"] >= 1 and res["db2_get2"] == "two"
    assert len(set(res["names"])) == 3 and res["same"] is True
    # two connections stayed open, one per database
    clients = redis_server.client().client_list()
    assert sorted(int(c["db"]) for c in clients if c["name"] == "" and c["cmd"] != "client|list") == [1, 2]


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
            return c
    """)
    assert got == expect  # nothing else: the pool module names the connection pools


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
