"""Who runs on a work folder and on a shared node registry: the folder's ``up.lock`` and
the stack-owner key in Redis (a TTL the running ``up`` refreshes)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

import click
import redis as redis_lib

from controlplane.redisdb import keynames

from .common import _say


#: Seconds the stack-owner key lives without a refresh; ``up`` refreshes it every
#: :data:`OWNER_REFRESH_S` seconds, so a stack that died frees its registry this long later.
OWNER_TTL_S = 15
OWNER_REFRESH_S = 3.0

#: SET the owner document (ARGV[1], TTL ARGV[2] s) when the key is missing or already
#: ours; else return the current owner's document.
_OWNER_REFRESH_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur == false or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
  return 1
end
return cur
"""


_OWNER_REPLACE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', tonumber(ARGV[3]))
  return 1
end
return 0
"""


def _owner_gone(raw: object) -> bool:
    """Whether the stack-owner value ``raw`` names an ``up`` process of this host that no
    longer exists (killed with SIGKILL, its claim not yet expired). Any doubt (another
    host, no pid, a pid that exists, whoever runs it) is "not gone"."""
    try:
        d = json.loads(raw)  # type: ignore[arg-type]
        pid = int(d["pid"])
        if d.get("host") != socket.gethostname() or pid <= 0 or pid == os.getpid():
            return False
    except (TypeError, ValueError, KeyError):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def _lock_workdir(wd: Path) -> object:
    """Hold ``wd/up.lock`` (an exclusive ``flock``, released when this process ends, also
    when it is killed) so that a second ``up`` on the same folder stops before it touches
    the Redis files of the first (its password, its append-only file). Returns the open
    file, to keep while ``up`` runs. Raises ``click.ClickException`` when another ``up``
    holds it."""
    import fcntl

    f = open(wd / "up.lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        other = f.read().strip() or "?"
        f.close()
        raise click.ClickException(
            f"the work folder {wd} is in use by another infergate up (pid {other}): stop "
            "it, or give this one another --workdir") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    return f


def _owner_doc(instance: str) -> str:
    """The stack-owner value: JSON ``{"instance_id", "pid", "host", "since"}``."""
    return json.dumps({"instance_id": instance, "pid": os.getpid(),
                       "host": socket.gethostname(), "since": round(time.time(), 3)})


def _describe_owner(raw: object) -> str:
    try:
        d = json.loads(raw)  # type: ignore[arg-type]
        return f"instance {d['instance_id']} (pid {d.get('pid')} on {d.get('host')})"
    except (TypeError, ValueError, KeyError):
        return f"owner {raw!r}"


def claim_registry(r: redis_lib.Redis, doc: str, take_over: bool, where: str,
                   named_by: str = "--redis-url") -> None:
    """Make this stack the owner of the registry in ``r`` (key
    ``keynames.STACK_OWNER``, value ``doc``, TTL :data:`OWNER_TTL_S`). Raises
    ``click.ClickException`` naming the other stack when a live one owns it and
    ``take_over`` is false; with ``take_over`` the key is overwritten. ``named_by``: what
    pointed this stack at that Redis (``--redis-url``, ``INFERGATE_REDIS_URL``, the
    file's ``redis.url``), named in the hint to leave it out."""
    if take_over:
        r.set(keynames.STACK_OWNER, doc, ex=OWNER_TTL_S)
        return
    cur = r.eval(_OWNER_REFRESH_LUA, 1, keynames.STACK_OWNER, doc, OWNER_TTL_S)
    if cur != 1 and _owner_gone(cur):
        # an up of this host that was killed outright: its claim has not expired yet
        if r.eval(_OWNER_REPLACE_LUA, 1, keynames.STACK_OWNER, cur, doc, OWNER_TTL_S) == 1:
            _say(f"the node registry's last owner, {_describe_owner(cur)}, is gone: "
                 "taking it over")
            return
        cur = r.eval(_OWNER_REFRESH_LUA, 1, keynames.STACK_OWNER, doc, OWNER_TTL_S)
    if cur != 1:
        raise click.ClickException(
            f"the node registry in the Redis at {where} belongs to another running "
            f"infergate up: {_describe_owner(cur)}. Stop it (its claim expires {OWNER_TTL_S} s "
            f"after it stops), give this stack its own Redis (leave out {named_by}), or pass "
            "--take-over to replace its registry entries")


def refresh_owner(r: redis_lib.Redis, doc: str) -> str | None:
    """Renew the stack-owner key; ``None`` when it is ours (or was gone and is ours
    again), else the description of the stack that took it over. Raises
    ``redis.RedisError``."""
    cur = r.eval(_OWNER_REFRESH_LUA, 1, keynames.STACK_OWNER, doc, OWNER_TTL_S)
    return None if cur == 1 else _describe_owner(cur)


def _release_owner(r: redis_lib.Redis, doc: str) -> None:
    """Delete the stack-owner key if it is still ours (a clean stop frees the registry
    at once); Redis errors are ignored (the key expires on its own)."""
    try:
        r.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
               "return 0", 1, keynames.STACK_OWNER, doc)
    except redis_lib.RedisError:
        pass
