"""On-disk cache of the dev sets' embeddings for the cache-quality benchmarks.

The embeddings of a text do not change between runs of one model, and embedding the
~21 000 texts of the dev sets takes 20-60 s of a shared CPU. :func:`embed` keeps the
vectors of every text it has embedded in ``<dir>/<model slug>.npz`` (keys: ``hashes``,
the 64-bit blake2b of each text as uint64, and ``vecs``, float32 (n, dim)) and embeds
only the texts it has not seen. ``<dir>`` is ``$INFERGATE_BENCH_CACHE`` or
``~/.cache/infergate/bench-embeddings``; ``INFERGATE_BENCH_CACHE=off`` embeds everything
afresh. A file that does not load is ignored and rewritten.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import numpy as np

from controlplane.embedder.models import slug


def cache_dir() -> Path | None:
    """The cache folder, or None when ``INFERGATE_BENCH_CACHE`` is ``off``."""
    env = os.environ.get("INFERGATE_BENCH_CACHE", "")
    if env.lower() == "off":
        return None
    return Path(env) if env else Path.home() / ".cache" / "infergate" / "bench-embeddings"


def _hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(),
                          "little")


def embed(model, texts: list[str], batch: int = 64, use_cache: bool = True,
          ) -> np.ndarray:
    """(len(texts), dim) float32 vectors of ``texts`` by ``model.encode``, read from the
    cache where it holds them; the new ones are added to the cache file."""
    d = cache_dir() if use_cache else None
    path = None if d is None else d / f"{slug(model.model_id)}.npz"
    known: dict[int, np.ndarray] = {}
    if path is not None and path.is_file():
        try:
            with np.load(path) as z:
                hashes, vecs = z["hashes"], z["vecs"]
            if vecs.ndim == 2 and vecs.shape[1] == model.dim and len(hashes) == len(vecs):
                known = dict(zip(hashes.tolist(), vecs))
        except (OSError, ValueError, KeyError) as exc:
            print(f"note: embedding cache {path} not read ({exc})", file=sys.stderr)
    keys = [_hash(t) for t in texts]
    todo = sorted({t for t, k in zip(texts, keys) if k not in known})
    if todo:
        new = np.vstack([model.encode(todo[i:i + batch]) for i in range(0, len(todo), batch)])
        for t, v in zip(todo, new.astype(np.float32)):
            known[_hash(t)] = v
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp.npz")
            np.savez(tmp, hashes=np.array(list(known), dtype=np.uint64),
                     vecs=np.vstack(list(known.values())).astype(np.float32))
            os.replace(tmp, path)
    if not texts:
        return np.zeros((0, model.dim), np.float32)
    return np.vstack([known[k] for k in keys]).astype(np.float32)
