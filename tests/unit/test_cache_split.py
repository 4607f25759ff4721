"""Disjoint fit and check parts by text, the verifier's training fingerprint, and the
calibration that refuses to grade a verifier on its own training texts."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.embedder import calibration as cal
from controlplane.embedder import split, tuning
from controlplane.embedder import verifier as ver


def _pairs(n_groups: int = 300) -> cal.Pairs:
    """Groups of recurring questions: each group's base text appears in several pairs
    (a paraphrase with other spacing and case, and negatives against the next group)."""
    t1, t2, lab = [], [], []
    for g in range(n_groups):
        base = f"How do I close account number {g} quickly?"
        t1 += [base, base, base.upper().replace(" ", "  ")]
        t2 += [f"how can i close account {g} fast", f"Where is branch {g}?",
               f"how can i close account {g} fast!"]
        lab += [1, 0, 1]
    return cal.Pairs(t1, t2, lab, [False] * len(lab))


def test_split_is_by_text_whole_groups_and_deterministic() -> None:
    p = _pairs()
    fit = split.split_pairs(p.text1, p.text2)
    assert 0.45 < fit.mean() < 0.75                      # about 60 % of the groups
    fit_texts = {cal.normalise(t) for i in np.flatnonzero(fit) for t in (p.text1[i], p.text2[i])}
    chk_texts = {cal.normalise(t) for i in np.flatnonzero(~fit)
                 for t in (p.text1[i], p.text2[i])}
    assert fit_texts and chk_texts and not fit_texts & chk_texts  # no text on both sides
    # the same answer in another order of the file, and for another salt another split
    order = np.random.default_rng(1).permutation(len(p))
    again = split.split_pairs([p.text1[i] for i in order], [p.text2[i] for i in order])
    assert (again == fit[order]).all()
    assert (split.split_pairs(p.text1, p.text2, salt="other") != fit).any()


def test_split_sets_keeps_a_text_on_one_side_across_sets() -> None:
    a = cal.Pairs(["shared question", "a one"], ["a two", "a three"], [1, 0], [False] * 2)
    b = cal.Pairs(["b one", "Shared  question!"], ["b two", "b three"], [1, 1], [False] * 2)
    for salt in ("s1", "s2", "s3", "s4"):
        m = split.split_sets({"a": a, "b": b}, salt=salt)
        assert m["a"][0] == m["b"][1]


def test_fingerprint_round_trip_and_overlap() -> None:
    fp = split.fingerprint(["Hello there", "hello, there!", "Other"])
    h = split.parse_fingerprint(fp)
    assert h.size == 2 and (np.diff(h.astype(np.float64)) > 0).all()
    assert split.overlap(["HELLO THERE", "new one", "new one"], h) == (1, 2)
    with pytest.raises(ValueError):
        split.parse_fingerprint("AAAA")


class _Model:
    model_id = "fake"
    dim = 8

    def encode(self, texts):
        out = []
        for t in texts:
            seed = int.from_bytes(cal.normalise(t).encode()[:8].ljust(8, b"_"), "little")
            out.append(np.random.default_rng(seed).standard_normal(self.dim))
        a = np.array(out, dtype=np.float32)
        return a / np.linalg.norm(a, axis=1, keepdims=True)


def _verifier(fingerprint: str = "") -> ver.Verifier:
    n = ver.n_features(8)
    return ver.Verifier(8, "fake", np.zeros(n, np.float32), np.ones(n, np.float32),
                        np.zeros(n, np.float32), 0.0, min_score=0.6, floor=0.0,
                        fingerprint=fingerprint)


def test_calibrate_refuses_the_verifiers_own_training_texts() -> None:
    p = _pairs(60)
    own = _verifier(split.fingerprint(p.text1 + p.text2))
    with pytest.raises(tuning.TuningError, match="training data"):
        tuning.calibrate(p, _Model(), 0.05, verifier=own)
    with pytest.raises(tuning.TuningError, match="training data"):
        tuning.calibrate(p, _Model(), 0.05, verifier=own, train=True, folds=3)
    # overridden: it goes on, with a loud warning among the notes
    res = tuning.calibrate(p, _Model(), 0.05, verifier=own, allow_overlap=True)
    assert res.overlap[0] == res.overlap[1] > 0
    assert any(n.startswith("WARNING") and "NOT hold" in n for n in res.notes)
    # a verifier that never saw these texts is graded on them
    res = tuning.calibrate(p, _Model(), 0.05, verifier=_verifier(split.fingerprint(["x y"])))
    assert res.overlap == (0, res.overlap[1]) and res.fit_pairs + res.check_pairs == len(p)


def test_calibration_reports_the_check_part() -> None:
    p = _pairs(200)
    res = tuning.calibrate(p, _Model(), 0.05)                 # cosine + guard
    assert res.score == "cosine" and res.fit_pairs > res.check_pairs > 0
    assert res.chosen is not None and res.check is not None
    assert res.check.threshold == res.chosen.threshold
    assert res.check.positives + res.check.negatives == res.check_pairs
    entry = tuning.domain_entry(res, model="m")
    assert entry["wrong_hit_upper"] == round(res.check.wrong_upper, 5)


def test_pairs_of_one_text_twice_are_left_out_of_calibration() -> None:
    """The exact cache answers a repeat whatever the threshold: a same-text pair labelled
    0 (NFC-equal counts as the same) must not count as a wrong hit, nor one labelled 1
    as a hit."""
    base = _pairs(200)
    p = cal.Pairs(list(base.text1), list(base.text2), list(base.label), list(base.mined))
    for g in range(40):
        p.text1.append(f"Café {g} opens when?")
        p.text2.append(f"Cafe\u0301 {g} opens when?")   # the same text after NFC
        p.label.append(g % 2)
        p.mined.append(False)
    kept, same = cal.drop_same_text(p)
    assert same == 40 and len(kept) == len(base) and kept.label == base.label
    assert cal.drop_same_text(base) == (base, 0)
    res = tuning.calibrate(p, _Model(), 0.05)
    ref = tuning.calibrate(base, _Model(), 0.05)
    assert res.fit_pairs + res.check_pairs == ref.fit_pairs + ref.check_pairs
    assert res.chosen is not None and res.chosen.threshold == ref.chosen.threshold
    assert any("40 pairs of one text twice" in n for n in res.notes)
    twice = cal.Pairs(["same"] * 3, ["same"] * 3, [1, 1, 0], [False] * 3)
    with pytest.raises(tuning.TuningError, match="two different texts"):
        tuning.calibrate(twice, _Model(), 0.05)


def test_check_part_bound_warns_and_a_weaker_trained_verifier_is_refused() -> None:
    row = cal.SweepRow(0.5, 10, 20, 3, 30, 0.5, 0.1, 0.2)
    res = tuning.CalibrationResult("cosine", 50, 20, 30, 0, [row], row, check=row)
    assert "check part" in tuning.check_warning(res, 0.05)
    assert tuning.check_verdict(res, 0.05) is None and tuning.check_warning(res, 0.3) is None
    good = cal.SweepRow(0.5, 10, 20, 0, 300, 0.5, 0.0, 0.009)
    better = cal.SweepRow(0.7, 15, 20, 0, 300, 0.75, 0.0, 0.009)
    res = tuning.CalibrationResult("verifier", 50, 20, 30, 0, [good], good, check=good,
                                   trained=_verifier(), baseline_check=better)
    assert "too few pairs to beat" in tuning.check_verdict(res, 0.01)
    res.baseline_check = cal.SweepRow(0.7, 5, 20, 0, 300, 0.25, 0.0, 0.009)
    assert tuning.check_verdict(res, 0.01) is None
    res.chosen = None
    assert "no threshold keeps" in tuning.check_verdict(res, 0.01)


def test_calibration_splits_the_judge_part_of_the_dev_split_again() -> None:
    """calibrate's own split has another salt: one side of the dev split (all of whose
    groups fell on one side) still splits into a fit and a check part."""
    p = _pairs(300)
    judge = split.subset(p, ~split.split_pairs(p.text1, p.text2))
    again = split.split_pairs(judge.text1, judge.text2)
    assert not again.any()                       # the same salt: nothing to choose on
    res = tuning.calibrate(judge, _Model(), 0.05)
    assert res.fit_pairs > 0 and res.check_pairs > 0
