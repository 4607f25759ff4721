"""Prefix affinity through a real edge (lua/infergate/routing/affinity.lua): the turns of
a conversation with a long system prompt stay on one node, conversations with different
prompts spread over the pool, two edges send the same prompt to the same node without
sharing anything, and an X-Session-ID header is an explicit key."""

from __future__ import annotations

from collections import Counter

import requests

from support.stack import edge_settings


def _system(i: int) -> str:
    # ~300 tokens (4 characters a token): above the default prefix_min_tokens (256)
    return f"Group {i}. " + " ".join(f"rule{i}-{j} applies." for j in range(80))


def _chat(edge, messages, headers=None) -> tuple[str, dict]:
    res = requests.post(f"{edge.url}/v1/chat/completions", headers=headers or {}, timeout=30,
                        json={"model": "sim-llama", "messages": messages, "max_tokens": 4})
    assert res.status_code == 200, res.text
    return res.headers["X-Infergate-Node"], res.json()


def _conversation(edge, i: int, turns: int = 3, cached: list[int] | None = None) -> list[str]:
    msgs = [{"role": "system", "content": _system(i)}]
    nodes = []
    for t in range(turns):
        msgs.append({"role": "user", "content": f"question {t} of conversation {i}"})
        node, body = _chat(edge, msgs)
        nodes.append(node)
        if cached is not None:
            cached.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
        msgs.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return nodes


def test_conversations_stick_spread_and_two_edges_agree(simnodes, redis_server,
                                                         edge_factory) -> None:
    pool = simnodes(3, "--output-tokens", "2:4", names=["pa", "pb", "pc"], time_scale=0.05)
    settings = edge_settings(redis_server.url, [n.node_settings() for n in pool])
    one, two = edge_factory(settings), edge_factory(settings)
    homes = {}
    for i in range(12):
        cached: list[int] = []
        nodes = _conversation(one, i, cached=cached)
        assert len(set(nodes)) == 1, (i, nodes)
        # the node's prefix cache holds the earlier turns (the simnode's vLLM-like model)
        assert cached[0] == 0 and min(cached[1:]) >= 300 // 16 * 16 - 16, cached
        homes[i] = nodes[0]
    assert len(set(homes.values())) >= 2, homes
    # the other edge has seen none of these requests and picks the same nodes
    for i in range(12):
        assert _conversation(two, i, turns=1) == [homes[i]], i
    # a short prompt has no key: plain cost, both nodes of a burst of sequential requests
    short = Counter(_chat(one, [{"role": "user", "content": "hi"}])[0] for _ in range(12))
    assert len(short) >= 2, short
    metrics = requests.get(one.metrics_url, timeout=5).text
    first = [ln for ln in metrics.splitlines()
             if ln.startswith('infergate_edge_affinity_picks_total{outcome="first"}')]
    assert first and float(first[0].split()[-1]) >= 36, first


def test_session_header_is_an_explicit_key(simnodes, redis_server, edge_factory) -> None:
    pool = simnodes(3, "--output-tokens", "2:2", names=["sa", "sb", "sc"], time_scale=0.05)
    settings = edge_settings(redis_server.url, [n.node_settings() for n in pool])
    edge = edge_factory(settings)
    for s in ("alice", "bob", "carol"):
        got = {_chat(edge, [{"role": "user", "content": f"hi {k}"}],
                     headers={"X-Session-ID": s})[0] for k in range(5)}
        assert len(got) == 1, (s, got)
    off = edge_settings(redis_server.url, [n.node_settings() for n in pool],
                        prefix_affinity=False)
    plain = edge_factory(off)
    got = Counter(_chat(plain, [{"role": "user", "content": "hi"}],
                        headers={"X-Session-ID": "alice"})[0] for _ in range(12))
    assert len(got) >= 2, got
