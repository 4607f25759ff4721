"""The embedder with the pool's own models: a semantic domain whose vectors come from a
real ``llama-server --embeddings --pooling mean`` (Gemma 3 270M) and whose verifier is a
rerank endpoint of the published Jina/Cohere shape (``support.rerankstub``), over the
embedder's real HTTP API and a real Redis. Serves hits, keeps the vectors of two models
apart, and falls open (a miss, HTTP 200) when an endpoint is down or slow.

One stack for the module. The embedder's own model, for lookups outside those domains, is
a second stub's bag-of-words embeddings (loading the bundled model would double the
module's time; what is tested is which model a lookup goes to)."""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import redis
import requests
import waitress

from controlplane import procs
from controlplane.embedder import remote
from controlplane.embedder.app import create_app
from controlplane.embedder.consumer import QueueConsumer
from controlplane.embedder.engine import Engine, connect
from controlplane.embedder.policy import Domain, PolicySource, ThresholdPolicy
from controlplane.redisdb import keynames
from support.rerankstub import RerankStub

pytestmark = pytest.mark.integration

PASSWORD = "How do I reset my password?"
PARAPHRASE = "How can I reset my password?"
OTHER = "What is the capital of France?"


def hx(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


@dataclass
class Stack:
    url: str
    r: redis.Redis
    engine: Engine
    stub: RerankStub
    emb_url: str
    own_model_id: str
    redis_port: int

    def post(self, path: str, body: object) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=30)

    def add(self, text: str, ns: str, model: str) -> dict:
        key = hx(ns + text)
        self.r.set(keynames.cache_entry(key), json.dumps({"body": "answer"}), ex=60)
        resp = self.post("/v1/index", {"key": key, "namespace": ns, "text": text, "ttl_s": 60,
                                       "model": model, "tenant": "acme",
                                       "route": "/v1/chat/completions"})
        assert resp.status_code == 200, resp.text
        return resp.json()

    def lookup(self, ns: str, text: str, model: str) -> dict:
        resp = self.post("/v1/lookups", {"lookups": [{"namespace": ns, "text": text,
                                                      "model": model}]})
        assert resp.status_code == 200, resp.text  # never an error to the edge
        return resp.json()["results"][0]


@pytest.fixture(scope="module")
def stack(realnodes, tmp_path_factory) -> Iterator[Stack]:
    node = realnodes(1, parallel=2, metrics=False,
                     extra_args=("--embeddings", "--pooling", "mean"))[0]
    # the first call after the start is slow (buffers allocated): not within a budget
    requests.post(node.url + "/v1/embeddings", json={"input": ["warm up"]}, timeout=60)
    stub = RerankStub()
    stub.delay_s = 2.0   # "slow": past the 1 s budget below, with room on a loaded host
    own_stub = RerankStub()  # the embedder's own model, always up
    own = remote.RemoteEmbeddings(own_stub.root, "bag", 5.0, remote.EndpointAccess())
    own.probe()
    managed, port = procs.start_redis_free_port(tmp_path_factory.mktemp("pool-redis"))
    # a generous budget for the real engine (a shared 2-core host), a short one for the
    # stub's endpoints, which the tests make slow
    common = dict(embeddings_url=node.url, embeddings_model="gemma-emb",
                  endpoint_timeout_ms=15000)
    policy = ThresholdPolicy((
        Domain(model="pool-bot", rerank_url=stub.url, rerank_model="stub",
               min_similarity=0.3, min_verifier_score=0.5, **common),
        Domain(model="pool-cosine", min_similarity=0.999, **common),
        Domain(model="rerank-only", rerank_url=stub.url, min_similarity=0.5,
               min_verifier_score=0.5, endpoint_timeout_ms=1000),
        Domain(model="stub-emb", embeddings_url=stub.root, min_similarity=0.9,
               endpoint_timeout_ms=1000),
        Domain(model="dead", embeddings_url=f"http://127.0.0.1:{procs.free_port()}",
               min_similarity=0.5),
        # what the edge's requests of model "tiny" on the chat route get
        Domain(route="/v1/chat/completions", model="tiny", rerank_url=stub.url,
               min_similarity=0.3, min_verifier_score=0.5, **common),
    ))
    engine = Engine(own, connect(f"redis://127.0.0.1:{port}/0", 1.0),
                    index_backend="local", policy=PolicySource(policy=policy))
    consumer = QueueConsumer(engine, connect(f"redis://127.0.0.1:{port}/0", 1.0,
                                             blocking=True)).start()
    http_port = procs.free_port()
    server = waitress.create_server(create_app(engine), host="127.0.0.1", port=http_port,
                                    threads=4)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{http_port}"
    procs.wait_until(lambda: requests.get(url + "/healthz", timeout=1).status_code == 200,
                     timeout=20, what="embedder /healthz")
    try:
        yield Stack(url, redis.Redis(port=port, decode_responses=True), engine, stub, node.url,
                    own.model_id, port)
    finally:
        consumer.stop()
        server.close()
        thread.join(timeout=5)
        engine.close()
        stub.stop()
        own_stub.stop()
        managed.stop()


def test_pool_models_serve_a_hit_decided_by_the_reranker(stack: Stack) -> None:
    ns = hx("pool-hit")
    reg = stack.engine.metrics.registry
    hits = reg.get_sample_value("infergate_embedder_hits_total")
    assert stack.add(PASSWORD, ns, "pool-bot")["indexed"] is True
    res = stack.lookup(ns, PARAPHRASE, "pool-bot")
    assert reg.get_sample_value("infergate_embedder_hits_total") == hits + 1  # one /metrics
    assert res["hit"] is True and res["key"] == hx(ns + PASSWORD), res
    assert res["decided_by"] == "rerank"
    assert res["model_id"].startswith("gemma-emb@127.0.0.1:")
    assert res["verifier_score"] == pytest.approx(5 / 7, abs=1e-6)  # the stub's Jaccard
    assert res["min_verifier_score"] == 0.5 and res["min_similarity"] == 0.3
    miss = stack.lookup(ns, OTHER, "pool-bot")
    assert miss["hit"] is False
    # what the admin page shows of the namespace
    h = stack.r.hgetall(keynames.cache_ns_stats(ns))
    assert h["embedding_model"] == res["model_id"] and "sample" not in h
    assert h["model"] == "pool-bot" and h["tenant"] == "acme"
    # the question is kept no longer than its answer (the index job's ttl_s: 60 s)
    assert stack.r.get(keynames.cache_ns_sample(ns)) == PASSWORD
    assert 0 < stack.r.pttl(keynames.cache_ns_sample(ns)) <= 60_000
    health = requests.get(stack.url + "/healthz", timeout=5).json()
    assert {"model_id": res["model_id"], "dim": 640,
            "url": stack.emb_url + "/v1/embeddings"} in health["pool_models"]


def test_vectors_of_two_models_are_never_compared(stack: Stack) -> None:
    ns = hx("pool-apart")
    stack.add(PASSWORD, ns, "pool-bot")
    # the same namespace through the embedder's own model: its index holds nothing there
    res = stack.lookup(ns, PASSWORD, "")
    assert res["hit"] is False and res["similarity"] is None
    assert res["model_id"] == stack.own_model_id
    # another domain on the same endpoint shares its index, with its own threshold
    same = stack.lookup(ns, PASSWORD, "pool-cosine")
    assert same["hit"] is True and same["decided_by"] == "cosine"
    assert stack.lookup(ns, PARAPHRASE, "pool-cosine")["hit"] is False


def test_reranker_down_or_slow_is_a_miss(stack: Stack, monkeypatch) -> None:
    monkeypatch.setattr(remote, "COOLDOWN_S", 0.0)
    ns = hx("pool-rerank-down")
    stack.add(PASSWORD, ns, "rerank-only")  # the embedder's own vectors, the pool's reranker
    assert stack.lookup(ns, PARAPHRASE, "rerank-only")["decided_by"] == "rerank"
    try:
        for mode in ("down", "slow"):
            stack.stub.mode = mode
            res = stack.lookup(ns, PARAPHRASE, "rerank-only")
            assert res["hit"] is False and res["guard"] == "reject:verifier_unavailable", mode
    finally:
        stack.stub.mode = "ok"
    assert stack.lookup(ns, PARAPHRASE, "rerank-only")["hit"] is True


def test_failed_endpoint_is_skipped_for_a_while(stack: Stack) -> None:
    ns = hx("pool-cooldown")
    stack.add(PASSWORD, ns, "rerank-only")
    stack.stub.mode = "down"
    try:
        assert stack.lookup(ns, PARAPHRASE, "rerank-only")["hit"] is False
        calls = stack.stub.calls
        assert stack.lookup(ns, PARAPHRASE, "rerank-only")["guard"] == \
            "reject:verifier_unavailable"
        assert stack.stub.calls == calls  # not asked again during the cooldown
    finally:
        stack.stub.mode = "ok"
        for rr in stack.engine.pool._rerankers.values():
            rr.endpoint._down_until = 0.0


def test_a_refused_request_is_a_miss_without_a_cooldown(stack: Stack) -> None:
    ns = hx("pool-refused")
    stack.add(PASSWORD, ns, "rerank-only")
    stack.stub.mode = "refuse"
    try:
        res = stack.lookup(ns, PARAPHRASE, "rerank-only")
        assert res["hit"] is False and res["guard"] == "reject:verifier_unavailable"
    finally:
        stack.stub.mode = "ok"
    assert stack.lookup(ns, PARAPHRASE, "rerank-only")["hit"] is True  # asked again at once


def test_slow_embeddings_endpoint_is_a_miss(stack: Stack, monkeypatch) -> None:
    monkeypatch.setattr(remote, "COOLDOWN_S", 0.0)
    ns = hx("pool-slow-emb")
    assert stack.add(PASSWORD, ns, "stub-emb")["indexed"] is True
    assert stack.lookup(ns, PASSWORD, "stub-emb")["hit"] is True
    stack.stub.mode = "slow"
    try:  # texts not embedded before (the embedder keeps recent vectors)
        res = stack.lookup(ns, "how do I reset my password", "stub-emb")
        assert res["hit"] is False and res["guard"] == "reject:embeddings_unavailable"
    finally:
        stack.stub.mode = "ok"
    assert stack.lookup(ns, "How do I reset my password", "stub-emb")["hit"] is True


def test_embeddings_endpoint_down_is_a_miss_and_indexes_nothing(stack: Stack) -> None:
    ns = hx("pool-dead")
    assert stack.add(PASSWORD, ns, "dead")["indexed"] is False
    res = stack.lookup(ns, PASSWORD, "dead")
    assert res["hit"] is False and res["guard"] == "reject:embeddings_unavailable"
    assert stack.engine.metrics.registry.get_sample_value(
        "infergate_embedder_errors_total", {"kind": "endpoint"}) >= 2
    # its HELP names the kind too: an endpoint's failure is a miss, never a 503
    (fam,) = [f for f in stack.engine.metrics.registry.collect()
              if f.name == "infergate_embedder_errors"]
    assert "endpoint" in fam.documentation and "miss" in fam.documentation, fam.documentation
    # the other lookups of the same call are answered as usual
    resp = stack.post("/v1/lookups", {"lookups": [{"namespace": ns, "text": PASSWORD,
                                                   "model": "dead"},
                                                  {"namespace": ns, "text": PASSWORD}]})
    a, b = resp.json()["results"]
    assert a["guard"] == "reject:embeddings_unavailable" and b["model_id"] == stack.own_model_id


def _pairs(path, n_far: int = 150):
    """Paraphrases (1), one task swapped for another (0) and far questions (0), TSV."""
    import itertools

    verbs = ["reset", "change", "update", "recover", "delete", "verify"]
    nouns = ["password", "email address", "phone number", "billing address", "username",
             "profile photo", "security question", "delivery address"]
    combos = list(itertools.product(verbs, nouns))
    rows = []
    for v, n in combos:
        v2 = verbs[(verbs.index(v) + 1) % len(verbs)]
        rows += [(f"How do I {v} my {n}?", f"How can I {v} my {n}?", "1"),
                 (f"How do I {v} my {n}?", f"How do I {v2} my {n}, please?", "0")]
    for i, (v, n) in enumerate(itertools.islice(itertools.cycle(combos), n_far)):
        rows.append((f"How do I {v} my {n}?", f"Who can {v} the {n} of office {i}?", "0"))
    path.write_text("\n".join("\t".join(r) for r in rows) + "\n", encoding="utf-8")
    return path


def test_calibrate_uses_the_domains_endpoints(stack: Stack, tmp_path) -> None:
    from click.testing import CliRunner

    from controlplane.cli import main
    from controlplane.config import load_settings

    cfg = tmp_path / "infergate.toml"
    # the stub's embeddings: hundreds of texts, too many for the engine on a shared host
    cfg.write_text(f'[[cache.semantic_domains]]\nmodel = "pool-bot"\nembeddings_url = '
                   f'"{stack.stub.root}"\nembeddings_model = "bag"\nrerank_url = '
                   f'"{stack.stub.url}"\n', encoding="utf-8")
    res = CliRunner().invoke(main, ["cache", "calibrate", "--pairs",
                                    str(_pairs(tmp_path / "p.tsv")), "--model", "pool-bot",
                                    "--max-wrong", "0.05", "--config", str(cfg), "--plot",
                                    ""], catch_exceptions=False)
    assert res.exit_code == 0, res.output
    assert "endpoints of the pool" in res.output and "score: verifier" in res.output
    assert "model bag@127.0.0.1:" in res.output
    (dom,) = load_settings(cfg).cache.semantic_domains
    assert dom.embeddings_url == stack.stub.root and dom.rerank_url == stack.stub.url
    # the floor of a reranker; its threshold serves the paraphrases (the stub: 5/7)
    assert dom.min_similarity == 0.5 and dom.min_verifier_score <= 5 / 7
    assert dom.hit_rate > 0.9 and dom.wrong_hit_upper <= 0.05


def test_the_edge_serves_a_hit_found_by_the_pools_models(stack: Stack, edge_factory,
                                                        tiny_upstreams) -> None:
    """nginx, the index queue and the edge's lookup: the entry is indexed with the
    endpoint's vectors (the domain is chosen by route and model), the paraphrase is served
    from the cache with the reranker's score named."""
    from support.stack import edge_settings

    (tiny,) = tiny_upstreams(1)  # no routing snapshot in this Redis: the edge's own node
    s = edge_settings(f"redis://127.0.0.1:{stack.redis_port}/0", [tiny.node_settings()])
    s.cache = s.cache.model_validate({"enabled": True, "embedder_url": stack.url,
                                      "semantic_budget_ms": 10000, "explain": True})
    edge = edge_factory(s)

    def body_of(text: str) -> dict:
        return {"model": "tiny", "temperature": 0, "messages": [{"role": "user",
                                                                 "content": text}]}

    def ask(text: str, explain: bool = True) -> requests.Response:
        body = body_of(text)
        res = requests.post(edge.url + "/v1/chat/completions", json=body, timeout=30,
                            headers={"X-Cache-Explain": "1"} if explain else {})
        assert res.status_code == 200, res.text
        return res

    first = ask(PASSWORD)
    assert first.headers["X-Cache-Status"] == "MISS" and tiny.hits == 1
    model_id = remote.remote_model_id(stack.emb_url, "gemma-emb")
    # a miss explained: nothing stored yet in the namespace
    assert first.headers["X-Cache-Explain"].startswith("cosine=none; min_similarity=0.3000")
    assert f"model={model_id}" in first.headers["X-Cache-Explain"]

    from controlplane.cache.key import keys_for

    ns_key = keynames.cache_ns_stats(keys_for("/v1/chat/completions", body_of(PASSWORD),
                                              "default").namespace)

    def indexed() -> bool:
        return stack.r.hget(ns_key, "embedding_model") == model_id

    procs.wait_until(indexed, 30, what="the entry indexed with the endpoint's vectors")
    hit = ask(PARAPHRASE)
    assert hit.headers["X-Cache-Status"] == "HIT" and tiny.hits == 1, dict(hit.headers)
    assert hit.headers["X-Cache-Score"] == "rerank=0.7143"
    assert "decided_by=rerank" in hit.headers["X-Cache-Explain"]
    assert f"model={model_id}" in hit.headers["X-Cache-Explain"]
    assert hit.json()["choices"][0]["message"] == first.json()["choices"][0]["message"]
    quiet = ask(PARAPHRASE, explain=False)  # not asked: not shown
    assert quiet.headers["X-Cache-Status"] == "HIT" and "X-Cache-Explain" not in quiet.headers
