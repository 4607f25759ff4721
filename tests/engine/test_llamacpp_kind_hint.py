"""``infergate up --node URL`` in front of a llama.cpp server started without ``--metrics``
and of a server that is none of the known kinds (the tiny upstream: 404 on /health,
/metrics and /props): ``infergate nodes list`` prints one line for each saying what to
set, and the llama.cpp node still gets its slots as its max_concurrency."""

from __future__ import annotations

import json
import subprocess

import pytest
import redis

from controlplane import procs
from controlplane.redisdb import keynames
from support.upstack import UpStack

pytestmark = pytest.mark.integration


def _list(up: UpStack, *extra: str) -> str:
    return subprocess.run(procs.infergate_argv("nodes", "--redis-url", up.redis_url, "list",
                                               *extra),
                          capture_output=True, text=True, timeout=30, check=True).stdout


def test_a_node_whose_kind_needs_a_setting_gets_one_line(realnodes, tiny_upstreams,
                                                        workdir) -> None:
    bare = realnodes(1, metrics=False)[0]
    other = tiny_upstreams(1)[0]
    up = UpStack.start(workdir / "up", "[cache]\nenabled = false\n",
                       "--node", bare.url, "--node", other.url)
    try:
        assert up.proc.poll() is None, up.text()

        def hinted() -> bool:
            text = _list(up)
            health = {v["name"]: v["healthy"] for v in json.loads(_list(up, "--json"))}
            return ("node-1: kind: llama.cpp server without --metrics" in text
                    and "node-2: kind: unknown" in text
                    and health == {"node-1": True, "node-2": False})

        procs.wait_until(hinted, timeout=30, what="a kind line for both nodes, node-2 down")
        text = _list(up)
        line = next(x for x in text.splitlines() if x.startswith("node-2: kind: unknown"))
        for said in ("GET /health", "GET /metrics", "GET /props HTTP 404", "openai",
                     "health_path", "metrics_path"):
            assert said in line, line
        assert "start llama-server with --metrics" in text
        views = {v["name"]: v for v in json.loads(_list(up, "--json"))}
        assert views["node-1"]["healthy"] is True and views["node-2"]["healthy"] is False
        assert "kind: unknown" in views["node-2"]["last_error"]
        snap = json.loads(redis.Redis.from_url(up.redis_url, decode_responses=True,
                                               socket_timeout=2).get(keynames.ROUTING))
        assert {n["name"]: n["max_concurrency"] for n in snap["nodes"]} == {
            "node-1": 2, "node-2": 64}
    finally:
        up.stop()
