"""Browsers through the edge (lua/infergate/core/cors.lua), with real nginx and a tiny
node: a CORS preflight is answered by the edge (204, before the API key, nothing sent
to a node), the edge's own answers (errors) carry the request's Origin back, and a
node's answer keeps the node's own CORS headers (or their absence), as behind nginx."""

from __future__ import annotations

import requests

from controlplane.admin import apikeys
from support.stack import edge_settings

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
ORIGIN = "http://app.example.com"


def _preflight(url: str, method: str = "POST", **headers: str) -> requests.Response:
    return requests.options(url, timeout=10, headers={
        "Origin": ORIGIN, "Access-Control-Request-Method": method, **headers})


def test_preflight_needs_no_key_and_errors_carry_the_origin(tiny_upstreams, redis_server,
                                                            edge_factory) -> None:
    (a,) = tiny_upstreams(names=["a"])
    s = edge_settings(redis_server.url, [a.node_settings()])
    s.auth.mode = "required"
    edge = edge_factory(s)
    key, _ = apikeys.create_key(redis_server.client(), "acme")

    res = _preflight(f"{edge.url}/v1/chat/completions",
                     **{"Access-Control-Request-Headers": "authorization,content-type"})
    assert res.status_code == 204, res.text
    assert res.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert res.headers["Access-Control-Allow-Methods"] == "POST, OPTIONS"
    assert res.headers["Access-Control-Allow-Headers"] == "authorization,content-type"
    assert res.headers["Access-Control-Max-Age"] == "600"
    assert "Origin" in res.headers["Vary"]
    assert "Access-Control-Allow-Credentials" not in res.headers
    res = _preflight(f"{edge.url}/v1/models", method="GET")
    assert res.status_code == 204
    assert res.headers["Access-Control-Allow-Methods"] == "GET, HEAD, OPTIONS"
    # without an Origin, OPTIONS still names the methods (RFC 9110 section 9.3.7)
    res = requests.options(f"{edge.url}/v1/chat/completions", timeout=10)
    assert res.status_code == 204 and res.headers["Allow"] == "POST, OPTIONS"
    assert "Access-Control-Allow-Origin" not in res.headers
    assert a.hits == 0, "a preflight never reaches a node"

    # the edge's own answers: the page can read them (and their request id)
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10,
                        headers={"Origin": ORIGIN})
    assert res.status_code == 401
    assert res.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "X-Request-Id" in res.headers["Access-Control-Expose-Headers"]
    res = requests.post(f"{edge.url}/v1/chat/completions", data=b"{not json", timeout=10,
                        headers={"Origin": ORIGIN, "Authorization": f"Bearer {key}",
                                 "Content-Type": "application/json"})
    assert res.status_code == 400 and res.headers["Access-Control-Allow-Origin"] == ORIGIN
    # no Origin: no CORS header
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10)
    assert res.status_code == 401 and "Access-Control-Allow-Origin" not in res.headers

    # a node's answer is the node's: this one sends no CORS header, the edge adds none
    res = requests.post(f"{edge.url}/v1/chat/completions", json=CHAT, timeout=10,
                        headers={"Origin": ORIGIN, "Authorization": f"Bearer {key}"})
    assert res.status_code == 200 and res.headers["X-Infergate-Node"] == "a"
    assert "Access-Control-Allow-Origin" not in res.headers
    assert a.hits == 1
