"""The write log of a generation (``keynames.NODES_GEN_LOG``, ``keynames.APIKEYS_GEN_LOG``):
every write that INCRs a group's generation also pushes a random token on its log
(newest first, the last :data:`LEN` kept), in the same transaction.

A generation alone tells an older Redis only while it holds fewer writes than the copy
(:mod:`controlplane.routing.statecopy`): Redis back from a snapshot at generation 5,
whose copy was read at 8, reads as current again after three writes to the restarted
Redis (a ``keys import`` of three keys), and the copy's changes since the snapshot were
then lost without a word. The token the copy read last is in the log of every Redis that
holds the copy's state; gone from it (with fewer than :data:`LEN` writes since), Redis
went back, whatever its generation -- unless a control plane whose copy was at least
as new wrote it back since (its token ``p<copy generation>:...``)."""

from __future__ import annotations

import secrets

import redis

#: Tokens kept in a log.
LEN = 256


def push(pipe: redis.Redis | redis.client.Pipeline, gen_key: str, log_key: str,
         token: str | None = None) -> str:
    """Queue the INCR of ``gen_key`` and the push of a token (a new random one unless
    ``token``) on ``log_key``; returns the token."""
    token = token or secrets.token_hex(6)
    pipe.incr(gen_key)
    pipe.lpush(log_key, token)
    pipe.ltrim(log_key, 0, LEN - 1)
    return token


def put_back_token(copy_gen: int) -> str:
    """The token of a write-back of a copy read at generation ``copy_gen``."""
    return f"p{copy_gen}:{secrets.token_hex(4)}"


def _put_back_gen(token: str) -> int:
    if not token.startswith("p"):
        return -1
    try:
        return int(token[1:].split(":", 1)[0])
    except ValueError:
        return -1


def lost(log: list[str], token: str | None, gen: int, copy_gen: int) -> bool:
    """Whether Redis, whose log is ``log`` (newest first) at generation ``gen``, lacks
    the write of the copy's ``token`` (read at generation ``copy_gen``): not in the log,
    with fewer than :data:`LEN` writes since, and no write-back of a copy at least as
    new in the log. False without a token (a log written by none yet)."""
    if not token or token in log or gen - copy_gen >= LEN:
        return False
    return not any(_put_back_gen(t) >= copy_gen for t in log)
