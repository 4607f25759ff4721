"""An answer cut short of the request's max_tokens with finish_reason "length" (the node's
context ran out: a llama-server slot of 1,024 tokens answers a 874-token prompt with
max_tokens 300 in 150 tokens, where a node of a larger context writes the 300) is not
stored by the response cache; an answer cut at max_tokens still is. Real nginx edge,
redis-server, a tiny upstream."""

from __future__ import annotations

from typing import Any

import pytest
import requests

from controlplane import procs
from controlplane.cache.key import keys_for
from controlplane.config import settings_from_dict
from controlplane.redisdb import keynames
from support.stack import edge_settings

pytestmark = pytest.mark.integration

CHAT = "/v1/chat/completions"


def cache_edge(redis_server, up, edge_factory):
    s = edge_settings(redis_server.url, [up.node_settings()])
    return edge_factory(settings_from_dict({**s.model_dump(mode="json"),
                                            "cache": {"enabled": True, "semantic": False}}))


def body_of(content: str, **params: Any) -> dict:
    return {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": content}],
            **params}


def counted(r, field: str) -> int:
    return int(r.hget(keynames.CACHE_STATS, field) or 0)


def send(edge, r, body: dict) -> requests.Response:
    """The answer, once the edge's flush wrote its counters (a store goes before them)."""
    field = "misses"
    before = counted(r, field)
    res = requests.post(edge.url + CHAT, json=body, timeout=30)
    assert res.status_code == 200
    if res.headers.get("X-Cache-Status") == "MISS":
        procs.wait_until(lambda: counted(r, field) > before, 10, what="cache counters flushed")
    return res


def stored(r, body: dict) -> bool:
    return bool(r.exists(keynames.cache_entry(keys_for(CHAT, body, "default").exact)))


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_json_answer_cut_before_max_tokens_is_not_stored(redis_server, tiny_upstreams,
                                                           edge_factory, field) -> None:
    (up,) = tiny_upstreams(1)
    up.finish_reason, up.completion_tokens = "length", 150
    edge = cache_edge(redis_server, up, edge_factory)
    r = redis_server.client()
    body = body_of(f"context cut json {field}", **{field: 300})
    first = send(edge, r, body)
    assert first.headers["X-Cache-Status"] == "MISS"
    assert first.json()["choices"][0]["finish_reason"] == "length"
    assert not stored(r, body)
    again = send(edge, r, body)
    assert again.headers["X-Cache-Status"] == "MISS" and up.hits == 2


def test_a_json_answer_cut_at_max_tokens_is_stored(redis_server, tiny_upstreams,
                                                   edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    up.finish_reason, up.completion_tokens = "length", 300
    edge = cache_edge(redis_server, up, edge_factory)
    r = redis_server.client()
    # the smaller of the two limits is the one a node applies at most
    body = body_of("cut at max_tokens json", max_tokens=300, max_completion_tokens=400)
    assert send(edge, r, body).headers["X-Cache-Status"] == "MISS"
    assert stored(r, body)
    hit = send(edge, r, body)
    assert hit.headers["X-Cache-Status"] == "HIT" and up.hits == 1


def test_a_stream_cut_before_max_tokens_is_not_stored(redis_server, tiny_upstreams,
                                                      edge_factory) -> None:
    (up,) = tiny_upstreams(1)
    up.finish_reason, up.chunks = "length", 4   # usage: 4 completion tokens
    edge = cache_edge(redis_server, up, edge_factory)
    r = redis_server.client()
    cut = body_of("context cut stream", max_tokens=300, stream=True)
    res = send(edge, r, cut)
    assert res.headers["X-Cache-Status"] == "MISS" and '"finish_reason": "length"' in res.text
    assert res.text.endswith("data: [DONE]\n\n") and not stored(r, cut)
    whole = body_of("cut at max_tokens stream", max_tokens=4, stream=True)
    send(edge, r, whole)
    assert stored(r, whole)
    # without a usage chunk nothing tells a cut from the whole answer: not stored, as an
    # answer that is not a stream is not without its usage
    up.stream_usage = False
    unknown = body_of("length stream without usage", max_tokens=4, stream=True)
    res = send(edge, r, unknown)
    assert '"finish_reason": "length"' in res.text and res.text.endswith("data: [DONE]\n\n")
    assert not stored(r, unknown)


def test_a_length_answer_without_max_tokens_is_not_stored(redis_server, tiny_upstreams,
                                                          edge_factory) -> None:
    """Without max_tokens, "length" is the node's own limit (its context: a node of a
    larger one writes more): the answer is not the whole one, and is not stored."""
    (up,) = tiny_upstreams(1)
    up.finish_reason, up.completion_tokens = "length", 150
    edge = cache_edge(redis_server, up, edge_factory)
    r = redis_server.client()
    body = body_of("context cut without max_tokens")
    assert send(edge, r, body).headers["X-Cache-Status"] == "MISS"
    assert not stored(r, body)
    up.finish_reason = "stop"
    done = body_of("a whole answer without max_tokens")
    send(edge, r, done)
    assert stored(r, done)
