"""The serving decision (``decision.choose``): which guard rejections the verifier may
overrule, and the verifier's per-language operating points (pure logic, fake vectors)."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.embedder import decision, guard
from controlplane.embedder import verifier as ver
from controlplane.embedder.index import Candidate

DIM = 8


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def _constant_verifier(p: float, min_score: float = 0.6,
                       language_min_score: dict | None = None,
                       language_min_cosine: dict | None = None) -> ver.Verifier:
    """A verifier whose model gives ``p`` to every pair (bias only)."""
    n = ver.n_features(DIM)
    return ver.Verifier(DIM, "fake", np.zeros(n, np.float32), np.ones(n, np.float32),
                        np.zeros(n, np.float32), float(np.log(p / (1 - p))),
                        min_score=min_score, floor=0.5,
                        language_min_score=dict(language_min_score or {}),
                        language_min_cosine=dict(language_min_cosine or {}))


def _ask(query: str, cached: str, v: ver.Verifier | None, min_score: float | None = 0.6,
         cos: float = 0.98):
    """The decision on one candidate whose vector has cosine ``cos`` with the query's."""
    rng = np.random.default_rng(0)
    u = _unit(rng.standard_normal(DIM))
    o = rng.standard_normal(DIM)
    o = _unit(o - (o @ u) * u)
    w = _unit(cos * u + np.sqrt(1 - cos * cos) * o)
    cand = Candidate("e1", float(u @ w), cached, w)
    return decision.choose(query, u, [cand], 0.5, min_score, True, v)


@pytest.mark.parametrize("query,cached,may", [
    ("How do I make pancakes?", "What is a good recipe for pancakes?", True),
    ("What is the capital of Peru?", "What is the capital of Chile?", True),
    ("皖是哪个省会的简称", "滇是哪个省会的简称", False),       # Chinese key characters
    ("What is the capital of 法国?", "What is the capital of Germany?", False),
    ("How do I enable wifi?", "How do I disable wifi?", False),  # an antonym, not key terms
    ("Borrow 100 dollars", "Borrow 200 dollars", False),
])
def test_only_english_key_term_rejections_go_to_the_verifier(query, cached, may) -> None:
    g = guard.check(query, cached)
    assert not g.ok
    assert guard.verifier_may_overrule(g, query, cached) is may
    assert decision.guard_verdict(query, cached, True).ok is may
    assert decision.guard_verdict(query, cached, False) == g


def test_the_verifier_decides_an_english_key_term_substitution() -> None:
    """Other words substituted need the verifier at SUBSTITUTION_MIN_SCORE whatever the
    threshold (it scored "New York City" / "New York State" 0.95, "fly" / "drive" 0.98);
    the same words spelled otherwise need only the threshold."""
    q, c = "How do I make pancakes?", "What is a good recipe for pancakes?"
    hit, verdict, score = _ask(q, c, _constant_verifier(0.995))
    assert hit is not None and verdict == "pass:verifier" and score == pytest.approx(0.995)
    for q2, c2 in ((q, c), ("What is the population of New York State?",
                            "What is the population of New York City?"),
                   ("How long does it take to drive from London to Paris?",
                    "How long does it take to fly from London to Paris?")):
        hit, verdict, _ = _ask(q2, c2, _constant_verifier(0.98))
        assert hit is None and verdict == "reject:verifier", (q2, c2)
    for q2, c2 in (("What is the difference between data analytics and data mining?",
                    "What is the difference between data analyticis and data mining?"),
                   ("What are some mind blowing facts about Steve Jobs?",
                    "What are some mindblowing facts about Steve Jobs?")):
        assert guard.spelling_variant(q2, c2)
        hit, verdict, _ = _ask(q2, c2, _constant_verifier(0.9))
        assert hit is not None and verdict == "pass:verifier", (q2, c2)
    hit, verdict, _ = _ask(q, c, _constant_verifier(0.3))
    assert hit is None and verdict == "reject:verifier"
    hit, verdict, _ = _ask(q, c, None, None)  # without the verifier the guard decides
    assert hit is None and verdict == "reject:key_terms"
    hit, verdict, _ = _ask("皖是哪个省会的简称", "滇是哪个省会的简称", _constant_verifier(0.99))
    assert hit is None and verdict == "reject:key_terms"


def test_a_qualifier_added_to_a_question_for_an_amount_needs_the_higher_bar() -> None:
    """"How many students" / "How many undergraduate students", "the GDP" / "the GDP per
    capita": the verifier scored them 0.96; an addition to another question keeps the
    threshold."""
    for q, c in (("How many undergraduate students attend Harvard?",
                  "How many students attend Harvard?"),
                 ("What is the GDP per capita of the United States?",
                  "What is the GDP of the United States?")):
        assert guard.check(q, c).ok and guard.qualifier_added(q, c)
        hit, verdict, _ = _ask(q, c, _constant_verifier(0.96))
        assert hit is None and verdict == "reject:verifier", q
        hit, verdict, _ = _ask(q, c, _constant_verifier(0.995))
        assert hit is not None and verdict == "pass:verifier", q
    q, c = "How do I reset my account password?", "How do I reset my password?"
    assert not guard.qualifier_added(q, c)
    hit, verdict, _ = _ask(q, c, _constant_verifier(0.96))
    assert hit is not None and verdict == "pass"


def test_language_operating_points_rescale_the_probability() -> None:
    v = _constant_verifier(0.91, min_score=0.95,
                           language_min_score={"zh": 0.9, "other": 0.97})
    assert ver.language_of("北京今天天气如何？") == "zh"
    assert ver.language_of("How is the weather?") == "other"
    # 0.91 is above the Chinese operating point (0.9): above the default threshold
    hit, _, score = _ask("北京今天天气如何？", "今天北京的天气怎么样？", v, 0.95)
    assert 0.95 < score < 0.96 and hit is not None
    # below the English operating point: rescaled under 0.95, a miss
    hit, _, score = _ask("How can I reset my password?", "How do I reset the password?", v,
                         0.95)
    assert score < 0.95 and hit is None
    # monotone per language, ends fixed; equal texts still score 1
    p = np.array([0.0, 0.2, 0.5, 0.8, 1.0])
    out = v.rescale(p, ["other"] * 5)
    assert out[0] == 0.0 and out[-1] == 1.0 and np.all(np.diff(out) > 0)
    assert v.score(["Hi!"], ["hi"], np.ones((1, DIM)), np.ones((1, DIM)))[0] == 1.0


def test_language_operating_points_round_trip_and_are_checked(tmp_path) -> None:
    v = _constant_verifier(0.9, min_score=0.95, language_min_score={"zh": 0.93})
    path = tmp_path / "v.json"
    v.save(path)
    assert ver.Verifier.load(path).language_min_score == {"zh": 0.93}
    d = v.to_dict()
    d["language_min_score"] = {"zh": 1.5}
    with pytest.raises(ver.VerifierError):
        ver.Verifier.from_dict(d)


def test_the_plain_cosine_point_serves_whatever_the_model_says() -> None:
    v = _constant_verifier(0.1, min_score=0.95, language_min_score={"zh": 0.9},
                           language_min_cosine={"zh": 0.96})
    q, c = "北京今天天气如何？", "今天北京的天气怎么样？"
    hit, verdict, score = _ask(q, c, v, 0.95, cos=0.97)
    assert hit is not None and verdict == "pass" and score >= 0.95
    assert _ask(q, c, v, 0.95, cos=0.955)[0] is None  # under the point: the model decides
    assert _ask(q, c, v, 0.99, cos=0.961)[0] is None  # a stricter domain needs more cosine
    # only where the guard passes, and only for the language that has a point
    assert _ask("借款1万", "借款5万", v, 0.95, cos=0.99)[0] is None
    assert _ask("How is the weather?", "How's the weather?", v, 0.95, cos=0.99)[0] is None
    d = v.to_dict()
    assert ver.Verifier.from_dict(d).language_min_cosine == {"zh": 0.96}
    d["language_min_cosine"] = {"zh": 1.2}
    with pytest.raises(ver.VerifierError):
        ver.Verifier.from_dict(d)


def test_the_same_words_up_to_chinese_synonyms_score_1() -> None:
    v = _constant_verifier(0.1)
    assert ver.same_words("怎么重置密码？", "如何重设密码")
    assert ver.same_words("Hi!", "hi")
    assert not ver.same_words("重设密码", "重置密钥")
    assert not ver.same_words("???", "!!!")
    u = np.ones((1, DIM)) / np.sqrt(DIM)
    assert v.score(["减肥有什么好方法？"], ["减肥有什么好办法？"], u, u)[0] == 1.0
    assert v.score(["减肥有什么好方法？"], ["减肥有什么好药？"], u, u)[0] < 0.5


def test_the_benchmarks_embedding_cache_embeds_each_text_once(tmp_path, monkeypatch) -> None:
    from bench.cache_quality import embcache

    class Model:
        model_id, dim = "fake/model", DIM
        calls: list[list[str]] = []

        def encode(self, texts):
            self.calls.append(list(texts))
            return np.vstack([_unit(np.arange(1, DIM + 1) * (len(t) + 1.0)) for t in texts])

    monkeypatch.setenv("INFERGATE_BENCH_CACHE", str(tmp_path))
    m = Model()
    a = embcache.embed(m, ["a", "bb", "a"])
    b = embcache.embed(m, ["bb", "ccc"])
    assert m.calls == [["a", "bb"], ["ccc"]]
    assert np.array_equal(a[1], b[0]) and np.array_equal(a[0], a[2])
    monkeypatch.setenv("INFERGATE_BENCH_CACHE", "off")
    embcache.embed(m, ["a"])
    assert m.calls[-1] == ["a"]
