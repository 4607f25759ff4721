"""The embedder service over real HTTP (waitress), with the default model
(use-multilingual-v3, numpy) and its shipped verifier, against real Redis servers for both
index backends: Debian's redis-server 7.0 (no search module -> in-process index) and
Redis 8.2 with redisearch.so (FT.* index).

The model is loaded once per test session (``models.shared_model``)."""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import redis
import requests
import waitress

from controlplane import procs
from controlplane.redisdb import keynames
from controlplane.embedder.app import create_app
from controlplane.embedder.consumer import QueueConsumer
from controlplane.embedder.engine import Engine, connect
from controlplane.embedder.models import (ModelLoadError, ModelSpec, OpenAIEmbeddingsModel,
                                          shared_model)
from controlplane.embedder.redis_search import SearchRedisMissing, start_search_redis
from controlplane.embedder.verifier import load_for

PASSWORD = "How do I reset my password?"


def hx(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


@pytest.fixture(scope="module")
def model():
    return shared_model(ModelSpec())


@dataclass
class Svc:
    url: str
    backend: str
    r: redis.Redis
    engine: Engine
    redis_managed: procs.Managed
    redis_dir: Path
    redis_port: int

    def post(self, path: str, body: object, **kw) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=30, **kw)

    def add(self, text: str, ns: str, ttl: int = 60, entry: bool = True) -> str:
        """Write a cache entry for ``text`` (unless ``entry`` is false) and index it."""
        key = hx(ns + text)
        if entry:
            self.r.set(keynames.cache_entry(key), json.dumps({"body": "answer"}), ex=ttl)
        resp = self.post("/v1/index", {"key": key, "namespace": ns, "text": text, "ttl_s": ttl,
                                       "model": "m", "tenant": "t"})
        assert resp.status_code == 200, resp.text
        assert resp.json()["indexed"] is True
        return key

    def lookup(self, ns: str, text: str, **extra) -> dict:
        resp = self.post("/v1/lookup", {"namespace": ns, "text": text, **extra})
        assert resp.status_code == 200, resp.text
        return resp.json()


def _start_service(model, backend: str, workdir: Path):
    port = procs.free_port()
    if backend == "local":
        managed = procs.start_redis(workdir, port)
    else:
        managed = start_search_redis(workdir, port)
    r_bin = connect(f"redis://127.0.0.1:{port}/0", 1.0)
    r_block = connect(f"redis://127.0.0.1:{port}/0", 1.0, blocking=True)
    engine = Engine(model, r_bin, index_backend=backend,
                    verifier=load_for(model.model_id, model.dim))
    consumer = QueueConsumer(engine, r_block, batch=8).start()
    http_port = procs.free_port()
    server = waitress.create_server(create_app(engine), host="127.0.0.1", port=http_port,
                                    threads=8)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{http_port}"
    svc = Svc(url, backend, redis.Redis(port=port, socket_timeout=2, decode_responses=True),
              engine, managed, workdir, port)
    procs.wait_until(lambda: requests.get(url + "/healthz", timeout=1).status_code == 200,
                     timeout=20, what="embedder /healthz")

    def stop() -> None:
        server.close()
        thread.join(timeout=5)
        consumer.stop()
        engine.close()
        svc.redis_managed.stop()

    return svc, stop


@pytest.fixture(scope="module", params=["local", "redis-search"])
def svc(request, model):
    d = Path(tempfile.mkdtemp(prefix="infergate-emb-"))
    try:
        try:
            s, stop = _start_service(model, request.param, d)
        except SearchRedisMissing as exc:
            pytest.skip(f"Redis with search not installed: {exc}")
        try:
            yield s
        finally:
            stop()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_healthz_names_model_and_backend(svc) -> None:
    doc = requests.get(svc.url + "/healthz", timeout=5).json()
    assert doc["status"] == "ok" and doc["redis"] is True
    assert doc["model_id"] == "use-multilingual-v3" and doc["dim"] == 512
    assert doc["index_backend"] == svc.backend
    assert doc["verifier"] is True and 0 < doc["default_min_verifier_score"] < 1
    assert doc["default_min_similarity"] == svc.engine.verifier.floor


def test_paraphrase_hits_with_similarity(svc) -> None:
    ns = hx("paraphrase" + svc.backend)
    key = svc.add(PASSWORD, ns)
    svc.add("What is the capital of France?", ns)
    res = svc.lookup(ns, "How can I reset my password?", min_similarity=0.8)
    assert res["hit"] is True and res["key"] == key
    assert 0.8 <= res["similarity"] <= 1.0
    assert res["candidate_text"] == PASSWORD
    assert res["guard"] == "pass"
    assert res["model_id"] == "use-multilingual-v3"
    assert res["elapsed_ms"] > 0
    assert res["verifier_score"] >= res["min_verifier_score"] > 0


def test_unrelated_text_misses(svc) -> None:
    ns = hx("unrelated" + svc.backend)
    svc.add(PASSWORD, ns)
    res = svc.lookup(ns, "Which wine goes with grilled fish?")
    assert res["hit"] is False and res["key"] is None
    assert res["similarity"] is not None and res["similarity"] < 0.5
    assert res["min_similarity"] == svc.engine.default_min_similarity


def test_zero_threshold_is_a_value_not_unset(svc) -> None:
    ns = hx("zero" + svc.backend)
    svc.add(PASSWORD, ns)
    text = "How do I bake bread at home?"
    assert svc.lookup(ns, text)["hit"] is False          # default threshold
    res = svc.lookup(ns, text, min_similarity=0, guard=False)
    assert res["min_similarity"] == 0
    assert res["hit"] is True and res["guard"] is None


def test_other_namespace_misses(svc) -> None:
    svc.add(PASSWORD, hx("ns-one" + svc.backend))
    res = svc.lookup(hx("ns-two" + svc.backend), PASSWORD, min_similarity=0.5)
    assert res == {**res, "hit": False, "key": None, "similarity": None,
                   "candidate_text": None}


def test_purged_entry_is_never_a_hit(svc) -> None:
    ns = hx("purged" + svc.backend)
    key = svc.add(PASSWORD, ns)
    assert svc.lookup(ns, PASSWORD)["hit"] is True
    svc.r.delete(keynames.cache_entry(key))
    assert svc.lookup(ns, PASSWORD)["hit"] is False


def test_texts_that_differ_only_outside_the_vocabulary_never_match(svc) -> None:
    """USE-m3 reads every character outside its vocabulary as one <unk>: the two texts
    embed the same (similarity 1), and the engine refuses the match."""
    if svc.engine.model.model_id != "use-multilingual-v3":
        pytest.skip("the vocabulary check is USE-m3's")
    ns = hx("oov" + svc.backend)
    svc.add("What is the Unicode name of \U00010000?", ns)
    res = svc.lookup(ns, "What is the Unicode name of \U00010001?")
    assert res["similarity"] > 0.99
    assert res["hit"] is False and res["guard"] == "reject:unknown_chars"
    assert svc.lookup(ns, "what is the unicode name of \U00010000")["hit"] is True


def test_a_purged_nearest_entry_gives_way_to_the_next(svc) -> None:
    """Only a would-be hit is checked in Redis; when its answer is gone, the next
    candidate that passes is served instead."""
    ns = hx("purged-next" + svc.backend)
    gone = svc.add(PASSWORD, ns)
    kept = svc.add("how do I reset my password", ns)
    first = svc.lookup(ns, PASSWORD)
    assert first["hit"] is True and first["key"] == gone
    svc.r.delete(keynames.cache_entry(gone))
    res = svc.lookup(ns, PASSWORD)
    assert res["hit"] is True and res["key"] == kept


def test_lookups_answers_each_in_its_place(svc) -> None:
    """POST /v1/lookups: one answer per lookup in the order sent, each what /v1/lookup
    says for it (a purged nearest entry giving way to the next included); a malformed
    item gets its 400 body in its place and the others are answered; ``brief`` drops
    ``candidate_text``."""
    ns = hx("batch" + svc.backend)
    other = hx("batch-other" + svc.backend)
    gone = svc.add(PASSWORD, ns)
    kept = svc.add("how do I reset my password", ns)
    capital = svc.add("What is the capital of France?", other)
    svc.r.delete(keynames.cache_entry(gone))
    items = [{"namespace": ns, "text": PASSWORD},
             {"namespace": other, "text": "what is the capital of France"},
             {"namespace": ns, "text": "Which wine goes with grilled fish?"},
             {"namespace": "NOTHEX", "text": "hi"},
             {"namespace": other, "text": "x" * (svc.engine.max_text_chars + 1)}]
    r = svc.post("/v1/lookups", {"lookups": items})
    assert r.status_code == 200, r.text
    res = r.json()["results"]
    assert len(res) == len(items)
    assert res[0]["hit"] is True and res[0]["key"] == kept
    assert res[1]["hit"] is True and res[1]["key"] == capital
    assert res[2]["hit"] is False and res[2]["key"] is None
    assert res[3]["error"]["param"] == "namespace" and "hit" not in res[3]
    assert res[4]["hit"] is False and res[4]["guard"] == "reject:too_long"
    for i in (0, 1, 2, 4):
        one = svc.lookup(items[i]["namespace"], items[i]["text"])
        assert {k: one[k] for k in ("hit", "key", "similarity", "guard")} == \
            {k: res[i][k] for k in ("hit", "key", "similarity", "guard")}
    brief = svc.post("/v1/lookups", {"lookups": items[:2], "brief": True}).json()["results"]
    assert "candidate_text" not in brief[0] and brief[0]["key"] == kept


@pytest.mark.parametrize("body", [{}, {"lookups": []}, {"lookups": {"a": 1}},
                                  {"lookups": [{"namespace": "ab" * 32, "text": "hi"}] * 65},
                                  [1]])
def test_bad_lookups_is_400(svc, body) -> None:
    r = svc.post("/v1/lookups", body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_expired_entry_misses(svc) -> None:
    ns = hx("expired" + svc.backend)
    svc.add(PASSWORD, ns, ttl=3)
    assert svc.lookup(ns, PASSWORD)["hit"] is True
    procs.wait_until(lambda: svc.lookup(ns, PASSWORD)["hit"] is False, timeout=15,
                     interval=0.2, what="the expired entry to stop answering")


def test_vector_expires_with_its_ttl_even_if_entry_lingers(svc) -> None:
    """The vector keeps the job's TTL: after it, no hit, whatever the entry does."""
    ns = hx("vec-ttl" + svc.backend)
    key = hx(ns + PASSWORD)
    svc.r.set(keynames.cache_entry(key), "{}", ex=120)
    assert svc.post("/v1/index", {"key": key, "namespace": ns, "text": PASSWORD,
                                  "ttl_s": 2}).status_code == 200
    procs.wait_until(lambda: svc.lookup(ns, PASSWORD)["hit"] is False, timeout=15,
                     interval=0.2, what="the vector to expire")
    assert svc.r.exists(keynames.cache_entry(key))


def test_chinese_text(svc) -> None:
    ns = hx("zh" + svc.backend)
    key = svc.add("如何修改银行卡的登录密码", ns)
    res = svc.lookup(ns, "如何修改银行卡的登录密码？", min_similarity=0.8)
    assert res["hit"] is True and res["key"] == key
    svc.add("借款1万需要什么条件", ns)
    res = svc.lookup(ns, "借款5万需要什么条件", min_similarity=0.5)
    assert res["hit"] is False and res["guard"] == "reject:numbers"
    assert res["candidate_text"] == "借款1万需要什么条件"
    assert svc.lookup(ns, "借款5万需要什么条件", min_similarity=0.5, guard=False)["hit"] is True


def test_verifier_decides_between_floor_and_hit(svc) -> None:
    ns = hx("verifier" + svc.backend)
    key = svc.add("What is the capital of France?", ns)
    # another question: an English key-term substitution goes to the verifier, which
    # scores the entity swap far under its threshold (Peru is in no closed class of the
    # guard; Spain is, a country: rejected by the guard itself)
    res = svc.lookup(ns, "What is the capital of Peru?", min_similarity=0.5)
    assert res["hit"] is False and res["guard"] == "reject:verifier"
    assert 0 < res["verifier_score"] < 0.5
    res = svc.lookup(ns, "What is the capital of Spain?", min_similarity=0.5)
    assert res["hit"] is False and res["guard"] == "reject:contrast:country"
    assert res["verifier_score"] is None
    # a Chinese one: the guard says no before the verifier is asked
    svc.add("皖是哪个省的简称", ns)
    res = svc.lookup(ns, "滇是哪个省的简称", min_similarity=0.5)
    assert res["hit"] is False and res["guard"] == "reject:key_terms"
    assert res["verifier_score"] is None
    # a looser paraphrase the guard lets through: the verifier's score decides (below
    # the shipped threshold: a domain can lower it, see the next test)
    res = svc.lookup(ns, "What's France's capital city?")
    assert res["hit"] is False and res["guard"] == "reject:verifier"
    assert 0 < res["verifier_score"] < res["min_verifier_score"]
    assert res["min_similarity"] == 0.5 and res["similarity"] > 0.9
    # the same question up to case and punctuation is always the same question
    res = svc.lookup(ns, "what is the capital of france")
    assert res["hit"] is True and res["key"] == key and res["verifier_score"] == 1.0
    # checks off: the cosine alone
    assert svc.lookup(ns, "What is the capital of Spain?", min_similarity=0.5,
                      guard=False)["hit"] is True


def test_domain_thresholds_follow_route_and_model(svc, monkeypatch) -> None:
    from controlplane.embedder.policy import Domain, PolicySource, ThresholdPolicy

    ns = hx("domains" + svc.backend)
    key = svc.add("What is the capital of France?", ns)
    para = "What's France's capital city?"
    assert svc.lookup(ns, para)["hit"] is False           # default verifier threshold
    pol = ThresholdPolicy((Domain(model="geo-bot", min_verifier_score=0.3),
                           Domain(route="/v1/completions", min_similarity=0.99,
                                  verifier=False)))
    monkeypatch.setattr(svc.engine, "policy", PolicySource(policy=pol))
    res = svc.lookup(ns, para, model="geo-bot", route="/v1/chat/completions")
    assert res["hit"] is True and res["key"] == key and res["min_verifier_score"] == 0.3
    res = svc.lookup(ns, para, route="/v1/completions")
    assert res["hit"] is False and res["min_similarity"] == 0.99
    assert res["min_verifier_score"] is None and res["verifier_score"] is None
    doc = requests.get(svc.url + "/healthz", timeout=5).json()
    assert doc["semantic_domains"] == 2
    r = svc.post("/v1/lookup", {"namespace": ns, "text": para, "model": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


def test_other_languages_hit_only_when_listed(svc, monkeypatch) -> None:
    """cache.semantic_languages (default English and Chinese): a German question gets no
    semantic hit but the same question up to case and punctuation; listed, the guard and
    the verifier decide as for English."""
    from controlplane.embedder.policy import PolicySource, ThresholdPolicy

    ns = hx("languages" + svc.backend)
    key = svc.add("Was passiert, wenn ich die Rechnung bezahle?", ns)
    near = "Was passiert, wenn ich die Rechnung nicht bezahle?"
    res = svc.lookup(ns, near)
    assert res["hit"] is False and res["guard"] == "reject:language"
    assert res["decided_by"] == "language"              # no score compared
    assert res["similarity"] > 0.9                      # close, refused for its language
    res = svc.lookup(ns, "was passiert wenn ich die rechnung bezahle")
    assert res["hit"] is True and res["key"] == key and res["verifier_score"] == 1.0
    monkeypatch.setattr(svc.engine, "policy",
                        PolicySource(policy=ThresholdPolicy(languages=("*",))))
    assert svc.lookup(ns, near)["guard"] != "reject:language"


def test_long_texts_take_no_part_in_the_semantic_cache(svc) -> None:
    """A text over max_text_chars is neither indexed nor embedded for a lookup (the model
    reads only its beginning: two long texts that differ further on would embed the
    same); /v1/embeddings still truncates and answers."""
    ns = hx("huge" + svc.backend)
    limit = svc.engine.max_text_chars
    head = "word " * (limit // 5)
    for text in (head + "ends one way", head + "ends another way", "长" * 50_000):
        assert len(text) > limit
        key = hx(ns + text)
        svc.r.set(keynames.cache_entry(key), json.dumps({"body": "answer"}), ex=60)
        r = svc.post("/v1/index", {"key": key, "namespace": ns, "text": text, "ttl_s": 60})
        assert r.status_code == 200 and r.json()["indexed"] is False
        res = svc.lookup(ns, text)
        assert res["hit"] is False and res["guard"] == "reject:too_long"
        assert res["decided_by"] == "length"
    r = svc.post("/v1/embeddings", {"input": "x" * 50_000})
    assert r.status_code == 200 and len(r.json()["data"][0]["embedding"]) == svc.engine.model.dim


@pytest.mark.parametrize("body,param", [
    ({"text": "hi"}, "namespace"),
    ({"namespace": "NOTHEX", "text": "hi"}, "namespace"),
    ({"namespace": "ab" * 32, "text": ""}, "text"),
    ({"namespace": "ab" * 32, "text": 5}, "text"),
    ({"namespace": "ab" * 32, "text": "hi", "min_similarity": 1.5}, "min_similarity"),
    ({"namespace": "ab" * 32, "text": "hi", "min_similarity": "0.9"}, "min_similarity"),
    ({"namespace": "ab" * 32, "text": "hi", "min_similarity": True}, "min_similarity"),
    ({"namespace": "ab" * 32, "text": "hi", "guard": "yes"}, "guard"),
    ({"namespace": "ab" * 32, "text": "a \ud800 b"}, "text"),   # JSON "\ud800": no UTF-8
    ([1, 2], None),
])
def test_bad_lookup_is_400(svc, body, param) -> None:
    r = svc.post("/v1/lookup", body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param
    assert err["message"]


@pytest.mark.parametrize("body,param", [
    ({"key": "ab" * 32, "namespace": "cd" * 32, "text": "hi"}, "ttl_s"),
    ({"key": "ab" * 32, "namespace": "cd" * 32, "text": "hi", "ttl_s": 0}, "ttl_s"),
    ({"key": "ab" * 32, "namespace": "cd" * 32, "text": "hi", "ttl_s": 1.5}, "ttl_s"),
    ({"key": "zz", "namespace": "cd" * 32, "text": "hi", "ttl_s": 5}, "key"),
    ({"key": "ab" * 32, "namespace": "cd" * 32, "text": "hi", "ttl_s": 5, "tenant": 3},
     "tenant"),
    ({"key": "ab" * 32, "namespace": "cd" * 32, "text": "\udc80", "ttl_s": 5}, "text"),
    ({"key": "ab" * 32, "namespace": "cd" * 32, "text": "hi", "ttl_s": 5, "model": "\ud800"},
     "model"),
])
def test_bad_index_is_400(svc, body, param) -> None:
    r = svc.post("/v1/index", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_not_json_and_unknown_paths(svc) -> None:
    r = requests.post(svc.url + "/v1/lookup", data="{nope", timeout=5,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    deep = b"[" * 100_000 + b"]" * 100_000  # past the parser's recursion limit
    r = requests.post(svc.url + "/v1/lookup", data=deep, timeout=5,
                      headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = requests.get(svc.url + "/v1/nothing", timeout=5)
    assert r.status_code == 404 and "error" in r.json()
    r = requests.get(svc.url + "/v1/lookup", timeout=5)
    assert r.status_code == 405 and "error" in r.json()


def test_queue_consumer_indexes_pushed_jobs(svc) -> None:
    ns = hx("queue" + svc.backend)
    key = hx(ns + "queued")
    svc.r.set(keynames.cache_entry(key), "{}", ex=60)
    before = svc.engine.metrics.invalid_jobs._value.get()
    svc.r.rpush(keynames.CACHE_INDEX_QUEUE, "not json", json.dumps({"key": "zz"}),
                json.dumps({"key": key, "namespace": ns, "text": "How do I close my account?",
                            "model": "m", "tenant": "t", "ttl_s": 60}))
    procs.wait_until(lambda: svc.lookup(ns, "How do I close my account?")["key"] == key,
                     timeout=15, interval=0.1, what="the queued job to be indexed")
    assert svc.engine.metrics.invalid_jobs._value.get() - before == 2
    assert svc.r.llen(keynames.CACHE_INDEX_QUEUE) == 0


def test_embeddings_endpoint_with_openai_sdk(svc, model) -> None:
    from openai import OpenAI

    with OpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0,
                timeout=30) as client:
        out = client.embeddings.create(model="use-multilingual-v3", input=["hello", "你好"])
    vecs = np.array([d.embedding for d in out.data], dtype=np.float32)
    assert vecs.shape == (2, 512)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-4)
    assert np.allclose(vecs, model.encode(["hello", "你好"]), atol=1e-4)
    r = svc.post("/v1/embeddings", {"input": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"


def test_remote_embeddings_backend(svc, model) -> None:
    """The OpenAI-compatible backend, pointed at this service's own /v1/embeddings."""
    remote = OpenAIEmbeddingsModel(svc.url, "use-multilingual-v3")
    assert remote.dim == 512 and remote.default_min_similarity == model.default_min_similarity
    assert np.allclose(remote.encode(["hello there"]), model.encode(["hello there"]),
                       atol=1e-4)
    with pytest.raises(ModelLoadError):
        OpenAIEmbeddingsModel(f"http://127.0.0.1:{procs.free_port()}", "x", timeout_s=1)


def test_metrics(svc) -> None:
    ns = hx("metrics" + svc.backend)
    svc.add(PASSWORD, ns)
    svc.lookup(ns, PASSWORD)
    text = requests.get(svc.url + "/metrics", timeout=5).text
    for name in ("infergate_embedder_lookups_total", "infergate_embedder_hits_total",
                 "infergate_embedder_embed_batch_size_bucket",
                 "infergate_embedder_lookup_seconds_bucket"):
        assert name in text


@pytest.fixture
def fragile(model, workdir):
    """A service (in-process index) whose Redis the test may stop and start."""
    s, stop = _start_service(model, "local", workdir / "redis")
    try:
        yield s
    finally:
        stop()


def test_redis_down_is_503_then_recovers(fragile) -> None:
    ns = hx("down")
    fragile.add(PASSWORD, ns)
    fragile.redis_managed.stop()
    r = fragile.post("/v1/lookup", {"namespace": ns, "text": PASSWORD})
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "service_unavailable"
    r = fragile.post("/v1/index", {"key": hx("k"), "namespace": ns, "text": "x", "ttl_s": 5})
    assert r.status_code == 503
    assert requests.get(fragile.url + "/healthz", timeout=5).status_code == 503
    fragile.redis_managed = procs.start_redis(fragile.redis_dir, fragile.redis_port)
    procs.wait_until(
        lambda: fragile.post("/v1/lookup", {"namespace": ns, "text": PASSWORD}).status_code
        == 200, timeout=15, what="lookups to work again")


def test_a_token_guards_every_v1_endpoint(svc) -> None:
    """cache.embedder_token: /v1/lookup(s), /v1/index and /v1/embeddings need the Bearer
    token (401 JSON otherwise, nothing read or written); /healthz and /metrics stay open.
    (The app of this module's engine with a token, through Flask's test client.)"""
    token = "t0k3n-" + "x" * 20
    client = create_app(svc.engine, token).test_client()
    assert client.get("/healthz").status_code == 200
    ns = "ab" * 32
    calls = [("/v1/lookup", {"namespace": ns, "text": "hello there"}),
             ("/v1/lookups", {"lookups": [{"namespace": ns, "text": "hello there"}]}),
             ("/v1/index", {"key": "cd" * 32, "namespace": ns, "text": "hi", "ttl_s": 5}),
             ("/v1/embeddings", {"input": "hello"})]
    for path, body in calls:
        for headers in ({}, {"Authorization": "Bearer wrong-token-xxxxxxxx"},
                        {"Authorization": token}):
            r = client.post(path, json=body, headers=headers)
            assert r.status_code == 401, (path, headers)
            assert r.get_json()["error"]["code"] == "invalid_embedder_token"
        r = client.post(path, json=body, headers={"Authorization": f"Bearer {token}"})
        assert r.status_code in (200, 202), (path, r.get_data(as_text=True))
    assert client.get("/metrics").status_code == 200


def test_queue_consumer_waits_for_running_lookups(svc) -> None:
    """A queued job is indexed only once no lookup runs (in any process: the shared
    activity count), so a burst's lookups keep the model to themselves."""
    ns = hx("deferred" + svc.backend)
    key = hx(ns + "deferred")
    svc.r.set(keynames.cache_entry(key), "{}", ex=60)
    m = svc.engine.metrics
    indexed = m.indexed.labels("queue")._value.get()
    deferrals = m.index_deferrals._value.get()
    with svc.engine.activity.lookup():  # as if a lookup call were running
        svc.r.rpush(keynames.CACHE_INDEX_QUEUE,
                    json.dumps({"key": key, "namespace": ns, "text": "Where is my parcel?",
                                "model": "m", "tenant": "t", "ttl_s": 60}))
        procs.wait_until(lambda: m.index_deferrals._value.get() > deferrals, timeout=10,
                         interval=0.01, what="the consumer to wait for the lookup")
        assert m.indexed.labels("queue")._value.get() == indexed
    procs.wait_until(lambda: svc.engine.metrics.indexed.labels("queue")._value.get() > indexed,
                     timeout=10, interval=0.02, what="the job indexed once lookups ended")
    assert svc.lookup(ns, "Where is my parcel?")["key"] == key
