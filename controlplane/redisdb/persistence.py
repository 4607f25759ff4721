"""Whether a Redis keeps its data across a restart: checked at start by ``infergate up``
(for a Redis named on purpose) and by the control plane (once it first reaches Redis).

The state (API keys, the node registry with the nodes added at run time and their
weights, drain states) lives in Redis alone; a Redis that writes nothing to disk loses it
at its next restart (the control plane writes back what it last read, if it ran through
the restart: :mod:`controlplane.routing.statecopy`). ``CONFIG GET appendonly`` and
``CONFIG GET save`` tell:

- ``appendonly yes``: durable (``appendfsync everysec``: about a second of writes at risk);
- ``appendonly no`` with a ``save`` rule: RDB snapshots only, the changes since the last
  one are lost on a crash;
- ``appendonly no`` and ``save ""``: nothing kept.

``CONFIG`` may be refused (an ACL user without ``+config``, a managed Redis that renames
or disables it): then the check could not be made, which is said, never an error. On a
Redis Cluster every master is asked (the least durable one counts).
"""

from __future__ import annotations

from dataclasses import dataclass

import redis

from controlplane.redisdb.url import redact

#: Where the Redis settings infergate needs are explained.
DOC = 'docs/operations.md "Durable state in Redis"'


@dataclass
class Persistence:
    """What :func:`check_persistence` found. ``level``: ``"aof"`` (append-only file),
    ``"rdb"`` (snapshots only: ``save`` holds the rules), ``"none"`` (nothing kept), or
    ``"unknown"`` (``error`` says why it could not be checked)."""

    level: str
    save: str = ""
    error: str = ""

    def warning(self, where: str) -> str | None:
        """One line for the operator (``where``: the Redis URL, its password hidden
        here), or None when the Redis keeps an append-only file."""
        shown = redact(where)
        if self.level == "none":
            return (f"warning: the Redis at {shown} keeps nothing across a restart "
                    '(appendonly no, save ""): its restart loses the run-time configuration '
                    "(API keys, nodes added at run time, weights, drains) unless a running "
                    "control plane writes back the copy it read; set appendonly yes "
                    f"({DOC})")
        if self.level == "rdb":
            return (f"warning: the Redis at {shown} keeps only snapshots (save "
                    f"{self.save!r}, appendonly no): a crash loses the run-time "
                    "configuration changed since the last one (API keys, nodes, weights, "
                    f"drains); set appendonly yes ({DOC})")
        if self.level == "unknown":
            return (f"note: could not check whether the Redis at {shown} keeps its data "
                    f"across a restart ({self.error}); make sure it runs with appendonly "
                    f"yes ({DOC})")
        return None


def _text(v: object) -> str:
    return v.decode("utf-8", "replace") if isinstance(v, bytes) else str(v)


def _one(raw: dict) -> Persistence:
    conf = {_text(k): _text(v) for k, v in raw.items()}
    appendonly = str(conf.get("appendonly", "")).lower()
    save = str(conf.get("save", "")).strip()
    if appendonly == "yes":
        return Persistence("aof", save)
    if appendonly not in ("no", ""):
        return Persistence("unknown", save, f"appendonly is {appendonly!r}")
    if "appendonly" not in conf:
        return Persistence("unknown", save, "CONFIG GET appendonly answered nothing")
    return Persistence("rdb", save) if save else Persistence("none")


_RANK = {"none": 0, "unknown": 1, "rdb": 2, "aof": 3}


def check_persistence(r: redis.Redis) -> Persistence:
    """``CONFIG GET appendonly`` and ``save`` on ``r`` (every master of a
    ``redis.RedisCluster``). Never raises for a refusal: a ``redis.ResponseError`` (no
    permission, unknown command) gives ``level="unknown"``. Raises other
    ``redis.RedisError`` (Redis unreachable)."""
    try:
        if isinstance(r, redis.RedisCluster):
            found: dict[str, dict] = {}
            for name in ("appendonly", "save"):
                res = r.config_get(name, target_nodes=redis.RedisCluster.PRIMARIES)
                if not any(isinstance(v, dict) for v in res.values()):
                    res = {"_": res}
                for node, conf in res.items():
                    found.setdefault(node, {}).update(conf)
            return min((_one(c) for c in found.values()), key=lambda p: _RANK[p.level],
                       default=Persistence("unknown", error="no master answered"))
        conf = dict(r.config_get("appendonly"))
        conf.update(r.config_get("save"))
        return _one(conf)
    except redis.ResponseError as exc:
        return Persistence("unknown", error=f"CONFIG GET refused: {exc}")
