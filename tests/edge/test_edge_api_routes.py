"""The API beyond completions at the edge, with real nginx and simulated nodes: the
named routes (/v1/responses, /v1/rerank, /rerank, /v1/score, /v1/audio/*, /tokenize,
/detokenize) and any other /v1/ path go to a node serving the request's model (from a
JSON body or a multipart/form-data field), with auth, rate limits and retries, never
through the cache; an unknown model is 404 model_not_found from the edge, as on the
chat routes; non-JSON bodies pass unrefused, JSON bodies keep their bounds."""

from __future__ import annotations

import json
import threading
import time

import pytest
import requests

from controlplane.admin import apikeys
from controlplane.config import settings_from_dict
from support.stack import edge_settings

NAMED = ("/v1/responses", "/v1/rerank", "/rerank", "/v1/score", "/tokenize", "/detokenize",
         "/v1/audio/speech")


@pytest.fixture
def two_models(simnodes, redis_server, edge_factory):
    """Node ``a`` serves m-a, node ``b`` serves m-b (configured lists)."""
    (a,) = simnodes(1, names=["a"], model="m-a")
    (b,) = simnodes(1, names=["b"], model="m-b")
    edge = edge_factory(edge_settings(redis_server.url, [a.node_settings(models=["m-a"]),
                                                         b.node_settings(models=["m-b"])]))
    return edge, a, b


def _paths(node) -> dict:
    """Requests per path the node received (its readiness probe's /health left out)."""
    return {p: n for p, n in node.state()["by_path"].items() if p != "/health"}


def _error(res: requests.Response, status: int, code: str) -> dict:
    assert res.status_code == status, res.text
    assert res.headers["Content-Type"].startswith("application/json")
    err = res.json()["error"]
    assert err["code"] == code and err["message"] and "type" in err and "param" in err, err
    return err


def test_named_routes_reach_a_node_serving_the_model(two_models) -> None:
    edge, a, b = two_models
    for path in NAMED:
        for model, node in (("m-a", a), ("m-b", b)):
            for _ in range(3):
                res = requests.post(edge.url + path, json={"model": model, "input": "hi"},
                                    timeout=15)
                assert res.status_code == 200, (path, res.text)
                doc = res.json()
                assert (doc["object"], doc["path"], doc["model"]) == ("simnode.echo", path, model)
                assert doc["node"] == node.name == res.headers["X-Infergate-Node"]
                assert len(res.headers["X-Request-Id"]) == 32
                assert "X-Cache-Status" not in res.headers
    for path in NAMED:
        assert _paths(a)[path] == 3 and _paths(b)[path] == 3, path
    # no model: any node
    res = requests.post(edge.url + "/tokenize", json={"prompt": "hi"}, timeout=15)
    assert res.status_code == 200 and res.json()["model"] is None


def test_unknown_model_is_404_from_the_edge_on_every_route(two_models) -> None:
    edge, a, b = two_models
    for path in (*NAMED, "/v1/foo", "/v1/responses/resp_1/cancel"):
        res = requests.post(edge.url + path, json={"model": "m-nowhere", "input": "x"}, timeout=15)
        err = _error(res, 404, "model_not_found")
        assert "m-nowhere" in err["message"] and "X-Infergate-Node" not in res.headers
    files = {"file": ("a.wav", b"RIFF\x00\x01binary", "audio/wav")}
    res = requests.post(edge.url + "/v1/audio/transcriptions", data={"model": "m-nowhere"},
                        files=files, timeout=15)
    _error(res, 404, "model_not_found")
    assert _paths(a) == {} and _paths(b) == {}


def test_multipart_audio_routes_by_its_model_field(two_models) -> None:
    edge, a, b = two_models
    audio = bytes(range(256)) * 64  # not UTF-8, not JSON
    for path in ("/v1/audio/transcriptions", "/v1/audio/translations"):
        for model, node in (("m-a", a), ("m-b", b)):
            files = {"file": ("clip.wav", audio, "audio/wav")}
            # the file part first: the model field after it is found too
            res = requests.post(edge.url + path, files={**files, "model": (None, model)},
                                data={"language": "en"}, timeout=15)
            assert res.status_code == 200, res.text
            doc = res.json()
            assert (doc["path"], doc["model"], doc["node"]) == (path, model, node.name)
            assert doc["content_type"] == "multipart/form-data"
            assert doc["body_bytes"] == int(res.request.headers["Content-Length"])
    # a multipart body without a model field: any node, never invalid_json
    res = requests.post(edge.url + "/v1/audio/transcriptions",
                        files={"file": ("clip.wav", audio, "audio/wav")}, timeout=15)
    assert res.status_code == 200 and res.json()["model"] is None
    # a model field that is not UTF-8: 400 from the edge
    body = (b"--xyz\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\n\xff\xfe"
            b"\r\n--xyz--\r\n")
    res = requests.post(edge.url + "/v1/audio/transcriptions", data=body, timeout=15,
                        headers={"Content-Type": "multipart/form-data; boundary=xyz"})
    _error(res, 400, "invalid_utf8")


def test_other_v1_paths_pass_through_to_a_node_of_the_model(two_models) -> None:
    edge, a, b = two_models
    res = requests.post(edge.url + "/v1/foo", json={"model": "m-b"}, timeout=15)
    # the node's own 404 comes back, from the node serving m-b
    assert res.status_code == 404 and res.headers["X-Infergate-Node"] == "b", res.text
    assert res.json()["error"]
    assert _paths(b) == {"/v1/foo": 1} and _paths(a) == {}
    # a GET without a body, with a query string: any node, passed on as it came
    res = requests.get(edge.url + "/v1/responses/resp_1?x=1", timeout=15)
    assert res.status_code == 404 and res.headers["X-Infergate-Node"] in ("a", "b")
    # a node's 404 is not a failure of the node: never retried elsewhere
    assert sum(_paths(n).get("/v1/responses/resp_1", 0) for n in (a, b)) == 1
    # other audio paths (a TTS server's voice list) are passed through too
    res = requests.get(edge.url + "/v1/audio/voices", timeout=15)
    assert res.status_code == 404 and res.headers["X-Infergate-Node"] in ("a", "b")
    # the trailing slash of a chat path is another path: the node answers it
    res = requests.post(edge.url + "/v1/chat/completions/", json={"model": "m-a"}, timeout=15)
    assert res.status_code == 404 and res.headers["X-Infergate-Node"] == "a"
    # binary and plain bodies are not JSON: passed on, not refused as invalid_json
    for data, ctype in ((b"\x00\xff\x10binary", "application/octet-stream"),
                        (b"just text", "text/plain")):
        res = requests.post(edge.url + "/v1/foo", data=data, timeout=15,
                            headers={"Content-Type": ctype})
        assert res.status_code == 404 and res.headers.get("X-Infergate-Node"), res.text


def test_methods_and_paths_the_edge_answers(two_models) -> None:
    edge, a, b = two_models
    res = requests.get(edge.url + "/v1/responses", timeout=15)
    assert _error(res, 405, "method_not_allowed") and res.headers["Allow"] == "POST"
    res = requests.request("PROPFIND", edge.url + "/v1/foo", timeout=15)
    _error(res, 405, "method_not_allowed")
    assert "DELETE" in res.headers["Allow"]
    # OPTIONS is answered by the edge (a browser's preflight: test_cors.py)
    res = requests.options(edge.url + "/v1/foo", timeout=15)
    assert res.status_code == 204 and res.headers["Allow"].endswith("DELETE, OPTIONS")
    # /v1/models is still the edge's answer, and only for GET / HEAD
    res = requests.get(edge.url + "/v1/models", timeout=15)
    assert [m["id"] for m in res.json()["data"]] == ["m-a", "m-b"]
    _error(requests.post(edge.url + "/v1/models", json={}, timeout=15), 405, "method_not_allowed")
    # node administration is not passed on
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        res = requests.post(edge.url + path, json={"lora_name": "x", "lora_path": "/tmp"},
                            timeout=15)
        _error(res, 404, "not_found")
    assert _paths(a) == {} and _paths(b) == {}


def test_json_bodies_keep_their_bounds(two_models) -> None:
    edge, a, b = two_models
    url = edge.url + "/v1/responses"
    hdr = {"Content-Type": "application/json"}
    _error(requests.post(url, data=b"{not json", headers=hdr, timeout=15), 400, "invalid_json")
    _error(requests.post(url, data=b"\xef\xbb\xbf{}", headers=hdr, timeout=15), 400,
           "invalid_json")
    _error(requests.post(url, data=b'{"input": "\xff"}', headers=hdr, timeout=15), 400,
           "invalid_utf8")
    deep = b'{"a":' * 200 + b"1" + b"}" * 200
    _error(requests.post(url, data=deep, headers=hdr, timeout=15), 400, "json_too_deep")
    wide = json.dumps({"model": "m-a", "input": [1] * 200000}).encode()
    _error(requests.post(url, data=wide, headers=hdr, timeout=15), 400, "too_many_json_members")
    # curl -d sends a JSON text as application/x-www-form-urlencoded: still JSON
    res = requests.post(url, data=b"{nope", timeout=15,
                        headers={"Content-Type": "application/x-www-form-urlencoded"})
    _error(res, 400, "invalid_json")
    # a compressed body cannot be read for its model
    res = requests.post(url, data=b"\x1f\x8b", timeout=15,
                        headers={**hdr, "Content-Encoding": "gzip"})
    _error(res, 415, "unsupported_content_encoding")
    assert _paths(a) == {} and _paths(b) == {}


def test_auth_and_rate_limits_apply(simnodes, redis_server, edge_factory) -> None:
    (a,) = simnodes(1, names=["a"], model="m-a")
    s = edge_settings(redis_server.url, [a.node_settings(models=["m-a"])])
    s.auth.mode = "required"
    r = redis_server.client()
    key, _ = apikeys.create_key(r, "acme", rpm=3)
    edge = edge_factory(s)
    files = {"file": ("clip.wav", b"\x00\x01", "audio/wav"), "model": (None, "m-a")}
    for path, kw in (("/v1/responses", {"json": {"model": "m-a"}}),
                     ("/v1/foo", {"json": {"model": "m-a"}}),
                     ("/v1/audio/transcriptions", {"files": files}),
                     ("/tokenize", {"json": {"model": "m-a", "prompt": "x"}})):
        res = requests.post(edge.url + path, timeout=15, **kw)
        _error(res, 401, "invalid_api_key")
    assert _paths(a) == {}
    auth = {"Authorization": f"Bearer {key}"}
    codes = [requests.post(edge.url + "/v1/responses", json={"model": "m-a"}, headers=auth,
                           timeout=15).status_code for _ in range(5)]
    assert codes[:3] == [200, 200, 200] and codes[3:] == [429, 429], codes
    res = requests.post(edge.url + "/v1/foo", json={"model": "m-a"}, headers=auth, timeout=15)
    _error(res, 429, "rate_limit_exceeded")
    assert _paths(a) == {"/v1/responses": 3}


def test_a_token_limit_charges_the_other_routes(simnodes, redis_server, edge_factory) -> None:
    """A key with only a tokens-per-minute limit cannot bypass it through /v1/responses or
    a pass-through path: their prompt is estimated as chat's is (at least 1 token)."""
    (a,) = simnodes(1, names=["a"], model="m-a")
    s = edge_settings(redis_server.url, [a.node_settings(models=["m-a"])])
    s.auth.mode = "required"
    key, _ = apikeys.create_key(redis_server.client(), "acme", tpm=100)
    edge = edge_factory(s)
    auth = {"Authorization": f"Bearer {key}"}
    body = {"model": "m-a", "input": "a" * 240}  # 60 tokens estimated
    res = requests.post(edge.url + "/v1/responses", json=body, headers=auth, timeout=15)
    assert res.status_code == 200 and res.headers["x-ratelimit-remaining-tokens"] == "40"
    for path in ("/v1/responses", "/v1/foo"):
        res = requests.post(edge.url + path, json=body, headers=auth, timeout=15)
        assert _error(res, 429, "rate_limit_exceeded")["type"] == "tokens"
    assert _paths(a) == {"/v1/responses": 1}


def test_a_failed_try_is_retried_on_another_node_of_the_model(
        simnodes, redis_server, edge_factory) -> None:
    down, up = simnodes(2, names=["down", "up"], model="m-a")
    down.set_faults(refuse=True)
    edge = edge_factory(edge_settings(redis_server.url, [
        down.node_settings(models=["m-a"]), up.node_settings(models=["m-a"])]))
    files = {"file": ("clip.wav", bytes(range(256)), "audio/wav"), "model": (None, "m-a")}
    for _ in range(4):
        for path, kw in (("/v1/responses", {"json": {"model": "m-a"}}),
                         ("/v1/audio/transcriptions", {"files": files})):
            res = requests.post(edge.url + path, timeout=15, **kw)
            assert res.status_code == 200 and res.json()["node"] == "up", res.text
    assert _paths(up) == {"/v1/responses": 4, "/v1/audio/transcriptions": 4}


def test_generating_routes_wait_for_a_slot_the_tokenizer_does_not(
        tiny_upstreams, redis_server, edge_factory) -> None:
    """/v1/responses, audio, rerank and score take a slot of the engine: shed (429) when the
    model's nodes are at their max_concurrency, as chat is; /tokenize takes none."""
    (slow,) = tiny_upstreams(names=["slow"])
    slow.mode = "hang"
    s = edge_settings(redis_server.url, [slow.node_settings(models=["m"], max_concurrency=1)],
                      read_timeout_ms=20000)
    s.admission.max_wait_ms = 100
    edge = edge_factory(s)

    def post(path: str, **kw) -> requests.Response:
        return requests.post(edge.url + path, timeout=30, **kw)

    def wait_inflight(n: int) -> None:
        deadline = time.monotonic() + 10
        while slow.inflight < n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert slow.inflight == n

    holders = [threading.Thread(target=post, args=("/v1/responses",),
                                kwargs={"json": {"model": "m"}}, daemon=True)]
    holders[0].start()
    try:
        wait_inflight(1)
        files = {"file": ("a.wav", b"\x00\x01"), "model": (None, "m")}
        for path, kw in (("/v1/responses", {"json": {"model": "m"}}),
                         ("/v1/audio/transcriptions", {"files": files}),
                         ("/v1/rerank", {"json": {"model": "m", "query": "q"}}),
                         ("/v1/score", {"json": {"model": "m"}})):
            res = post(path, **kw)
            err = _error(res, 429, "nodes_saturated")
            assert err["type"] == "server_overloaded" and "Retry-After" in res.headers, path
        holders.append(threading.Thread(target=post, args=("/tokenize",),
                                        kwargs={"json": {"model": "m", "content": "x"}},
                                        daemon=True))
        holders[1].start()
        wait_inflight(2)  # admitted past the full slot
    finally:
        slow.release()
        for t in holders:
            t.join(15)


def test_the_cache_covers_chat_only(simnodes, redis_server, edge_factory) -> None:
    (a,) = simnodes(1, names=["a"], model="m-a")
    s = edge_settings(redis_server.url, [a.node_settings(models=["m-a"])])
    s = settings_from_dict({**s.model_dump(mode="json"),
                            "cache": {"enabled": True, "semantic": False}})
    edge = edge_factory(s)
    chat = {"model": "m-a", "messages": [{"role": "user", "content": "cached?"}]}
    deadline = time.monotonic() + 10
    while requests.post(edge.url + "/v1/chat/completions", json=chat,
                        timeout=15).headers.get("X-Cache-Status") != "HIT":
        assert time.monotonic() < deadline, "the chat answer is never served from the cache"
    body = {"model": "m-a", "input": "cached?", "messages": chat["messages"]}
    for path in ("/v1/responses", "/tokenize", "/v1/foo"):
        for _ in range(3):
            res = requests.post(edge.url + path, json=body, timeout=15)
            assert res.headers["X-Infergate-Node"] == "a" and "X-Cache-Status" not in res.headers
    assert {p: _paths(a)[p] for p in ("/v1/responses", "/tokenize", "/v1/foo")} == {
        "/v1/responses": 3, "/tokenize": 3, "/v1/foo": 3}
