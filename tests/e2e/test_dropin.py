"""The drop-in guide for an existing nginx (docs/dropin.md), followed step by step in a
scratch folder: the shell lines of the guide are read from it and run in their order,
with /etc/infergate, /etc/nginx, /etc/redis and /var/lib/infergate moved under the
scratch folder, free ports instead of the standard ones, and the services systemd would
start (Redis, nginx, the units of docs/systemd/) started in the foreground. A line of the
guide this test does not know fails it, so the guide and the test stay the same.

What it shows: Redis with the durable settings written into its config file; render and
``--check`` (binds the listen addresses) into a folder that then holds only the three
config files; the includes inside an existing ``http {}`` and ``server {}``; ``nginx -t``
after including; the control plane and the embedder with the commands of their units,
the embedder on ``cache.embedder_url`` of the same file; a key, then a first request
through the existing server (a semantic lookup answered, not BYPASS) and the same
request again from the cache, while the existing site still answers."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path

import pytest
import requests

from controlplane import procs
from controlplane.edge.render import default_modules_dir, nginx_binary

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
INFERGATE = ROOT / ".venv" / "bin" / "infergate"
GUIDE = ROOT / "docs" / "dropin.md"


def guide_text() -> str:
    """The whole guide (docs/dropin.md): every ``sh`` block in it is a step."""
    return GUIDE.read_text(encoding="utf-8")


def blocks(section: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", section, re.S | re.M)


def shell_lines(section: str) -> list[str]:
    return [ln.strip() for b in blocks(section, "sh") for ln in b.splitlines() if ln.strip()]


def unit_command(name: str) -> list[str]:
    """ExecStart of docs/systemd/<name>, as argv."""
    text = (ROOT / "docs" / "systemd" / name).read_text()
    return shlex.split(re.search(r"^ExecStart=(.*)$", text, re.M).group(1))


class Guide:
    """The scratch machine the guide runs on."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.moved = {"/etc/infergate": root / "etc" / "infergate",
                      "/etc/nginx/infergate": root / "etc" / "nginx" / "infergate",
                      "/etc/nginx/nginx.conf": root / "etc" / "nginx" / "nginx.conf",
                      "/var/lib/infergate": root / "var" / "lib" / "infergate",
                      "/opt/infergate/venv/bin/infergate": INFERGATE}
        self.procs: list[procs.Managed] = []
        self.redis_port = procs.free_port()
        self.redis_conf = root / "etc" / "redis" / "redis.conf"
        self.host_port = procs.free_port()
        self.nginx_prefix = root / "nginx-prefix"
        self.key = ""
        self.answers: list[requests.Response] = []

    def path(self, text: str) -> str:
        for old, new in self.moved.items():
            text = text.replace(old, str(new))
        return text

    def run(self, argv: list[str]) -> str:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, f"{argv}: {res.stdout}{res.stderr}"
        return res.stdout + res.stderr

    def start(self, name: str, argv: list[str], ready, timeout: float = 60) -> None:
        m = procs.Managed(name, argv, self.root / "logs" / f"{name}.log").start()
        self.procs.append(m)
        m.wait_ready(ready, timeout)

    def stop(self) -> None:
        for m in reversed(self.procs):
            m.stop()


def _debian_redis_running(g: Guide) -> None:
    """What the redis-server package leaves behind: Debian's redis.conf, the server
    running with it (here on a free port, in the foreground, files in the scratch)."""
    conf = Path("/etc/redis/redis.conf").read_text()
    data = g.root / "var" / "lib" / "redis"
    data.mkdir(parents=True)
    for key, value in (("port", str(g.redis_port)), ("daemonize", "no"), ("supervised", "no"),
                       ("pidfile", str(g.root / "redis.pid")), ("logfile", '""'),
                       ("dir", str(data)), ("bind", "127.0.0.1")):
        conf = re.sub(rf"^{key} .*$", f"{key} {value}", conf, flags=re.M)
    g.redis_conf.parent.mkdir(parents=True)
    g.redis_conf.write_text(conf)
    g.start("redis", [procs.find_redis_server(), str(g.redis_conf)],
            lambda: procs.port_open("127.0.0.1", g.redis_port), 15)


def _existing_nginx_conf(g: Guide, section: str) -> None:
    """The guide's nginx block as the operator fills it in: a Debian-style nginx.conf
    (modules-enabled loads the Lua module) whose ``server {}`` already has a site."""
    (block,) = blocks(section, "nginx")
    assert "include /etc/nginx/infergate/infergate-http.conf;" in block
    assert "include /etc/nginx/infergate/infergate-server.conf;" in block
    p = g.nginx_prefix
    (p / "logs").mkdir(parents=True)
    text = g.path(block)
    text = text.replace("    # ... your existing settings ...",
                        f"    access_log {p}/logs/access.log;\n"
                        f"    client_body_temp_path {p}/client_body_temp;\n"
                        f"    proxy_temp_path {p}/proxy_temp;")
    text = text.replace("listen 443 ssl;", f"listen 127.0.0.1:{g.host_port};")
    text = text.replace("        # ... your certificates, other locations ...",
                        '        location / { default_type text/plain; return 200 "existing site\\n"; }\n'
                        # the site's own error page, and a location with its own body limit
                        '        error_page 404 /site-404.html;\n'
                        '        location = /site-404.html { internal; default_type text/html; '
                        'return 404 "<h1>site 404</h1>"; }\n'
                        '        location = /upload { client_max_body_size 1k; return 204; }\n'
                        '        location /gone/ { return 404; }')
    modules = ("include /etc/nginx/modules-enabled/*.conf;"
               if Path("/etc/nginx/modules-enabled/50-mod-http-lua.conf").exists() else
               f"load_module {default_modules_dir()}/ndk_http_module.so;\n"
               f"load_module {default_modules_dir()}/ngx_http_lua_module.so;")
    head = (f"{modules}\nworker_processes 1;\npid {p}/nginx.pid;\n"
            f"error_log {p}/logs/error.log;\nevents {{ worker_connections 256; }}\n")
    conf = g.moved["/etc/nginx/nginx.conf"]
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(head + text)


def _config(g: Guide, node_url: str) -> dict[str, int]:
    """The $EDITOR step: nodes, Redis, keys required, the cache with its embedder."""
    ports = {"metrics": procs.free_port(), "standalone": procs.free_port(),
             "admin": procs.free_port(), "embedder": procs.free_port()}
    path = g.moved["/etc/infergate"] / "infergate.toml"
    assert path.read_text() == (ROOT / "docs" / "infergate.example.toml").read_text()
    path.write_text(f"""
[redis]
url = "redis://127.0.0.1:{g.redis_port}/0"

[edge]
listen = "127.0.0.1:{ports['standalone']}"
metrics_listen = "127.0.0.1:{ports['metrics']}"

[controlplane]
listen = "127.0.0.1:{ports['admin']}"
poll_interval_s = 0.5

[auth]
mode = "required"

[cache]
enabled = true
embedder_url = "http://127.0.0.1:{ports['embedder']}"
semantic_budget_ms = 2000

[[nodes]]
name = "gpu-a"
url = "{node_url}"
kind = "vllm"
""")
    return ports


def test_dropin_guide_step_by_step(workdir: Path, simnodes) -> None:
    section = guide_text()
    lines = shell_lines(section)
    assert lines, "no shell steps in the drop-in guide"
    (node,) = simnodes(1, names=["gpu-a"], time_scale=0.05)
    g = Guide(workdir)
    conf_dir = g.moved["/etc/infergate"]
    ports: dict[str, int] = {}
    done = []
    try:
        for line in lines:
            words = shlex.split(line, comments=True)
            if line == "bash .ci/install-runtime":
                # the install itself: tests/e2e/test_runtime_install.py. What this guide
                # needs from it: Debian's Redis running, the example config in place.
                assert (ROOT / ".ci" / "install-runtime").is_file()
                _debian_redis_running(g)
                conf_dir.mkdir(parents=True)
                (conf_dir / "infergate.toml").write_text(
                    (ROOT / "docs" / "infergate.example.toml").read_text())
            elif words[0] == "redis-cli":
                g.run(["redis-cli", "-p", str(g.redis_port), *words[1:]])
            elif words[0] == "$EDITOR":
                assert g.path(words[1]) == str(conf_dir / "infergate.toml")
                ports = _config(g, node.url)
            elif words[:2] == ["infergate", "render-nginx"]:
                out = g.run([str(INFERGATE), *map(g.path, words[1:])])
                assert "listen addresses free, nginx -t: ok" in out, out
                _existing_nginx_conf(g, section)
            elif words == ["nginx", "-t"]:
                # nginx's own prefix (Debian's modules-enabled names modules relative to it)
                g.run([nginx_binary(), "-t", "-c", str(g.moved["/etc/nginx/nginx.conf"])])
            elif words == ["systemctl", "reload", "nginx"]:
                g.start("nginx", [nginx_binary(), "-c", str(g.moved["/etc/nginx/nginx.conf"]),
                                  "-g", "daemon off;"],
                        lambda: procs.port_open("127.0.0.1", g.host_port), 20)
            elif words[:3] == ["systemctl", "enable", "--now"]:
                assert words[3:] == ["infergate-controlplane", "infergate-embedder"]
                cp = [g.path(a) for a in unit_command("infergate-controlplane.service")]
                g.start("controlplane", cp,
                        lambda: procs.port_open("127.0.0.1", ports["admin"]), 30)
                emb = [g.path(a) for a in unit_command("infergate-embedder.service")]
                url = f"http://127.0.0.1:{ports['embedder']}/healthz"

                def embedder_up() -> bool:
                    try:
                        return requests.get(url, timeout=1).status_code == 200
                    except requests.RequestException:
                        return False

                g.start("embedder", emb, embedder_up, 120)
            elif words[:2] == ["infergate", "keys"]:
                out = g.run([str(INFERGATE), *map(g.path, words[1:])])
                g.key = re.search(r"\big-[A-Za-z0-9_\-]+", out).group(0)
            elif words[0] == "KEY=ig-...":
                assert g.key, "the key is set from what `infergate keys create` printed"
            elif words[0] == "curl":
                url = next(w for w in words if w.startswith("https://your.host/"))
                body = json.loads(words[words.index("-d") + 1])
                body["model"] = "sim-llama"
                target = url.replace("https://your.host", f"http://127.0.0.1:{g.host_port}")
                headers = {"Authorization": f"Bearer {g.key}"}
                for _ in range(2):
                    g.answers.append(requests.post(target, json=body, headers=headers, timeout=30))
                    if len(g.answers) == 1:
                        time.sleep(0.5)  # the answer is stored just after it is sent
            else:
                pytest.fail(f"drop-in step this test does not know: {line!r}")
            done.append(line)

        assert done == lines
        # Redis: the durable settings are in its config file now
        conf = g.redis_conf.read_text()
        for setting in ("appendonly yes", "appendfsync everysec", "maxmemory-policy volatile-lru"):
            assert re.search(rf"^{setting}$", conf, re.M), setting
        # render-nginx wrote only the config into --out; runtime files under --prefix
        out_dir = g.moved["/etc/nginx/infergate"]
        assert sorted(p.name for p in out_dir.iterdir()) == [
            "hop-id", "infergate-http.conf", "infergate-server.conf", "nginx.conf"]
        assert (g.moved["/var/lib/infergate"] / "nginx" / "logs").is_dir()
        # the first request: through the existing server, a node answered, the semantic
        # lookup reached the embedder (MISS, not BYPASS); the same request: a cache hit
        first, again = g.answers
        assert first.status_code == 200, first.text
        assert first.headers["X-Infergate-Node"] == "gpu-a"
        assert first.headers["X-Cache-Status"] == "MISS", first.headers
        assert again.status_code == 200, again.text
        assert again.headers["X-Cache-Status"] == "HIT", again.headers
        assert again.json()["choices"][0]["message"]["content"] == \
            first.json()["choices"][0]["message"]["content"]
        site = requests.get(f"http://127.0.0.1:{g.host_port}/", timeout=5)
        assert site.status_code == 200 and site.text == "existing site\n"
        # the site keeps its own error pages; the API's locations answer JSON (any /v1
        # path is the API's: here it needs a key)
        assert requests.get(f"http://127.0.0.1:{g.host_port}/v1/nope", timeout=5).json()[
            "error"]["code"] == "invalid_api_key"
        big = requests.post(f"http://127.0.0.1:{g.host_port}/upload", data=b"x" * 4096, timeout=5)
        assert big.status_code == 413 and "json" not in big.headers["Content-Type"]
        assert "<h1>site 404</h1>" in requests.get(f"http://127.0.0.1:{g.host_port}/gone/x",
                                                   timeout=5).text
        unauth = requests.post(f"http://127.0.0.1:{g.host_port}/v1/chat/completions",
                               json={"model": "sim-llama", "messages": []}, timeout=5)
        assert unauth.status_code == 401
        metrics = requests.get(f"http://127.0.0.1:{ports['metrics']}/metrics", timeout=5)
        assert "infergate_edge_requests_total" in metrics.text
        log = (g.nginx_prefix / "logs" / "error.log").read_text()
        bad = [ln for ln in log.splitlines()
               if re.search(r"\[(emerg|alert|crit|error)\]|global Lua variable", ln)
               and 'request: "POST /upload ' not in ln]   # the site's own 413 above
        assert not bad, bad
    finally:
        g.stop()
