"""How the edge shows the embedder's semantic decision (infergate.cache.semantic): the
hit's ``X-Cache-Score`` names the score that decided, ``X-Cache-Explain`` lists the
figures of a lookup answer."""

from __future__ import annotations

from support.stack import lua_eval


def run(workdir, code: str):
    return lua_eval(workdir, f"""
        local semantic = require("infergate.cache.semantic")
        {code}
    """)


ANSWER = ('{hit = true, similarity = 0.97123, verifier_score = 0.81234, min_similarity = 0.5, '
          'min_verifier_score = 0.7, guard = "pass", decided_by = "verifier", '
          'model_id = "use-multilingual-v3"}')


def test_the_hit_names_the_score_that_decided(workdir) -> None:
    out = run(workdir, f"""
        local a = {ANSWER}
        local r = {{ semantic.score_text(a) }}
        a.decided_by = "rerank"; r[#r + 1] = semantic.score_text(a)
        a.decided_by = "cosine"; r[#r + 1] = semantic.score_text(a)
        a.decided_by = nil; r[#r + 1] = semantic.score_text(a)
        return r
    """)
    assert out == ["verifier=0.8123", "rerank=0.8123", "cosine=0.9712", "cosine=0.9712"]


def test_explain_lists_the_figures_of_the_decision(workdir) -> None:
    out = run(workdir, f"""
        local a = {ANSWER}
        local miss = {{ hit = false, guard = "reject:embeddings_unavailable",
                        min_similarity = 0.9, decided_by = "cosine",
                        model_id = "bge m3@10.0.0.5:8080" }}
        return {{ semantic.explain_text(a), semantic.explain_text(miss) }}
    """)
    assert out[0] == ("cosine=0.9712; verifier=0.8123; min_similarity=0.5000; "
                      "min_verifier_score=0.7000; guard=pass; decided_by=verifier; "
                      "model=use-multilingual-v3")
    # no candidate: the cosine is none; a header value keeps to safe characters
    assert out[1] == ("cosine=none; min_similarity=0.9000; guard=reject:embeddings_unavailable;"
                      " decided_by=cosine; model=bge_m3@10.0.0.5:8080")


def test_a_guard_reason_with_words_of_the_question_stays_ascii(workdir) -> None:
    out = run(workdir, """
        return { semantic.explain_text({ hit = false, similarity = 0.9, decided_by = "cosine",
                                         guard = "reject:antonym:最高/最低 100%;" }) }
    """)
    guard = out[0].split("; ")[1]
    assert guard == "guard=reject:antonym:%E6%9C%80%E9%AB%98/%E6%9C%80%E4%BD%8E%20100%25%3B"
    assert out[0].isascii()
    from urllib.parse import unquote
    assert unquote(guard) == "guard=reject:antonym:最高/最低 100%;"
