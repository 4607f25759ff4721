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

# Fixtures that start several parts together live in tests/support/.
pytest_plugins = ["support.stack"]

TESTS = Path(__file__).resolve().parent
OUTPUT = TESTS / "output"
#: Test folders whose tests start no process (the fast loop: pytest -m "not integration").
PURE_LAYERS = {"unit"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test outside tests/unit/ starts real processes (nginx, redis-server,
    simulated nodes): mark it ``integration`` by its folder."""
    for item in items:
        try:
            layer = Path(str(item.fspath)).resolve().relative_to(TESTS).parts[0]
        except ValueError:
            continue
        if layer not in PURE_LAYERS:
            item.add_marker(pytest.mark.integration)


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
    port = procs.free_port()
    m = procs.start_redis(workdir / "redis", port)
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
    port = procs.free_port()
    m = procs.start_redis(d / "redis", port)
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
