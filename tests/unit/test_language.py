"""The language rule of the semantic cache (``controlplane.embedder.language`` and its use
in ``decision.choose``, the policy, the configuration and calibration): pure logic with
the real language model and fake vectors."""

from __future__ import annotations

import numpy as np
import pytest

from controlplane.config import ConfigError, settings_from_dict
from controlplane.embedder import calibration as cal
from controlplane.embedder import decision, language, tuning
from controlplane.embedder import verifier as ver
from controlplane.embedder.index import Candidate
from controlplane.embedder.policy import ThresholdPolicy

DIM = 8


@pytest.mark.parametrize("text,lang", [
    ("How do I reset my password?", "en"),
    ("How do i get traffic for website?", "en"),
    ("Can we turn back time?", "en"),
    ("怎么重置密码？", "zh"),
    ("How do I say 你好 in English?", "zh"),         # Han: the guard's Chinese rules apply
    ("パスワードをリセットするには？", "ja"),
    ("支払わなかったらどうなりますか", "ja"),          # kanji with kana
    ("비밀번호를 어떻게 재설정하나요?", "ko"),
    ("Was passiert, wenn ich die Rechnung nicht bezahle?", "de"),
    ("Comment convertir des miles en kilomètres ?", "fr"),
    ("¿Cómo puedo restablecer mi contraseña?", "es"),
    ("O que acontece se eu não pagar a multa?", "pt"),
    ("Что будет, если я не оплачу штраф?", "ru"),
    ("12 * 7 = ?", language.UNDETERMINED),
    # short queries the model cannot tell: read as English
    ("Pricing?", "en"), ("Refund policy?", "en"), ("Best pasta recipe", "en"),
    # longer, unsure (fr 0.19, es 0.18, en 0.16), with a word only English has
    ("Convert 100 euros to US dollars", "en"),
    # unsure and ASCII, but without such a word; or sure of another language
    ("Comment convertir 100 euros en dollars", "fr"),
    ("Quanto custa o bilhete de comboio para Lisboa", "pt"),
    # unsure among Slavic languages, English nowhere: not English for its "to"
    ("To je dobra otazka pro nasi podporu", "sl"),
    # a short one it can tell, or with letters outside ASCII
    ("Wie spät ist es?", "de"), ("Politique de remboursement", "fr"),
    ("👍", language.UNDETERMINED),
])
def test_detect(text: str, lang: str) -> None:
    assert language.detect(text) == lang


def test_allowed_and_codes() -> None:
    assert language.allowed("en", language.GUARDED)
    assert not language.allowed("de", language.GUARDED)
    assert language.allowed("de", ("*",)) and language.allowed(language.UNDETERMINED, ("*",))
    assert language.valid_code("*") and language.valid_code("de")
    assert not language.valid_code("xx") and not language.valid_code("EN")


def _unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x)).astype(np.float32)


def _choose(query: str, cached: str, p: float = 0.99, cos: float = 0.98, **kw):
    """The decision on one candidate with cosine ``cos``, a verifier giving ``p``."""
    rng = np.random.default_rng(1)
    u = _unit(rng.standard_normal(DIM))
    o = rng.standard_normal(DIM)
    o = _unit(o - (o @ u) * u)
    w = _unit(cos * u + np.sqrt(1 - cos * cos) * o)
    n = ver.n_features(DIM)
    v = ver.Verifier(DIM, "fake", np.zeros(n, np.float32), np.ones(n, np.float32),
                     np.zeros(n, np.float32), float(np.log(p / (1 - p))), min_score=0.9,
                     floor=0.5)
    return decision.choose(query, u, [Candidate("e1", float(u @ w), cached, w)], 0.5, 0.9,
                           kw.pop("use_guard", True), v, **kw)


def test_other_languages_get_no_semantic_hit_by_default() -> None:
    """A negation the guard cannot read ("nicht", "не") would be served at the verifier's
    word: the rule refuses the language, whatever the score."""
    for q, c in (("Was passiert, wenn ich die Rechnung nicht bezahle?",
                  "Was passiert, wenn ich die Rechnung bezahle?"),
                 ("Что будет, если я не оплачу штраф?", "Что будет, если я оплачу штраф?"),
                 ("払わなかったらどうなりますか", "払ったらどうなりますか")):
        hit, verdict, _ = _choose(q, c)
        assert hit is None and verdict == "reject:language", q
        # listed by the operator: the guard and the verifier decide again
        hit, verdict, _ = _choose(q, c, languages=("*",))
        assert hit is not None and verdict.startswith("pass"), q
        hit, verdict, _ = _choose(q, c, languages=None)
        assert hit is not None, q
    # the guard off (an API caller's choice): the cosine alone, no language rule
    hit, _, _ = _choose("Wie spät ist es?", "Wie viel Uhr ist es?", use_guard=False)
    assert hit is not None


def test_the_same_question_up_to_case_and_punctuation_still_hits() -> None:
    hit, verdict, score = _choose("wie spät ist es", "Wie spät ist es?", p=0.1)
    assert hit is not None and verdict == "pass" and score == 1.0


def test_a_candidate_in_another_language_is_rejected() -> None:
    hit, verdict, _ = _choose("How do I reset my password?", "如何重设密码？")
    assert hit is None and verdict == "reject:language"
    hit, verdict, _ = _choose("How do I reset my password?", "¿Cómo restablezco mi contraseña?",
                              languages=("*",))
    assert hit is None and verdict == "reject:language"
    hit, verdict, _ = _choose("How can I reset my password?", "How do I reset my password?")
    assert hit is not None and verdict == "pass"


def test_configuration_and_policy() -> None:
    s = settings_from_dict({"cache": {"semantic_languages": ["EN", "zh", " de "],
                                      "semantic_domains": [
                                          {"model": "bank", "min_similarity": 0.5,
                                           "languages": ["fr"]}]}})
    assert s.cache.semantic_languages == ["en", "zh", "de"]
    pol = ThresholdPolicy.from_cache_settings(s.cache)
    assert pol.languages_for("00" * 32) == ("en", "zh", "de")
    assert pol.languages_for("00" * 32, None, "bank") == ("fr",)
    assert ThresholdPolicy().languages_for("00" * 32) == language.GUARDED
    assert settings_from_dict({}).cache.semantic_languages == list(language.GUARDED)
    with pytest.raises(ConfigError, match="unknown language 'german'"):
        settings_from_dict({"cache": {"semantic_languages": ["german"]}})
    with pytest.raises(ConfigError, match="unknown language 'xx'"):
        settings_from_dict({"cache": {"semantic_domains": [
            {"model": "m", "min_similarity": 0.5, "languages": ["xx"]}]}})


def _german_pairs(n: int) -> cal.Pairs:
    words = ["Rechnung", "Vertrag", "Konto", "Karte", "Passwort", "Adresse", "Termin",
             "Bestellung", "Lieferung", "Rückgabe"]
    t1, t2, y = [], [], []
    for i in range(n):
        w, v = words[i % len(words)], words[(i + 3) % len(words)]
        t1.append(f"Wie ändere ich meine {w} Nummer {i}?")
        t2.append(f"Wie kann ich meine {w} Nummer {i} ändern?" if i % 2 else
                  f"Wie ändere ich meine {v} Nummer {i + 1000}?")
        y.append(i % 2)
    return cal.Pairs(t1, t2, y, [False] * n)


def test_pair_languages_and_the_domain_entry() -> None:
    p = _german_pairs(40)
    assert tuning.pair_languages(p) == ("de",)
    mixed = cal.Pairs(p.text1 + ["Wie geht es dir heute?"], p.text2 + ["How are you today?"],
                      p.label + [1], p.mined + [False])
    assert tuning.pair_languages(mixed) == ("de",)       # one English text is noise
    row = cal.SweepRow(0.9, 5, 10, 0, 10, 0.5, 0.0, 0.1)
    res = tuning.CalibrationResult("cosine", 40, 20, 20, 0, [row], row, check=row,
                                   languages=("de",))
    assert tuning.domain_entry(res, model="m")["languages"] == ["de", "en", "zh"]
    # the configuration's own list is kept; "*" needs nothing more
    assert tuning.domain_entry(res, model="m", languages=["en", "fr"])["languages"] == \
        ["de", "en", "fr"]
    assert "languages" not in tuning.domain_entry(res, model="m", languages=["*"])
    assert "languages" not in tuning.domain_entry(res, model="m", languages=["de"])
    res.languages = ("en",)
    assert "languages" not in tuning.domain_entry(res, model="m")
