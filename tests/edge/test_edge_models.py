"""Model-aware routing at the edge, against tiny upstreams: a request goes only to the
nodes that serve its model (configured in the static list, or from the snapshot's
``models``), an unknown model gets 404 model_not_found from the edge (unless a node
takes any model: a single-model llama.cpp server), GET /v1/models is
the union the edge answers itself, and shedding looks only at the model's nodes."""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests

from support.stack import edge_settings, write_snapshot


def _post(edge, model: str | None, **kw) -> requests.Response:
    body: dict = {"messages": [{"role": "user", "content": "hi"}], **kw}
    if model is not None:
        body["model"] = model
    return requests.post(f"{edge.url}/v1/chat/completions", json=body, timeout=15)


def _nodes_for(edge, model: str | None, n: int = 20) -> Counter:
    def one(_: int) -> str:
        res = _post(edge, model)
        assert res.status_code == 200, res.text
        return res.headers["X-Infergate-Node"]

    with ThreadPoolExecutor(4) as pool:
        return Counter(pool.map(one, range(n)))


def _models(edge) -> requests.Response:
    return requests.get(f"{edge.url}/v1/models", timeout=10)


@pytest.fixture
def static_pool(tiny_upstreams, redis_server, edge_factory):
    """n1 serves m-a, n2 serves m-b (configured); no snapshot in Redis."""
    n1, n2 = tiny_upstreams(names=["n1", "n2"])
    edge = edge_factory(edge_settings(redis_server.url, [
        n1.node_settings(models=["m-a"]), n2.node_settings(models=["m-b", "m-shared"])]))
    return edge, n1, n2


def test_requests_go_only_to_nodes_serving_their_model(static_pool) -> None:
    edge, n1, n2 = static_pool
    assert _nodes_for(edge, "m-a") == {"n1": 20}
    assert _nodes_for(edge, "m-b") == {"n2": 20}
    # no model in the body: any node, as before
    assert set(_nodes_for(edge, None, 30)) == {"n1", "n2"}


def test_unknown_model_is_404_from_the_edge_without_touching_a_node(static_pool) -> None:
    edge, n1, n2 = static_pool
    before = n1.hits + n2.hits
    res = _post(edge, "m-nowhere")
    assert res.status_code == 404, res.text
    assert res.headers["Content-Type"].startswith("application/json")
    err = res.json()["error"]
    assert err["code"] == "model_not_found" and err["type"] == "invalid_request_error"
    assert err["param"] == "model" and "m-nowhere" in err["message"]
    assert "X-Infergate-Node" not in res.headers
    assert n1.hits + n2.hits == before
    # a name over 256 bytes is not echoed whole; the cut keeps the message valid UTF-8
    # (over 512 bytes the name is refused outright: tests/edge/test_edge_badinput.py)
    res = _post(edge, "é" * 200)
    assert res.status_code == 404 and len(res.content) < 1000
    assert res.json()["error"]["message"].count("é") == 128 and "é..." in res.text


def test_models_list_is_the_union_answered_by_the_edge(static_pool) -> None:
    edge, _, _ = static_pool
    res = _models(edge)
    assert res.status_code == 200 and res.headers["Content-Type"].startswith("application/json")
    doc = res.json()
    assert doc["object"] == "list"
    assert [m["id"] for m in doc["data"]] == ["m-a", "m-b", "m-shared"]
    assert all(m["object"] == "model" and m["owned_by"] == "infergate" for m in doc["data"])
    assert "X-Infergate-Node" not in res.headers
    assert requests.head(f"{edge.url}/v1/models", timeout=10).status_code == 200


def test_a_model_is_retrieved_from_the_edge(tiny_upstreams, redis_server, edge_factory) -> None:
    """GET /v1/models/<id> (the OpenAI SDKs' models.retrieve) is answered by the edge from
    the nodes' lists, ids with "/" too; an id no node lists is 404 model_not_found. The
    "created" of both answers is the time of the request, as vLLM gives it."""
    (n1,) = tiny_upstreams(names=["n1"])
    edge = edge_factory(edge_settings(redis_server.url, [
        n1.node_settings(models=["m-a", "org/Model-7B"])]))
    t0 = int(time.time())
    res = requests.get(f"{edge.url}/v1/models/org/Model-7B", timeout=10)
    assert res.status_code == 200, res.text
    doc = res.json()
    assert (doc["id"], doc["object"], doc["owned_by"]) == ("org/Model-7B", "model", "infergate")
    assert t0 <= doc["created"] <= time.time() + 1
    assert all(t0 <= m["created"] <= time.time() + 1 for m in _models(edge).json()["data"])
    client = openai.OpenAI(base_url=f"{edge.url}/v1", api_key="none", max_retries=0)
    assert client.models.retrieve("m-a").id == "m-a"
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("m-nowhere")
    assert exc.value.body["code"] == "model_not_found" and "m-nowhere" in exc.value.body["message"]
    assert n1.hits == 0


def test_a_model_whose_id_is_a_file_path_is_retrieved(tiny_upstreams, redis_server,
                                                      edge_factory) -> None:
    """llama-server started with `-m /path/model.gguf` names its model by that path. The
    OpenAI SDK retrieves it as /v1/models/%2Fpath%2Fmodel.gguf and a hand-written URL reads
    /v1/models//path/model.gguf: the id is the path as the client wrote it (decoded), not
    nginx's normalised $uri, whose merged slashes lost the leading "/"."""
    (n1,) = tiny_upstreams(names=["n1"])
    model = "/models/gemma-3-270m-q4_k_m.gguf"
    edge = edge_factory(edge_settings(redis_server.url, [
        n1.node_settings(models=[model, "org/Model-7B", "a+b c"])]))
    client = openai.OpenAI(base_url=f"{edge.url}/v1", api_key="none", max_retries=0)
    assert client.models.retrieve(model).id == model
    for path in ("/v1/models//models/gemma-3-270m-q4_k_m.gguf",
                 "/v1/models/%2Fmodels%2Fgemma-3-270m-q4_k_m.gguf?x=1"):
        res = requests.get(edge.url + path, timeout=10)
        assert res.status_code == 200, (path, res.text)
        assert res.json()["id"] == model
    assert requests.get(f"{edge.url}/v1/models/org%2FModel-7B", timeout=10).json()["id"] \
        == "org/Model-7B"
    assert requests.get(f"{edge.url}/v1/models/a+b%20c", timeout=10).json()["id"] == "a+b c"
    assert client.models.retrieve("a+b c").id == "a+b c"
    # without the leading "/" it is another id, which no node lists
    res = requests.get(f"{edge.url}/v1/models/models/gemma-3-270m-q4_k_m.gguf", timeout=10)
    assert res.status_code == 404 and res.json()["error"]["code"] == "model_not_found"
    assert n1.hits == 0


@pytest.fixture
def snap_pool(tiny_upstreams, redis_server, edge_factory):
    ups = tiny_upstreams(names=["a", "b", "c"])
    edge = edge_factory(edge_settings(redis_server.url, [u.node_settings() for u in ups],
                                      stale_after_s=5.0))
    return edge, ups, redis_server.client()


def test_snapshot_models_route_and_unknown_lists_keep_todays_behaviour(snap_pool) -> None:
    edge, (a, b, c), r = snap_pool
    # nobody lists models: any model goes anywhere, /v1/models is a node's answer
    snap = write_snapshot(r, [u.snapshot_node() for u in (a, b, c)])
    edge.wait_snapshot(snap["version"])
    assert _post(edge, "whatever").status_code == 200
    assert [m["id"] for m in _models(edge).json()["data"]] == ["tiny"]

    # a serves m-a, b serves m-b, c is unknown (may serve anything)
    snap = write_snapshot(r, [a.snapshot_node(models=["m-a"]), b.snapshot_node(models=["m-b"]),
                              c.snapshot_node(models=None)])
    edge.wait_snapshot(snap["version"])
    assert set(_nodes_for(edge, "m-a", 30)) == {"a", "c"}
    assert set(_nodes_for(edge, "m-b", 30)) == {"b", "c"}
    assert _nodes_for(edge, "m-other") == {"c": 20}      # unknown node: not a 404
    assert [m["id"] for m in _models(edge).json()["data"]] == ["m-a", "m-b"]

    # every list known: the union of the eligible nodes, and 404 for the rest
    snap = write_snapshot(r, [a.snapshot_node(models=["m-a"]),
                              b.snapshot_node(models=["m-b"], healthy=False),
                              c.snapshot_node(models=["m-c"])])
    edge.wait_snapshot(snap["version"])
    assert [m["id"] for m in _models(edge).json()["data"]] == ["m-a", "m-c"]
    assert _post(edge, "m-other").json()["error"]["code"] == "model_not_found"
    # the only node of m-b is unhealthy: 503, not a request to a node of another model
    hits = a.hits + c.hits
    res = _post(edge, "m-b")
    assert res.status_code == 503 and res.json()["error"]["code"] == "no_healthy_upstream"
    assert a.hits + c.hits == hits


def test_a_node_that_takes_any_model_gets_the_names_nobody_lists(snap_pool) -> None:
    edge, (a, b, c), r = snap_pool
    # a serves m-a; b is a single-model llama.cpp server (its list, and any name); c m-c
    snap = write_snapshot(r, [a.snapshot_node(models=["m-a"]),
                              b.snapshot_node(models=["gemma"], models_any=True),
                              c.snapshot_node(models=["m-c"])])
    edge.wait_snapshot(snap["version"])
    assert _nodes_for(edge, "gpt-3.5-turbo") == {"b": 20}   # listed nowhere: not a 404
    assert _nodes_for(edge, "gemma") == {"b": 20}
    # a model another node lists goes only there, never to the node taking any
    assert _nodes_for(edge, "m-a") == {"a": 20}
    assert _nodes_for(edge, "m-c") == {"c": 20}
    assert [m["id"] for m in _models(edge).json()["data"]] == ["gemma", "m-a", "m-c"]
    status = {n["name"]: n for n in edge.status()["nodes"]}
    assert status["b"]["models_any"] is True and status["a"]["models_any"] is False

    # the node taking any model is down: a name nobody lists has no node (503, not 404)
    snap = write_snapshot(r, [a.snapshot_node(models=["m-a"]),
                              b.snapshot_node(models=["gemma"], models_any=True, healthy=False),
                              c.snapshot_node(models=["m-c"])])
    edge.wait_snapshot(snap["version"])
    hits = a.hits + c.hits
    res = _post(edge, "gpt-3.5-turbo")
    assert res.status_code == 503 and res.json()["error"]["code"] == "no_healthy_upstream"
    assert a.hits + c.hits == hits

    # a node whose list is unknown may serve any name (an engine still loading, an
    # openai-kind node): no name goes to the node taking any model but its own
    snap = write_snapshot(r, [a.snapshot_node(models=["m-a"]),
                              b.snapshot_node(models=["gemma"], models_any=True),
                              c.snapshot_node(models=None)])
    edge.wait_snapshot(snap["version"])
    assert _nodes_for(edge, "gpt-3.5-turbo") == {"c": 20}
    assert _nodes_for(edge, "m-a", 30).keys() <= {"a", "c"}
    assert _nodes_for(edge, "gemma", 30).keys() <= {"b", "c"}

    # ... but not while that node is down (an address with nothing behind it, never read)
    # or drained: it can be sent nothing, and the name goes to the node taking any model
    # instead of the 503 of no eligible node
    for down in ({"healthy": False}, {"state": "drained"}):
        snap = write_snapshot(r, [a.snapshot_node(models=["m-a"]),
                                  b.snapshot_node(models=["gemma"], models_any=True),
                                  c.snapshot_node(models=None, **down)])
        edge.wait_snapshot(snap["version"])
        assert _nodes_for(edge, "gpt-3.5-turbo") == {"b": 20}, down
        assert _nodes_for(edge, "m-a") == {"a": 20}, down

    # without the flag the same names are 404 again
    snap = write_snapshot(r, [a.snapshot_node(models=["m-a"]), b.snapshot_node(models=["gemma"]),
                              c.snapshot_node(models=["m-c"])])
    edge.wait_snapshot(snap["version"])
    assert _post(edge, "gpt-3.5-turbo").json()["error"]["code"] == "model_not_found"


def test_shedding_is_per_model(tiny_upstreams, redis_server, edge_factory) -> None:
    slow, fast = tiny_upstreams(names=["slow", "fast"])
    slow.mode = "hang"
    settings = edge_settings(redis_server.url, [
        slow.node_settings(models=["m-slow"], max_concurrency=1),
        fast.node_settings(models=["m-fast"], max_concurrency=1)], read_timeout_ms=20000)
    settings.admission.max_wait_ms = 100
    edge = edge_factory(settings)
    holder = threading.Thread(target=lambda: _post(edge, "m-slow"), daemon=True)
    holder.start()
    deadline = time.monotonic() + 10
    while slow.inflight < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert slow.inflight == 1
    try:
        # m-slow's only node is at its max_concurrency: shed
        res = _post(edge, "m-slow")
        assert res.status_code == 429, res.text
        assert res.json()["error"]["code"] == "nodes_saturated" and "Retry-After" in res.headers
        # another model's node has room: admitted
        ok = _post(edge, "m-fast")
        assert ok.status_code == 200 and ok.headers["X-Infergate-Node"] == "fast"
    finally:
        slow.release()
        holder.join(10)
