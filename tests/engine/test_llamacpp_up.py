"""``infergate up --node URL --node URL`` in front of two real llama.cpp servers
(``llama-server``, Gemma 3 270M, 2 slots, 1 thread each) with no other node flag: the
control plane tells their kind from their metrics (``llamacpp``), reads their slots from
``/props`` and routes real generations through the edge.

One stack serves the whole module (starting it is the slow part); answers are kept short
(``max_tokens`` 8). Needs the binary of ``python -m bench.realnode build`` (see
tests/support/realnode.py: skipped locally without it, failed under CI)."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import openai
import pytest
import redis
import requests

from bench.realnode import MODEL_ALIAS
from controlplane import procs
from controlplane.redisdb import keynames
from support.upstack import UpStack

pytestmark = pytest.mark.integration

#: Seconds for both nodes to show healthy with their llama.cpp metrics and slots.
DETECT_TIMEOUT_S = 30.0
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def stack(realnodes):
    nodes = realnodes(2, parallel=2, threads=1)
    folder = Path(tempfile.mkdtemp(prefix="infergate-engine-"))
    up = UpStack.start(folder, "[cache]\nenabled = false\n",
                       *[a for n in nodes for a in ("--node", n.url)])
    try:
        assert up.proc.poll() is None, up.text()
        yield up
    finally:
        up.stop()
        shutil.rmtree(folder, ignore_errors=True)


def _snapshot(up: UpStack) -> dict:
    raw = redis.Redis.from_url(up.redis_url, decode_responses=True,
                               socket_timeout=2).get(keynames.ROUTING)
    return json.loads(raw) if raw else {"nodes": []}


def _detected(up: UpStack) -> bool:
    nodes = _snapshot(up)["nodes"]
    return len(nodes) == 2 and all(
        n["healthy"] and n["has_metrics"] and n["max_concurrency"] == 2
        and n.get("models") == [MODEL_ALIAS] and n.get("models_any") is True for n in nodes)


def _auth(up: UpStack) -> dict:
    return {"Authorization": f"Bearer {up.key}"}


def test_kind_health_and_slots_are_told_from_the_nodes(stack) -> None:
    procs.wait_until(lambda: _detected(stack), timeout=DETECT_TIMEOUT_S,
                     what="both llama.cpp nodes healthy with metrics, 2 slots and their model")
    out = subprocess.run(procs.infergate_argv("nodes", "--redis-url", stack.redis_url, "list",
                                              "--json"),
                         capture_output=True, text=True, timeout=30, check=True).stdout
    views = json.loads(out)
    assert [(v["healthy"], v["dialect"]) for v in views] == [(True, "llamacpp")] * 2, out
    assert not any("kind: " in (v["last_error"] or "") for v in views), out
    assert [(v["max_concurrency"], v["routed_max_concurrency"]) for v in views] == [(64, 2)] * 2
    table = subprocess.run(procs.infergate_argv("nodes", "--redis-url", stack.redis_url, "list"),
                           capture_output=True, text=True, timeout=30, check=True).stdout
    assert table.count("2 (slots)") == 2, table
    # up's nodes keep the default kind; the KIND column names what the node turned out to be
    assert table.count("llamacpp (detected)") == 2, table


def test_chat_plain_and_streamed(stack) -> None:
    procs.wait_until(lambda: _detected(stack), timeout=DETECT_TIMEOUT_S, what="nodes detected")
    url = f"{stack.base}/v1/chat/completions"
    body = {"model": MODEL_ALIAS, "messages": HELLO, "max_tokens": 8}
    r = requests.post(url, headers=_auth(stack), json=body, timeout=60)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["model"] == MODEL_ALIAS and doc["choices"][0]["message"]["content"].strip()
    assert doc["usage"]["completion_tokens"] >= 1
    text, done = "", False
    with requests.post(url, headers=_auth(stack), json={**body, "stream": True}, stream=True,
                       timeout=60) as s:
        assert s.status_code == 200 and "text/event-stream" in s.headers["Content-Type"]
        # bytes: a decoded line would also be split at U+2028 or U+0085 (str.splitlines),
        # which a model may write raw inside a JSON string
        for raw in s.iter_lines():
            line = raw.decode()
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            for ch in json.loads(line[6:])["choices"]:
                text += (ch.get("delta") or {}).get("content") or ""
    assert done and text.strip()


def test_openai_sdk_models_and_any_model_name(stack) -> None:
    procs.wait_until(lambda: _detected(stack), timeout=DETECT_TIMEOUT_S, what="nodes detected")
    client = openai.OpenAI(base_url=f"{stack.base}/v1", api_key=stack.key, max_retries=0,
                           timeout=60)
    res = client.chat.completions.create(model=MODEL_ALIAS, messages=HELLO, max_tokens=8)
    assert res.choices[0].message.content.strip()
    assert MODEL_ALIAS in [m.id for m in client.models.list()]
    # a single-model llama-server answers any model name with its model; through the
    # edge too (a client written for another API keeps its placeholder name)
    body = {"model": "gpt-3.5-turbo", "messages": HELLO, "max_tokens": 8}
    node_url = _snapshot(stack)["nodes"][0]["url"]
    direct = requests.post(f"{node_url}/v1/chat/completions", json=body, timeout=60)
    assert direct.status_code == 200 and direct.json()["model"] == MODEL_ALIAS, direct.text
    r = client.chat.completions.create(**body)
    assert r.model == MODEL_ALIAS and r.choices[0].message.content.strip()
    # GET /v1/models/<id> lists what the nodes name, as llama-server's own list does
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-3.5-turbo")
