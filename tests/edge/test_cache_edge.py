"""The response cache end to end: real nginx edge, redis-server, the embedder service
(bundled all-MiniLM-L6-v2, started once for the module) and a simulated node.

Each test uses its own prompts, so entries of one test never answer another."""

from __future__ import annotations

import contextlib
import http.client
import json
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import openai
import pytest
import redis
import requests

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.cache.key import keys_for
from controlplane.config import Settings
from controlplane.simnode import launch
from support.stack import SimNode, edge_settings, start_cache_backend, write_snapshot

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"
COMP = "/v1/completions"
MODEL = "sim-llama"


@dataclass
class Stack:
    """Module-wide processes: Redis, one simulated node, the embedder."""

    dir: Path
    redis_url: str
    redis_port: int
    node: SimNode
    embedder_url: str
    r: redis.Redis

    def node_requests(self) -> int:
        return int(self.node.state()["requests_total"])

    def counters(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.r.hgetall(keynames.CACHE_STATS).items()}


def _http_ok(url: str) -> bool:
    return requests.get(url, timeout=1).status_code == 200


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    d = Path(tempfile.mkdtemp(prefix="infergate-cache-"))
    d.chmod(0o755)
    ps = procs.ProcessSet()
    try:
        node = launch.start_node("sim-c", d / "logs", "--time-scale", "0.05",
                                 "--output-tokens", "24:48", into=ps, cls=SimNode)
        url, rport, embedder_url, r = start_cache_backend(d, ps)
        yield Stack(d, url, rport, node, embedder_url, r)
    finally:
        ps.stop_all()
        shutil.rmtree(d, ignore_errors=True)


def cache_settings(stack: Stack, redis_url: str | None = None, **cache: Any) -> Settings:
    s = edge_settings(redis_url or stack.redis_url, [stack.node.node_settings()], workers=2)
    c = {"enabled": True, "embedder_url": stack.embedder_url, "semantic_budget_ms": 3000,
         "min_similarity": 0.8, "coalesce_wait_s": 10.0, "coalesce_poll_ms": 20}
    c.update(cache)
    s.cache = s.cache.model_validate(c)
    return s


@pytest.fixture
def edge(stack, edge_factory):
    return edge_factory(cache_settings(stack))


def body_of(content: str, system: str | None = None, **params: Any) -> dict:
    msgs = [{"role": "system", "content": system}] if system else []
    msgs.append({"role": "user", "content": content})
    return {"model": MODEL, "messages": msgs, **params}


def post(edge, body: dict, path: str = CHAT, headers: dict | None = None,
         timeout: float = 30) -> requests.Response:
    return requests.post(edge.url + path, json=body, headers=headers or {}, timeout=timeout)


def exact_key(body: dict, path: str = CHAT, tenant: str = "default") -> str:
    return keys_for(path, body, tenant).exact


def wait_stored(stack: Stack, body: dict, path: str = CHAT, timeout: float = 10) -> dict:
    k = keynames.cache_entry(exact_key(body, path))
    procs.wait_until(lambda: stack.r.exists(k), timeout, what=f"cache entry {k}")
    return json.loads(stack.r.get(k))


def wait_indexed(stack: Stack, body: dict, timeout: float = 20) -> None:
    key = exact_key(body)
    prefix = keynames.CACHE_VEC_PREFIX

    def found() -> bool:
        return any(True for _ in stack.r.scan_iter(match=f"{prefix}*:{key}", count=1000))

    procs.wait_until(found, timeout, what="semantic vector of the entry")


def wait_counted(stack: Stack, before: dict[str, int], field: str, n: int = 1,
                 timeout: float = 10) -> None:
    """Wait until counter ``field`` grew by ``n`` (the edge's flush timer wrote the
    request's counters; an entry it stored is written before them)."""
    procs.wait_until(lambda: stack.counters().get(field, 0) >= before.get(field, 0) + n,
                     timeout, what=f"cache counter {field} +{n}")


def content_of(res: requests.Response) -> str:
    return res.json()["choices"][0]["message"]["content"]


# ----------------------------------------------------------------------------- exact


def test_exact_hit_is_served_without_a_node(stack, edge) -> None:
    body = body_of("What is the capital of France?", temperature=0)
    first = post(edge, body)
    assert first.status_code == 200, first.text
    assert first.headers["X-Cache-Status"] == "MISS"
    assert "X-Infergate-Node" in first.headers
    entry = wait_stored(stack, body)
    assert entry["tenant"] == "default" and entry["model"] == MODEL and entry["ttl"] == 3600
    assert 3500 < stack.r.ttl(keynames.cache_entry(exact_key(body))) <= 3600
    n = stack.node_requests()
    before = stack.counters()
    second = post(edge, body)
    assert second.status_code == 200
    assert second.headers["X-Cache-Status"] == "HIT"
    assert second.headers["X-Cache-Match"] == "exact"
    assert second.headers["X-Cache-Similarity"] == "1.0"
    assert "X-Infergate-Node" not in second.headers
    assert stack.node_requests() == n
    a, b = first.json(), second.json()
    assert content_of(second) == content_of(first)
    assert b["id"] != a["id"] and b["object"] == "chat.completion"
    assert b["usage"] == a["usage"] and b["choices"][0]["finish_reason"] == "stop"
    wait_counted(stack, before, "hits_exact")
    assert stack.counters()["lookups"] == before["lookups"] + 1


def test_text_completions_are_cached_too(stack, edge) -> None:
    body = {"model": MODEL, "prompt": "Write one line about the sea.", "temperature": 0}
    first = post(edge, body, COMP)
    assert first.status_code == 200 and first.headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, body, COMP)
    second = post(edge, body, COMP)
    assert second.headers["X-Cache-Status"] == "HIT"
    assert second.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    assert second.json()["object"] == "text_completion"


@pytest.mark.parametrize("variant", ["system", "model", "temperature", "earlier_turns", "max_tokens"])
def test_answer_changing_differences_miss(stack, edge, variant) -> None:
    q = {"system": "Name three prime numbers.", "model": "Which planet has rings?",
         "temperature": "Who painted the Mona Lisa?", "earlier_turns": "How far is the Moon?",
         "max_tokens": "What is photosynthesis?"}[variant]
    base = body_of(q, system="You are terse.", temperature=0)
    assert post(edge, base).headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, base)
    if variant == "system":
        other = body_of(q, system="You are verbose.", temperature=0)
    elif variant == "model":
        other = {**base, "model": "other-model"}
    elif variant == "temperature":
        other = {**base, "temperature": 0.3}
    elif variant == "max_tokens":
        other = {**base, "max_tokens": 500}
    else:
        other = {**base, "messages": [base["messages"][0], {"role": "user", "content": "Hi"},
                                      {"role": "assistant", "content": "Hello."},
                                      base["messages"][1]]}
    res = post(edge, other)
    assert res.headers["X-Cache-Status"] == "MISS", variant


def test_stream_is_stored_and_replayed_for_the_openai_client(stack, edge) -> None:
    client = openai.OpenAI(base_url=edge.url + "/v1", api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Tell me a short story about a lighthouse."}]
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, stream=True,
        stream_options={"include_usage": True})
    assert raw.headers["X-Cache-Status"] == "MISS"
    live = list(raw.parse())
    live_text = "".join(c.choices[0].delta.content or "" for c in live if c.choices)
    assert live_text
    body = {"model": MODEL, "messages": messages, "temperature": 0}
    entry = wait_stored(stack, body)
    assert entry["stream"] is True
    n = stack.node_requests()

    raw2 = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=messages, temperature=0, stream=True,
        stream_options={"include_usage": True})
    assert raw2.headers["X-Cache-Status"] == "HIT"
    assert raw2.headers["Content-Type"].startswith("text/event-stream")
    chunks = list(raw2.parse())
    content_chunks = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content_chunks) >= 2  # split into several chunks
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in content_chunks) == live_text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == live[-1].usage.completion_tokens

    # without include_usage: no usage chunk; a non-streamed request shares the entry
    chunks3 = list(client.chat.completions.create(model=MODEL, messages=messages,
                                                  temperature=0, stream=True))
    assert all(c.usage is None for c in chunks3)
    plain = client.chat.completions.with_raw_response.create(model=MODEL, messages=messages,
                                                             temperature=0)
    assert plain.headers["X-Cache-Status"] == "HIT"
    assert plain.parse().choices[0].message.content == live_text
    assert stack.node_requests() == n


def sse_chunks(text: str) -> list[dict]:
    """The JSON chunks of an SSE text, which must end with ``data: [DONE]``."""
    events = [e for e in text.split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]", events[-1]
    return [json.loads(e[len("data: "):]) for e in events[:-1]]


def usage_chunks(chunks: list[dict]) -> list[dict]:
    return [c for c in chunks if c.get("usage")]


def test_stream_without_usage_is_stored_with_usage_and_answers_every_request(stack, edge) -> None:
    # The edge asks the node for usage; the client, which did not, gets no usage chunk,
    # and the stored entry answers plain requests and streams with usage too.
    body = body_of("Describe a quiet harbour at dawn.", temperature=0)
    live = post(edge, {**body, "stream": True})
    assert live.status_code == 200 and live.headers["X-Cache-Status"] == "MISS"
    chunks = sse_chunks(live.text)
    assert usage_chunks(chunks) == [] and all(c["choices"] for c in chunks)
    live_text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    entry = wait_stored(stack, body)
    stored = json.loads(entry["body"])
    # the node got include_usage (the simulated node, like vLLM, sends usage only then)
    assert entry["stream"] is True and entry["usage"] is True
    assert stored["usage"]["completion_tokens"] > 0 and stored["usage"]["prompt_tokens"] > 0
    assert entry["prompt_chars"] == len("Describe a quiet harbour at dawn.")
    n = stack.node_requests()

    plain = post(edge, body)
    assert plain.headers["X-Cache-Status"] == "HIT" and plain.headers["X-Cache-Match"] == "exact"
    assert content_of(plain) == live_text and plain.json()["usage"] == stored["usage"]
    asked = post(edge, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert asked.headers["X-Cache-Status"] == "HIT"
    got = sse_chunks(asked.text)
    assert got[-1]["choices"] == [] and got[-1]["usage"] == stored["usage"]
    assert usage_chunks(got) == [got[-1]]
    quiet = post(edge, {**body, "stream": True})
    assert quiet.headers["X-Cache-Status"] == "HIT" and usage_chunks(sse_chunks(quiet.text)) == []
    assert stack.node_requests() == n


def test_plain_entry_answers_streams_with_and_without_usage(stack, edge) -> None:
    body = body_of("Name the largest desert in Asia.", temperature=0)
    first = post(edge, body)
    assert first.headers["X-Cache-Status"] == "MISS"
    assert wait_stored(stack, body)["stream"] is False
    asked = post(edge, {**body, "stream": True, "stream_options": {"include_usage": True}})
    assert asked.headers["X-Cache-Status"] == "HIT"
    got = sse_chunks(asked.text)
    assert usage_chunks(got) == [got[-1]] and got[-1]["usage"] == first.json()["usage"]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in got if c["choices"]) \
        == content_of(first)
    quiet = post(edge, {**body, "stream": True})
    assert quiet.headers["X-Cache-Status"] == "HIT" and usage_chunks(sse_chunks(quiet.text)) == []


def test_stream_with_usage_gets_the_nodes_usage_chunk(stack, edge) -> None:
    body = body_of("Give one fact about owls.", temperature=0, stream=True,
                   stream_options={"include_usage": True})
    res = post(edge, body)
    assert res.headers["X-Cache-Status"] == "MISS"
    got = sse_chunks(res.text)
    assert usage_chunks(got) == [got[-1]] and got[-1]["choices"] == []
    stored = json.loads(wait_stored(stack, body)["body"])
    assert stored["usage"] == got[-1]["usage"]


def test_node_is_asked_for_usage_only_for_streams_the_cache_stores(stack, edge_factory,
                                                                   tiny_upstreams) -> None:
    # Database 2 of the module's Redis: no snapshot there, the edge uses its tiny node.
    r2 = redis.Redis(host="127.0.0.1", port=stack.redis_port, db=2, decode_responses=True)
    r2.flushdb()
    (tiny,) = tiny_upstreams(1)
    s = edge_settings(f"redis://127.0.0.1:{stack.redis_port}/2", [tiny.node_settings()])
    s.cache = s.cache.model_validate({"enabled": True, "semantic": False})
    edge = edge_factory(s)
    url = edge.url + CHAT

    def send(body: dict, **headers: str) -> tuple[requests.Response, bytes, bytes]:
        raw = json.dumps(body).encode()
        res = requests.post(url, data=raw, timeout=30,
                            headers={"Content-Type": "application/json",
                                     "Accept-Encoding": "gzip", **headers})
        assert res.status_code == 200, res.text
        return res, raw, tiny.bodies[-1]

    body = {"model": "tiny", "stream": True, "temperature": 0, "tools": [],
            "messages": [{"role": "user", "content": "Say \"stream_options\": [] é"}]}
    res, raw, got = send(body)
    assert res.headers["X-Cache-Status"] == "MISS"
    assert got == b'{"stream_options":{"include_usage":true},' + raw[1:]
    assert usage_chunks(sse_chunks(res.text)) == []   # the node sent one; taken out
    # a stream_options of the client's own: only include_usage changes (another seed: the
    # first answer, stored, would answer it)
    res, raw, got = send({**body, "seed": 2, "stream_options": {"include_usage": False, "x": 1}})
    assert json.loads(got) == {**body, "seed": 2,
                               "stream_options": {"include_usage": True, "x": 1}}
    assert usage_chunks(sse_chunks(res.text)) == []
    # asked by the client: the body as sent, the usage chunk passed on
    res, raw, got = send({**body, "seed": 3, "stream_options": {"include_usage": True}})
    assert got == raw and usage_chunks(sse_chunks(res.text))[0]["usage"]["completion_tokens"] == 5
    # not stored: the body as sent
    res, raw, got = send(body, **{"Cache-Control": "no-store"})
    assert got == raw and res.headers["X-Cache-Status"] == "BYPASS"
    # a chunked request body is rewritten as well
    raw = json.dumps({**body, "seed": 7}).encode()
    res = requests.post(url, data=iter([raw[:20], raw[20:]]), timeout=30,
                        headers={"Content-Type": "application/json"})
    assert res.status_code == 200 and usage_chunks(sse_chunks(res.text)) == []
    assert tiny.bodies[-1] == b'{"stream_options":{"include_usage":true},' + raw[1:]
    r2.flushdb()


def test_seeds_a_double_cannot_tell_apart_are_not_cached(stack, edge) -> None:
    """"seed": 9007199254740993 and 9007199254740992 decode to the same double at the
    edge: neither is cached, so neither is answered with the other's answer."""
    bodies = [body_of("Pick a number between one and ten.", seed=s)
              for s in (9007199254740993, 9007199254740992, 9007199254740993)]
    got = [post(edge, b) for b in bodies]
    assert [r.status_code for r in got] == [200, 200, 200]
    assert [r.headers["X-Cache-Status"] for r in got] == ["BYPASS"] * 3
    ok = body_of("Pick a number between one and ten.", seed=9007199254740991)
    assert post(edge, ok).headers["X-Cache-Status"] == "MISS"    # below 2^53: cached


def test_answers_of_a_compressing_node_are_stored_for_clients_that_accept_gzip(
        stack, edge_factory, tiny_upstreams) -> None:
    """OpenAI SDKs send Accept-Encoding: gzip, deflate on every request. A request whose
    answer will be stored reaches the node without it, so the answer of a node behind a
    compressing proxy is stored and the repeat is a hit; a request that is not stored
    keeps the header, and the node's compressed answer reaches the client as sent."""
    r3 = redis.Redis(host="127.0.0.1", port=stack.redis_port, db=3, decode_responses=True)
    r3.flushdb()
    (tiny,) = tiny_upstreams(1)
    tiny.gzip = True
    s = edge_settings(f"redis://127.0.0.1:{stack.redis_port}/3", [tiny.node_settings()])
    s.cache = s.cache.model_validate({"enabled": True, "semantic": False})
    edge = edge_factory(s)
    sdk = {"Accept-Encoding": "gzip, deflate"}
    body = {"model": "tiny", "temperature": 0,
            "messages": [{"role": "user", "content": "Name a compressed river."}]}
    first = post(edge, body, headers=sdk)
    assert first.status_code == 200 and first.headers["X-Cache-Status"] == "MISS"
    assert "Content-Encoding" not in first.headers and tiny.accept_encodings[-1] is None
    procs.wait_until(lambda: r3.exists(keynames.cache_entry(exact_key(body))), 10,
                     what="cache entry")
    again = post(edge, body, headers=sdk)
    assert again.headers["X-Cache-Status"] == "HIT" and tiny.hits == 1
    assert again.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    # not stored: passed on as the client sent it, and answered compressed
    res = post(edge, body, headers={**sdk, "Cache-Control": "no-store"})
    assert res.status_code == 200 and res.headers["X-Cache-Status"] == "BYPASS"
    assert tiny.accept_encodings[-1] == "gzip, deflate"
    assert res.headers["Content-Encoding"] == "gzip"
    assert res.json()["choices"][0]["message"]["content"] == "hello from tiny-1"
    r3.flushdb()


# ----------------------------------------------------------------------------- semantic


def test_paraphrase_is_a_semantic_hit(stack, edge) -> None:
    body = body_of("How do I reset my password?", temperature=0)
    first = post(edge, body)
    assert first.headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, body)
    wait_indexed(stack, body)
    n = stack.node_requests()
    before = stack.counters()
    res = post(edge, body_of("How can I reset my password?", temperature=0),
               headers={"X-Cache-Explain": "1"})
    assert res.status_code == 200
    assert res.headers["X-Cache-Status"] == "HIT"
    assert res.headers["X-Cache-Match"] == "semantic"
    sim = float(res.headers["X-Cache-Similarity"])
    assert 0.8 <= sim < 1.0
    # the score the decision used, named; the explanation only when cache.explain is on
    name, _, value = res.headers["X-Cache-Score"].partition("=")
    assert name in ("verifier", "cosine") and 0 < float(value) <= 1
    assert "X-Cache-Explain" not in res.headers
    assert content_of(res) == content_of(first)
    assert stack.node_requests() == n
    wait_counted(stack, before, "hits_semantic")

    unrelated = post(edge, body_of("What is the boiling point of water at sea level?",
                                   temperature=0))
    assert unrelated.headers["X-Cache-Status"] == "MISS"
    # the same question under another system prompt is another namespace
    other_ns = post(edge, body_of("How can I reset my password?", system="Answer in French.",
                                  temperature=0))
    assert other_ns.headers["X-Cache-Status"] == "MISS"


def test_the_same_words_spelled_otherwise_are_a_semantic_miss(stack, edge) -> None:
    """The guard's literal check end to end: code whose indentation differs is another
    question; a /v1/completions prompt matches only up to case (the route reaches the
    embedder)."""
    code = body_of("Does this run?\nif True:\nprint('hi')", temperature=0)
    post(edge, code)
    wait_stored(stack, code)
    wait_indexed(stack, code)
    res = post(edge, body_of("Does this run?\nif True:\n    print('hi')", temperature=0))
    assert res.headers["X-Cache-Status"] == "MISS"

    prompt = {"model": MODEL, "prompt": "Roses are red, violets are", "max_tokens": 8,
              "temperature": 0}
    post(edge, prompt, COMP)
    wait_stored(stack, prompt, COMP)
    key = exact_key(prompt, COMP)
    procs.wait_until(lambda: any(True for _ in stack.r.scan_iter(
        match=f"{keynames.CACHE_VEC_PREFIX}*:{key}", count=1000)), 20,
        what="semantic vector of the prompt")
    same_case = post(edge, {**prompt, "prompt": "roses are red, violets are"}, COMP)
    assert same_case.headers["X-Cache-Status"] == "HIT", dict(same_case.headers)
    assert same_case.headers["X-Cache-Match"] == "semantic"
    spaced = post(edge, {**prompt, "prompt": "Roses are red, violets are "}, COMP)
    assert spaced.headers["X-Cache-Status"] == "MISS"


def test_an_answer_that_echoes_its_prompt_is_served_only_to_that_prompt(stack, edge) -> None:
    """`echo: true` repeats the prompt in the answer, so a paraphrase must not get it: such
    a request has exact hits only (its answer is not indexed for semantic lookups)."""
    echo = {"model": MODEL, "prompt": "Once upon a time in Paris", "max_tokens": 8,
            "temperature": 0, "echo": True}
    plain = {**echo, "prompt": "Once upon a time in Rome"}
    plain.pop("echo")
    for b in (echo, plain):
        assert post(edge, b, COMP).headers["X-Cache-Status"] == "MISS"
        wait_stored(stack, b, COMP)
    # index jobs are taken in order: the plain prompt's vector comes after the echo's turn
    key = exact_key(plain, COMP)
    procs.wait_until(lambda: any(True for _ in stack.r.scan_iter(
        match=f"{keynames.CACHE_VEC_PREFIX}*:{key}", count=1000)), 20,
        what="semantic vector of the plain prompt")
    echo_key = exact_key(echo, COMP)
    assert not any(True for _ in stack.r.scan_iter(
        match=f"{keynames.CACHE_VEC_PREFIX}*:{echo_key}", count=1000))
    other = post(edge, {**echo, "prompt": "once upon a time in paris"}, COMP)
    assert other.headers["X-Cache-Status"] == "MISS", dict(other.headers)
    assert post(edge, echo, COMP).headers["X-Cache-Status"] == "HIT"
    same_case = post(edge, {**plain, "prompt": "once upon a time in rome"}, COMP)
    assert same_case.headers["X-Cache-Status"] == "HIT"      # without echo: semantic


def test_semantic_hit_reports_the_requesters_prompt_tokens(stack, edge) -> None:
    body = body_of("How do I delete my account?", temperature=0)
    first = post(edge, body)
    assert first.headers["X-Cache-Status"] == "MISS"
    entry = wait_stored(stack, body)
    wait_indexed(stack, body)
    assert entry["prompt_chars"] == len("How do I delete my account?")
    stored = first.json()["usage"]
    # a stored prompt a quarter as long as the paraphrase: the estimate is 4x its tokens
    # (prompt_tokens x requester's characters / stored characters)
    ask = "how do I delete my account"  # equal up to case and punctuation: a sure paraphrase
    k = keynames.cache_entry(exact_key(body))
    stack.r.set(k, json.dumps({**entry, "prompt_chars": len(ask) // 4}), keepttl=True)
    want = round(stored["prompt_tokens"] * len(ask) / (len(ask) // 4))
    res = post(edge, body_of(ask, temperature=0))
    assert res.headers["X-Cache-Status"] == "HIT", res.headers
    assert res.headers["X-Cache-Match"] == "semantic"
    u = res.json()["usage"]
    assert u["prompt_tokens"] == want and u["completion_tokens"] == stored["completion_tokens"]
    assert u["total_tokens"] == want + stored["completion_tokens"]
    streamed = post(edge, body_of(ask, temperature=0, stream=True,
                                  stream_options={"include_usage": True}))
    assert streamed.headers["X-Cache-Match"] == "semantic"
    assert sse_chunks(streamed.text)[-1]["usage"]["prompt_tokens"] == want
    # an exact hit: the same prompt, the stored figures
    assert post(edge, body).json()["usage"] == stored


def test_purged_entry_is_not_a_semantic_hit(stack, edge) -> None:
    from controlplane.cache import store as cache_store

    body = body_of("Where can I download my invoices?", temperature=0)
    assert post(edge, body).headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, body)
    wait_indexed(stack, body)
    assert post(edge, body_of("Where do I download my invoices?", temperature=0)) \
        .headers["X-Cache-Status"] == "HIT"
    r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    assert cache_store.purge(r, namespace=keys_for(CHAT, body).namespace) >= 1
    res = post(edge, body_of("Where do I download my invoices?", temperature=0))
    assert res.headers["X-Cache-Status"] == "MISS"


def test_chinese_prompts_exact_and_semantic(stack, edge) -> None:
    body = body_of("如何修改我的登录密码？", temperature=0)
    first = post(edge, body)
    assert first.status_code == 200 and first.headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, body)
    wait_indexed(stack, body)
    again = post(edge, body)
    assert again.headers["X-Cache-Status"] == "HIT" and again.headers["X-Cache-Match"] == "exact"
    assert content_of(again) == content_of(first)
    para = post(edge, body_of("怎么更改登录密码？", temperature=0))
    assert para.status_code == 200
    assert para.headers["X-Cache-Status"] in ("HIT", "MISS")  # semantic path ran, no crash


def test_fifty_thousand_character_prompt(stack, edge) -> None:
    text = ("The quick brown fox jumps over the lazy dog. " * 1200)[:50000]
    body = body_of(text, temperature=0, max_tokens=64)
    first = post(edge, body, timeout=60)
    assert first.status_code == 200, first.text
    assert first.headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, body)
    second = post(edge, body, timeout=60)
    assert second.headers["X-Cache-Status"] == "HIT"
    assert content_of(second) == content_of(first)


# ----------------------------------------------------------------------------- not stored


def test_server_error_is_not_stored(stack, edge) -> None:
    body = body_of("Explain TCP slow start briefly.", temperature=0)
    before = stack.counters()
    stack.node.set_faults(error_rate=1.0, error_status=500)
    try:
        res = post(edge, body)
    finally:
        stack.node.set_faults(error_rate=0.0)
    assert res.status_code >= 500 and res.headers["X-Cache-Status"] == "MISS"
    wait_counted(stack, before, "misses")
    assert not stack.r.exists(keynames.cache_entry(exact_key(body)))
    ok = post(edge, body)
    assert ok.status_code == 200 and ok.headers["X-Cache-Status"] == "MISS"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_answer_cut_by_max_tokens_is_stored_for_that_max_tokens(stack, edge, stream) -> None:
    # finish_reason "length" is the whole answer to a request with that max_tokens; the
    # key holds max_tokens, so another max_tokens is another entry
    body = body_of(f"List every country in Europe with its capital ({stream}).", temperature=0,
                   max_tokens=3, stream=stream)
    res = post(edge, body)
    assert res.status_code == 200 and res.headers["X-Cache-Status"] == "MISS"
    if not stream:
        assert res.json()["choices"][0]["finish_reason"] == "length"
    stored = wait_stored(stack, body)
    assert json.loads(stored["body"])["choices"][0]["finish_reason"] == "length"
    n = stack.node_requests()
    hit = post(edge, body)
    assert hit.headers["X-Cache-Status"] == "HIT" and stack.node_requests() == n
    if stream:
        assert '"finish_reason":"length"' in hit.text and hit.text.endswith("data: [DONE]\n\n")
    else:
        assert hit.json()["choices"][0]["finish_reason"] == "length"
    other = post(edge, {**body, "max_tokens": 4})
    assert other.headers["X-Cache-Status"] == "MISS"


def test_client_aborted_stream_is_not_stored(stack, edge) -> None:
    body = body_of("Describe the water cycle in detail.", temperature=0, stream=True)
    before = stack.counters()
    stack.node.set_faults(slowdown=40.0)
    try:
        with requests.post(edge.url + CHAT, json=body, stream=True, timeout=30) as res:
            assert res.headers["X-Cache-Status"] == "MISS"
            it = res.iter_lines()
            first = next(line for line in it if line)
            assert first.startswith(b"data: ")
            res.raw._fp.close()  # the client goes away mid-stream
    finally:
        stack.node.set_faults(slowdown=1.0)
    wait_counted(stack, before, "misses")
    assert not stack.r.exists(keynames.cache_entry(exact_key(body)))


# ----------------------------------------------------------------------------- bypass


def test_no_store_and_no_cache(stack, edge) -> None:
    body = body_of("What does HTTP 418 mean?", temperature=0)
    before = stack.counters()
    res = post(edge, body, headers={"Cache-Control": "no-store"})
    assert res.status_code == 200 and res.headers["X-Cache-Status"] == "BYPASS"
    wait_counted(stack, before, "bypass")
    assert not stack.r.exists(keynames.cache_entry(exact_key(body)))

    first = post(edge, body)
    assert first.headers["X-Cache-Status"] == "MISS"
    created = wait_stored(stack, body)["created"]
    n = stack.node_requests()
    fresh = post(edge, body, headers={"Cache-Control": "no-cache"})
    assert fresh.headers["X-Cache-Status"] == "BYPASS"
    assert "X-Infergate-Node" in fresh.headers and stack.node_requests() == n + 1
    k = keynames.cache_entry(exact_key(body))
    procs.wait_until(lambda: json.loads(stack.r.get(k))["created"] > created, 10,
                     what="fresh answer stored after no-cache")
    assert post(edge, body).headers["X-Cache-Status"] == "HIT"
    # the other ways clients ask for a fresh answer (RFC 9111): max-age=0, and Pragma
    # without a Cache-Control header; no-cache inside a list of directives
    for headers in ({"Cache-Control": "max-age=0"}, {"Pragma": "no-cache"},
                    {"Cache-Control": "no-transform, no-cache"}):
        n = stack.node_requests()
        res = post(edge, body, headers=headers)
        assert res.headers["X-Cache-Status"] == "BYPASS", headers
        assert stack.node_requests() == n + 1
    assert post(edge, body, headers={"Cache-Control": "max-age=60", "Pragma": "no-cache"}) \
        .headers["X-Cache-Status"] == "HIT"      # Cache-Control present: Pragma ignored
    # a directive on a second Cache-Control line counts (RFC 9110 5.3: one list)
    for lines in (("private", "no-store"), ("max-age=60", "no-cache")):
        n = stack.node_requests()
        status = _post_lines(edge, body, [("Cache-Control", v) for v in lines])
        assert status == "BYPASS", lines
        assert stack.node_requests() == n + 1


def _post_lines(edge, body: dict, lines: list[tuple[str, str]]) -> str:
    """POST ``body`` with the header lines as given (repeated names too); returns its
    X-Cache-Status."""
    u = urlsplit(edge.url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        raw = json.dumps(body).encode()
        conn.putrequest("POST", CHAT)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Content-Length", str(len(raw)))
        for name, value in lines:
            conn.putheader(name, value)
        conn.endheaders(raw)
        res = conn.getresponse()
        res.read()
        assert res.status == 200
        return res.getheader("X-Cache-Status") or ""
    finally:
        conn.close()


@pytest.mark.parametrize("body", [
    {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
    body_of("Pick a random number.", temperature=1.5),
    body_of("Give me two options.", n=2),
    body_of("Say hi.", logprobs=True, top_logprobs=2),
    body_of("Say hello.", stream="true"),
    body_of("Say hey.", stream_options="x"),
    body_of("Say ho.", temperature=-5),
    body_of("Say ha.", max_tokens=0),
    {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Name a colour."}, "Ignore that, write a poem."]}]},
    {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Name a shape."}, {"type": "text", "text": {"a": 1}}]}]},
    {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "Name a fruit."}, {"type": "text", "content": "in French"}]}]},
    body_of("Say hiya.", n_probs=3),
    body_of("Say howdy.", n_probs=2, post_sampling_probs=True),
    body_of("Say yo.", prompt_logprobs=1),
], ids=["image", "hot", "n2", "logprobs", "stream_string", "stream_options_string",
        "negative_temperature", "zero_max_tokens", "bare_string_part", "text_not_a_string",
        "part_without_text", "llamacpp_n_probs", "llamacpp_post_sampling_probs",
        "vllm_prompt_logprobs"])
def test_uncacheable_requests_bypass(stack, edge, body) -> None:
    before = stack.counters()
    res = post(edge, body)
    assert res.headers["X-Cache-Status"] == "BYPASS"
    wait_counted(stack, before, "bypass")
    assert not stack.r.exists(keynames.cache_entry(exact_key(body)))


def test_several_prompts_bypass_and_one_list_of_token_ids_does_not(stack, edge) -> None:
    """/v1/completions with a list of prompts answers one choice each, which an entry does
    not keep: BYPASS at once (it said MISS and then stored nothing)."""
    several = {"model": MODEL, "prompt": ["Count to three.", "Count to four."], "max_tokens": 8}
    res = post(edge, several, path=COMP)
    # (the simulated node answers 400 to more than one prompt; llama-server answers them)
    assert res.headers["X-Cache-Status"] == "BYPASS" and "X-Infergate-Node" in res.headers
    one = {"model": MODEL, "prompt": [101, 102, 103], "max_tokens": 8}
    assert post(edge, one, path=COMP).headers["X-Cache-Status"] == "MISS"


def test_a_parameter_the_node_refuses_is_never_answered_from_the_cache(stack, edge) -> None:
    good = body_of("Name a primary colour.", temperature=0)
    assert post(edge, good).headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, good)
    assert post(edge, good).headers["X-Cache-Status"] == "HIT"
    n = stack.node_requests()
    bads = ({"stream": "true"}, {"stream": 1}, {"stream_options": "x"}, {"top_p": 0},
            {"stream_options": []}, {"stream_options": [True]},
            {"stream_options": {"include_usage": True}},
            {"stream": True, "stream_options": {"include_usage": "x"}},
            {"stream": True, "stream_options": {"continuous_usage_stats": 1}})
    for bad in bads:
        res = post(edge, {**good, **bad})
        assert res.headers["X-Cache-Status"] == "BYPASS", (bad, res.headers)
    assert stack.node_requests() == n + len(bads)
    # a stream with options of its own is served from the stored answer
    res = post(edge, {**good, "stream": True, "stream_options": {}})
    assert res.headers["X-Cache-Status"] == "HIT"


def test_hit_is_served_when_no_node_is_eligible(stack, edge) -> None:
    body = body_of("What colour is the sky on a clear day?", temperature=0)
    assert post(edge, body).headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, body)
    snap = write_snapshot(stack.r, [stack.node.snapshot_node(healthy=False)])
    try:
        edge.wait_snapshot(snap["version"])
        res = post(edge, body)
        assert res.status_code == 200 and res.headers["X-Cache-Status"] == "HIT"
        unseen = post(edge, body_of("Unseen question?", temperature=0))
        assert unseen.status_code == 503 and unseen.headers["X-Cache-Status"] == "MISS"
    finally:
        snap = write_snapshot(stack.r, [stack.node.snapshot_node()])
        edge.wait_snapshot(snap["version"])


# ----------------------------------------------------------------------------- TTL


def test_entry_expires_after_its_ttl(stack, edge_factory) -> None:
    edge = edge_factory(cache_settings(stack, ttl_s=1))
    body = body_of("What is the tallest mountain on Earth?", temperature=0)
    assert post(edge, body).headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, body)
    k = keynames.cache_entry(exact_key(body))
    assert 0 < stack.r.pttl(k) <= 1000
    assert post(edge, body).headers["X-Cache-Status"] == "HIT"
    procs.wait_until(lambda: not stack.r.exists(k), 5, what="entry expiry")
    assert post(edge, body).headers["X-Cache-Status"] == "MISS"


def test_workers_keep_hot_entries_for_local_ttl_ms(stack, edge_factory) -> None:
    """cache.local_ttl_ms: a worker answers repeats of an entry it read from its own copy,
    without Redis, for that long; never past the entry's TTL; 0 (the default) reads Redis
    on every hit, so a deleted entry misses at once."""
    s = cache_settings(stack, local_ttl_ms=1500, semantic=False)
    s.edge.workers = 1  # one worker: every request meets the same copy
    edge = edge_factory(s)
    body = body_of("What is the capital of Mongolia?", temperature=0)
    assert post(edge, body).headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, body)
    k = keynames.cache_entry(exact_key(body))
    assert post(edge, body).headers["X-Cache-Status"] == "HIT"      # read, now kept
    stack.r.delete(k)
    assert post(edge, body).headers["X-Cache-Status"] == "HIT"      # from the copy
    procs.wait_until(lambda: post(edge, body).headers["X-Cache-Status"] == "MISS", 10,
                     interval=0.2, what="the worker's copy to expire")

    # the copy never outlives the entry: TTL 1 s, local_ttl_ms 60 s
    s = cache_settings(stack, local_ttl_ms=60000, semantic=False, ttl_s=1)
    s.edge.workers = 1
    edge = edge_factory(s)
    body = body_of("What is the capital of Chile?", temperature=0)
    assert post(edge, body).headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, body)
    assert post(edge, body).headers["X-Cache-Status"] == "HIT"
    procs.wait_until(lambda: post(edge, body).headers["X-Cache-Status"] == "MISS", 10,
                     interval=0.2, what="the entry's TTL to end the copy too")

    # off by default: a deleted entry misses at once
    edge = edge_factory(cache_settings(stack, semantic=False))
    body = body_of("What is the capital of Peru?", temperature=0)
    assert post(edge, body).headers["X-Cache-Status"] == "MISS"
    wait_stored(stack, body)
    assert post(edge, body).headers["X-Cache-Status"] == "HIT"
    stack.r.delete(keynames.cache_entry(exact_key(body)))
    assert post(edge, body).headers["X-Cache-Status"] == "MISS"


# ----------------------------------------------------------------------------- failures


def test_embedder_down_is_bypass_and_the_request_is_answered(stack, edge_factory) -> None:
    dead = f"http://127.0.0.1:{procs.free_port()}"
    edge = edge_factory(cache_settings(stack, embedder_url=dead, semantic_budget_ms=150))
    body = body_of("Why do cats purr?", temperature=0)
    before = stack.counters()
    t0 = time.monotonic()
    res = post(edge, body)
    assert res.status_code == 200 and res.headers["X-Cache-Status"] == "BYPASS"
    assert content_of(res)
    assert time.monotonic() - t0 < 10
    wait_counted(stack, before, "bypass")
    # the answer is still stored: the exact cache works without the embedder
    wait_stored(stack, body)
    assert post(edge, body).headers["X-Cache-Status"] == "HIT"


def test_an_embedder_past_its_budget_or_down_is_named_in_the_edge_warning(
        stack, edge_factory) -> None:
    """A lookup that times out (an embedder that accepts and never answers) or cannot
    connect fails open, and the edge's warn line says which: nginx's own line for it
    ("upstream timed out" / "connect() failed", with subrequest
    "/_infergate/cache/lookup") gives the errno only."""
    import socket

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(64)                                  # accepts (backlog), never answers
    try:
        for url, why in ((f"http://127.0.0.1:{hung.getsockname()[1]}", "embedder timed out"),
                         (f"http://127.0.0.1:{procs.free_port()}", "embedder unreachable")):
            edge = edge_factory(cache_settings(stack, embedder_url=url, semantic_budget_ms=150))
            res = post(edge, body_of(f"Why is the sky blue? ({why})", temperature=0))
            assert res.status_code == 200 and res.headers["X-Cache-Status"] == "BYPASS"
            log = edge.error_log()
            assert f"semantic cache lookup skipped: {why}" in log, log[-2000:]
    finally:
        hung.close()


def test_semantic_over_budget_is_bypass(stack, edge_factory) -> None:
    edge = edge_factory(cache_settings(stack, semantic_budget_ms=1))
    res = post(edge, body_of("How many legs does a spider have?", temperature=0))
    assert res.status_code == 200
    assert res.headers["X-Cache-Status"] in ("BYPASS", "MISS")  # 1 ms is usually too little
    res2 = post(edge, body_of("How many legs does an ant have?", temperature=0))
    assert res2.status_code == 200


def test_redis_down_is_bypass_and_the_request_is_answered(stack, edge_factory, workdir) -> None:
    port = procs.free_port()
    own = procs.start_redis(workdir / "redis-own", port)
    try:
        edge = edge_factory(cache_settings(stack, redis_url=f"redis://127.0.0.1:{port}/0"))
        body = body_of("What is a monad?", temperature=0)
        assert post(edge, body).headers["X-Cache-Status"] == "MISS"
        own.stop()
        for _ in range(2):
            res = post(edge, body)
            assert res.status_code == 200 and res.headers["X-Cache-Status"] == "BYPASS"
            assert content_of(res)
        own = procs.start_redis(workdir / "redis-own", port)  # back, empty
        procs.wait_until(lambda: post(edge, body).headers["X-Cache-Status"] != "BYPASS", 10,
                         interval=0.3, what="cache lookups again after Redis returned")
    finally:
        own.stop()


# ----------------------------------------------------------------------------- coalescing


def test_concurrent_identical_misses_make_one_node_request(stack, edge) -> None:
    body = body_of("Summarise the plot of Hamlet.", temperature=0)
    stack.node.set_faults(slowdown=10.0)
    n = stack.node_requests()
    results: list[requests.Response] = []
    lock = threading.Lock()

    def one() -> None:
        res = post(edge, body)
        with lock:
            results.append(res)

    try:
        threads = [threading.Thread(target=one) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        stack.node.set_faults(slowdown=1.0)
    assert len(results) == 6 and all(r.status_code == 200 for r in results)
    statuses = sorted(r.headers["X-Cache-Status"] for r in results)
    assert statuses == ["HIT"] * 5 + ["MISS"]
    assert stack.node_requests() == n + 1
    assert len({content_of(r) for r in results}) == 1


# ----------------------------------------------------------------------------- tenants


def test_tenants_never_share_answers(stack, edge_factory) -> None:
    from controlplane.admin import apikeys

    s = cache_settings(stack)
    s.auth.mode = "required"
    edge = edge_factory(s)
    k1, _ = apikeys.create_key(stack.r, "tenant-one")
    k2, _ = apikeys.create_key(stack.r, "tenant-two")
    body = body_of("Which language is spoken in Brazil?", temperature=0)
    h1 = {"Authorization": f"Bearer {k1}"}
    h2 = {"Authorization": f"Bearer {k2}"}
    assert post(edge, body, headers=h1).headers["X-Cache-Status"] == "MISS"
    k = keynames.cache_entry(keys_for(CHAT, body, "tenant-one").exact)
    procs.wait_until(lambda: stack.r.exists(k), 10, what="tenant-one entry")
    assert json.loads(stack.r.get(k))["tenant"] == "tenant-one"
    assert stack.r.sismember(keynames.cache_index("tenant", "tenant-one"),
                             keys_for(CHAT, body, "tenant-one").exact)
    # with API keys the semantic index job went to the tenant's shard of the queue,
    # which the embedder consumes: the entry gets its vector
    exact = keys_for(CHAT, body, "tenant-one").exact
    procs.wait_until(lambda: any(True for _ in stack.r.scan_iter(
        match=f"{keynames.CACHE_VEC_PREFIX}*:{exact}", count=1000)), 20, what="vector")
    assert post(edge, body, headers=h1).headers["X-Cache-Status"] == "HIT"
    other = post(edge, body, headers=h2)
    assert other.status_code == 200 and other.headers["X-Cache-Status"] == "MISS"
    assert post(edge, body).status_code == 401  # no key: answered by auth, never by the cache


# ----------------------------------------------------------------------------- search index


def test_semantic_hit_with_the_redis_search_index(stack, edge_factory, workdir) -> None:
    from controlplane.embedder.redis_search import SearchRedisMissing, start_search_redis

    port = procs.free_port()
    try:
        srv = start_search_redis(workdir / "search-redis", port)
    except SearchRedisMissing as exc:
        pytest.skip(f"Redis with the search module not installed: {exc}")
    url = f"redis://127.0.0.1:{port}/0"
    eport = procs.free_port()
    emb = procs.Managed("embedder-search", procs.infergate_argv(
        "embedder", "--listen", f"127.0.0.1:{eport}", "--redis-url", url,
        "--index", "redis-search", "--threads", "2"), workdir / "logs" / "embedder-search.log")
    try:
        emb.start().wait_ready(lambda: _http_ok(f"http://127.0.0.1:{eport}/healthz"), 120)
        health = requests.get(f"http://127.0.0.1:{eport}/healthz", timeout=5).json()
        assert health["index_backend"] == "redis-search"
        edge = edge_factory(cache_settings(stack, redis_url=url,
                                           embedder_url=f"http://127.0.0.1:{eport}"))
        r = redis.Redis(host="127.0.0.1", port=port, decode_responses=True)
        body = body_of("How do I change my email address?", temperature=0)
        first = post(edge, body)
        assert first.headers["X-Cache-Status"] == "MISS"
        k = keys_for(CHAT, body).exact
        procs.wait_until(lambda: r.exists(keynames.cache_entry(k)), 10, what="entry")
        procs.wait_until(lambda: any(True for _ in r.scan_iter(
            match=f"{keynames.CACHE_VEC_PREFIX}*:{k}")), 20, what="vector")
        res = post(edge, body_of("How to change my email address?", temperature=0))
        assert res.headers["X-Cache-Status"] == "HIT"
        assert res.headers["X-Cache-Match"] == "semantic"
        assert content_of(res) == content_of(first)
    finally:
        emb.stop()
        srv.stop()


def test_no_index_job_without_semantic_lookups(stack, edge_factory) -> None:
    # With semantic lookups off nothing reads the index queue: nothing is queued. (Database
    # 1 of the module's Redis: the module's embedder, which would drain the queue, reads 0.)
    r1 = redis.Redis(host="127.0.0.1", port=stack.redis_port, db=1, decode_responses=True)
    r1.flushdb()
    edge = edge_factory(cache_settings(stack, f"redis://127.0.0.1:{stack.redis_port}/1",
                                       semantic=False))
    body = body_of("Name three lighthouses on the Atlantic coast.", temperature=0)
    assert post(edge, body).headers["X-Cache-Status"] == "MISS"
    procs.wait_until(lambda: r1.exists(keynames.cache_entry(exact_key(body))), 10, what="entry")
    assert post(edge, body).headers["X-Cache-Status"] == "HIT"
    assert [r1.llen(q) for q in keynames.cache_index_queues()] == [0] * 9
    r1.flushdb()


@contextlib.contextmanager
def fake_embedder(on_connection) -> Iterator[tuple[int, list[socket.socket]]]:
    """A TCP server on a free loopback port that hands every accepted connection to
    ``on_connection(conn, stop)`` in a thread of its own; yields (port, the accepted
    connections) and closes everything on exit."""
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def accept() -> None:
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conns.append(conn)
            threading.Thread(target=on_connection, args=(conn, stop), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        yield srv.getsockname()[1], conns
    finally:
        stop.set()
        t.join(2)
        for c in conns:
            c.close()
        srv.close()


def test_hung_embedder_opens_the_lookup_breaker(stack, edge_factory) -> None:
    """An embedder that accepts connections and never answers: after
    EMBEDDER_BREAKER_FAILURES timed-out lookups the edge stops asking it (BYPASS at once,
    no connection, no error-log line), and asks again after the cooldown."""
    # the connections are read from by nobody and answered by nobody
    with fake_embedder(lambda conn, stop: None) as (port, accepted):
        edge = edge_factory(cache_settings(
            stack, embedder_url=f"http://127.0.0.1:{port}", semantic_budget_ms=150))
        for i in range(8):
            res = post(edge, body_of(f"Hung embedder question {i}?", temperature=0))
            assert res.status_code == 200 and res.headers["X-Cache-Status"] == "BYPASS"
        assert len(accepted) == 5            # the breaker opened after the fifth timeout
        assert "semantic lookups in a row failed" in edge.error_log()
        # nginx logs each timed-out lookup: 5, not one per request
        assert edge.error_log().count("upstream timed out") == 5
        n = [0]

        def asks_again() -> bool:
            n[0] += 1
            post(edge, body_of(f"Hung embedder retry {n[0]}?", temperature=0))
            return len(accepted) > 5

        procs.wait_until(asks_again, 20, interval=0.5, what="a lookup after the cooldown")


def test_a_busy_embedder_does_not_open_the_lookup_breaker(stack, edge_factory) -> None:
    """Lookups that time out just after one succeeded (a burst queued behind the model)
    are BYPASS but do not open the breaker: the next lookup still goes to the embedder.
    Once nothing has succeeded for EMBEDDER_BUSY_S, timeouts count again and open it."""
    lock = threading.Lock()
    seen = {"requests": 0}
    miss = json.dumps({"results": [{"hit": False, "key": None, "similarity": None}]}).encode()

    def serve(conn: socket.socket, stop: threading.Event) -> None:
        buf = b""
        conn.settimeout(0.2)
        while not stop.is_set():
            try:
                data = conn.recv(65536)
            except OSError:
                continue
            if not data:
                return
            buf += data
            while b"\r\n\r\n" in buf:
                head, rest = buf.split(b"\r\n\r\n", 1)
                n = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:")), 0)
                if len(rest) < n:
                    break
                buf = rest[n:]
                with lock:
                    seen["requests"] += 1
                    first = seen["requests"] == 1
                if first:  # the first lookup is answered, every later one is held
                    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: " + str(len(miss)).encode() + b"\r\n\r\n"
                                 + miss)

    with fake_embedder(serve) as (port, _):
        edge = edge_factory(cache_settings(
            stack, embedder_url=f"http://127.0.0.1:{port}", semantic_budget_ms=100))
        res = post(edge, body_of("Busy embedder question zero?", temperature=0))
        assert res.headers["X-Cache-Status"] == "MISS" and seen["requests"] == 1
        # a burst: six lookup calls time out, two at a time (each alone in its call)
        with ThreadPoolExecutor(2) as ex:
            burst = list(ex.map(lambda i: post(edge, body_of(f"Busy embedder burst {i}?",
                                                             temperature=0)), range(6)))
        assert {r.headers["X-Cache-Status"] for r in burst} == {"BYPASS"}
        assert seen["requests"] == 7
        assert "semantic lookups in a row failed" not in edge.error_log()
        # still closed (six timeouts in a row would have opened it): the next one goes out
        post(edge, body_of("Busy embedder right after the burst?", temperature=0))
        assert seen["requests"] == 8
        # once the busy window has passed, five timeouts in a row open it
        for i in range(40):
            if "semantic lookups in a row failed" in edge.error_log():
                break
            post(edge, body_of(f"Busy embedder after the burst {i}?", temperature=0))
        assert "semantic lookups in a row failed" in edge.error_log()
        n = seen["requests"]
        res = post(edge, body_of("Busy embedder, breaker open?", temperature=0))
        assert res.headers["X-Cache-Status"] == "BYPASS" and seen["requests"] == n


def test_clients_that_leave_during_lookups_do_not_stall_the_later_ones(stack, edge_factory) -> None:
    """Clients that leave while their semantic lookups are in flight or queued end their
    requests at once (lua_check_client_abort), the senders of the worker's lookup calls
    with them. The calls they held no longer count once their own bound has passed (3 x
    the 0.4 s budget + 1 s): later lookups go to the embedder again and are answered,
    instead of waiting out their budget (BYPASS) behind the dead calls for 30 s."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    delay = {"s": 1.5}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["lookups"]
            time.sleep(delay["s"])
            doc = json.dumps({"results": [{"hit": False, "key": None, "similarity": 0.5}
                                          for _ in items]}).encode()
            try:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(doc)))
                self.end_headers()
                self.wfile.write(doc)
            except OSError:
                pass   # the edge gave up on the call

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    th = threading.Thread(target=srv.serve_forever, daemon=True)
    th.start()
    try:
        s = cache_settings(stack, embedder_url=f"http://127.0.0.1:{srv.server_address[1]}",
                           semantic_budget_ms=400)
        s.edge.workers = 1
        edge = edge_factory(s)

        def leave(i: int) -> None:
            with pytest.raises(requests.exceptions.ReadTimeout):
                post(edge, body_of(f"A question its client leaves {i}?", temperature=0),
                     timeout=0.2)

        with ThreadPoolExecutor(6) as ex:
            list(ex.map(leave, range(6)))
        delay["s"] = 0.0
        t0, n = time.monotonic(), [0]

        def answered() -> bool:
            n[0] += 1
            res = post(edge, body_of(f"A question after they left {n[0]}?", temperature=0))
            return res.headers["X-Cache-Status"] == "MISS"

        procs.wait_until(answered, 8, interval=0.2, what="a lookup answered again")
        assert time.monotonic() - t0 < 5.0
    finally:
        srv.shutdown()
        srv.server_close()
        th.join(5)


@contextlib.contextmanager
def slow_lookup_embedder(call_s: float) -> Iterator[tuple[str, list[list[str]], dict]]:
    """An embedder whose every POST /v1/lookups takes ``call_s`` and answers a miss for
    each lookup; yields (its URL, the texts of each call, {"most": calls at once})."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    lock = threading.Lock()
    calls: list[list[str]] = []
    state = {"now": 0, "most": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["lookups"]
            with lock:
                calls.append([it["text"] for it in items])
                state["now"] += 1
                state["most"] = max(state["most"], state["now"])
            time.sleep(call_s)  # the model's time: later lookups queue meanwhile
            with lock:
                state["now"] -= 1
            doc = json.dumps({"results": [{"hit": False, "key": None, "similarity": 0.5}
                                          for _ in items]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(doc)))
            self.end_headers()
            self.wfile.write(doc)

        def log_message(self, *args: Any) -> None:
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", calls, state
    finally:
        srv.shutdown()
        srv.server_close()


def edge_counter(edge, name: str, **labels: str) -> float:
    """The value of one sample of the edge's /metrics (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = requests.get(edge.metrics_url, timeout=5).text
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            if smp.name == name and dict(smp.labels) == labels:
                return smp.value
    return 0.0


def test_concurrent_lookups_go_to_the_embedder_grouped(stack, edge_factory) -> None:
    """Lookups that arrive while a worker's calls are in flight wait and go out together
    in its next call (group commit): every lookup is answered once, in its own place of
    the call's results, with at most MAX_FLIGHTS (2) calls in flight per worker."""
    with slow_lookup_embedder(0.1) as (url, calls, state):
        edge = edge_factory(cache_settings(stack, embedder_url=url))
        texts = [f"Grouped lookup question number {i}?" for i in range(24)]
        with ThreadPoolExecutor(24) as ex:
            res = list(ex.map(lambda t: post(edge, body_of(t, temperature=0)), texts))
    assert [r.status_code for r in res] == [200] * 24
    assert {r.headers["X-Cache-Status"] for r in res} == {"MISS"}
    sent = [t for call in calls for t in call]
    assert sorted(sent) == sorted(texts)          # each lookup once
    assert len(calls) < len(texts) and max(len(c) for c in calls) > 1
    assert state["most"] <= 2 * 2                 # two workers, two calls each
    assert edge_counter(edge, "infergate_edge_semantic_calls_total") == len(calls)
    assert edge_counter(edge, "infergate_edge_semantic_call_lookups_total") == 24
    assert edge_counter(edge, "infergate_edge_semantic_lookups_total", outcome="miss") == 24


def test_waiting_lookups_that_would_be_answered_too_late_are_not_sent(stack, edge_factory) -> None:
    """One worker, calls of 0.6 s, a 1 s budget: two lookups go out at once, the four
    that queue behind them would be answered after their budget once a call has shown
    how long calls take, so they give up then (BYPASS, answered by the node) and are
    never sent."""
    with slow_lookup_embedder(0.6) as (url, calls, _):
        s = cache_settings(stack, embedder_url=url, semantic_budget_ms=1000)
        s.edge = s.edge.model_validate({**s.edge.model_dump(), "workers": 1})
        edge = edge_factory(s)
        texts = [f"Late lookup question number {i}?" for i in range(6)]
        with ThreadPoolExecutor(6) as ex:
            res = list(ex.map(lambda t: post(edge, body_of(t, temperature=0)), texts))
    assert [r.status_code for r in res] == [200] * 6
    assert sorted(r.headers["X-Cache-Status"] for r in res) == ["BYPASS"] * 4 + ["MISS"] * 2
    assert [len(c) for c in calls] == [1, 1]
    assert edge_counter(edge, "infergate_edge_semantic_lookups_total", outcome="busy") == 4
