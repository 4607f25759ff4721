"""Threshold calibration: confidence bounds, sweep and choice, pair files, per-domain
threshold selection (config + policy)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from controlplane.config import ConfigError, settings_from_dict
from controlplane.embedder import calibration as cal
from controlplane.embedder.policy import Domain, PolicySource, ThresholdPolicy


# ---------------------------------------------------------------- bounds

def test_wilson_upper_known_values() -> None:
    # one-sided 95 %: z = 1.6449
    assert cal.wilson_upper(0, 100) == pytest.approx(0.02634, abs=1e-4)
    assert cal.wilson_upper(5, 1000) == pytest.approx(0.01024, abs=1e-4)
    assert cal.wilson_upper(50, 100) == pytest.approx(0.5814, abs=1e-3)
    assert cal.wilson_upper(0, 0) == 1.0
    assert cal.wilson_upper(10, 10) == 1.0


def test_clopper_pearson_upper_known_values() -> None:
    # k = 0: the bound solves (1 - p)^n = 0.05
    assert cal.clopper_pearson_upper(0, 100) == pytest.approx(1 - 0.05 ** (1 / 100), rel=1e-6)
    # scipy.stats.beta.ppf(0.95, 6, 995) = 0.010487...
    assert cal.clopper_pearson_upper(5, 1000) == pytest.approx(0.010487, abs=2e-5)
    assert cal.clopper_pearson_upper(3, 3) == 1.0


@pytest.mark.parametrize("k,n", [(0, 10), (1, 50), (7, 300), (30, 1000), (200, 2500)])
def test_bounds_are_above_the_rate_and_shrink_with_n(k: int, n: int) -> None:
    for f in (cal.wilson_upper, cal.clopper_pearson_upper):
        ub = f(k, n)
        assert k / n < ub <= 1.0
        assert f(10 * k, 10 * n) < ub
    # the exact bound is the more conservative one
    assert cal.clopper_pearson_upper(k, n) >= cal.wilson_upper(k, n) - 1e-9


@pytest.mark.parametrize("k,n", [(-1, 5), (6, 5)])
def test_bounds_reject_impossible_counts(k: int, n: int) -> None:
    with pytest.raises(ValueError):
        cal.wilson_upper(k, n)
    with pytest.raises(ValueError):
        cal.clopper_pearson_upper(k, n)


# ---------------------------------------------------------------- sweep and choice

def test_sweep_counts_hits_and_wrong_hits() -> None:
    scores = [0.95, 0.90, 0.85, 0.80, 0.92, 0.70]
    labels = [1, 1, 1, 1, 0, 0]
    rows = cal.sweep(scores, labels, [0.8, 0.9, 0.93])
    assert [(r.hits, r.wrong) for r in rows] == [(4, 1), (2, 1), (1, 0)]
    assert rows[0].hit_rate == 1.0 and rows[0].wrong_rate == 0.5
    assert rows[2].wrong_upper == pytest.approx(cal.wilson_upper(0, 2))
    # a filter (the guard) removes pairs whatever their score
    rows = cal.sweep(scores, labels, [0.8], allowed=[True, False, True, True, False, True])
    assert (rows[0].hits, rows[0].wrong) == (3, 0)


def test_choose_is_the_lowest_threshold_under_the_bound() -> None:
    rng = np.random.default_rng(1)
    pos = rng.uniform(0.6, 1.0, 2000)
    neg = rng.uniform(0.0, 0.9, 2000)  # negatives reach 0.9: safe from a bit under 0.9
    scores = np.concatenate([pos, neg])
    labels = np.array([1] * 2000 + [0] * 2000)
    rows = cal.sweep(scores, labels, cal.grid(0.5, 1.0, 0.001))
    row = cal.choose(rows, 0.01)
    assert row is not None and 0.88 <= row.threshold <= 0.9
    assert row.wrong_upper <= 0.01
    below = [r for r in rows if r.threshold < row.threshold]
    assert all(r.wrong_upper > 0.01 for r in below)
    # what the observed rate alone would allow is lower than what the bound allows
    assert min(r.threshold for r in rows if (r.wrong_rate or 0) <= 0.01) < row.threshold


def test_choose_none_when_negatives_are_too_few() -> None:
    # 50 negatives, none served: the bound (5.8 %) never reaches 1 %
    rows = cal.sweep([0.99] * 10 + [0.1] * 50, [1] * 10 + [0] * 50, [0.5, 0.9])
    assert cal.choose(rows, 0.01) is None
    assert cal.choose(rows, 0.1) is not None


def test_sweep_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError):
        cal.sweep([0.1, 0.2], [1], [0.5])
    with pytest.raises(ValueError):
        cal.sweep([0.1], [1], [0.5], bound="nope")


# ---------------------------------------------------------------- pair files

def test_load_pairs_tsv_jsonl_and_qqp_shape(tmp_path) -> None:
    tsv = tmp_path / "p.tsv"
    tsv.write_text("text1\ttext2\tlabel\n怎么还款\t如何还款\t1\n借款1万\t借款5万\t0\nbad row\n",
                   encoding="utf-8")
    p = cal.load_pairs(tsv)
    assert (p.text1, p.text2, p.label) == (["怎么还款", "借款1万"], ["如何还款", "借款5万"], [1, 0])
    jl = tmp_path / "p.jsonl"
    jl.write_text("\n".join(json.dumps(d) for d in [
        {"text1": "a b", "text2": "a c", "label": 0},
        {"text1": "x", "text2": "y", "label": "1"},
        {"text1": "x", "text2": "y", "label": True},   # not a label
    ]) + "\n", encoding="utf-8")
    assert cal.load_pairs(jl).label == [0, 1]
    qqp = tmp_path / "q.jsonl"
    qqp.write_text(json.dumps({"origin": "How?", "similar": "How so?"}) + "\n")
    assert cal.load_pairs(qqp).label == [1]


def test_load_pairs_errors(tmp_path) -> None:
    with pytest.raises(cal.PairsError, match="cannot read"):
        cal.load_pairs(tmp_path / "missing.tsv")
    (tmp_path / "empty.tsv").write_text("text1\ttext2\tlabel\n")
    with pytest.raises(cal.PairsError, match="no valid pair"):
        cal.load_pairs(tmp_path / "empty.tsv")
    (tmp_path / "bad.jsonl").write_text('{"text1": "a"}\nnot json\n')
    with pytest.raises(cal.PairsError, match=":2: not a JSON object"):
        cal.load_pairs(tmp_path / "bad.jsonl")


def test_mined_negatives_come_from_other_groups() -> None:
    p = cal.Pairs(["how to cook rice", "cook rice how", "fix a bike"],
                  ["cooking rice", "rice cooking", "repair a bike"], [1, 1, 1], [False] * 3)
    v1 = np.eye(3, dtype=np.float32)
    v2 = np.array([[0.9, 0, 0.1], [0.8, 0.1, 0.3], [0.5, 0.1, 0.9]], dtype=np.float32)
    out = cal.mine_negatives(p, v1, v2)
    assert len(out) == 6 and out.label[3:] == [0, 0, 0] and out.mined[3:] == [True] * 3
    # "cooking rice" is closest to its own group's entries; its negative is "fix a bike"
    assert out.text1[3] == "fix a bike"
    assert out.text1[5] in ("how to cook rice", "cook rice how")
    labelled = cal.Pairs(["a"], ["b"], [0], [False])
    assert cal.mine_negatives(labelled, v1[:1], v2[:1]) is labelled


@pytest.mark.parametrize("a,b", [
    ("Why do some people think the Earth is flat?",
     "Why do some people think that the Earth is flat?"),
    ("Which is best laptop to buy under 30k?", "Which is the best laptop to buy under 30k?"),
    ("What's your favorite song and why?", "What is your favorite song and why?"),
    ("How can I improve my English?", "How do you improve your English?"),
    ("Why can't I sleep at night?", "Why can I not sleep at night?"),
    ("What are the best books for SSC CGL?", "Which is the best book for SSC CGL?"),
    ("What happened to Yahoo?", "What has happened to Yahoo?"),
    ("How to change my email address?", "How do I change my email address?"),
    ("Where can I download my invoices?", "Where do I download my invoices?"),
])
def test_duplicate_key_joins_trivial_rewordings(a: str, b: str) -> None:
    assert cal.duplicate_key(a) == cal.duplicate_key(b)


@pytest.mark.parametrize("a,b", [
    ("How can I get meth out of my system in 2 days?",
     "How can I get meth out of my system in 3 days?"),
    ("How are U.S. family offices structured?", "How are Canadian family offices structured?"),
    ("How is Donald Trump a better choice than Hillary Clinton?",
     "How is Hillary Clinton a better choice than Donald Trump?"),
    ("What is the kindest thing a stranger has done for you?",
     "What is the kindest thing you have done for a stranger?"),
    ("Who are you?", "Who am I?"),
    ("Why does she hate me?", "Why do I hate her?"),
    ("Can I eat eggs?", "Should I eat eggs?"),
    ("When can I apply?", "When should I apply?"),
    ("How do I learn Python?", "Why do I learn Python?"),
    ("Is it safe?", "Is it not safe?"),
    ("Flights from Delhi to Goa", "Flights from Goa to Delhi"),
    ("怎么还款", "如何还款"),
    ("What to do in Paris?", "What do I do in Paris?"),
])
def test_duplicate_key_keeps_different_questions_apart(a: str, b: str) -> None:
    assert cal.duplicate_key(a) != cal.duplicate_key(b)


def test_mined_negative_is_never_a_lexical_duplicate() -> None:
    # "what's the capital of France" is a rewording of the first query's own question: the
    # negative mined for it must be the other question, even though it is further away
    p = cal.Pairs(["What is the capital of France?", "What's the capital of France?",
                   "How do I bake bread?"],
                  ["France's capital city?", "Capital of France, which city?",
                   "Bread baking at home?"], [1, 1, 1], [False] * 3)
    v1 = np.array([[1, 0, 0], [0.99, 0.141, 0], [0, 0, 1]], dtype=np.float32)
    v2 = np.array([[0.98, 0.2, 0.0], [0.9, 0.43, 0.0], [0.1, 0, 0.99]], dtype=np.float32)
    out = cal.mine_negatives(p, v1, v2)
    assert out.text1[3] == out.text1[4] == "How do I bake bread?"
    assert cal.groups(p.text1, p.text2, key=cal.duplicate_key)[
        cal.duplicate_key(p.text1[0])] == cal.groups(p.text1, p.text2, key=cal.duplicate_key)[
        cal.duplicate_key(p.text1[1])]


def test_folds_keep_shared_texts_together() -> None:
    p = cal.Pairs(["a", "a", "c", "e", "g"], ["b", "x", "d", "f", "h"], [1, 0, 1, 1, 0],
                  [False] * 5)
    f = cal.fold_ids(p, 3, seed=1)
    assert f[0] == f[1]  # "a" in both
    assert set(f.tolist()) <= {0, 1, 2}


# ---------------------------------------------------------------- per-domain thresholds

def _policy(domains: list[dict], verifier: bool = True) -> ThresholdPolicy:
    s = settings_from_dict({"cache": {"verifier": verifier, "semantic_domains": domains}})
    return ThresholdPolicy.from_cache_settings(s.cache)


def test_most_specific_domain_wins() -> None:
    pol = _policy([
        {"min_similarity": 0.9},
        {"route": "/v1/chat/completions", "min_similarity": 0.85},
        {"model": "bank", "min_similarity": 0.8},
        {"model": "bank", "route": "/v1/chat/completions", "min_similarity": 0.79},
        {"namespace_prefix": "ab", "min_verifier_score": 0.7},
        {"namespace_prefix": "abcd", "min_verifier_score": 0.6},
    ])
    ns = "ff" * 32
    assert pol.resolve(ns).min_similarity == 0.9
    assert pol.resolve(ns, "/v1/completions").min_similarity == 0.9
    assert pol.resolve(ns, "/v1/chat/completions").min_similarity == 0.85
    assert pol.resolve(ns, "/v1/completions", "bank").min_similarity == 0.8
    assert pol.resolve(ns, "/v1/chat/completions", "bank").min_similarity == 0.79
    assert pol.resolve("ab" + "0" * 62, "/v1/chat/completions", "bank").min_verifier_score == 0.7
    assert pol.resolve("abcd" + "0" * 60).min_verifier_score == 0.6
    assert _policy([]).resolve(ns) is None


def test_domain_validation() -> None:
    with pytest.raises(ConfigError, match="needs min_similarity or min_verifier_score"):
        settings_from_dict({"cache": {"semantic_domains": [{"model": "m"}]}})
    with pytest.raises(ConfigError, match="namespace_prefix"):
        settings_from_dict({"cache": {"semantic_domains": [
            {"namespace_prefix": "XYZ", "min_similarity": 0.9}]}})
    with pytest.raises(ConfigError, match="min_similarity"):
        settings_from_dict({"cache": {"semantic_domains": [{"min_similarity": 1.5}]}})


def test_policy_source_reloads_a_changed_file(tmp_path) -> None:
    cfg = tmp_path / "infergate.toml"
    cfg.write_text('[[cache.semantic_domains]]\nmodel = "m"\nmin_similarity = 0.9\n')
    src = PolicySource(cfg, check_every_s=0.0)
    assert src.current().resolve("00" * 32, None, "m").min_similarity == 0.9
    cfg.write_text('[[cache.semantic_domains]]\nmodel = "m"\nmin_similarity = 0.7\n')
    st = os.stat(cfg)
    os.utime(cfg, (st.st_atime, st.st_mtime + 5))
    assert src.current().resolve("00" * 32, None, "m").min_similarity == 0.7
    # a broken file keeps the last good policy
    cfg.write_text("[[cache.semantic_domains]]\nmodel = \n")
    os.utime(cfg, (st.st_atime, st.st_mtime + 10))
    assert src.current().resolve("00" * 32, None, "m").min_similarity == 0.7
    assert Domain(model="m", min_similarity=0.1).specificity == (2, 0)


def test_write_domain_keeps_the_files_mode_owner_and_link(tmp_path) -> None:
    """`cache calibrate` rewrites the operator's configuration, which holds the admin
    token and maybe a Redis password (the runtime install makes it 0640
    root:infergate): the new file keeps the old one's mode and owner instead of the
    writer's umask (0644 under 022, readable by every user), and a symbolic link stays a
    link to the file it names."""
    from controlplane.embedder.tuning import write_domain

    real = tmp_path / "etc" / "infergate.toml"
    real.parent.mkdir()
    real.write_text('[controlplane]\nadmin_token = "s3cret-token-0123456789"\n')
    os.chmod(real, 0o640)
    link = tmp_path / "infergate.toml"
    link.symlink_to(real)
    old_umask = os.umask(0o022)
    try:
        write_domain(link, {"model": "m", "min_similarity": 0.9})
    finally:
        os.umask(old_umask)
    assert link.is_symlink() and os.path.realpath(link) == str(real)
    st = os.stat(real)
    assert st.st_mode & 0o777 == 0o640, oct(st.st_mode)
    assert (st.st_uid, st.st_gid) == (os.geteuid(), os.getegid())
    text = real.read_text()
    assert "s3cret-token-0123456789" in text and 'model = "m"' in text
    assert sorted(p.name for p in real.parent.iterdir()) == ["infergate.toml"]  # no leftovers
    new = tmp_path / "new.toml"
    write_domain(new, {"model": "m", "min_similarity": 0.9})
    assert new.exists() and not new.is_symlink()
