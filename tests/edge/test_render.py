"""``infergate render-nginx``: the three rendered files pass ``nginx -t`` standalone and
as includes inside an existing http {} / server {}, settings reach the right
directives, the OpenResty rendering differs only by the module lines, and bad input
gets a clear error."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
from pathlib import Path

import pytest
import requests
from click.testing import CliRunner

from controlplane import procs
from controlplane.config import ConfigError, settings_from_dict
from controlplane.edge.options import lua_string, option_spec, rendered_options
from controlplane.edge.render import (
    NginxError, RenderError, default_modules_dir, nginx_test, render_nginx, render_nginx_cmd,
    start_nginx,
)
from support.stack import LuaError, lua_eval

MODULE_LINES = (f"load_module {default_modules_dir()}/ndk_http_module.so; "
                f"load_module {default_modules_dir()}/ngx_http_lua_module.so;")


# A free metrics port (the default 127.0.0.1:9145 may be another edge's), the same for
# every render of this module so that renders can be compared.
METRICS_LISTEN = f"127.0.0.1:{procs.free_port()}"


def _settings(**edge):
    return settings_from_dict({
        "redis": {"url": "redis://127.0.0.1:6390/0"},
        "edge": {"workers": 1, "metrics_listen": METRICS_LISTEN, **edge},
        "nodes": [{"name": "gpu-a", "url": "http://127.0.0.1:9001"},
                  {"name": "gpu-b", "url": "http://localhost:9002", "weight": 2.0,
                   "max_concurrency": 8}],
    })


def _options(http_conf: Path) -> dict:
    """The options document embedded in init_by_lua (checked against the spec there)."""
    doc, spec = rendered_options(http_conf.read_text())
    assert spec == option_spec()
    return doc


def test_standalone_config_passes_nginx_t(workdir: Path) -> None:
    r = render_nginx(_settings(), workdir / "out", listen="127.0.0.1:18123", prefix=workdir / "pre")
    for p in (r.http_conf, r.server_conf, r.nginx_conf):
        assert p.exists() and p.stat().st_mode & 0o004, p
    nginx_test(r.nginx_conf, r.prefix)
    conf = r.nginx_conf.read_text()
    assert "load_module" in conf and f"pid {workdir / 'pre'}/nginx.pid;" in conf
    assert "worker_processes 1;" in conf and "listen 127.0.0.1:18123 backlog=4096;" in conf
    assert "multi_accept on;" in conf  # one worker: a burst of new connections at once
    assert (workdir / "pre" / "logs").is_dir()
    assert r.url == "http://127.0.0.1:18123"


def test_includes_work_inside_an_existing_http_and_server(workdir: Path) -> None:
    """The host config keeps its own server-level settings and `location /`."""
    r = render_nginx(_settings(), workdir / "out", listen="127.0.0.1:18124", prefix=workdir)
    wrapper = workdir / "host.conf"
    wrapper.write_text(f"""
pid {workdir}/host.pid;
error_log {workdir}/logs/host-error.log;
events {{}}
http {{
    access_log off;
    client_body_temp_path {workdir}/cbt;
    proxy_temp_path {workdir}/pt;
    include {r.http_conf};
    server {{
        listen 127.0.0.1:18125;
        client_max_body_size 1m;
        location / {{ return 200 "host site"; }}
        location /v1/other {{ return 200 "host api"; }}
        include {r.server_conf};
    }}
    server {{
        listen 127.0.0.1:18126;
        location / {{ proxy_pass http://infergate_nodes; }}
    }}
}}
""")
    out = subprocess.run(["nginx", "-t", "-p", str(workdir), "-c", str(wrapper), "-g", MODULE_LINES],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_the_drop_in_guide_names_every_location_outside_v1(workdir: Path) -> None:
    """A site's own prefix or regex location for one of these paths passes ``nginx -t``
    and is then shadowed by the include's exact one: the guide's list of what may clash
    names each of them, so that an operator can look for them before the reload."""
    r = render_nginx(_settings(), workdir / "out", listen="127.0.0.1:18127", prefix=workdir)
    paths = set(re.findall(r"^location (?:=|\^~) (\S+) \{", r.server_conf.read_text(), re.M))
    outside = {("/_infergate/..." if p.startswith("/_infergate/") else p)
               for p in paths if not p.startswith("/v1/")}
    assert {"/tokenize", "/rerank", "/infergate/status"} <= outside
    guide = (Path(__file__).resolve().parents[2] / "docs" / "dropin.md").read_text()
    clashes = guide[guide.index("What the includes may clash with"):]
    missing = sorted(p for p in outside if f"`= {p}`" not in clashes)
    assert not missing, f"docs/dropin.md does not name these locations: {missing}"


def test_settings_reach_the_directives(workdir: Path) -> None:
    s = _settings(max_tries=4, connect_timeout_ms=1500, read_timeout_ms=30000, send_timeout_ms=45000,
                  retry_window_s=12.5, client_max_body_size="2m",
                  client_body_buffer_size="256k", keepalive=16, workers=3,
                  edge_id="edge-7", breaker_failures=7, breaker_cooldown_s=3.0, inflight_cost=2.0,
                  sync_interval_s=0.25, stale_after_s=4.0, redis_timeout_ms=150)
    r = render_nginx(s, workdir / "out", listen="127.0.0.1:18127")
    server = r.server_conf.read_text()
    http = r.http_conf.read_text()
    # the five OpenAI locations, the nine more named API paths and the /v1/ rest
    assert server.count("proxy_next_upstream_tries 4;") == 15
    assert "proxy_connect_timeout 1500ms;" in server
    assert "proxy_read_timeout 30s;" in server and "proxy_send_timeout 45s;" in server
    assert "proxy_next_upstream_timeout 12500ms;" in server
    assert "client_max_body_size 2m;" in server and "client_body_buffer_size 256k;" in server
    assert "client_body_buffer_size 1m;" in render_nginx(_settings(), workdir / "d").server_conf.read_text()
    assert "non_idempotent" in server and "proxy_buffering off;" in server
    assert "proxy_request_buffering on;" in server and "proxy_http_version 1.1;" in server
    for code in (400, 404, 405, 413, 429, 500, 502, 503, 504):
        assert f"error_page {code} = /_infergate/error/{code};" in server
    assert "keepalive 16;" in http
    # several workers accept one connection at a time (a burst would land on one)
    assert "worker_processes 3;" in r.nginx_conf.read_text()
    assert "multi_accept off;" in r.nginx_conf.read_text()
    assert "worker_processes 3;" in r.nginx_conf.read_text()
    opts = _options(r.http_conf)
    e = opts["edge"]
    assert e["edge_id"] == "edge-7" and r.edge_id == "edge-7"
    assert e["max_tries"] == 4 and e["breaker_failures"] == 7
    assert e["breaker_cooldown_s"] == 3.0 and e["inflight_cost"] == 2.0
    assert e["sync_interval_s"] == 0.25 and e["stale_after_s"] == 4.0
    assert e["redis_timeout_ms"] == 150 and opts["redis"]["url"] == "redis://127.0.0.1:6390/0"
    nodes = {n["name"]: n for n in opts["nodes"]}
    assert nodes["gpu-a"] == {"name": "gpu-a", "host": "127.0.0.1", "port": 9001, "weight": 1.0,
                              "max_concurrency": 64, "kind": "vllm"}
    assert nodes["gpu-b"]["host"] == "127.0.0.1"  # localhost resolved at render time
    assert nodes["gpu-b"]["weight"] == 2.0 and nodes["gpu-b"]["max_concurrency"] == 8


def test_default_edge_id_is_host_and_port(workdir: Path) -> None:
    import socket

    r = render_nginx(_settings(), workdir / "out", listen="127.0.0.1:18128")
    assert r.edge_id == f"{socket.gethostname()}:18128"


def test_openresty_rendering_differs_only_by_module_lines(workdir: Path) -> None:
    deb = render_nginx(_settings(edge_id="e"), workdir / "deb", listen="127.0.0.1:18129", prefix=workdir / "p")
    (workdir / "ores").mkdir()   # the same edge: its hop id too
    shutil.copy(deb.out_dir / "hop-id", workdir / "ores" / "hop-id")
    ores = render_nginx(_settings(edge_id="e"), workdir / "ores", listen="127.0.0.1:18129", prefix=workdir / "p",
                        openresty=True)
    assert "load_module" not in ores.nginx_conf.read_text()
    assert deb.server_conf.read_text() == ores.server_conf.read_text()
    # the same but for the folder each edge reports as its configuration's
    assert deb.http_conf.read_text().replace(str(deb.out_dir), "OUT") \
        == ores.http_conf.read_text().replace(str(ores.out_dir), "OUT")
    # OpenResty has the modules built in; with Debian's nginx they come from -g
    out = subprocess.run(["nginx", "-t", "-p", str(ores.prefix), "-c", str(ores.nginx_conf),
                          "-g", MODULE_LINES], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_awkward_characters_in_options_survive(workdir: Path) -> None:
    """A Redis URL with quotes, braces and ']]' is embedded safely: nginx starts."""
    s = _settings()
    s.redis.url = "redis://:p'\"{};=@127.0.0.1:6390/0?note=]]=]"
    listen = f"127.0.0.1:{procs.free_port()}"
    r = render_nginx(s, workdir / "out", listen=listen, prefix=workdir / "pre")
    assert "]]" in _options(r.http_conf)["redis"]["url"]
    m = start_nginx(r.nginx_conf, r.prefix)
    try:
        st = requests.get(f"{r.url}/infergate/status", timeout=5).json()
        assert {n["name"] for n in st["nodes"]} == {"gpu-a", "gpu-b"}
        assert st["snapshot"]["source"] == "static"
    finally:
        m.stop()


def test_unresolvable_node_is_kept_without_address(workdir: Path) -> None:
    s = settings_from_dict({"redis": {"url": "redis://127.0.0.1:6390/0"},
                            "nodes": [{"name": "ghost", "url": "http://no-such-host.invalid:8000"}]})
    r = render_nginx(s, workdir / "out", listen="127.0.0.1:18130")
    assert any("ghost" in w for w in r.warnings)
    assert _options(r.http_conf)["nodes"][0]["host"] is None


def test_redis_host_name_gets_a_resolver(workdir: Path) -> None:
    s = settings_from_dict({"redis": {"url": "redis://redis.example:6379/0"}})
    r = render_nginx(s, workdir / "out", listen="127.0.0.1:18131", resolver="10.9.8.7")
    assert "resolver 10.9.8.7 valid=30s ipv6=off;" in r.http_conf.read_text()
    r2 = render_nginx(_settings(), workdir / "out2", listen="127.0.0.1:18131")
    assert "resolver" not in r2.http_conf.read_text()


@pytest.mark.parametrize("listen", ["nonsense", "127.0.0.1:0", "127.0.0.1:70000", ":x"])
def test_bad_listen_is_rejected(workdir: Path, listen: str) -> None:
    with pytest.raises(RenderError, match="listen"):
        render_nginx(_settings(), workdir / "out", listen=listen)


def test_bad_edge_values_are_rejected(workdir: Path) -> None:
    with pytest.raises(ConfigError, match="client_max_body_size"):
        _settings(client_max_body_size="lots")
    s = _settings()
    s.edge.client_max_body_size = "lots"  # assigned after loading: checked when rendering
    with pytest.raises(RenderError, match="client_max_body_size"):
        render_nginx(s, workdir / "out", listen="127.0.0.1:1")
    s = _settings()
    s.redis.url = "unix:///tmp/redis.sock"
    with pytest.raises(RenderError, match="redis://"):
        render_nginx(s, workdir / "out", listen="127.0.0.1:1")


def test_nginx_test_reports_nginx_messages(workdir: Path) -> None:
    bad = workdir / "bad.conf"
    bad.write_text("events {}\nhttp { nonsense_directive on; }\n")
    with pytest.raises(NginxError, match="nonsense_directive"):
        nginx_test(bad, workdir)


def test_cli_writes_files_and_checks(workdir: Path) -> None:
    cfg = workdir / "infergate.toml"
    cfg.write_text('[redis]\nurl = "redis://127.0.0.1:6390/0"\n[edge]\nworkers = 1\n'
                   f'metrics_listen = "127.0.0.1:{procs.free_port()}"\n'
                   '[[nodes]]\nname = "a"\nurl = "http://127.0.0.1:9001"\n')
    res = CliRunner().invoke(render_nginx_cmd, ["--config", str(cfg), "--out", str(workdir / "o"),
                                                "--listen", f"127.0.0.1:{procs.free_port()}",
                                                "--prefix", str(workdir / "run"), "--check"])
    assert res.exit_code == 0, res.output
    for name in ("infergate-http.conf", "infergate-server.conf", "nginx.conf"):
        assert (workdir / "o" / name).exists()
        assert name in res.output
    assert f"from {cfg}" in (workdir / "o" / "nginx.conf").read_text()
    # pid, logs and temp folders go under the prefix, never into the output folder
    assert sorted(p.name for p in (workdir / "o").iterdir()) == [
        "hop-id", "infergate-http.conf", "infergate-server.conf", "nginx.conf"]
    assert (workdir / "run" / "logs").is_dir()


def test_cli_check_names_a_listen_address_in_use(workdir: Path) -> None:
    """nginx -t does not bind: --check does, and names the setting whose port is taken
    and the process that holds it (here the test's own)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cfg = workdir / "infergate.toml"
        cfg.write_text(f'[edge]\nmetrics_listen = "127.0.0.1:{port}"\n')
        res = CliRunner().invoke(render_nginx_cmd, [
            "--config", str(cfg), "--out", str(workdir / "o"), "--prefix", str(workdir / "run"),
            "--listen", f"127.0.0.1:{procs.free_port()}", "--check"])
    assert res.exit_code == 1, res.output
    assert f"edge.metrics_listen (infergate-http.conf) 127.0.0.1:{port} is already in use" in res.output
    assert f"another process (pid {os.getpid()} (" in res.output
    assert "nginx -t: ok" not in res.output and "Traceback" not in res.output


def test_a_failed_check_puts_the_previous_files_back(workdir: Path) -> None:
    """A render into the live include folder whose --check fails (a listen address in use)
    leaves the files of the last good render for the next reload, not the new ones; a
    first render that fails its check leaves none."""
    cfg = workdir / "infergate.toml"

    def render(out: Path, metrics_port: int):
        cfg.write_text(f'[edge]\nmetrics_listen = "127.0.0.1:{metrics_port}"\n')
        return CliRunner().invoke(render_nginx_cmd, [
            "--config", str(cfg), "--out", str(out), "--prefix", str(workdir / "run"),
            "--listen", f"127.0.0.1:{procs.free_port()}", "--check"])

    live, first = workdir / "live", workdir / "first"
    good_port = procs.free_port()
    assert render(live, good_port).exit_code == 0
    before = {p.name: p.read_bytes() for p in live.iterdir()}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        res = render(live, taken.getsockname()[1])
        new = render(first, taken.getsockname()[1])
    assert res.exit_code == 1 and "put back as they were" in res.output, res.output
    assert {p.name: p.read_bytes() for p in live.iterdir()} == before
    assert f"127.0.0.1:{good_port}" in (live / "infergate-http.conf").read_text()
    assert new.exit_code == 1 and "nothing was left" in new.output, new.output
    assert list(first.iterdir()) == []


def test_cli_check_refuses_lua_files_nginx_t_does_not_load(workdir: Path) -> None:
    """nginx -t does not run init_by_lua: an init file or a --lua-dir without infergate's
    modules passes it, and nginx then refuses to start. --check names them."""
    cfg = workdir / "infergate.toml"
    missing = workdir / "shop-init.lua"
    cfg.write_text(f'[edge]\nmetrics_listen = "127.0.0.1:{procs.free_port()}"\n'
                   f'init_lua_file = "{missing}"\ninit_worker_lua_file = "{workdir}"\n')
    empty_lua = workdir / "lua"
    empty_lua.mkdir()

    def check(*extra: str):
        return CliRunner().invoke(render_nginx_cmd, [
            "--config", str(cfg), "--out", str(workdir / "o"), "--prefix", str(workdir / "run"),
            "--listen", f"127.0.0.1:{procs.free_port()}", "--check", *extra])

    res = check()
    assert res.exit_code == 1, res.output
    assert f"edge.init_lua_file: {missing} does not exist; nginx would not start" in res.output
    assert f"edge.init_worker_lua_file: {workdir} is not a file" in res.output
    assert "nginx -t: ok" not in res.output and "Traceback" not in res.output
    missing.write_text("shop = true\n")
    worker = workdir / "shop-worker.lua"
    worker.write_text("\n")
    cfg.write_text(cfg.read_text().replace(f'"{workdir}"', f'"{worker}"'))
    res = check("--lua-dir", str(empty_lua))
    assert res.exit_code == 1, res.output
    assert f"--lua-dir {empty_lua}: no infergate/core/config.lua there" in res.output
    assert "init_lua_file" not in res.output
    res = check()
    assert res.exit_code == 0, res.output
    assert "nginx -t: ok" in res.output
    # nginx -t made an empty pid file to check it could: not left behind
    assert not (workdir / "run" / "nginx.pid").exists()


def test_cli_check_accepts_the_address_of_its_own_running_edge(workdir: Path, redis_server,
                                                              edge_factory) -> None:
    """Re-rendering into the folder the running nginx reads: its own metrics address is
    not "taken" (the edge names its configuration folder on /metrics)."""
    edge = edge_factory(settings_from_dict({"redis": {"url": redis_server.url}}))
    metrics = edge.metrics_url.removeprefix("http://").removesuffix("/metrics")
    own = edge.rendered.out_dir
    assert f'config_dir="{own}"' in requests.get(edge.metrics_url, timeout=5).text
    assert edge.status()["config_dir"] == str(own)
    cfg = workdir / "infergate.toml"
    cfg.write_text(f'[redis]\nurl = "{redis_server.url}"\n[edge]\nmetrics_listen = "{metrics}"\n')
    res = CliRunner().invoke(render_nginx_cmd, [
        "--config", str(cfg), "--out", str(own), "--prefix", str(workdir / "run"),
        "--listen", f"127.0.0.1:{procs.free_port()}", "--check"])
    assert res.exit_code == 0, res.output
    assert f"note: edge.metrics_listen (infergate-http.conf) {metrics} is served by the running " \
           f"edge of this configuration ({own})" in res.output


def test_cli_check_refuses_the_address_of_another_edge(workdir: Path, redis_server,
                                                       edge_factory) -> None:
    """On a shared host another stack's edge is not "this nginx": its metrics and API
    addresses are taken, and --check says whose they are."""
    other = edge_factory(settings_from_dict({"redis": {"url": redis_server.url}}))
    metrics = other.metrics_url.removeprefix("http://").removesuffix("/metrics")
    listen = other.url.removeprefix("http://")
    cfg = workdir / "infergate.toml"
    cfg.write_text(f'[redis]\nurl = "{redis_server.url}"\n[edge]\nmetrics_listen = "{metrics}"\n')
    res = CliRunner().invoke(render_nginx_cmd, [
        "--config", str(cfg), "--out", str(workdir / "o"), "--prefix", str(workdir / "run"),
        "--listen", listen, "--check"])
    assert res.exit_code == 1, res.output
    held = f"is held by another running infergate edge rendered into {other.rendered.out_dir}"
    assert f"edge.metrics_listen (infergate-http.conf) {metrics} {held}" in res.output
    assert f"the standalone listen (nginx.conf; edge.listen or --listen) {listen} {held}" \
        in res.output
    assert "nginx -t: ok" not in res.output and "Traceback" not in res.output
    # the API address given as the metrics address: still recognised as that edge (its
    # status answers there, whatever its folder is called)
    cfg.write_text(f'[redis]\nurl = "{redis_server.url}"\n[edge]\nmetrics_listen = "{listen}"\n')
    res = CliRunner().invoke(render_nginx_cmd, [
        "--config", str(cfg), "--out", str(workdir / "o"), "--prefix", str(workdir / "run"),
        "--listen", f"127.0.0.1:{procs.free_port()}", "--check"])
    assert res.exit_code == 1 and f"edge.metrics_listen (infergate-http.conf) {listen} {held}" \
        in res.output, res.output


@pytest.mark.parametrize("name", ["sp ace", "semi;colon", "quo'te", "brace{"])
def test_folders_nginx_cannot_name_are_refused(workdir: Path, name: str) -> None:
    """An unquoted path with a space or ';' would split the pid/include directives: refused
    before anything is written."""
    with pytest.raises(RenderError, match="nginx directives would split"):
        render_nginx(_settings(), workdir / name, listen="127.0.0.1:18131")
    with pytest.raises(RenderError, match="--prefix"):
        render_nginx(_settings(), workdir / "ok", listen="127.0.0.1:18131",
                     prefix=workdir / name)
    assert not (workdir / name).exists()


def test_binary_config_file_is_a_clear_error(workdir: Path) -> None:
    cfg = workdir / "bin.toml"
    cfg.write_bytes(b"\xff\xfe\x00garbage")
    res = CliRunner().invoke(render_nginx_cmd, ["--config", str(cfg), "--out", str(workdir / "o"),
                                                "--prefix", str(workdir / "run")])
    assert res.exit_code == 1 and "not UTF-8 text" in res.output
    assert "Traceback" not in res.output


def test_cli_prefix_is_never_the_output_folder(workdir: Path) -> None:
    res = CliRunner().invoke(render_nginx_cmd, ["--out", str(workdir / "o"),
                                                "--prefix", str(workdir / "o")])
    assert res.exit_code == 1 and "--prefix must not be the --out folder" in res.output
    assert not (workdir / "o").exists()


@pytest.mark.skipif(bool(shutil.which("openresty") or shutil.which(
    "openresty", path="/usr/local/openresty/bin")), reason="OpenResty is installed here")
def test_cli_openresty_check_without_openresty_says_so(workdir: Path, monkeypatch) -> None:
    monkeypatch.delenv("INFERGATE_NGINX", raising=False)
    res = CliRunner().invoke(render_nginx_cmd, ["--out", str(workdir / "o"), "--openresty",
                                                "--prefix", str(workdir / "run"), "--check"])
    assert res.exit_code == 1
    lines = [ln for ln in res.output.splitlines() if ln.strip()]
    assert lines == ["Error: openresty not found (PATH, /usr/local/openresty/bin): install "
                     "OpenResty, or render without --openresty for Debian's nginx"], res.output


def test_cli_openresty_flag(workdir: Path) -> None:
    res = CliRunner().invoke(render_nginx_cmd, ["--out", str(workdir / "o"), "--openresty",
                                                "--prefix", str(workdir / "run"),
                                                "--listen", "0.0.0.0:8080"])
    assert res.exit_code == 0, res.output
    assert "load_module" not in (workdir / "o" / "nginx.conf").read_text()


@pytest.mark.parametrize("args,message", [
    (["--config", "/nonexistent/infergate.toml"], "no such configuration file"),
    (["--listen", "localhost"], "HOST:PORT"),
])
def test_cli_bad_input(workdir: Path, args: list[str], message: str) -> None:
    res = CliRunner().invoke(render_nginx_cmd, ["--out", str(workdir / "o"), *args])
    assert res.exit_code != 0
    assert message in res.output
    assert "Traceback" not in res.output


def test_cli_invalid_toml_value(workdir: Path) -> None:
    cfg = workdir / "bad.toml"
    cfg.write_text("[edge]\nmax_tries = 0\n")
    res = CliRunner().invoke(render_nginx_cmd, ["--config", str(cfg), "--out", str(workdir / "o")])
    assert res.exit_code != 0 and "max_tries" in res.output


# Lua side of the options: infergate.core.config validates what init_by_lua receives.

def test_lua_config_accepts_rendered_options(workdir: Path) -> None:
    r = render_nginx(_settings(), workdir / "out", listen="127.0.0.1:18133")
    doc, spec = rendered_options(r.http_conf.read_text())
    got = lua_eval(workdir, f"""
            local config = require("infergate.core.config")
            assert(config.init({lua_string(json.dumps(doc))}, {lua_string(json.dumps(spec))}))
            local o = config.get()
            return {{ max_tries = o.edge.max_tries, nodes = #o.nodes, second = o.nodes[2].name }}
    """)
    assert got == {"max_tries": 3, "nodes": 2, "second": "gpu-b"}


@pytest.mark.parametrize("options,message", [
    ('{"edge": {"max_tries": 0}}', "edge.max_tries: 0 is below the minimum 1"),
    ('{"edge": {"max_tries": "3"}}', "edge.max_tries: must be an integer"),
    ('{"bogus": 1}', "bogus: unknown option"),
    ('{"nodes": [{"name": "a", "host": "127.0.0.1", "port": 0}]}', "nodes[1].port"),
    ('{"nodes": [{"name": "a", "port": 1}, {"name": "a", "port": 2}]}', "duplicate node name"),
    ('[1, 2', "not valid JSON"),
])
def test_lua_config_rejects_bad_options(workdir: Path, options: str, message: str) -> None:
    with pytest.raises(LuaError, match=re.escape(message)):
        lua_eval(workdir, f"""
            local ok, err = require("infergate.core.config").init([==[{options}]==],
                {lua_string(json.dumps(option_spec()))})
            if not ok then error(err, 0) end
            return true
        """)


def test_http_include_with_a_redis_password_is_not_world_readable(workdir: Path) -> None:
    plain = render_nginx(_settings(), workdir / "plain", listen="127.0.0.1:18134")
    assert plain.http_conf.stat().st_mode & 0o777 == 0o644
    s = _settings()
    s.redis.url = "redis://:s3cret@127.0.0.1:6390/0"
    secret = render_nginx(s, workdir / "secret", listen="127.0.0.1:18134")
    assert secret.http_conf.stat().st_mode & 0o777 == 0o640
    assert secret.server_conf.stat().st_mode & 0o777 == 0o644


def test_a_render_that_cannot_write_leaves_the_last_one_whole(workdir: Path) -> None:
    """A render that fails half-way (here: files over 30,000 bytes cannot be written, as
    on a full disk) left the new http include next to a cut-off server include, which
    nginx refuses at the next start. Every file is written aside first: the last render
    stays as it was, and no temporary file is left."""
    import sys

    out = workdir / "out"
    render_nginx(_settings(), out, listen="127.0.0.1:18123", prefix=workdir / "pre")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert len(before["infergate-server.conf"]) > 30000 > len(before["infergate-http.conf"])
    script = (
        "import resource, signal, sys\n"
        "from controlplane.config import settings_from_dict\n"
        "from controlplane.edge.render import render_nginx\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (30000, 30000))\n"
        f"s = settings_from_dict({{'redis': {{'url': 'redis://127.0.0.1:6391/0'}}, "
        f"'edge': {{'workers': 2, 'metrics_listen': '{METRICS_LISTEN}'}}}})\n"
        f"render_nginx(s, {str(out)!r}, listen='127.0.0.1:18124', prefix={str(workdir / 'pre')!r})\n")
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[2], timeout=60)
    assert res.returncode != 0 and "File too large" in res.stderr, res.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    nginx_test(out / "nginx.conf", workdir / "pre")


def test_a_render_keeps_a_linked_file_linked_and_a_file_its_owner(workdir: Path) -> None:
    """A rendered include that is a symbolic link (into a folder the operator manages) is
    rewritten where the link points, the link kept; an include an operator gave another
    owner or group (a group that may read the 0640 include) keeps them. Renaming the new
    file over the path replaced the link by a plain file, leaving the linked file stale,
    and gave the file the writer's owner and group."""
    out, real = workdir / "out", workdir / "real"
    real.mkdir()
    render_nginx(_settings(), out, listen="127.0.0.1:18123", prefix=workdir / "pre")
    (out / "infergate-http.conf").rename(real / "infergate-http.conf")
    (out / "infergate-http.conf").symlink_to(real / "infergate-http.conf")
    (real / "infergate-http.conf").write_text("# old\n", encoding="utf-8")
    owner = (65534, 65534) if os.geteuid() == 0 else (os.geteuid(), os.getegid())
    os.chown(out / "infergate-server.conf", *owner)
    render_nginx(_settings(), out, listen="127.0.0.1:18124", prefix=workdir / "pre")
    assert (out / "infergate-http.conf").is_symlink()
    assert "lua_shared_dict" in (real / "infergate-http.conf").read_text(encoding="utf-8")
    st = (out / "infergate-server.conf").stat()
    assert (st.st_uid, st.st_gid) == owner
    assert not [p.name for d in (out, real) for p in d.iterdir() if p.name.endswith(".tmp")]
    nginx_test(out / "nginx.conf", workdir / "pre")


def test_embedder_token_goes_into_the_lookup_location_only(workdir: Path) -> None:
    """cache.embedder_token: the lookup subrequest sends it; the server include that holds
    it is not world-readable; the options every worker keeps never carry it."""
    s = _settings()
    s.cache.enabled = True
    s.cache.embedder_token = "tok_" + "z" * 28
    r = render_nginx(s, workdir / "tok", listen="127.0.0.1:18135")
    server = r.server_conf.read_text()
    lookup = server[server.index("location = /_infergate/cache/lookup"):]
    lookup = lookup[:lookup.index("}")]
    assert f'proxy_set_header Authorization "Bearer {s.cache.embedder_token}";' in lookup
    assert server.count(s.cache.embedder_token) == 1
    assert s.cache.embedder_token not in r.http_conf.read_text()
    assert r.server_conf.stat().st_mode & 0o777 == 0o640
    with pytest.raises(ValueError):
        s.cache.model_validate({"embedder_token": 'bad" token; x'})


def test_a_metrics_port_held_elsewhere_fails_the_start_not_the_first_requests(workdir: Path) -> None:
    """nginx's master listens on the ports it could bind while it retries the one it
    could not, then exits: the start waits for a worker's answer, so it fails with the
    bind error instead of returning an edge that resets the first connections."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        s = _settings()
        s.edge.metrics_listen = f"127.0.0.1:{holder.getsockname()[1]}"
        r = render_nginx(s, workdir / "out", listen=f"127.0.0.1:{procs.free_port()}",
                         prefix=workdir / "pre")
        with pytest.raises(procs.StartError, match="in use"):
            start_nginx(r.nginx_conf, r.prefix)
    finally:
        holder.close()


def test_the_state_folder_is_made_under_the_prefix_only_when_it_is_the_default(
        workdir: Path) -> None:
    render_nginx(_settings(), workdir / "a", listen="127.0.0.1:18131", prefix=workdir / "pa")
    assert (workdir / "pa" / "infergate-state").is_dir()
    render_nginx(_settings(state_dir=str(workdir / "elsewhere")), workdir / "b", listen="127.0.0.1:18131", prefix=workdir / "pb")
    assert (workdir / "pb" / "logs").is_dir()
    assert not (workdir / "pb" / "infergate-state").exists()


def test_the_hop_id_is_random_and_kept_across_renders(workdir: Path) -> None:
    a = render_nginx(_settings(), workdir / "a", listen="127.0.0.1:18129", prefix=workdir / "p")
    first = (a.out_dir / "hop-id").read_text().strip()
    assert re.fullmatch(r"[0-9a-f]{16}", first)
    assert f'set $infergate_hop_id "{first}";' in a.server_conf.read_text()
    again = render_nginx(_settings(), workdir / "a", listen="127.0.0.1:18129", prefix=workdir / "p")
    assert (again.out_dir / "hop-id").read_text().strip() == first
    other = render_nginx(_settings(), workdir / "b", listen="127.0.0.1:18129", prefix=workdir / "p")
    assert (other.out_dir / "hop-id").read_text().strip() != first
    (workdir / "a" / "hop-id").write_text("not an id\n")       # replaced, never used
    fixed = render_nginx(_settings(), workdir / "a", listen="127.0.0.1:18129", prefix=workdir / "p")
    assert re.fullmatch(r"[0-9a-f]{16}", (fixed.out_dir / "hop-id").read_text().strip())


def test_a_sites_own_lua_is_kept_at_every_render(workdir: Path) -> None:
    """An OpenResty site's module path and init code, named in [edge]
    lua_package_path_extra / init_lua_file / init_worker_lua_file, run in the rendered
    http include before infergate's (nginx allows one lua_package_path and one block of
    each per http {}), and every render keeps them: a hand edit of the file would be
    lost at the next render."""
    lib = workdir / "shoplua"
    lib.mkdir()
    (lib / "shopmod.lua").write_text('return { name = "shop" }\n')
    marks = workdir / "marks"
    marks.mkdir()
    marks.chmod(0o777)                       # the workers run as nobody
    init = workdir / "shop-init.lua"
    init.write_text(f'shop = require("shopmod")\n'
                    f'local f = assert(io.open("{marks}/init", "w")) f:write(shop.name) f:close()\n')
    worker = workdir / "shop-worker.lua"
    worker.write_text(f'local f = assert(io.open("{marks}/worker", "w")) '
                      f'f:write(shop.name) f:close()\n')
    s = _settings(lua_package_path_extra=f"{lib}/?.lua", init_lua_file=str(init),
                  init_worker_lua_file=str(worker))
    listen = f"127.0.0.1:{procs.free_port()}"
    for _ in range(2):                       # a second render keeps them
        r = render_nginx(s, workdir / "out", listen=listen, prefix=workdir / "pre")
        http = r.http_conf.read_text()
        assert f'lua_package_path "{lib}/?.lua;' in http
        assert http.index(str(init)) < http.index('require("infergate.core.config").init(')
    nginx = start_nginx(r.nginx_conf, r.prefix)
    try:
        procs.wait_until(lambda: (marks / "worker").exists(), 10, what="the worker init ran")
        assert (marks / "init").read_text() == "shop" == (marks / "worker").read_text()
        assert requests.get(f"http://{listen}/infergate/status", timeout=5).status_code == 200
    finally:
        nginx.stop()
    for bad in ({"init_lua_file": "shop-init.lua"}, {"lua_package_path_extra": 'a" b'}):
        with pytest.raises(ConfigError):
            _settings(**bad)


def _site_conf(site: Path, http_body: str) -> Path:
    """A site's own nginx.conf under ``site`` (logs/ made): the Lua module, a pid and
    error log there, and ``http {`` ``http_body`` ``}``."""
    (site / "logs").mkdir(parents=True)
    conf = site / "nginx.conf"
    modules = MODULE_LINES.replace("; ", ";\n")
    conf.write_text(f"""{modules}
pid {site}/nginx.pid;
error_log {site}/logs/error.log warn;
events {{}}
http {{
{http_body}}}
""")
    return conf


def test_a_sites_log_format_with_the_edges_variables_logs_no_warning(workdir: Path) -> None:
    """``$infergate_rid`` (and ``$infergate_upstream_addr``, ``_status``,
    ``_response_time``) in a log_format of the site's:
    requests to the site's own locations and to a server without the server include are
    logged with nginx's ``$request_id``, and without a ``using uninitialized variable``
    warning in the error log for each of them."""
    s = _settings(metrics_listen=f"127.0.0.1:{procs.free_port()}")
    r = render_nginx(s, workdir / "out", listen=f"127.0.0.1:{procs.free_port()}",
                     prefix=workdir / "pre")
    api, other = procs.free_port(), procs.free_port()
    site = workdir / "site"
    conf = _site_conf(site, f"""    log_format site '"$request" $status rid=$infergate_rid ua="$infergate_upstream_addr" '
                    'us="$infergate_upstream_status" urt="$infergate_upstream_response_time"';
    access_log {site}/logs/access.log site;
    client_body_temp_path {site}/cbt;
    proxy_temp_path {site}/pt;
    include {r.http_conf};
    server {{
        listen 127.0.0.1:{api};
        location / {{ return 200 "host site"; }}
        include {r.server_conf};
    }}
    server {{
        listen 127.0.0.1:{other};
        location / {{ return 200 "other site"; }}
    }}
""")
    nginx = start_nginx(conf, site)
    try:
        assert requests.get(f"http://127.0.0.1:{api}/", timeout=5).text == "host site"
        assert requests.get(f"http://127.0.0.1:{other}/x", timeout=5).text == "other site"
        assert requests.get(f"http://{s.edge.metrics_listen}/metrics", timeout=5).ok
        assert requests.get(f"http://127.0.0.1:{api}/infergate/status", timeout=5).ok
    finally:
        nginx.stop()
    log = (site / "logs" / "access.log").read_text()
    for request in ("GET / ", "GET /x ", "GET /infergate/status "):
        lines = [ln for ln in log.splitlines() if ln.startswith(f'"{request}')]
        assert lines, log
        for line in lines:
            assert re.search(r" 200 rid=[0-9a-f]{32} ", line), line
    errors = (site / "logs" / "error.log").read_text()
    assert "uninitialized" not in errors, errors


def test_a_sites_inherited_proxy_directives_limits_and_denials_keep_openai_answers(
        workdir: Path, tiny_upstreams) -> None:
    """Directives an nginx site sets in http {} or server {} and the includes inherit:
    ``proxy_intercept_errors on`` must not replace a node's own error answer with the
    edge's page; the site's ``limit_req`` answers JSON that names that limit, not "no
    node available"; a site's ``deny`` still gets a JSON 403; nodes get the client's
    address in X-Forwarded-For (as a site's own proxy_set_header would have sent it)."""
    (up,) = tiny_upstreams(1)
    s = settings_from_dict({"redis": {"url": f"redis://127.0.0.1:{procs.free_port()}/0"},
                            "edge": {"workers": 1,
                                     "metrics_listen": f"127.0.0.1:{procs.free_port()}"},
                            "nodes": [up.node_settings().model_dump(mode="json")]})
    r = render_nginx(s, workdir / "out", listen=f"127.0.0.1:{procs.free_port()}",
                     prefix=workdir / "pre")
    api, denied = procs.free_port(), procs.free_port()
    site = workdir / "site"
    conf = _site_conf(site, f"""    access_log off;
    client_body_temp_path {site}/cbt;
    proxy_temp_path {site}/pt;
    proxy_intercept_errors on;
    limit_req_zone $binary_remote_addr zone=perip:1m rate=1r/m;
    include {r.http_conf};
    server {{
        listen 127.0.0.1:{api};
        location / {{ return 200 "host site"; }}
        include {r.server_conf};
    }}
    server {{
        listen 127.0.0.1:{denied};
        deny 127.0.0.1;
        limit_req zone=perip;
        include {r.server_conf};
    }}
""")
    nginx = start_nginx(conf, site)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    try:
        # the node's own 404 for a path it does not serve, as it wrote it
        res = requests.post(f"http://127.0.0.1:{api}/v1/not-served", json=body, timeout=10)
        assert res.status_code == 404, res.text
        assert res.json()["error"]["message"] == "no route /v1/not-served"
        ok = requests.post(f"http://127.0.0.1:{api}/v1/chat/completions", json=body, timeout=10)
        assert ok.status_code == 200, ok.text
        assert up.headers_seen[-1].get("X-Forwarded-For") == "127.0.0.1"
        # a stream (relayed by the edge itself): the same header, the client's own kept
        ok = requests.post(f"http://127.0.0.1:{api}/v1/chat/completions",
                           json={**body, "stream": True},
                           headers={"X-Forwarded-For": "198.51.100.4"}, timeout=10)
        assert ok.status_code == 200 and ok.text.rstrip().endswith("[DONE]"), ok.text
        assert up.headers_seen[-1].get("X-Forwarded-For") == "198.51.100.4, 127.0.0.1"
        # a site's deny: a JSON 403, not nginx's HTML page
        res = requests.post(f"http://127.0.0.1:{denied}/v1/chat/completions", json=body,
                            timeout=10)
        assert res.status_code == 403 and res.json()["error"]["code"] == "forbidden"
    finally:
        nginx.stop()
    # the limit: a server without the deny, the zone shared
    conf.write_text(conf.read_text().replace("        deny 127.0.0.1;\n", ""))
    nginx = start_nginx(conf, site)
    try:
        first = requests.get(f"http://127.0.0.1:{denied}/v1/models", timeout=10)
        second = requests.get(f"http://127.0.0.1:{denied}/v1/models", timeout=10)
        assert first.status_code == 200, first.text
        assert second.status_code == 503, second.text
        err = second.json()["error"]
        assert err["code"] == "rate_limit_exceeded" and "limit_req" in err["message"]
    finally:
        nginx.stop()
