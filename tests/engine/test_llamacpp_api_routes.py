"""The API beyond completions through the edge to a real llama.cpp server: the Responses
API (plain and streamed), the tokenizer, a path the server does not serve, the routes it
serves only with other models (rerank, audio: its own 501 comes back), an unknown model
(404 model_not_found from the edge) and a missing key (401)."""

from __future__ import annotations

import pytest
import requests

from controlplane.admin import apikeys
from support.stack import edge_settings

pytestmark = pytest.mark.integration

MODEL = "gemma-3-270m"


@pytest.fixture(scope="module")
def node(realnodes):
    return realnodes(1, parallel=2)[0]


@pytest.fixture
def edge(node, redis_server, edge_factory):
    s = edge_settings(redis_server.url, [{"name": "llama", "url": node.url, "models": [MODEL]}],
                      read_timeout_ms=60000)
    s.auth.mode = "required"
    key, _ = apikeys.create_key(redis_server.client(), "acme")
    e = edge_factory(s)
    e.key = key
    return e


def _post(edge, path: str, key: bool = True, **kw) -> requests.Response:
    headers = {"Authorization": f"Bearer {edge.key}"} if key else {}
    return requests.post(edge.url + path, headers=headers, timeout=120, **kw)


def test_chat_prompts_reach_the_model_in_gemmas_turn_format(node, edge) -> None:
    """The engine's chat template is Gemma's turn format with the messages in it (not a
    fixed text): a longer question is a longer prompt, the system message goes before
    the first user turn, and a final assistant message is continued, not closed."""
    tmpl = requests.post(f"{node.url}/apply-template", timeout=30, json={"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]})
    assert tmpl.json()["prompt"] == ("<start_of_turn>user\nBe brief.\n\nHello there"
                                     "<end_of_turn>\n<start_of_turn>model\n")

    def usage(messages: list[dict]) -> dict:
        res = _post(edge, "/v1/chat/completions", json={
            "model": MODEL, "messages": messages, "max_tokens": 2, "temperature": 0})
        assert res.status_code == 200, res.text
        return res.json()["usage"]

    short = usage([{"role": "user", "content": "Hi"}])["prompt_tokens"]
    long = usage([{"role": "user", "content": "Tell me about load balancers " * 20}])
    assert long["prompt_tokens"] > short + 100
    ask = [{"role": "user", "content": "Count from one to ten."}]
    # the prefill's tokens count in the prompt, with no end of turn after them
    opened = usage(ask + [{"role": "assistant", "content": "one, two, three, four,"}])
    assert opened["prompt_tokens"] > usage(ask)["prompt_tokens"] + 5
    raw = requests.post(f"{node.url}/tokenize", timeout=30, json={"content": (
        "<start_of_turn>user\nCount from one to ten.<end_of_turn>\n<start_of_turn>model\n"
        "one, two, three, four,"), "add_special": True}).json()["tokens"]
    assert opened["prompt_tokens"] == len(raw)


def test_responses_and_tokenizer_reach_the_engine(edge) -> None:
    res = _post(edge, "/v1/responses", json={"model": MODEL, "input": "Say hi",
                                             "max_output_tokens": 4})
    assert res.status_code == 200, res.text
    doc = res.json()
    assert doc["object"] == "response" and doc["model"] == MODEL and doc["status"] == "completed"
    assert doc["output"][0]["content"][0]["text"]
    assert res.headers["X-Infergate-Node"] == "llama" and "X-Cache-Status" not in res.headers

    toks = _post(edge, "/tokenize", json={"content": "hello world"})
    assert toks.status_code == 200, toks.text
    tokens = toks.json()["tokens"]
    assert tokens and all(isinstance(t, int) for t in tokens)
    back = _post(edge, "/detokenize", json={"tokens": tokens})
    assert back.status_code == 200 and back.json()["content"].strip() == "hello world"

    # last: llama-server may close the connection after a stream, and the next request
    # on it fails (nginx keeps it for reuse; see the balancer's retry on one node)
    with _post(edge, "/v1/responses", stream=True,
               json={"model": MODEL, "input": "Say hi", "max_output_tokens": 4,
                     "stream": True}) as res:
        assert res.status_code == 200 and res.headers["Content-Type"].startswith(
            "text/event-stream")
        text = b"".join(res.iter_content(None)).decode()
    assert "event: response.created" in text and "event: response.completed" in text


def test_the_engine_answers_what_it_does_not_serve(edge) -> None:
    # a path llama-server does not have: its own 404, from the node serving the model
    res = _post(edge, "/v1/foo", json={"model": MODEL})
    assert res.status_code == 404 and res.headers["X-Infergate-Node"] == "llama", res.text
    assert res.json()["error"]["type"] == "not_found_error"
    # reranking and audio need other models: the server's 501, after routing by the model
    res = _post(edge, "/v1/rerank", json={"model": MODEL, "query": "a", "documents": ["b"]})
    assert res.status_code == 501 and res.headers["X-Infergate-Node"] == "llama", res.text
    res = _post(edge, "/v1/audio/transcriptions", data={"model": MODEL},
                files={"file": ("clip.wav", b"RIFF\x00\x00\x00\x00WAVE", "audio/wav")})
    assert res.status_code == 501 and res.headers["X-Infergate-Node"] == "llama", res.text
    assert "audio" in res.json()["error"]["message"]
    # the node stays healthy: a route it does not serve is not its failure
    assert edge.node_status("llama")["breaker"] == "closed"


def test_unknown_model_and_missing_key_are_answered_by_the_edge(edge) -> None:
    for path, kw in (("/v1/responses", {"json": {"model": "nope", "input": "x"}}),
                     ("/tokenize", {"json": {"model": "nope", "content": "x"}}),
                     ("/v1/foo", {"json": {"model": "nope"}}),
                     ("/v1/audio/transcriptions", {"data": {"model": "nope"},
                                                   "files": {"file": ("a.wav", b"x")}})):
        res = _post(edge, path, **kw)
        assert res.status_code == 404, (path, res.text)
        assert res.json()["error"]["code"] == "model_not_found"
        assert "X-Infergate-Node" not in res.headers
        res = _post(edge, path, key=False, **kw)
        assert res.status_code == 401 and res.json()["error"]["code"] == "invalid_api_key"


def _shape(res: requests.Response) -> tuple[dict, int]:
    """Per choice index of an SSE answer: (its role chunks, content chunks, finish
    reasons), and the number of [DONE] lines."""
    import json as _json

    per: dict = {}
    done = 0
    for line in res.iter_lines():
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            done += 1
            continue
        doc = _json.loads(data)
        if not isinstance(doc, dict):
            continue       # llama-server's "data: null" before a prompt array's chunks
        for c in doc.get("choices") or []:
            roles, parts, finishes = per.setdefault(c["index"], [0, 0, []])
            delta = c.get("delta") or {}
            per[c["index"]][0] += 1 if delta.get("role") else 0
            per[c["index"]][1] += 1 if (delta.get("content") or c.get("text")) else 0
            if c.get("finish_reason"):
                finishes.append(c["finish_reason"])
    return per, done


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Name two colours."}],
                              "n": 2}),
    ("/v1/completions", {"prompt": ["Colours: red,", "Fruits: apple,"]}),
], ids=["chat_n2", "completions_two_prompts"])
def test_streams_of_several_choices_reach_the_client_whole(node, edge, path, body) -> None:
    """Every choice of a stream keeps its role chunk and its finish_reason through the
    edge, as the engine sends them (before, choice 0 lost its role chunk and choice 1
    its finish chunk), with one [DONE]."""
    body = {"model": MODEL, "max_tokens": 4, "temperature": 0, "stream": True, **body}
    direct = requests.post(node.url + path, json=body, timeout=120, stream=True)
    via = _post(edge, path, json=body, stream=True)
    assert direct.status_code == 200 and via.status_code == 200, via.text
    want, _ = _shape(direct)
    got, done = _shape(via)
    assert len(want) == 2, want
    assert {i: (r, f) for i, (r, _, f) in got.items()} == \
        {i: (r, f) for i, (r, _, f) in want.items()}
    assert all(f for _, _, f in got.values()) and done == 1
