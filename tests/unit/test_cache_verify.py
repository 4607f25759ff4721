"""Online verification of semantic hits (controlplane/cache/verify.py): the verdict, the
threshold rule, and one worker run against fakeredis with a fake node and embedder."""

from __future__ import annotations

import json

import fakeredis
import pytest

from controlplane.cache import store
from controlplane.cache import verify as v
from controlplane.config import NodeSettings, settings_from_dict
from controlplane.embedder.calibration import wilson_upper
from controlplane.redisdb import keynames

RULE = v.ThresholdRule(max_wrong=0.01, step=0.01, max_raise=0.05)
KEY = "ab" * 32
NS = "cd" * 32


# ---- verdict ---------------------------------------------------------------------------


@pytest.mark.parametrize("cached,fresh,sim,ok", [
    ("Paris.", "paris.", None, True),                 # same text up to case
    ("The  capital is\nParis", "the capital is paris", None, True),  # and white space
    ("Paris.", "It is Paris.", 0.95, True),          # similar enough
    ("Paris.", "It is Paris.", 0.9, True),           # the bound counts as right
    ("Paris.", "Berlin.", 0.5, False),
    ("Paris.", "Berlin.", None, False),              # not measured: wrong unless equal
])
def test_verdict(cached, fresh, sim, ok) -> None:
    assert v.verdict(cached, fresh, sim, 0.9) is ok


def test_cosine() -> None:
    assert v.cosine([1, 0], [1, 0]) == pytest.approx(1.0)
    assert v.cosine([1, 0], [0, 1]) == pytest.approx(0.0)
    assert v.cosine([0, 0], [1, 1]) == 0.0
    with pytest.raises(ValueError):
        v.cosine([1], [1, 2])


def test_answer_text_of_chat_text_and_other_documents() -> None:
    chat = {"choices": [{"message": {"role": "assistant", "content": "hi"}}]}
    assert v.answer_text(chat) == "hi"
    assert v.answer_text({"choices": [{"text": "once"}]}) == "once"
    tools = {"choices": [{"message": {"content": None, "tool_calls": [
        {"function": {"name": "f", "arguments": "{}"}}]}}]}
    assert json.loads(v.answer_text(tools)) == [{"arguments": "{}", "name": "f"}]
    assert v.answer_text({"error": {}}) is None and v.answer_text([]) is None


def test_fresh_request_is_not_streaming() -> None:
    d = v.fresh_request(json.dumps({"model": "m", "stream": True,
                                    "stream_options": {"include_usage": True}}))
    assert d == {"model": "m", "stream": False}
    assert v.fresh_request("[1]") is None and v.fresh_request("{") is None


def test_parse_item_refuses_malformed_items() -> None:
    good = {"key": KEY, "namespace": NS, "path": "/v1/chat/completions", "model": "m",
            "tenant": "t", "body": "{}", "ts": 1}
    assert v.parse_item(json.dumps(good)) == v.VerifyItem(KEY, NS, "/v1/chat/completions",
                                                          "m", "t", "{}")
    for bad in ({**good, "key": "XYZ"}, {**good, "path": "/v1/embeddings"},
                {**good, "body": {}}, {k: x for k, x in good.items() if k != "namespace"}):
        assert v.parse_item(json.dumps(bad)) is None
    assert v.parse_item("not json") is None


# ---- threshold rule --------------------------------------------------------------------


def test_a_wrong_verdict_raises_by_one_step() -> None:
    assert v.next_raise(0.0, 1, 1, RULE) == pytest.approx(0.01)
    assert v.next_raise(0.01, 3, 1, RULE) == pytest.approx(0.02)


def test_the_raise_is_bounded() -> None:
    assert v.next_raise(0.05, 2, 2, RULE) == pytest.approx(0.05)
    assert v.next_raise(0.045, 2, 2, RULE) == pytest.approx(0.05)


def test_no_wrong_verdict_never_raises() -> None:
    # 0 of 10 still has a bound above 1 %: not enough evidence either way
    assert wilson_upper(0, 10) > 0.01
    assert v.next_raise(0.0, 10, 0, RULE) == 0.0
    assert v.next_raise(0.02, 10, 0, RULE) == pytest.approx(0.02)


def test_well_under_the_target_lowers_towards_the_configured_threshold() -> None:
    n = 600  # 0 of 600: bound ~0.45 %, under half the 1 % target
    assert wilson_upper(0, n) < 0.005
    assert v.next_raise(0.02, n, 0, RULE) == pytest.approx(0.01)
    assert v.next_raise(0.01, n, 0, RULE) == 0.0
    assert v.next_raise(0.0, n, 0, RULE) == 0.0  # never below the configured one


def test_a_rate_under_the_target_but_not_well_under_keeps_the_raise() -> None:
    # 2 of 1000: bound ~0.56 %: under 1 %, not under 0.5 %
    assert 0.005 < wilson_upper(2, 1000) < 0.01
    assert v.next_raise(0.02, 1000, 2, RULE) == pytest.approx(0.02)


# ---- one worker run ------------------------------------------------------------------


class FakeResponse:
    def __init__(self, status: int, doc: object) -> None:
        self.status_code = status
        self._doc = doc

    def json(self) -> object:
        return self._doc


class FakeSession:
    """A node answering ``content`` to every completion request."""

    def __init__(self, content: str) -> None:
        self.content = content
        self.sent: list[tuple[str, dict]] = []

    def post(self, url: str, json: dict, timeout: float) -> FakeResponse:  # noqa: A002
        self.sent.append((url, json))
        return FakeResponse(200, {"choices": [{"message": {"role": "assistant",
                                                           "content": self.content}}]})


def _setup(content: str, cached: str = "Reset it from the login page.",
           sim: float = 0.2) -> tuple[v.OnlineVerifier, FakeSession, fakeredis.FakeRedis]:
    r = fakeredis.FakeRedis(decode_responses=True)
    body = json.dumps({"choices": [{"message": {"role": "assistant", "content": cached}}]})
    store.store(r, KEY, tenant="default", model="m", namespace=NS, body=body, ttl=600)
    r.rpush(keynames.CACHE_VERIFY_QUEUE, json.dumps({
        "key": KEY, "namespace": NS, "path": "/v1/chat/completions", "model": "m",
        "tenant": "default", "body": json.dumps({"model": "m", "stream": True, "messages": [
            {"role": "user", "content": "How can I reset my password?"}]}), "ts": 1}))
    s = settings_from_dict({"cache": {"enabled": True}})
    node = NodeSettings(name="n1", url="http://127.0.0.1:9")
    session = FakeSession(content)
    worker = v.OnlineVerifier(s, r, lambda: [(node, ["m"], False, True)], session=session,
                              embed=lambda texts: [[1.0, 0.0], [sim, (1 - sim * sim) ** 0.5]])
    return worker, session, r


def test_a_different_answer_is_wrong_drops_the_entry_and_raises_the_threshold() -> None:
    worker, session, r = _setup("Bananas are yellow.")
    out = worker.run_once()
    assert [o.result for o in out] == ["wrong"]
    url, sent = session.sent[0]
    assert url == "http://127.0.0.1:9/v1/chat/completions" and sent["stream"] is False
    ns = store.namespace_stats(r)[0]
    assert (ns.namespace, ns.verified, ns.wrong) == (NS, 1, 1)
    assert ns.threshold_raise == pytest.approx(0.01) and ns.wrong_rate == 1.0
    assert store.threshold_raises(r) == {NS: pytest.approx(0.01)}
    assert r.ttl(keynames.CACHE_THRESHOLD_RAISE) > 0 and r.ttl(keynames.cache_ns_stats(NS)) > 0
    assert not r.exists(keynames.cache_entry(KEY))
    # the window starts again after a move
    assert (ns.win_verified, ns.win_wrong) == (0, 0)


def test_the_same_answer_is_right_and_keeps_the_entry() -> None:
    worker, _, r = _setup("reset it from the login page.")
    assert [o.result for o in worker.run_once()] == ["right"]
    ns = store.namespace_stats(r)[0]
    assert (ns.verified, ns.wrong, ns.threshold_raise) == (1, 0, 0.0)
    assert r.exists(keynames.cache_entry(KEY))


def test_a_similar_answer_is_right() -> None:
    worker, _, r = _setup("You can reset it on the login page.", sim=0.95)
    assert [o.result for o in worker.run_once()] == ["right"]


def test_no_node_counts_an_error_and_judges_nothing() -> None:
    worker, _, r = _setup("x")
    worker.nodes = lambda: []
    assert [o.result for o in worker.run_once()] == ["error"]
    ns = store.namespace_stats(r)[0]
    assert (ns.verified, ns.verify_errors) == (0, 1)
    assert r.exists(keynames.cache_entry(KEY))


def test_an_entry_gone_is_not_judged() -> None:
    worker, session, r = _setup("x")
    r.delete(keynames.cache_entry(KEY))
    assert [o.result for o in worker.run_once()] == ["gone"]
    assert session.sent == []


def test_the_node_asked_serves_the_model_or_takes_any_when_none_lists_it() -> None:
    s = settings_from_dict({"cache": {"enabled": True}})
    a, b, c = (NodeSettings(name=x, url=f"http://127.0.0.1:{i}") for i, x in
               enumerate("abc", start=9))
    nodes = [(a, ["m-a"], False, True), (b, ["gemma"], True, True), (c, None, False, True)]
    worker = v.OnlineVerifier(s, fakeredis.FakeRedis(), lambda: nodes)
    assert {worker._pick("m-a").name for _ in range(40)} == {"a", "c"}
    assert {worker._pick("gpt-4o").name for _ in range(40)} == {"c"}   # c may serve it
    nodes[2] = (c, ["m-c"], False, True)
    assert {worker._pick("gpt-4o").name for _ in range(20)} == {"b"}   # listed nowhere
    assert {worker._pick("m-a").name for _ in range(20)} == {"a"}      # never b
    # the only node of m-c is down: no node, never the one taking any name
    nodes[2] = (c, ["m-c"], False, False)
    assert worker._pick("m-c") is None
    # a node whose list is unknown (even a down one) may serve the name: no fallback
    nodes[2] = (c, None, False, False)
    assert worker._pick("gpt-4o") is None
    nodes[1] = (b, ["gemma"], False, True)
    nodes[2] = (c, ["m-c"], False, True)
    assert worker._pick("gpt-4o") is None
