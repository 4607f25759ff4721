"""Pure logic of the pool's endpoints as the embedder's models (``embedder.remote``) and
their options: the rerank answer shapes, logits, URLs, and the domain settings."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from controlplane.config.cache import SemanticDomain
from controlplane.embedder import remote


def test_both_published_rerank_shapes_are_read_in_document_order() -> None:
    jina = {"results": [{"index": 1, "relevance_score": 0.9},
                        {"index": 0, "relevance_score": 0.2}]}
    assert remote.parse_rerank(jina, 2).tolist() == [0.2, 0.9]
    tei = [{"index": 0, "score": 0.7}, {"index": 1, "score": -1.5}]
    assert remote.parse_rerank(tei, 2, "tei").tolist() == [0.7, -1.5]


@pytest.mark.parametrize("doc", [
    {"results": [{"index": 0, "relevance_score": 0.5}]},          # a document unscored
    {"results": [{"index": 0, "relevance_score": "x"}, {"index": 1, "relevance_score": 1}]},
    {"results": [{"index": 5, "relevance_score": 1}, {"index": 1, "relevance_score": 1}]},
    {"error": "nope"}, "text", None,
])
def test_an_answer_that_does_not_score_every_document_is_an_error(doc) -> None:
    with pytest.raises(remote.EndpointError):
        remote.parse_rerank(doc, 2)


def test_logits_are_mapped_to_probabilities() -> None:
    rr = remote.Reranker("http://127.0.0.1:9/v1/rerank", "m", 1.0, remote.EndpointAccess(),
                         logits=True)
    rr.endpoint.post = lambda body: {"results": [  # type: ignore[method-assign]
        {"index": i, "relevance_score": s} for i, s in enumerate([0.0, 8.0, -8.0, 1e9])]}
    p = rr.rank("q", ["a", "b", "c", "d"])
    assert p[0] == pytest.approx(0.5) and p[1] > 0.999 and p[2] < 0.001 and p[3] == 1.0


def test_scores_are_asked_once_per_query() -> None:
    rr = remote.Reranker("http://127.0.0.1:9/rerank", "m", 1.0, remote.EndpointAccess(),
                         fmt="tei")
    bodies: list[dict] = []

    def post(body: dict) -> object:
        bodies.append(body)
        return [{"index": i, "score": 0.1 * (i + 1)} for i in range(len(body["texts"]))]

    rr.endpoint.post = post  # type: ignore[method-assign]
    s = rr.score(["q1", "q2", "q1"], ["a", "b", "c"])
    assert np.allclose(s, [0.1, 0.1, 0.2])
    assert bodies == [{"query": "q1", "texts": ["a", "c"]}, {"query": "q2", "texts": ["b"]}]


def test_a_failed_endpoint_cools_down() -> None:
    ep = remote._Endpoint("http://127.0.0.1:9/v1/embeddings", 0.2, remote.EndpointAccess())
    with pytest.raises(remote.EndpointError, match="ConnectionError"):
        ep.post({})
    with pytest.raises(remote.EndpointError, match="failed less than"):
        ep.post({})


def test_urls_and_model_ids() -> None:
    assert remote.embeddings_endpoint("http://h:8080") == "http://h:8080/v1/embeddings"
    assert remote.embeddings_endpoint("http://h:8080/v1/") == "http://h:8080/v1/embeddings"
    assert remote.embeddings_endpoint("http://h/x/embeddings") == "http://h/x/embeddings"
    assert remote.remote_model_id("https://h/v1", "bge") == "bge@h:443"
    assert remote.remote_model_id("http://h:81", "") == "remote@h:81"


def test_an_unreadable_key_is_an_endpoint_error(monkeypatch) -> None:
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    with pytest.raises(remote.EndpointError, match="NO_SUCH_KEY_VAR"):
        remote.EndpointAccess(api_key_env="NO_SUCH_KEY_VAR").headers()
    monkeypatch.setenv("NO_SUCH_KEY_VAR", "s3cret")
    assert remote.EndpointAccess(api_key_env="NO_SUCH_KEY_VAR").headers() == {
        "Authorization": "Bearer s3cret"}


def test_domain_with_endpoints_needs_no_threshold_and_checks_its_fields() -> None:
    d = SemanticDomain(model="m", embeddings_url="http://h:1/v1/", rerank_url="https://r/rerank")
    assert d.remote and d.embeddings_url == "http://h:1/v1"
    with pytest.raises(ValidationError, match="min_similarity or min_verifier_score"):
        SemanticDomain(model="m")
    for bad in ({"embeddings_url": "ftp://h"}, {"rerank_url": "http://h:99999/x"},
                {"embeddings_url": "http://h", "api_key_env": "not a name"},
                {"embeddings_url": "http://h", "api_key_file": "rel/path"},
                {"embeddings_url": "http://h", "api_key_env": "K", "api_key_file": "/k"},
                {"embeddings_url": "http://h", "endpoint_timeout_ms": 5},
                {"embeddings_url": "http://h", "rerank_format": "other"}):
        with pytest.raises(ValidationError):
            SemanticDomain(**bad)
