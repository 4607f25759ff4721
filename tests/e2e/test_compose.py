"""docker-compose.yml, controlplane/Dockerfile and docs/compose/infergate.toml, checked
without a Docker engine: ``docker compose config`` (Compose v2) or, when the plugin is
missing, ``docker-compose config`` (Debian's 1.29) validates the file and prints the
resolved services; the Dockerfile's COPY sources must exist and not be excluded by
.dockerignore; the compose configuration must load and render for OpenResty.

Nothing here builds an image or starts a container (docs/operations.md "Containers"
says what that leaves unexercised)."""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from controlplane.config import load_settings
from controlplane.edge.render import render_nginx

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "controlplane" / "Dockerfile"
COMPOSE_TOML = ROOT / "docs" / "compose" / "infergate.toml"


def _works(argv: list[str]) -> bool:
    try:
        return subprocess.run(argv, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def compose_command() -> list[str] | None:
    """``docker compose`` when the v2 plugin answers, else ``docker-compose``, else None."""
    if shutil.which("docker") and _works(["docker", "compose", "version"]):
        return ["docker", "compose"]
    if shutil.which("docker-compose") and _works(["docker-compose", "version"]):
        return ["docker-compose"]
    return None


@pytest.fixture(scope="module")
def compose() -> list[str]:
    cmd = compose_command()
    if cmd is None:
        pytest.skip("neither `docker compose` (v2 plugin) nor `docker-compose` is installed "
                    "(apt-get install docker-compose)")
    return cmd


#: The admin token the compose file is checked with (it has no default).
TOKEN = "compose-test-token"


def run_compose(cmd: list[str], *args: str, token: str | None = TOKEN) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "INFERGATE_ADMIN_TOKEN"}
    if token is not None:
        env["INFERGATE_ADMIN_TOKEN"] = token
    return subprocess.run([*cmd, "-f", str(COMPOSE), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_compose_file_is_valid(compose) -> None:
    res = run_compose(compose, "config", "-q")
    assert res.returncode == 0, res.stderr


def test_compose_refuses_to_start_without_an_admin_token(compose) -> None:
    res = run_compose(compose, "config", "-q", token=None)
    assert res.returncode != 0
    assert "set INFERGATE_ADMIN_TOKEN" in res.stderr + res.stdout
    assert "change-me" not in COMPOSE.read_text()


def test_compose_services_and_wiring(compose) -> None:
    res = run_compose(compose, "config")
    assert res.returncode == 0, res.stderr
    doc = yaml.safe_load(res.stdout)
    services = doc["services"]
    assert set(services) == {"redis", "sim-a", "sim-b", "controlplane", "embedder", "render", "edge"}
    for name in ("sim-a", "sim-b", "controlplane", "render"):
        assert services[name]["image"] == "infergate:local"
        assert services[name]["build"]["dockerfile"].endswith("controlplane/Dockerfile")
    emb = services["embedder"]
    assert emb["build"]["args"]["EXTRAS"] == "cache" and emb["image"] == "infergate:cache"
    assert "healthcheck" in emb
    edge = services["edge"]
    deps = edge["depends_on"]
    assert deps["render"]["condition"] == "service_completed_successfully"
    assert deps["embedder"]["condition"] == "service_healthy"
    assert services["controlplane"]["depends_on"]["redis"]["condition"] == "service_healthy"
    assert {"8080", "9145"} <= {_published(p) for p in edge["ports"]}
    assert services["controlplane"]["environment"]["INFERGATE_ADMIN_TOKEN"] == TOKEN
    # every bind-mounted file or folder exists in the repository
    for svc in services.values():
        for v in svc.get("volumes", []):
            src = _bind_source(v)
            if src is not None:
                assert (ROOT / src).exists(), src  # ROOT / "/abs" is "/abs"


def _published(port: object) -> str:
    """Host port of a ``ports`` entry (long form, or ``[ip:]host:container[/proto]``)."""
    if isinstance(port, dict):
        return str(port.get("published"))
    return str(port).split("/")[0].split(":")[-2]


def _bind_source(volume: object) -> str | None:
    """Host path of a bind mount (short or long form), None for a named volume."""
    if isinstance(volume, dict):
        return volume["source"] if volume.get("type") == "bind" else None
    src = str(volume).split(":")[0]
    return src if src.startswith(("/", ".")) else None


def _dockerignore() -> list[str]:
    path = ROOT / ".dockerignore"
    if not path.exists():
        return []
    return [line.strip() for line in path.read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def test_dockerfile_copies_only_what_exists() -> None:
    text = DOCKERFILE.read_text()
    ignored = _dockerignore()
    sources = []
    for line in text.splitlines():
        m = re.match(r"^COPY\s+(?!--from)(.+)\s+\S+$", line.strip())
        if m:
            sources += m.group(1).split()
    assert {"pyproject.toml", "controlplane", "lua", "nginx", "templates"} <= set(sources)
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        assert not any(fnmatch.fnmatch(src, pat.rstrip("/")) for pat in ignored), \
            f"COPY {src}: excluded by .dockerignore"
    # the semantic extra gets the CPU build of torch first, from the PyTorch CPU index
    assert "download.pytorch.org/whl/cpu" in text and 'torch==${TORCH_VERSION}' in text
    assert text.index("torch==") < text.index('pip install --no-cache-dir ".${EXTRAS')
    pinned = re.search(r'"torch==([0-9.]+)"', (ROOT / "pyproject.toml").read_text())
    assert pinned and f"ARG TORCH_VERSION={pinned.group(1)}" in text
    assert re.search(r"^USER\s+\S+", text, re.M), "the image runs as a non-root user"
    assert ".venv" in ignored and ".git" in ignored


def test_compose_configuration_renders_for_openresty(workdir: Path) -> None:
    s = load_settings(COMPOSE_TOML)
    assert s.cache.enabled and s.cache.embedder_url == "http://embedder:8090"
    r = render_nginx(s, workdir / "rendered", openresty=True, prefix=workdir / "prefix",
                     lua_dir="/opt/infergate/lua", resolver="127.0.0.11")
    http = r.http_conf.read_text()
    assert "load_module" not in r.nginx_conf.read_text()
    assert "resolver 127.0.0.11" in http  # Docker's embedded DNS resolves "redis"
    assert "server embedder:8090;" in http
    assert re.search(r"listen 0\.0\.0\.0:9145;", http)
    assert 'lua_package_path "/opt/infergate/lua/?.lua;;"' in http
    assert "listen 0.0.0.0:8080 backlog=4096;" in r.nginx_conf.read_text()
