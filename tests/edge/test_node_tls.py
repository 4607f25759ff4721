"""``https://`` nodes and node API keys, end to end: a TLS-terminating nginx that answers
401 unless the request carries ``Authorization: Bearer s3cret`` stands in front of a
simulated node (and, in one test, a real llama.cpp server), with certificates of a CA
made here with openssl. The control plane polls it with the key and verifies its
certificate; the edge proxies to it over TLS with the key; the key appears in no log,
event, admin answer, admin page, ``infergate nodes list`` or ``/infergate/status``.
A wrong key shows the node as "credentials refused"; an untrusted certificate is never
used."""

from __future__ import annotations

import json
import re
import os
import shutil
import stat
import subprocess
from pathlib import Path

import pytest
import redis
import requests
from click.testing import CliRunner

from controlplane import procs
from controlplane.admin import create_app
from controlplane.cli import main
from controlplane.config import NodeSettings, settings_from_dict
from controlplane.edge.render import render_nginx, start_nginx
from controlplane.redisdb import keynames
from controlplane.routing import registry
from support.stack import edge_settings, write_snapshot

pytestmark = pytest.mark.integration

KEY = "s3cret"
ADMIN = "tls-admin-token-1"
CHAT = {"model": "sim-llama", "messages": [{"role": "user", "content": "hello"}],
        "max_tokens": 4}


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _make_ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
             "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2",
             "-subj", f"/CN=infergate test {name}", cwd=d)


def _make_cert(d: Path, name: str, ca: str, san: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(f"subjectAltName={san}\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile",
             f"{name}.ext", cwd=d)


@pytest.fixture
def certs(workdir: Path) -> Path:
    """CA ``ca`` with the server certificates ``node`` (DNS:localhost) and ``nodeb``
    (DNS:node-b.test), and an unrelated CA ``other`` with ``rogue`` (DNS:localhost)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (apt-get install openssl)")
    d = workdir / "tls"
    d.mkdir()
    d.chmod(0o755)
    _make_ca(d, "ca")
    _make_ca(d, "other")
    _make_cert(d, "node", "ca", "DNS:localhost")
    _make_cert(d, "rogue", "other", "DNS:localhost")
    _make_cert(d, "nodeb", "ca", "DNS:node-b.test")
    for f in d.iterdir():
        f.chmod(0o644)
    return d


FRONT_CONF = """
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {prefix}/access.log;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    server {{
        listen 127.0.0.1:{port} ssl;
        ssl_certificate {cert};
        ssl_certificate_key {key};
        location / {{
            {check}
            proxy_pass {backend};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
        location /v1/ {{
            if ($http_authorization != "Bearer {token}") {{ return 401; }}
            proxy_pass {backend};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""
#: The bearer check of FRONT_CONF outside /v1/ (``only_v1``: none, as vLLM's --api-key).
CHECK = 'if ($http_authorization != "Bearer {token}") {{ return 401; }}'.format(token=KEY)


@pytest.fixture
def tls_front(workdir: Path, certs: Path):
    """Factory: ``tls_front(backend_url, cert="node", only_v1=False)`` -> port of an nginx
    that serves TLS with that certificate and passes only requests with ``Bearer s3cret``
    on (``only_v1``: only under ``/v1/`` as vLLM's ``--api-key``; /health and /metrics
    are open)."""
    started: list[procs.Managed] = []

    def start(backend: str, cert: str = "node", only_v1: bool = False) -> int:
        i = len(started) + 1
        prefix = workdir / f"front-{i}"
        prefix.mkdir()
        port = procs.free_port()
        conf = prefix / "nginx.conf"
        conf.write_text(FRONT_CONF.format(prefix=prefix, port=port, cert=certs / f"{cert}.crt",
                                          key=certs / f"{cert}.key", token=KEY,
                                          check="" if only_v1 else CHECK,
                                          backend=backend.rstrip("/")))
        started.append(start_nginx(conf, prefix))
        return port

    try:
        yield start
    finally:
        for m in started:
            m.stop()


def _wait_node(r: redis.Redis, name: str, pred, timeout: float = 30.0) -> dict:
    """Wait until the node's metrics document satisfies ``pred``; return it."""
    out: dict = {}

    def check() -> bool:
        raw = r.get(keynames.node_metrics(name))
        if not raw:
            return False
        out.clear()
        out.update(json.loads(raw))
        return pred(out)

    procs.wait_until(check, timeout, what=f"node {name} state")
    return out


def _admin_page(settings, r) -> str:
    """The admin page's node list, logged in, as HTML."""
    app = create_app(settings, r, secret_key="fixed-test-secret")
    c = app.test_client()
    page = c.get("/login")
    csrf = re.search(r'name="csrf_token" value="([^"]+)"', page.text).group(1)
    assert c.post("/login", data={"token": ADMIN, "csrf_token": csrf}).status_code == 303
    html = c.get("/nodes").text
    return html + c.get("/nodes/tls-good").text + c.get("/events").text


def test_https_node_with_api_key(workdir, redis_server, simnodes, tls_front, certs,
                                 controlplane_factory, edge_factory, monkeypatch):
    (sim,) = simnodes(1)
    good = tls_front(sim.url)
    bad = tls_front(sim.url)
    monkeypatch.setenv("INFERGATE_TEST_NODE_KEY", KEY)
    wrong = workdir / "wrong.key"
    wrong.write_text("not-the-key\n")
    nodes = [
        NodeSettings(name="tls-good", url=f"https://localhost:{good}",
                     ca_file=str(certs / "ca.crt"), api_key_env="INFERGATE_TEST_NODE_KEY"),
        NodeSettings(name="tls-bad", url=f"https://localhost:{bad}",
                     ca_file=str(certs / "ca.crt"), api_key_file=str(wrong)),
    ]
    settings = edge_settings(redis_server.url, nodes)
    settings.controlplane.admin_token = ADMIN
    settings.controlplane.poll_interval_s = 0.2
    cp = controlplane_factory(settings)
    r = redis_server.client()
    _wait_node(r, "tls-good", lambda d: d.get("healthy") is True and d.get("has_metrics"))
    _wait_node(r, "tls-bad", lambda d: d.get("healthy") is False)
    edge = edge_factory(settings)
    procs.wait_until(lambda: edge.status()["snapshot"]["source"] == "redis", 10,
                     what="edge on the control plane's snapshot")

    # the edge reaches the https node with its key, whatever the client sends
    for headers in ({}, {"Authorization": "Bearer client-credential"}):
        for _ in range(3):
            res = requests.post(edge.url + "/v1/chat/completions", json=CHAT, headers=headers,
                                timeout=30)
            assert res.status_code == 200, res.text
            assert res.json()["choices"]
    assert all(line.split('ua="')[1].startswith("127.0.0.1:" + str(good))
               for line in edge.access_log().splitlines() if "/v1/chat/completions" in line)

    # the wrong key: "credentials refused", not "down"
    api = requests.get(cp.admin_url + "/api/v1/nodes",
                       headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert api.status_code == 200
    views = {v["name"]: v for v in api.json()["nodes"]}
    assert views["tls-good"]["status"] == "active"
    assert views["tls-bad"]["status"] == "credentials refused"
    assert "credentials refused" in views["tls-bad"]["last_error"]
    listing = CliRunner().invoke(main, ["nodes", "list", "--redis-url", redis_server.url])
    assert listing.exit_code == 0, listing.output
    assert re.search(r"tls-bad\s+active\s+credentials refused", listing.output), listing.output

    # the key is nowhere to be seen
    snap = requests.get(cp.admin_url + "/api/v1/snapshot",
                        headers={"Authorization": f"Bearer {ADMIN}"}, timeout=10)
    assert snap.status_code == 200 and '"[redacted]"' in snap.text
    events = json.dumps(registry.recent_events(r, 1000))
    cp_log = (workdir / "logs" / "controlplane-1.log").read_text(errors="replace")
    seen = {
        "edge error log": edge.error_log(), "edge access log": edge.access_log(),
        "control-plane log": cp_log, "events": events, "admin API nodes": api.text,
        "admin API snapshot": snap.text, "nodes list": listing.output,
        "nodes list --json": CliRunner().invoke(
            main, ["nodes", "list", "--json", "--redis-url", redis_server.url]).output,
        "edge status": json.dumps(edge.status()), "admin page": _admin_page(settings, r),
        "registry": json.dumps(r.hgetall(keynames.NODES)),
    }
    for what, text in seen.items():
        assert KEY not in text and "not-the-key" not in text, what
    # the stored snapshot carries the key for the edges (Redis is trusted with it)
    assert f"Bearer {KEY}" in r.get(keynames.ROUTING)


def test_a_key_refused_only_under_v1_is_credentials_refused(workdir, redis_server, simnodes,
                                                             tls_front, certs,
                                                             controlplane_factory):
    (sim,) = simnodes(1)
    port = tls_front(sim.url, only_v1=True)
    wrong = workdir / "wrong.key"
    wrong.write_text("not-the-key\n")
    node = NodeSettings(name="vllm-like", url=f"https://localhost:{port}",
                        ca_file=str(certs / "ca.crt"), api_key_file=str(wrong))
    settings = edge_settings(redis_server.url, [node])
    settings.controlplane.poll_interval_s = 0.2
    controlplane_factory(settings)
    doc = _wait_node(redis_server.client(), "vllm-like", lambda d: d.get("healthy") is False)
    assert "models: credentials refused (HTTP 401)" in doc["last_error"]
    assert doc["has_metrics"]  # /metrics answered: the node is up, its key is wrong
    listing = CliRunner().invoke(main, ["nodes", "list", "--redis-url", redis_server.url])
    assert re.search(r"vllm-like\s+active\s+credentials refused", listing.output), \
        listing.output


def test_untrusted_certificate_is_not_used(redis_server, simnodes, tls_front, certs,
                                           edge_factory):
    (sim,) = simnodes(1)
    rogue = tls_front(sim.url, cert="rogue")
    trusted = tls_front(sim.url)
    node = NodeSettings(name="tls-ok", url=f"https://localhost:{trusted}",
                        ca_file=str(certs / "ca.crt"))
    settings = edge_settings(redis_server.url, [node], max_tries=1)
    edge = edge_factory(settings)
    r = redis_server.client()
    entry = {"name": "tls-x", "url": f"https://localhost:{rogue}", "host": "127.0.0.1",
             "port": rogue, "kind": "vllm", "state": "active", "healthy": True,
             "weight": 1.0, "effective_weight": 1.0, "max_concurrency": 8,
             "scheme": "https", "tls_name": "localhost", "auth": f"Bearer {KEY}"}
    snap = write_snapshot(r, [entry])
    edge.wait_snapshot(snap["version"])
    res = requests.post(edge.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert res.status_code in (502, 503), res.text
    assert "certificate verify" in edge.error_log()
    assert requests.get(f"https://localhost:{rogue}/health", verify=False,
                        headers={"Authorization": f"Bearer {KEY}"}, timeout=5).status_code == 200
    # the same node behind the trusted certificate serves
    snap = write_snapshot(r, [{**entry, "name": "tls-ok", "url": f"https://localhost:{trusted}",
                               "port": trusted}])
    edge.wait_snapshot(snap["version"])
    res = requests.post(edge.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert res.status_code == 200, res.text
    edge.check_log = False  # the verify error above is logged at [error], as it should


def test_each_try_checks_its_own_node_name(workdir, redis_server, simnodes, tls_front, certs,
                                           edge_factory):
    """Two https nodes of one group (same scheme and key) with different host names: the
    balancer sets the certificate name of every try, so both serve, also as retries."""
    (sim,) = simnodes(1)
    pa, pb = tls_front(sim.url), tls_front(sim.url, cert="nodeb")
    settings = edge_settings(redis_server.url, [], max_tries=1)
    settings.controlplane.node_ca_file = str(certs / "ca.crt")
    edge = edge_factory(settings)
    common = {"kind": "vllm", "scheme": "https", "auth": f"Bearer {KEY}", "host": "127.0.0.1",
              "score": None, "has_metrics": False}
    snap = write_snapshot(redis_server.client(), [
        {**common, "name": "a", "url": f"https://localhost:{pa}", "port": pa,
         "tls_name": "localhost"},
        {**common, "name": "b", "url": f"https://node-b.test:{pb}", "port": pb,
         "tls_name": "node-b.test"}])
    edge.wait_snapshot(snap["version"])
    for _ in range(12):
        res = requests.post(edge.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert res.status_code == 200, res.text
    served = {n["name"]: n["requests"] for n in edge.status()["nodes"]}
    assert served["a"] > 0 and served["b"] > 0, served
    assert "certificate" not in edge.error_log()
    # no model list known: GET /v1/models/<id> goes to a node, its path (normalised)
    # escaped as a fixed proxy_pass would, the query string kept
    requests.get(edge.url + "/v1//models/org/some%20model?x=1", timeout=30)

    def fronts() -> str:  # a front writes its access log line after the answer
        return "".join(p.read_text() for p in workdir.glob("front-*/access.log"))

    procs.wait_until(lambda: "GET /v1/models/org/some%20model?x=1 " in fronts(), 10,
                     what=f"the front's access log line; it has {fronts()[-2000:]}")


def _mixed_pool(redis_server, simnodes, tls_front, certs, edge_factory, plain: dict,
                tls: dict):
    """An edge whose snapshot holds a plain node ("plain") and an https node with a key
    ("tls", behind a TLS front), each with the extra fields given; returns the edge."""
    sims = simnodes(2)
    port = tls_front(sims[1].url)
    settings = edge_settings(redis_server.url, [], max_tries=2)
    settings.controlplane.node_ca_file = str(certs / "ca.crt")
    edge = edge_factory(settings)
    snap = write_snapshot(redis_server.client(), [
        {**sims[0].snapshot_node(), "name": "plain", "score": None, "has_metrics": False,
         **plain},
        {"name": "tls", "url": f"https://localhost:{port}", "host": "127.0.0.1",
         "port": port, "kind": "vllm", "scheme": "https", "tls_name": "localhost",
         "auth": f"Bearer {KEY}", **tls}])
    edge.wait_snapshot(snap["version"])
    return edge


def test_a_mixed_pool_sends_each_request_within_one_group(redis_server, simnodes, tls_front,
                                                          certs, edge_factory):
    """A plain node and an https node with a key: each request is sent with the scheme
    and key of the node it reaches (both serve, none fails)."""
    edge = _mixed_pool(redis_server, simnodes, tls_front, certs, edge_factory, {}, {})
    for _ in range(16):
        res = requests.post(edge.url + "/v1/chat/completions", json=CHAT, timeout=30)
        assert res.status_code == 200, res.text
    st = {n["name"]: n for n in edge.status()["nodes"]}
    assert st["plain"]["requests"] > 0 and st["tls"]["requests"] > 0, st
    assert st["plain"]["failures"] == 0 and st["tls"]["failures"] == 0, st


def test_a_prompt_only_one_group_holds_goes_to_that_group(redis_server, simnodes, tls_front,
                                                         certs, edge_factory):
    """In a mixed pool, a prompt over the plain node's slot context (but within the https
    node's) is drawn into the https node's group every time: the plain node, left out of
    the request's choice, gives its group no weight (drawn by it, the request had no
    node left: 503)."""
    edge = _mixed_pool(redis_server, simnodes, tls_front, certs, edge_factory,
                       {"ctx_tokens": 256}, {"ctx_tokens": 4096})
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "word " * 1000}]}
    got = []
    for _ in range(12):
        res = requests.post(edge.url + "/v1/chat/completions", json=long_chat, timeout=30)
        got.append((res.status_code, res.headers.get("X-Infergate-Node")))
    assert got == [(200, "tls")] * 12, got


def test_without_any_ca_bundle_https_nodes_are_refused(workdir, redis_server, simnodes,
                                                       tls_front, edge_factory, monkeypatch):
    """A host without the system CA bundle and no node CA configured: the configuration
    still loads (plain nodes work), https nodes are never sent a request unverified, and
    an https node in the file cannot be rendered."""
    import controlplane.edge.render as render_mod

    monkeypatch.setenv("SSL_CERT_FILE", str(workdir / "missing.crt"))
    (sim,) = simnodes(1)
    port = tls_front(sim.url)
    edge = edge_factory(edge_settings(redis_server.url, []))
    r = redis_server.client()
    snap = write_snapshot(r, [{"name": "tls", "url": f"https://localhost:{port}",
                               "host": "127.0.0.1", "port": port, "kind": "vllm",
                               "scheme": "https", "tls_name": "localhost"}])
    edge.wait_snapshot(snap["version"])
    res = requests.post(edge.url + "/v1/chat/completions", json=CHAT, timeout=30)
    assert res.status_code == 502 and res.json()["error"]["code"] == "edge_misconfigured"
    assert "no CA bundle" in edge.error_log()
    snap = write_snapshot(r, [{**sim.snapshot_node(), "score": None}])
    edge.wait_snapshot(snap["version"])
    assert requests.post(edge.url + "/v1/chat/completions", json=CHAT,
                         timeout=30).status_code == 200
    bad = edge_settings(redis_server.url, [NodeSettings(name="t", url="https://localhost:1")])
    with pytest.raises(render_mod.RenderError, match="CA bundle"):
        render_nginx(bad, workdir / "no-ca", listen="127.0.0.1:1", prefix=workdir / "no-ca-p")


def test_controlplane_refuses_untrusted_certificate(redis_server, simnodes, tls_front, certs,
                                                    controlplane_factory):
    (sim,) = simnodes(1)
    rogue = tls_front(sim.url, cert="rogue")
    node = NodeSettings(name="tls-rogue", url=f"https://localhost:{rogue}",
                        ca_file=str(certs / "ca.crt"))
    settings = edge_settings(redis_server.url, [node])
    settings.controlplane.poll_interval_s = 0.2
    controlplane_factory(settings)
    doc = _wait_node(redis_server.client(), "tls-rogue",
                     lambda d: d.get("healthy") is False)
    assert "certificate verify failed" in doc["last_error"]


def test_real_engine_behind_tls_with_api_key(redis_server, realnodes, tls_front, certs,
                                             controlplane_factory, edge_factory, monkeypatch):
    (real,) = realnodes(1, parallel=1, threads=1)
    port = tls_front(real.url)
    key_file = Path(str(certs)) / "engine.key.txt"
    key_file.write_text(KEY + "\n")
    node = NodeSettings(name="engine", url=f"https://localhost:{port}", kind="vllm",
                        ca_file=str(certs / "ca.crt"), api_key_file=str(key_file))
    settings = settings_from_dict({**edge_settings(redis_server.url, [node]).model_dump(),
                                   "controlplane": {"poll_interval_s": 0.2}})
    controlplane_factory(settings)
    _wait_node(redis_server.client(), "engine", lambda d: d.get("healthy") is True)
    edge = edge_factory(settings)
    procs.wait_until(lambda: edge.status()["snapshot"]["source"] == "redis", 10,
                     what="edge on the control plane's snapshot")
    models = requests.get(edge.url + "/v1/models", timeout=10).json()
    model = models["data"][0]["id"]
    res = requests.post(edge.url + "/v1/chat/completions", timeout=120, json={
        "model": model, "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8})
    assert res.status_code == 200, res.text
    assert res.json()["choices"][0]["message"]["content"] is not None
    assert KEY not in edge.error_log() + edge.access_log()


def test_render_bundles_the_cas_and_protects_the_static_key(tmp_path, certs, monkeypatch):
    monkeypatch.setenv("T_RENDER_KEY", "render-secret")
    ca1, ca2 = certs / "ca.crt", certs / "other.crt"
    s = settings_from_dict({
        "controlplane": {"node_ca_file": str(ca1)},
        "nodes": [{"name": "a", "url": "https://127.0.0.1:8443", "ca_file": str(ca2),
                   "api_key_env": "T_RENDER_KEY"},
                  {"name": "b", "url": "http://127.0.0.1:8000"}]})
    r = render_nginx(s, tmp_path / "out", listen="127.0.0.1:18999", prefix=tmp_path / "pre")
    bundle = tmp_path / "out" / "node-ca.pem"
    assert bundle.read_text() == ca1.read_text() + ca2.read_text()
    server = r.server_conf.read_text()
    # every proxied location (one proxy_pass to the nodes each) verifies and authenticates
    proxied = server.count("://infergate_nodes")
    assert proxied >= 15
    assert server.count(f"proxy_ssl_trusted_certificate {bundle.resolve()};") == proxied
    assert server.count("proxy_set_header Authorization $infergate_node_auth;") == proxied
    assert "proxy_pass $infergate_upstream_scheme://infergate_nodes/v1/chat/completions" \
        "$is_args$args;" in server
    http = r.http_conf.read_text()
    assert "Bearer render-secret" in http
    assert stat.S_IMODE(os.stat(r.http_conf).st_mode) == 0o640
    plain = settings_from_dict({"nodes": [{"name": "b", "url": "http://127.0.0.1:8000"}]})
    r2 = render_nginx(plain, tmp_path / "out2", listen="127.0.0.1:18998",
                      prefix=tmp_path / "pre2")
    assert stat.S_IMODE(os.stat(r2.http_conf).st_mode) == 0o644
    assert not (tmp_path / "out2" / "node-ca.pem").exists()
