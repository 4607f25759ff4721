"""One-time carry-over of state keys renamed for Redis Cluster hash tags.

:data:`controlplane.redisdb.keynames.RENAMED` maps each old name to its new one (the API
key id index and marker, the registry's seeded set and drain states). A Redis written by
an earlier version holds the old names; :func:`migrate_key_names` moves them to the new
ones so no configuration is lost on upgrade. The control plane runs it before it first
reads the registry, and the ``infergate`` commands before their first command.

Merging, not overwriting: a hash or set is merged into the new key (fields or members
already under the new name win: they were written by the new version), a string is
copied only when the new key is missing; then the old key is deleted. Every step is
idempotent, so an interrupted run (or two control planes at once) is completed by the
next one. Only commands on single keys are used (``TYPE``, ``HGETALL``, ``HSETNX``,
``SMEMBERS``, ``SADD``, ``GET``, ``SET NX``, ``DEL``), so it works on one Redis and on a
cluster alike (old and new names may hash to different slots).

Raises ``redis.RedisError`` when Redis fails; the caller tries again later.
"""

from __future__ import annotations

import logging
from typing import Any

from controlplane.redisdb import keynames

log = logging.getLogger("infergate.redisdb")


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _merge(r: Any, old: str, new: str) -> int:
    """Carry ``old`` into ``new`` (see the module docstring); returns the fields, members
    or strings written under ``new``."""
    kind = _s(r.type(old))
    written = 0
    if kind == "hash":
        for field, value in r.hgetall(old).items():
            written += int(r.hsetnx(new, field, value))
    elif kind == "set":
        members = list(r.smembers(old))
        if members:
            written += int(r.sadd(new, *members))
    elif kind == "string":
        value = r.get(old)
        if value is not None and r.set(new, value, nx=True):
            written += 1
    elif kind == "none":
        return 0
    else:
        log.error("redis key %s has type %s, not the expected one: left as it is", old, kind)
        return 0
    r.delete(old)
    return written


def migrate_key_names(r: Any, renamed: dict[str, str] | None = None) -> dict[str, int]:
    """Move every old key name that still exists to its new name. Returns ``{old name:
    fields/members/strings written}`` for the keys that were found (empty when nothing
    was left to do). ``r``: a ``redis.Redis`` or ``redis.RedisCluster``."""
    done: dict[str, int] = {}
    for old, new in (renamed if renamed is not None else keynames.RENAMED).items():
        if not r.exists(old):
            continue
        done[old] = _merge(r, old, new)
        log.warning("redis key %s carried over to %s (%d written; the old name is gone)",
                    old, new, done[old])
    return done
