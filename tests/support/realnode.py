"""Real inference nodes: llama.cpp's ``llama-server`` with Gemma 3 270M, started through
:class:`bench.realnode.RealNode` on free loopback ports.

Fixture (registered through ``pytest_plugins`` in tests/conftest.py):
``realnodes(n, parallel=2, threads=1, metrics=True, extra_args=())`` -> list of started :class:`RealNode` (``/health``
answered 200 within the deadline), all stopped at the end of the test module.

When the binary (``python -m bench.realnode build``, run by .ci/install) or the model
package is missing, a test that asks for nodes fails under CI (``CI=true``) and is skipped
elsewhere, with the message saying what to run.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from bench.realnode import BuildError, RealNode, find_binary, model_path
from controlplane import procs

#: Seconds each node gets to load the model and answer /health.
READY_TIMEOUT_S = 90.0


def in_ci() -> bool:
    """``CI`` is set to ``true`` or ``1`` (GitHub Actions, GitLab CI and most others)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require_engine() -> None:
    """Fail (under CI) or skip (elsewhere) unless the llama-server binary and the model
    package are there."""
    try:
        if find_binary() is None:
            raise BuildError("llama-server is not built: run `python -m bench.realnode build` "
                             "(.ci/install does), or set INFERGATE_LLAMA_SERVER to a binary")
        model_path()
    except BuildError as exc:
        if in_ci():
            pytest.fail(f"real engine missing under CI: {exc}", pytrace=False)
        pytest.skip(f"real engine missing: {exc}")


@pytest.fixture(scope="module")
def realnodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., list[RealNode]]]:
    """Factory: ``realnodes(n, parallel=2, threads=1, metrics=True)`` starts ``n``
    llama-servers (one after the other, each waited for; ``metrics=False``: without
    ``--metrics``) and returns them; every one is stopped at the end of the module, also
    when a later one fails to start."""
    started: list[RealNode] = []
    logs = tmp_path_factory.mktemp("realnodes")

    def start(n: int, parallel: int = 2, threads: int = 1, metrics: bool = True,
              extra_args: tuple[str, ...] = ()) -> list[RealNode]:
        require_engine()
        out = []
        for _ in range(n):
            def on(port: int) -> RealNode:
                node = RealNode(port=port, parallel=parallel, threads=threads,
                                metrics=metrics, log_dir=logs, extra_args=extra_args)
                started.append(node)   # stopped at the end even when interrupted
                return node.start(timeout_s=READY_TIMEOUT_S)

            out.append(procs.on_free_port(on))
        return out

    try:
        yield start
    finally:
        for node in reversed(started):
            node.stop()
