"""Messages of the vector channel ``keynames.CACHE_VEC_CHANNEL``, which keeps the
in-process indexes of every embedder process in step (``controlplane.embedder.index``).

A message is a vector hash key (``keynames.cache_vec(...)``):

- ``<hash key>``: a vector was stored (the embedder that wrote it announces it);
- ``-<hash key>`` (:data:`GONE`): a vector was deleted (a purge, a dropped entry:
  ``controlplane.cache.store``). A reader checks that the hash is really gone before it
  drops its row (the entry may have been stored and indexed again since).

Sent with ``SPUBLISH`` (sharded pub/sub, Redis 7.0) on a Redis Cluster pipeline,
``PUBLISH`` otherwise. No numpy here: the control plane's purge uses it too.
"""

from __future__ import annotations

from typing import Any

import redis

from controlplane.redisdb import keynames

#: Prefix of a deletion message (a hash key starts with ``infergate:``, never with it).
GONE = "-"


def _publish(pipe: Any, message: str) -> None:
    if isinstance(pipe, (redis.cluster.ClusterPipeline, redis.RedisCluster)):
        pipe.spublish(keynames.CACHE_VEC_CHANNEL, message)
    else:
        pipe.publish(keynames.CACHE_VEC_CHANNEL, message)


def publish_added(pipe: Any, hash_key: str) -> None:
    """Queue the announcement of a stored vector on ``pipe`` (a pipeline or a client)."""
    _publish(pipe, hash_key)


def publish_gone(pipe: Any, hash_key: str) -> None:
    """Queue the announcement of a deleted vector on ``pipe`` (a pipeline or a client)."""
    _publish(pipe, GONE + hash_key)


def parse(data: bytes | str) -> tuple[bool, str]:
    """``(gone, hash key)`` of a message's data."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
    if text.startswith(GONE):
        return True, text[len(GONE):]
    return False, text
