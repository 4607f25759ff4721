"""The learned verifier: features, training, inference, file round trip, and how the
engine combines it with per-domain thresholds (fake model, fakeredis)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from controlplane.embedder import verifier as ver


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


def test_features_shape_and_scalar_signals() -> None:
    rng = np.random.default_rng(0)
    u = _unit(rng.standard_normal((3, 16)))
    v = _unit(u + 0.1 * rng.standard_normal((3, 16)))
    q = ["借款1万需要什么条件", "How do I enable dark mode?", "怎么还款"]
    c = ["借款5万需要什么条件", "How do I disable dark mode?", "怎么还款"]
    x = ver.features(q, c, u, v)
    assert x.shape == (3, 2 * 16 + len(ver.SCALAR_FEATURES)) and x.dtype == np.float32
    np.testing.assert_allclose(x[:, :16], np.abs(u - v), atol=1e-6)
    np.testing.assert_allclose(x[:, 16:32], u * v, atol=1e-6)
    col = {n: 32 + i for i, n in enumerate(ver.SCALAR_FEATURES)}
    np.testing.assert_allclose(x[:, col["cos"]], np.einsum("ij,ij->i", u, v), atol=1e-6)
    np.testing.assert_allclose(ver.cosine_of(x), x[:, col["cos"]])
    assert x[0, col["numbers_differ"]] == 1 and x[0, col["guard_pass"]] == 0
    assert x[1, col["antonym"]] == 1
    assert x[2, col["guard_pass"]] == 1 and x[2, col["char_jaccard"]] == 1.0
    assert x[2, col["cjk_share"]] == 1.0 and x[1, col["cjk_share"]] == 0.0


def test_features_never_fail_on_odd_text() -> None:
    u = _unit(np.ones((4, 8)))
    x = ver.features(["", " ", "x" * 10000, "🙂"], ["a", "", "y", "🙂🙂"], u, u)
    assert np.isfinite(x).all()


def _separable(n: int = 400, dim: int = 8, seed: int = 3):
    rng = np.random.default_rng(seed)
    u = _unit(rng.standard_normal((n, dim)))
    y = (np.arange(n) % 2).astype(int)
    noise = np.where(y[:, None] == 1, 0.05, 1.5)
    v = _unit(u + noise * rng.standard_normal((n, dim)))
    q = [f"question {i}" for i in range(n)]
    c = [f"entry {i}" for i in range(n)]
    return q, c, u, v, y


def test_training_separates_and_round_trips(tmp_path) -> None:
    q, c, u, v, y = _separable()
    x = ver.features(q, c, u, v)
    model = ver.fit(x, y, dim=8, model_id="fake", min_score=0.7, floor=0.2, iters=200)
    p = model.score(q, c, u, v)
    assert p.shape == (len(y),) and ((p >= 0) & (p <= 1)).all()
    acc = ((p >= 0.5) == (y == 1)).mean()
    assert acc > 0.95
    path = tmp_path / "v.json"
    model.save(path)
    again = ver.Verifier.load(path)
    np.testing.assert_allclose(again.score(q, c, u, v), p, atol=1e-4)
    assert (again.min_score, again.floor, again.model_id, again.dim) == (0.7, 0.2, "fake", 8)
    assert ver.load_for("fake", 8, path).model_id == "fake"
    with pytest.raises(ver.VerifierError, match="trained for fake"):
        ver.load_for("other-model", 8, path)
    assert ver.load_for("never-shipped-model", 8) is None


def test_cross_validated_scores_are_out_of_fold() -> None:
    q, c, u, v, y = _separable(n=300)
    x = ver.features(q, c, u, v)
    folds = np.arange(len(y)) % 3
    oof = ver.cross_val_scores(x, y, folds, floor=-1.0, iters=150)
    assert oof.shape == (len(y),)
    assert ((oof >= 0.5) == (y == 1)).mean() > 0.9
    with pytest.raises(ValueError, match="both labels"):
        ver.cross_val_scores(x, np.ones(len(y), int), folds, floor=-1.0, iters=5)


def test_content_features_see_duplicates_order_and_wh_words() -> None:
    col = {n: i for i, n in enumerate(ver.CONTENT_FEATURES)}
    dup = ver.content_features("What's your favorite song and why?",
                               "What is your favorite song and why?")
    assert dup[col["seq_equal"]] == 1 and dup[col["order_discordant"]] == 0
    swap = ver.content_features("How is Donald Trump a better choice than Hillary Clinton?",
                                "How is Hillary Clinton a better choice than Donald Trump?")
    assert swap[col["seq_equal"]] == 0 and swap[col["same_bag_reordered"]] == 1
    assert swap[col["order_discordant"]] > 0.3 and swap[col["content_jaccard"]] == 1
    wh = ver.content_features("How do I learn Python?", "Why do I learn Python?")
    assert wh[col["wh_differs"]] == 1 and wh[col["wh_first_differs"]] == 1
    zh = ver.content_features("借款1万需要什么条件", "借款5万需要什么条件")
    assert zh[col["content_only_q"]] == 1 and zh[col["content_only_c"]] == 1
    assert ver.content_features("", "")[col["seq_equal"]] == 1


def test_mlp_separates_and_round_trips(tmp_path) -> None:
    q, c, u, v, y = _separable()
    x = ver.features(q, c, u, v)
    model = ver.fit_mlp(x, y, dim=8, model_id="fake", min_score=0.6, hidden=8, iters=150,
                        seeds=(0, 1))
    assert model.kind == "mlp" and len(model.members) == 2
    p = model.score(q, c, u, v)
    assert ((p >= 0) & (p <= 1)).all() and ((p >= 0.5) == (y == 1)).mean() > 0.95
    path = tmp_path / "mlp.json"
    model.save(path)
    again = ver.load_for("fake", 8, path)
    assert again.kind == "mlp" and again.min_score == 0.6
    # input weights are stored as float16
    np.testing.assert_allclose(again.score(q, c, u, v), p, atol=2e-3)


def test_version_1_files_still_load_and_use_version_1_features(tmp_path) -> None:
    q, c, u, v, y = _separable(n=200)
    x1 = ver.features(q, c, u, v, feature_version=1)
    assert x1.shape == (200, ver.n_features(8, 1)) == (200, 2 * 8 + 18)
    model = ver.fit(x1, y, dim=8, model_id="fake", iters=100)
    assert model.feature_version == 1
    d = model.to_dict()
    d["version"] = 1
    del d["kind"]
    (tmp_path / "v1.json").write_text(json.dumps(d))
    old = ver.Verifier.load(tmp_path / "v1.json")
    assert old.feature_version == 1 and old.kind == "logistic"
    np.testing.assert_allclose(old.score(q, c, u, v), model.score(q, c, u, v), atol=1e-4)
    d["kind"] = "mlp"
    (tmp_path / "bad.json").write_text(json.dumps(d))
    with pytest.raises(ver.VerifierError, match="kind"):
        ver.Verifier.load(tmp_path / "bad.json")


def test_bad_files(tmp_path) -> None:
    (tmp_path / "a.json").write_text("{not json")
    with pytest.raises(ver.VerifierError, match="cannot read"):
        ver.Verifier.load(tmp_path / "a.json")
    (tmp_path / "b.json").write_text('{"version": 1, "feature_version": 1, "dim": 4, '
                                     '"model_id": "m", "w": [1], "mean": [0], "scale": [1], '
                                     '"b": 0, "min_score": 0.5, "floor": 0.5}')
    with pytest.raises(ver.VerifierError, match="expected"):
        ver.Verifier.load(tmp_path / "b.json")
    (tmp_path / "c.json").write_text('{"version": 9}')
    with pytest.raises(ver.VerifierError, match="version"):
        ver.Verifier.load(tmp_path / "c.json")


def test_shipped_verifier_loads_and_scores() -> None:
    """The shipped file loads and scores a close paraphrase above an unrelated question
    (its speed is measured by bench.cache_quality, decision_ms_per_pair)."""
    v = ver.load_for("use-multilingual-v3", 512)
    if v is None:
        pytest.skip("no verifier file shipped for use-multilingual-v3")
    assert 0.0 < v.min_score < 1.0 and 0.0 <= v.floor < 1.0
    rng = np.random.default_rng(0)
    u = _unit(rng.standard_normal((1, 512)))
    w = _unit(u + 0.05 * rng.standard_normal((1, 512)))
    x = _unit(rng.standard_normal((1, 512)))
    q = ["How can I reset my password?"]
    close = v.score(q, ["How do I reset my password?"], u, w)
    far = v.score(q, ["Where is the nearest branch open on Sunday?"], u, x)
    assert 0.0 <= float(far[0]) < float(close[0]) <= 1.0


# ---------------------------------------------------------------- engine thresholds

class _FakeModel:
    model_id = "fake"
    dim = 8
    max_chars = 100
    default_min_similarity = 0.97

    def encode(self, texts):
        """The vector depends on the first word only: "hello there" = "hello world"."""
        out = []
        for t in texts:
            seed = int.from_bytes(t.split()[0].encode()[:8].ljust(8, b"_"), "little")
            out.append(np.random.default_rng(seed).standard_normal(self.dim))
        return _unit(np.array(out))


@pytest.fixture
def engine_factory():
    fakeredis = pytest.importorskip("fakeredis")
    from controlplane.embedder.engine import Engine
    from controlplane.embedder.policy import PolicySource, ThresholdPolicy
    from controlplane.config import settings_from_dict

    made = []

    def make(cache: dict, verifier: ver.Verifier | None):
        s = settings_from_dict({"cache": cache})
        pol = PolicySource(policy=ThresholdPolicy.from_cache_settings(s.cache))
        e = Engine(_FakeModel(), fakeredis.FakeRedis(), index_backend="local",
                   subscribe=False, verifier=verifier, policy=pol)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def _fake_verifier() -> ver.Verifier:
    n = 2 * 8 + len(ver.SCALAR_FEATURES)
    return ver.Verifier(8, "fake", np.zeros(n, np.float32), np.ones(n, np.float32),
                        np.zeros(n, np.float32), 0.0, min_score=0.6, floor=0.55)


def test_engine_thresholds_per_domain(engine_factory) -> None:
    ns = "ab" * 32
    e = engine_factory({"semantic_domains": [
        {"model": "bank", "min_verifier_score": 0.4},
        {"namespace_prefix": "ab", "route": "/v1/completions", "min_similarity": 0.9,
         "verifier": False},
    ]}, _fake_verifier())
    assert e.verifier_active and e.default_min_similarity == 0.55
    assert e.thresholds(ns) == (0.55, 0.6)                 # verifier defaults
    assert e.thresholds(ns, 0.8) == (0.8, 0.6)             # the edge's min_similarity
    assert e.thresholds(ns, 0.8, model="bank") == (0.8, 0.4)
    assert e.thresholds(ns, 0.8, "/v1/completions", "bank") == (0.9, None)  # no verifier
    off = engine_factory({"verifier": False}, _fake_verifier())
    assert not off.verifier_active and off.thresholds(ns) == (0.97, None)
    none = engine_factory({}, None)
    assert none.thresholds(ns) == (0.97, None) and none.default_min_similarity == 0.97


def test_engine_lookup_applies_the_verifier(engine_factory) -> None:
    from controlplane.embedder.index import IndexItem
    from controlplane.redisdb import keynames

    v = _fake_verifier()  # all-zero weights: probability 0.5 for every pair
    e = engine_factory({}, v)
    ns, key = "cd" * 32, "ef" * 32
    e.r.set(keynames.cache_entry(key), b"{}", ex=60)
    e.index_items([IndexItem(key=key, namespace=ns, text="hello there", ttl_s=60)])
    res = e.lookup(ns, "hello world")                      # cosine 1, p = 0.5 < 0.6
    assert res.similarity == pytest.approx(1.0, abs=1e-5)
    assert res.hit is False and res.guard == "reject:verifier"
    assert res.verifier_score == pytest.approx(0.5) and res.min_verifier_score == 0.6
    res = e.lookup(ns, "hello  THERE!")                    # the same words: p = 1
    assert res.hit is True and res.verifier_score == 1.0
    v.min_score = 0.5
    res = e.lookup(ns, "hello world")
    assert res.hit is True and res.key == key and res.guard == "pass"
    v.min_score = 0.9
    assert e.lookup(ns, "hello world", use_guard=False).hit is True  # checks off
    assert e.metrics.verifier_rejects._value.get() == 1


def test_a_domains_own_verifier_leaves_the_other_domains_decisions_unchanged(
        engine_factory, tmp_path) -> None:
    """``verifier_file`` of one ``[[cache.semantic_domains]]`` entry (what ``cache
    calibrate --train-verifier`` writes) applies to that domain only."""
    from controlplane.embedder.index import IndexItem
    from controlplane.redisdb import keynames

    accepting = _fake_verifier()
    accepting.b = 5.0                                      # p = 0.993 for every pair
    rejecting = _fake_verifier()
    rejecting.b, rejecting.floor, rejecting.min_score = -5.0, 0.3, 0.2   # p = 0.007
    own = tmp_path / "bank-verifier.json"
    rejecting.save(own)
    base = [{"model": "a", "min_verifier_score": 0.6}]
    ns, key = "cd" * 32, "ef" * 32

    def decisions(domains: list[dict]) -> list[tuple]:
        e = engine_factory({"semantic_domains": domains}, accepting)
        e.r.set(keynames.cache_entry(key), b"{}", ex=60)
        e.index_items([IndexItem(key=key, namespace=ns, text="hello there", ttl_s=60)])
        out = []
        for model in ("a", "b", None):
            r = e.lookup(ns, "hello world", model=model)
            out.append((r.hit, r.guard, r.min_similarity, r.min_verifier_score,
                        r.verifier_score))
        return out

    before = decisions(base)
    after = decisions(base + [{"model": "b", "min_verifier_score": 0.5,
                               "verifier_file": str(own)}])
    assert before[0] == after[0] and before[2] == after[2]   # domain a and no domain
    assert before[1][0] is True and after[1][0] is False      # domain b: its own verifier
    assert after[1][1] == "reject:verifier" and after[1][2] == 0.3  # its floor
    assert after[1][4] == pytest.approx(1 / (1 + np.exp(5.0)), rel=1e-3)
    # a domain whose file cannot be read serves only texts equal up to case/punctuation
    e = engine_factory({"semantic_domains": [{"model": "c", "min_verifier_score": 0.5,
                                              "verifier_file": str(tmp_path / "gone.json")}]},
                       accepting)
    assert e.thresholds(ns, model="c")[1] == 1.0 and e.thresholds(ns, model="a")[1] == 0.6


def test_a_domains_verifier_is_read_again_when_the_configuration_reloads(
        engine_factory, tmp_path) -> None:
    from controlplane.config import settings_from_dict
    from controlplane.embedder.policy import PolicySource, ThresholdPolicy

    own = tmp_path / "v.json"
    first = _fake_verifier()
    first.min_score = 0.61
    first.save(own)
    dom = {"semantic_domains": [{"model": "b", "min_similarity": 0.5,
                                 "verifier_file": str(own)}]}
    e = engine_factory(dom, _fake_verifier())
    assert e.thresholds("ab", model="b")[1] == 0.61
    second = _fake_verifier()
    second.min_score = 0.77
    second.save(own)
    assert e.thresholds("ab", model="b")[1] == 0.61      # same configuration: kept
    s = settings_from_dict({"cache": dom})
    e.policy = PolicySource(policy=ThresholdPolicy.from_cache_settings(s.cache))
    assert e.thresholds("ab", model="b")[1] == 0.77      # reloaded: read again
