"""Semantic-index vectors in a test Redis, written by the embedder's own
:class:`controlplane.embedder.index.VectorStore` (same keys, fields and TTL rule)."""

from __future__ import annotations

import redis

from controlplane.redisdb import keynames


def write_vectors(r: redis.Redis, exact_keys: list[str], model_slug: str = "all-minilm-l6-v2",
                  dim: int = 4, namespace: str = "ab" * 16) -> list[str]:
    """Index ``exact_keys`` (hex of existing cache entries) for ``model_slug``/``dim``;
    returns the vector hash keys written. ``r`` may decode responses or not."""
    import numpy as np

    from controlplane.embedder.index import IndexItem, VectorStore

    kw = r.connection_pool.connection_kwargs
    raw = redis.Redis(host=kw.get("host", "127.0.0.1"), port=kw.get("port", 6379),
                      db=kw.get("db", 0), password=kw.get("password"), socket_timeout=2,
                      decode_responses=False)
    store = VectorStore(raw, model_slug, dim)
    items = [IndexItem(key=k, namespace=namespace, text=f"question {k}", ttl_s=300)
             for k in exact_keys]
    vecs = np.full((len(items), dim), 1 / np.sqrt(dim), dtype=np.float32)
    applied = store.write(items, vecs)
    assert all(ms > 0 for ms in applied), applied
    raw.close()
    return [store.hash_key(k) for k in exact_keys]


def vector_keys(r: redis.Redis) -> set[str]:
    """Every vector hash key present (any model and dimension)."""
    out = set()
    for k in r.scan_iter(match=keynames.CACHE_VEC_PREFIX + "*", count=1000):
        out.add(k.decode() if isinstance(k, bytes) else k)
    return out
