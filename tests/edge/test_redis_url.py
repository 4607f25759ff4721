"""Every form of ``redis.url`` on both sides: the Python parser and clients
(controlplane.redisdb.url, controlplane.redisdb.conn) and the edge's Lua client
(lua/infergate/redis/client.lua) inside a real nginx, against real redis-servers: a password
and a database number, TLS (``rediss://``) with a CA and a client certificate made with
openssl here, and the failures: wrong CA, no client certificate, bad URLs.

Sentinel has its own file (test_redis_url_sentinel.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import redis
import requests

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.config import ConfigError, settings_from_dict
from controlplane.edge.options import lua_string, option_spec
from controlplane.redisdb.conn import make_redis
from controlplane.redisdb.url import RedisTarget, RedisURLError, parse_redis_url
from support.stack import edge_settings, lua_eval, write_snapshot

# ----------------------------------------------------------------------------- parsing

GOOD = [
    ("redis://127.0.0.1:6379/0", RedisTarget("direct", host="127.0.0.1", port=6379)),
    ("redis://localhost", RedisTarget("direct", host="localhost", port=6379)),
    ("redis://:s%40cret@10.0.0.5:7000/12",
     RedisTarget("direct", host="10.0.0.5", port=7000, db=12, password="s@cret")),
    ("redis://user:pw@h:1/", RedisTarget("direct", host="h", port=1, username="user", password="pw")),
    ("redis://[::1]:6380/2", RedisTarget("direct", host="::1", port=6380, db=2)),
    ("REDIS://h:2/1?timeout=3", RedisTarget("direct", host="h", port=2, db=1)),
    ("rediss://cache.internal:6380/4",
     RedisTarget("direct", tls=True, host="cache.internal", port=6380, db=4)),
    ("redis+sentinel://10.0.0.1,10.0.0.2:26380/mymaster",
     RedisTarget("sentinel", sentinels=(("10.0.0.1", 26379), ("10.0.0.2", 26380)),
                 service="mymaster")),
    ("redis+sentinel://:pw@[::1]:26379/svc-1.a/3",
     RedisTarget("sentinel", sentinels=(("::1", 26379),), service="svc-1.a", db=3, password="pw")),
    ("redis+cluster://10.0.0.1:7000,10.0.0.2",
     RedisTarget("cluster", nodes=(("10.0.0.1", 7000), ("10.0.0.2", 6379)))),
    ("redis+cluster://u:p%40w@[::1]:7001/0?x=1",
     RedisTarget("cluster", nodes=(("::1", 7001),), username="u", password="p@w")),
    ("rediss+cluster://:pw@c1.internal:7000/",
     RedisTarget("cluster", tls=True, nodes=(("c1.internal", 7000),), password="pw")),
]

BAD = [
    ("", "non-empty"),
    ("127.0.0.1:6379", "redis://"),
    ("http://h:1", "unsupported"),
    ("unix:///tmp/redis.sock", "unsupported"),
    ("rediss+sentinel://h:1/m", "TLS"),
    ("redis://h:99999/0", "port out of range"),
    ("redis://h:1/x", "db number"),
    ("redis:///0", "no host"),
    ("redis://a:1,b:2/0", "sentinel"),
    ("redis+sentinel://h:1", "service"),
    ("redis+sentinel://h:1/m/x", "db number"),
    ("redis+cluster://h:1/2", "only database 0"),
    ("redis+cluster://h:1,h:99999", "port out of range"),
    ("redis+cluster:///", "no host"),
]


@pytest.mark.parametrize("url,expect", GOOD)
def test_python_parses_every_form(url: str, expect: RedisTarget) -> None:
    assert parse_redis_url(url) == expect


@pytest.mark.parametrize("url,message", BAD)
def test_python_rejects_with_a_reason(url: str, message: str) -> None:
    with pytest.raises(RedisURLError, match=message):
        parse_redis_url(url)


def test_config_names_the_field_and_hides_the_password() -> None:
    with pytest.raises(ConfigError) as exc:
        settings_from_dict({"redis": {"url": "redis://:hunter2@h:1/x"}})
    assert "redis.url" in str(exc.value) and "db number" in str(exc.value)
    assert "hunter2" not in str(exc.value)
    with pytest.raises(ConfigError, match="go together"):
        settings_from_dict({"redis": {"url": "rediss://h:1/0", "tls_cert_file": "/x.pem"}})


def test_lua_agrees_with_python(workdir: Path) -> None:
    """The same URLs through lua/infergate/redis/client.lua: same fields, same rejections."""
    urls = [u for u, _ in GOOD] + [u for u, _ in BAD]
    got = lua_eval(workdir, f"""
            local redis = require("infergate.redis.client")
            local urls = require("cjson.safe").decode([==[{json.dumps(urls)}]==])
            local out = {{}}
            for i, u in ipairs(urls) do
                local c, err = redis.parse_url(u)
                if c then c.pool = nil end
                out[i] = c or {{ error = err }}
            end
            return out
    """)
    for (url, expect), lua in zip(GOOD, got):
        want: dict = {"db": expect.db}
        if expect.password:
            want["password"] = expect.password
        if expect.username:
            want["username"] = expect.username
        if expect.kind == "direct":
            want.update(host="127.0.0.1" if expect.host == "localhost" else expect.host,
                        port=expect.port)
            if expect.tls:
                want.update(ssl=True, server_name=expect.host, ssl_verify=True)
        elif expect.kind == "cluster":
            clu = lua.pop("cluster")
            assert [(h["host"], h["port"]) for h in clu["seeds"]] == list(expect.nodes), url
            if expect.tls:
                want.update(ssl=True, ssl_verify=True)
        else:
            sent = lua.pop("sentinel")
            assert sent["service"] == expect.service, url
            assert [(h["host"], h["port"]) for h in sent["hosts"]] == list(expect.sentinels), url
        assert lua == want, url
    for (url, message), lua in zip(BAD, got[len(GOOD):]):
        assert message.lower() in lua.get("error", "").lower(), (url, lua)


# ----------------------------------------------------------------------------- password + db

def _edge_routes_on(edge, version: int) -> dict:
    st = edge.wait_snapshot(version)
    assert st["snapshot"]["redis_ok"] is True
    return st


def test_password_and_database_on_both_sides(workdir, tiny_upstreams, edge_factory) -> None:
    port = procs.free_port()
    server = procs.start_redis(workdir / "redis-pw", port)
    try:
        redis.Redis(host="127.0.0.1", port=port).config_set("requirepass", "s3cr:t@x")
        url = f"redis://:s3cr%3At%40x@127.0.0.1:{port}/3"
        (up,) = tiny_upstreams(1)
        s = edge_settings(url, [up.node_settings()])
        r = make_redis(s.redis)
        snap = write_snapshot(r, [up.snapshot_node()])
        edge = edge_factory(s)
        _edge_routes_on(edge, snap["version"])
        # everything landed in db 3 of the password-protected server, nothing in db 0
        plain = redis.Redis(host="127.0.0.1", port=port, password="s3cr:t@x", decode_responses=True)
        assert plain.get(keynames.ROUTING) is None
        procs.wait_until(lambda: r.hget(keynames.EDGES, edge.rendered.edge_id) is not None, 5,
                         what="edge stats in db 3")
        wrong = make_redis(settings_from_dict({"redis": {"url": f"redis://:nope@127.0.0.1:{port}/3"}}).redis)
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
        # user info without a colon is the password on the Python side too (as at the edge)
        bare = make_redis(settings_from_dict(
            {"redis": {"url": f"redis://s3cr%3At%40x@127.0.0.1:{port}/3"}}).redis)
        assert bare.hget(keynames.EDGES, edge.rendered.edge_id) is not None
    finally:
        server.stop()


# ----------------------------------------------------------------------------- TLS

def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN=infergate test {name}", cwd=d)


def _make_cert(d: Path, name: str, ca: str, san: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext", cwd=d)


@pytest.fixture
def tls_redis(workdir: Path):
    """redis-server with a plain port (for the readiness check) and a TLS port that
    requires a client certificate (tls-auth-clients yes, Redis' default); certificates
    from a throwaway CA ``ca`` (server: DNS:localhost, IP:127.0.0.1; client: ``client``)
    and an unrelated CA ``other``."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (apt-get install openssl)")
    d = workdir / "tls"
    d.mkdir()
    d.chmod(0o755)
    _make_ca(d, "ca")
    _make_ca(d, "other")
    _make_cert(d, "server", "ca", "DNS:localhost,IP:127.0.0.1")
    _make_cert(d, "client", "ca", "DNS:infergate-client")
    for f in d.iterdir():
        f.chmod(0o644)
    port, tls_port = procs.free_port(), procs.free_port()
    try:
        m = procs.start_redis(d / "data", port, extra=[
            "--tls-port", str(tls_port), "--tls-cert-file", str(d / "server.crt"),
            "--tls-key-file", str(d / "server.key"), "--tls-ca-cert-file", str(d / "ca.crt"),
            "--tls-auth-clients", "yes"])
    except procs.StartError as exc:
        if "Bad directive" in str(exc):
            pytest.skip("this redis-server was built without TLS (no --tls-port)")
        raise
    try:
        yield d, tls_port
    finally:
        m.stop()


def _tls_settings(d: Path, tls_port: int, nodes: list, **redis_opts):
    s = edge_settings(f"rediss://localhost:{tls_port}/2", nodes)
    opts = {"url": s.redis.url, "tls_ca_file": str(d / "ca.crt"),
            "tls_cert_file": str(d / "client.crt"), "tls_key_file": str(d / "client.key")}
    opts.update(redis_opts)
    s.redis = s.redis.model_validate(opts)
    return s


def test_tls_with_client_certificate_on_both_sides(tls_redis, tiny_upstreams, edge_factory) -> None:
    d, tls_port = tls_redis
    (up,) = tiny_upstreams(1)
    s = _tls_settings(d, tls_port, [up.node_settings()])
    r = make_redis(s.redis)
    snap = write_snapshot(r, [up.snapshot_node()])
    edge = edge_factory(s)
    assert "lua_ssl_trusted_certificate" in edge.rendered.http_conf.read_text()
    _edge_routes_on(edge, snap["version"])
    procs.wait_until(lambda: r.hget(keynames.EDGES, edge.rendered.edge_id) is not None, 5,
                     what="edge stats written over TLS")
    # a second snapshot goes through the pooled (already TLS) connection
    snap2 = write_snapshot(r, [up.snapshot_node(score=0.5)])
    _edge_routes_on(edge, snap2["version"])


def test_tls_failures_are_reported_and_the_edge_stays_up(tls_redis, tiny_upstreams,
                                                          edge_factory) -> None:
    d, tls_port = tls_redis
    (up,) = tiny_upstreams(1)
    cases = {
        "other CA": _tls_settings(d, tls_port, [up.node_settings()], tls_ca_file=str(d / "other.crt")),
        "no client certificate": _tls_settings(d, tls_port, [up.node_settings()],
                                               tls_cert_file="", tls_key_file=""),
    }
    for what, s in cases.items():
        with pytest.raises(redis.ConnectionError):
            make_redis(s.redis).ping()
        edge = edge_factory(s)
        out: dict = {}

        def failed() -> bool:
            out.update(edge.status()["snapshot"])
            return out["redis_ok"] is False and bool(out["redis_error"])

        procs.wait_until(failed, 5, what=f"edge to report the TLS failure ({what})")
        assert "tls" in out["redis_error"].lower(), (what, out)
        # fail-static: the static node list still serves
        res = requests.post(f"{edge.url}/v1/chat/completions", timeout=5,
                            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
        assert res.status_code == 200, (what, res.text)
    # nginx checks the certificate's DNS names only: an IP address in the URL does not match
    # (redis-py accepts the IP SAN); the edge says so instead of routing on nothing
    s = _tls_settings(d, tls_port, [up.node_settings()])
    s.redis.url = f"rediss://127.0.0.1:{tls_port}/2"
    assert make_redis(s.redis).ping() is True
    edge = edge_factory(s)
    procs.wait_until(lambda: "host mismatch" in str(edge.status()["snapshot"]["redis_error"]), 5,
                     what="edge to report the host name mismatch")
    # verification off: encrypted without checking the CA (client certificate still needed)
    s = _tls_settings(d, tls_port, [up.node_settings()], tls_ca_file=str(d / "other.crt"),
                      tls_verify=False)
    assert make_redis(s.redis).ping() is True
    edge = edge_factory(s)
    assert "lua_ssl_trusted_certificate" not in edge.rendered.http_conf.read_text()
    snap = write_snapshot(make_redis(s.redis), [up.snapshot_node()])
    _edge_routes_on(edge, snap["version"])


def test_tls_files_are_checked_before_nginx_runs(workdir: Path) -> None:
    """A missing CA file stops render-nginx; a missing client certificate stops nginx's
    start (the master reads it in init_by_lua) with a message naming the file."""
    from controlplane.edge.render import RenderError, render_nginx

    s = settings_from_dict({"redis": {"url": "rediss://redis.internal:6380/0",
                                      "tls_ca_file": str(workdir / "missing-ca.pem")}})
    with pytest.raises(RenderError, match="missing-ca.pem"):
        render_nginx(s, workdir / "out", listen="127.0.0.1:1", resolver="127.0.0.1")
    missing = workdir / "missing-client.pem"
    with pytest.raises(Exception, match="missing-client.pem"):
        lua_eval(workdir, f"""
            local ok, err = require("infergate.core.config").init({{ redis = {{
                tls_cert_file = "{missing}", tls_key_file = "{missing}" }} }},
                {lua_string(json.dumps(option_spec()))})
            if not ok then error(err, 0) end
            return ok
        """)
