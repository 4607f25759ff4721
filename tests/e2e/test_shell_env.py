"""The tests may run from a shell that holds a running stack's variables: after the
README's quick start, that shell has `infergate up`'s `export INFERGATE_REDIS_URL=...` line
(perhaps an admin token too) when `.venv/bin/pytest` is typed in it. Those variables
override the configuration of every part, so unless the suite drops them, its control
planes and edges use that stack's Redis (writing their nodes into its registry, then
waiting in vain for their own snapshot) and its admin token.

The outer test starts a Redis standing for that stack's and runs the inner test in a
pytest session of its own with the variables set; the inner test starts a control plane
on a Redis of its own, as the suite's fixtures do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from controlplane.config import settings_from_dict

ROOT = Path(__file__).resolve().parents[2]
INNER = "INFERGATE_TEST_SHELL_ENV_INNER"


@pytest.mark.skipif(not os.environ.get(INNER), reason="run by the test below, in a session of its own")
def test_a_control_plane_of_the_suite_keeps_to_its_own_redis(redis_server, controlplane_factory) -> None:
    settings = settings_from_dict({"redis": {"url": redis_server.url},
                                   "controlplane": {"poll_interval_s": 0.2}})
    assert settings.redis.url == redis_server.url
    assert not settings.controlplane.admin_token
    controlplane_factory(settings, timeout=15.0)  # waits for its snapshot in its own Redis


def test_the_suite_ignores_a_running_stacks_variables(redis_server) -> None:
    stack = redis_server.client()
    stack.set("user:data", "kept")
    env = {**os.environ, INNER: "1", "INFERGATE_REDIS_URL": redis_server.url,
           "INFERGATE_ADMIN_TOKEN": "the-stacks-admin-token",
           "INFERGATE_EMBEDDER_TOKEN": "the-stacks-embedder-token",
           "INFERGATE_INSTANCE_ID": "up-0123456789ab"}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "0",
         f"{Path(__file__).relative_to(ROOT)}::"
         "test_a_control_plane_of_the_suite_keeps_to_its_own_redis"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:] + res.stderr[-2000:]
    # the stack's Redis got nothing from the suite
    assert stack.keys("*") == ["user:data"]
