"""Disjoint parts of labelled pairs, by text, and the fingerprint of a verifier's
training texts.

Questions recur across pairs (a bank's "how do I raise my limit" appears in dozens of
pairs): a split by pair would put one text on both sides, so a threshold chosen on one
part would be graded on questions it has already seen. :func:`split_pairs` joins the texts
of every pair, whatever its label, by union-find over :func:`calibration.normalise` forms,
and sends each connected group as a whole to the *fit* part or the *check* part, by a
salted hash of the group (deterministic, independent of the order of the file). No
normalised text is on both sides.

:func:`fingerprint` stores a set of 64-bit hashes of the normalised texts a verifier was
trained on (``"fingerprint"`` in the verifier file, base64 of the sorted little-endian
uint64 values); :func:`overlap` says which share of an operator's texts it holds, so
``infergate cache calibrate`` can refuse to grade a verifier on its own training data.

Pure logic, numpy only.
"""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from controlplane.embedder import calibration as cal

SPLIT_SALT = "infergate-split-v1"
FIT_SHARE = 0.6
"""Share of the text groups (not of the pairs) that go to the fit part."""
FINGERPRINT_KEY = "normalise-blake2b64"


def text_hash(text: str) -> int:
    """64-bit hash (unsigned) of ``calibration.normalise(text)``."""
    d = hashlib.blake2b(cal.normalise(text).encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(d, "little")


def _unit(key: str, salt: str) -> float:
    d = hashlib.blake2b(f"{salt}\0{key}".encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(d, "little") / 2.0 ** 64


def split_pairs(text1: Sequence[str], text2: Sequence[str], fit_share: float = FIT_SHARE,
                salt: str = SPLIT_SALT) -> np.ndarray:
    """Per pair, True for the fit part and False for the check part: groups of texts
    connected by any pair (``calibration.groups`` over normalised texts, all labels) go
    whole to one part, the fit part when a salted hash of the group's smallest normalised
    text, as a number 0-1, is under ``fit_share``. Raises ``ValueError`` for a
    ``fit_share`` outside (0, 1) or texts of unequal counts."""
    if not 0.0 < fit_share < 1.0:
        raise ValueError("fit_share must be in (0, 1)")
    if len(text1) != len(text2):
        raise ValueError("text1 and text2 must have the same length")
    g = cal.groups(text1, text2, None)
    smallest: dict[int, str] = {}
    for t, gid in g.items():
        if gid not in smallest or t < smallest[gid]:
            smallest[gid] = t
    fit_group = {gid: _unit(t, salt) < fit_share for gid, t in smallest.items()}
    return np.array([fit_group[g[cal.normalise(a)]] for a in text1], dtype=bool)


def subset(pairs: cal.Pairs, mask: np.ndarray) -> cal.Pairs:
    """The pairs where ``mask`` is True (labels and mined flags kept)."""
    idx = np.flatnonzero(np.asarray(mask, dtype=bool))
    return cal.Pairs([pairs.text1[i] for i in idx], [pairs.text2[i] for i in idx],
                     [pairs.label[i] for i in idx], [pairs.mined[i] for i in idx])


def fingerprint(texts: Iterable[str]) -> str:
    """Base64 of the sorted, distinct 64-bit hashes (:func:`text_hash`) of ``texts``."""
    h = np.unique(np.array([text_hash(t) for t in texts], dtype=np.uint64))
    return base64.b64encode(h.astype("<u8").tobytes()).decode("ascii")


def parse_fingerprint(text: str) -> np.ndarray:
    """The sorted uint64 hashes of a :func:`fingerprint`. Raises ``ValueError`` when it is
    not base64 of a whole number of 8-byte values."""
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    if len(raw) % 8:
        raise ValueError("fingerprint: not a whole number of 8-byte hashes")
    return np.frombuffer(raw, dtype="<u8").astype(np.uint64)


def overlap(texts: Iterable[str], hashes: np.ndarray) -> tuple[int, int]:
    """``(known, distinct)``: how many of the distinct normalised ``texts`` have their
    hash in ``hashes`` (sorted uint64, :func:`parse_fingerprint`)."""
    mine = np.unique(np.array([text_hash(t) for t in texts], dtype=np.uint64))
    if mine.size == 0 or hashes.size == 0:
        return 0, int(mine.size)
    return int(np.isin(mine, hashes, assume_unique=True).sum()), int(mine.size)


def split_sets(sets: dict[str, cal.Pairs], fit_share: float = FIT_SHARE,
               salt: str = SPLIT_SALT) -> dict[str, np.ndarray]:
    """:func:`split_pairs` over several pair sets at once (a text that recurs in two sets
    is on one side in both): per set name, the fit mask of its pairs."""
    t1 = [t for p in sets.values() for t in p.text1]
    t2 = [t for p in sets.values() for t in p.text2]
    mask = split_pairs(t1, t2, fit_share, salt)
    out, at = {}, 0
    for name, p in sets.items():
        out[name] = mask[at:at + len(p)]
        at += len(p)
    return out
