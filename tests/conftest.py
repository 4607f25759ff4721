"""Shared fixtures. Every process a test needs is started on free loopback ports,
waited for with a deadline and stopped at teardown (see controlplane.procs)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import redis

from controlplane import procs
from controlplane.edge import render as _render
from support import cabundle

# Every configuration a test renders must pass ``nginx -t`` (the standalone config
# includes both drop-in files, so this checks them too): the renderer is wrapped here,
# before any test module imports it. OpenResty renderings are checked only where an
# openresty binary exists (their own tests say so).
_render_nginx = _render.render_nginx


def _render_and_check(*args, **kwargs):
    rendered = _render_nginx(*args, **kwargs)
    if not rendered.openresty or shutil.which("openresty"):
        _render.nginx_test(rendered.nginx_conf, rendered.prefix,
                           nginx_bin="openresty" if rendered.openresty else None)
    return rendered


# a caller that starts nginx on the configuration at once (edge_factory) skips the
# separate `nginx -t`: the start parses the same files and fails on what -t would refuse
_render_and_check.unchecked = _render_nginx  # type: ignore[attr-defined]
_render.render_nginx = _render_and_check

#: Variables of a running stack that override the configuration of every part: the shell
#: that runs the tests may hold them (the banner of ``infergate up`` has the user export
#: INFERGATE_REDIS_URL; an admin token, the instance id ``up`` hands its parts, ...). They
#: are dropped for the whole run, its workers and every process it starts, so the tests'
#: control planes, edges and embedders keep to the Redis and tokens their tests set up
#: instead of writing into that stack's Redis. A test that needs one sets it itself.
STACK_ENV = ("INFERGATE_REDIS_URL", "INFERGATE_ADMIN_TOKEN", "INFERGATE_ADMIN_SECRET_KEY",
             "INFERGATE_EMBEDDER_TOKEN", "INFERGATE_INSTANCE_ID", "INFERGATE_CONFIG",
             "INFERGATE_API_KEY")
STACK_ENV_PREFIXES = ("INFERGATE_EMBEDDER_",)  # the embedder's options (click envvars)
for _name in list(os.environ):
    if _name in STACK_ENV or _name.startswith(STACK_ENV_PREFIXES):
        del os.environ[_name]

# Every nginx of the run starts on a one-certificate CA bundle (support.cabundle): set
# before any part starts.
cabundle.install()

# Fixtures that start several parts together live in tests/support/.
pytest_plugins = ["support.stack", "support.tiny_upstream", "support.realnode",
                  "support.rediscluster"]

TESTS = Path(__file__).resolve().parent
OUTPUT = TESTS / "output"
#: Test folders of the fast loop (pytest -m "not integration"). tests/unit/ starts no
#: process at all; tests/lua/ runs Lua inside short-lived nginx processes (init_by_lua,
#: no server, no Redis: support.stack.lua_eval) and marks each of its tests that starts a
#: server (redis-server, a serving nginx) ``integration`` itself (tests/lua/conftest.py
#: refuses a server to any other).
FAST_LAYERS = {"unit", "lua"}


#: The files that take longest (measured with --durations=0 on 2 cores, 40-100 s each),
#: collected first: the workers (``--dist loadfile``) take files in collection order, so
#: the run ends on short files instead of one worker finishing a long one alone. Order
#: only: a file missing here just runs in its place.
SLOW_FIRST = (
    "edge/test_edge_outlier.py", "e2e/test_up_restarts.py", "e2e/test_up_supervision.py",
    "e2e/test_runtime_install.py", "embedder/test_cache_calibrate_cli.py",
    "edge/test_cache_edge.py", "admin/test_browser_admin.py", "e2e/test_up_embedder_port.py",
    "engine/test_llamacpp_life.py", "edge/test_auth.py", "faults/test_drill_state.py",
    "embedder/test_embedder_processes.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test outside the fast layers starts real processes (nginx, redis-server,
    simulated nodes): mark it ``integration`` by its folder. The :data:`SLOW_FIRST`
    files go first (each file's tests in their own order)."""
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}

    def order(item: pytest.Item) -> int:
        try:
            rel = Path(str(item.fspath)).resolve().relative_to(TESTS).as_posix()
        except ValueError:
            return len(rank)
        return rank.get(rel, len(rank))

    items.sort(key=order)  # stable: the rest keep their collection order
    for item in items:
        try:
            layer = Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if layer not in FAST_LAYERS:
            item.add_marker(pytest.mark.integration)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """With exactly ``-m "not integration"`` (the fast loop), nothing outside the fast
    layers can be selected (see :func:`pytest_collection_modifyitems`): skip importing
    those folders instead of collecting and deselecting them."""
    if (config.getoption("markexpr") or "").strip() != "not integration":
        return None
    try:
        parts = collection_path.resolve().relative_to(TESTS).parts
    except ValueError:
        return None
    if len(parts) == 1 and collection_path.is_dir() and parts[0] not in FAST_LAYERS | {"support"}:
        return True
    return None


@pytest.fixture
def workdir():
    """A scratch folder under /tmp that nginx workers (which drop root for ``nobody``)
    can traverse; pytest's own tmp_path is private to root. Removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="infergate-test-"))
    os.chmod(d, 0o755)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def output_dir(request: pytest.FixtureRequest) -> Path:
    """tests/output/<test name>/ for artifacts a person may want to look at."""
    d = OUTPUT / request.node.name.replace("/", "_")
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


class RedisServer:
    def __init__(self, managed: procs.Managed, port: int):
        self.managed = managed
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True,
                           socket_timeout=2)

    def stop(self) -> None:
        self.managed.stop()

    def start_again(self, workdir: Path) -> None:
        self.managed = procs.start_redis(workdir, self.port)


@pytest.fixture
def redis_server(workdir: Path):
    """A fresh redis-server on a free port; ``.url``, ``.client()``, ``.stop()``."""
    m, port = procs.start_redis_free_port(workdir / "redis")
    server = RedisServer(m, port)
    try:
        yield server
    finally:
        server.managed.stop()


@pytest.fixture(scope="module")
def shared_redis_port():
    """One redis-server for a whole test module (pair with ``r``, which empties it before
    each test): much faster than a server per test."""
    d = Path(tempfile.mkdtemp(prefix="infergate-test-"))
    m, port = procs.start_redis_free_port(d / "redis")
    try:
        yield port
    finally:
        m.stop()
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def r(shared_redis_port) -> redis.Redis:
    """A client of the module's redis-server, emptied (FLUSHALL) for this test."""
    client = redis.Redis(host="127.0.0.1", port=shared_redis_port, decode_responses=True,
                         socket_timeout=2)
    client.flushall()
    return client
