"""Two real llama.cpp servers (``llama-server``, Gemma 3 270M) that hold different
requests behind the control plane and the edge: one slot of 2,048 tokens, and two slots
of 1,024. A prompt of about 1,500 tokens fits only the first; a request with ``n`` = 2
only the second (llama-server refuses an ``n`` over its ``--parallel``). Each goes to the
node that can hold it, streamed or not, never to the one that answers it with a 400
(the edge routed such a prompt to the small node every time, both nodes idle).
Needs the binary of ``python -m bench.realnode build`` (see tests/support/realnode.py)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import redis
import requests

from bench.realnode import MODEL_ALIAS
from controlplane import procs
from controlplane.config import NodeSettings
from controlplane.redisdb import keynames
from support.stack import edge_settings

pytestmark = pytest.mark.integration

#: About 1,500 prompt tokens on gemma 3 (a numbered line is 10-11 tokens): over the
#: small node's 1,024, under the large node's 2,048 (and under twice the largest, where
#: the edge refuses a prompt itself).
FINISHED = re.compile(r'"finish_reason":\s*"(stop|length)"')
LONG = "".join(f"Line {i}: the fox ran far away.\n" for i in range(140))


def _snapshot(redis_url: str) -> dict[str, dict]:
    raw = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=2).get(
        keynames.ROUTING)
    return {n["name"]: n for n in (json.loads(raw)["nodes"] if raw else [])}


@pytest.fixture(scope="module")
def pair(realnodes):
    (large,) = realnodes(1, parallel=1, threads=1)                  # 1 slot of 2,048
    (small,) = realnodes(1, parallel=2, threads=1,
                         extra_args=("--ctx-size", "2048"))          # 2 slots of 1,024
    return large, small


def test_requests_go_to_the_node_that_can_hold_them(pair, redis_server, controlplane_factory,
                                                    edge_factory) -> None:
    large, small = pair
    for node, ctx in ((large, 2048), (small, 1024)):
        props = requests.get(node.url + "/props", timeout=5).json()
        assert props["default_generation_settings"]["n_ctx"] == ctx
    s = edge_settings(redis_server.url, [NodeSettings(name="large", url=large.url),
                                         NodeSettings(name="small", url=small.url)],
                      read_timeout_ms=120000)
    s.deadlines.request_ms = 120000
    s.controlplane.poll_interval_s = 0.5
    controlplane_factory(s)

    def detected() -> bool:
        n = _snapshot(redis_server.url)
        return (n.get("large", {}).get("ctx_tokens") == 2048
                and n.get("small", {}).get("ctx_tokens") == 1024
                and n["large"].get("slots") == 1 and n["small"].get("slots") == 2)

    procs.wait_until(detected, timeout=60, what="both nodes' slots and contexts in the snapshot")
    edge = edge_factory(s)
    procs.wait_until(lambda: all(edge.node_status(n).get("healthy") is True
                                 for n in ("large", "small")), timeout=10,
                     what="the edge to have the snapshot")
    # what each node does with these requests when asked directly
    direct = requests.post(small.url + "/v1/completions", timeout=120,
                           json={"prompt": LONG, "max_tokens": 1})
    assert direct.status_code == 400, direct.text
    assert direct.json()["error"]["n_ctx"] == 1024
    direct = requests.post(large.url + "/v1/completions", timeout=120,
                           json={"prompt": "Hi", "max_tokens": 1, "n": 2})
    assert direct.status_code == 400, direct.text

    got = []
    for i in range(2):   # plain, then streamed
        chat = {"model": MODEL_ALIAS, "max_tokens": 1, "stream": i % 2 == 1,
                "messages": [{"role": "user", "content": LONG + f"Which line is {i}?"}]}
        res = requests.post(f"{edge.url}/v1/chat/completions", json=chat, timeout=120)
        got.append(("long chat", i, res.status_code, res.headers.get("X-Infergate-Node")))
        res = requests.post(f"{edge.url}/v1/completions", timeout=120,
                            json={"model": MODEL_ALIAS, "max_tokens": 1,
                                  "prompt": LONG + f"Line {140 + i}:"})
        got.append(("long prompt", i, res.status_code, res.headers.get("X-Infergate-Node")))
        res = requests.post(f"{edge.url}/v1/chat/completions", timeout=120,
                            json={"model": MODEL_ALIAS, "max_tokens": 2, "n": 2,
                                  "stream": i % 2 == 1,
                                  "messages": [{"role": "user", "content": f"Hi {i}"}]})
        got.append(("n=2", i, res.status_code, res.headers.get("X-Infergate-Node")))
    for what, i, status, node in got:
        want = "small" if what == "n=2" else "large"
        assert (status, node) == (200, want), got
    # the large node busy: a long prompt waits for its slot (the small one's free slots
    # are not its own), neither a 429 nor the small node's 400
    busy = {"model": MODEL_ALIAS, "max_tokens": 48, "stream": True,
            "messages": [{"role": "user", "content": LONG + "Tell a story."}]}
    with requests.post(f"{edge.url}/v1/chat/completions", json=busy, stream=True,
                       timeout=120) as held:
        assert held.headers.get("X-Infergate-Node") == "large"
        lines = held.iter_lines()
        while b'"content":"' not in next(lines):     # the large node is writing
            pass
        for i, stream in enumerate((False, True)):
            res = requests.post(f"{edge.url}/v1/chat/completions", timeout=120,
                                json={"model": MODEL_ALIAS, "max_tokens": 1, "stream": stream,
                                      "messages": [{"role": "user",
                                                    "content": LONG + f"Which line is {9 + i}?"}]})
            got.append(("behind", i, res.status_code, res.headers.get("X-Infergate-Node")))
            assert (res.status_code, got[-1][3]) == (200, "large"), (got, res.text)
        assert FINISHED.search(b"".join(lines).decode()), "the busy stream was cut"
    # short requests still use both nodes (three at once fill the three slots)
    def short(i: int) -> tuple[int, str | None]:
        res = requests.post(f"{edge.url}/v1/completions", timeout=120,
                            json={"model": MODEL_ALIAS, "max_tokens": 16, "prompt": f"Hi {i}"})
        return res.status_code, res.headers.get("X-Infergate-Node")

    with ThreadPoolExecutor(3) as pool:
        shorts = list(pool.map(short, range(6)))
    assert all(status == 200 for status, _ in shorts), shorts
    assert {node for _, node in shorts} == {"large", "small"}, shorts
