"""Who runs on a work folder and on a shared node registry: the folder's ``up.lock`` and
the stack-owner key in Redis (which the running ``up`` refreshes)."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import IO

import click
import redis as redis_lib

from controlplane.redisdb import keynames

from .common import _say


#: Seconds without a refresh after which a claim is stale; ``up`` refreshes it every
#: :data:`OWNER_REFRESH_S` seconds, so a stack that died frees its registry this long later.
OWNER_TTL_S = 15
OWNER_REFRESH_S = 3.0
#: The key's own TTL, set anew at each refresh: its remaining TTL tells how long the owner
#: has not refreshed it, so a stale claim still names its owner (an ``up`` stopped with
#: SIGSTOP, whose stack serves on, keeps its registry).
OWNER_KEEP_S = 86400

#: SET the owner document (ARGV[1], TTL ARGV[2] s) when the key is missing or already
#: ours and return 1; else return {the current owner's document, the key's TTL}.
_OWNER_REFRESH_LUA = """
local cur = redis.call('GET', KEYS[1])
if cur == false or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', tonumber(ARGV[2]))
  return 1
end
return {cur, redis.call('TTL', KEYS[1])}
"""


_OWNER_REPLACE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[2], 'EX', tonumber(ARGV[3]))
  return 1
end
return 0
"""


def _owner_pid_here(raw: object) -> int | None:
    """The pid of the ``up`` named by the stack-owner value ``raw`` when it ran on this
    host (not this process); ``None`` otherwise (another host, no pid, unreadable)."""
    try:
        d = json.loads(raw)  # type: ignore[arg-type]
        pid = int(d["pid"])
        if d.get("host") != socket.gethostname() or pid <= 0 or pid == os.getpid():
            return None
    except (TypeError, ValueError, KeyError):
        return None
    return pid


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _runs_infergate(pid: int) -> bool:
    """Whether process ``pid`` exists and its command line names infergate (the
    ``infergate`` script, or ``python -m controlplane.cli``; unreadable: assumed so); a
    pid that the system gave to another program is not the owner."""
    if not _pid_exists(pid):
        return False
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return True
    return b"infergate" in cmd or b"controlplane.cli" in cmd


def _owner_idle_s(ttl: object) -> float:
    """Seconds since the owner last refreshed its claim, from the key's remaining TTL."""
    try:
        left = int(ttl)  # type: ignore[call-overload]
    except (TypeError, ValueError):
        return 0.0
    return float(OWNER_KEEP_S - left) if left >= 0 else 0.0


def _workdir_busy(wd: Path, f: IO[str]) -> click.ClickException:
    """The error for a work folder whose ``up.lock`` (open as ``f``) another ``up`` holds."""
    f.seek(0)
    other = f.read().strip() or "?"
    return click.ClickException(
        f"the work folder {wd} is in use by another infergate up (pid {other}): stop "
        "it, or give this one another --workdir")


def check_workdir_free(wd: Path) -> None:
    """Raise ``click.ClickException`` when another ``up`` holds ``wd/up.lock``; checked
    before the listen addresses, which that ``up``'s own processes may hold (their "in
    use" would send the operator to another --listen first). Takes no lock."""
    import fcntl

    try:
        f = open(wd / "up.lock")
    except OSError:
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _workdir_busy(wd, f) from None
        fcntl.flock(f, fcntl.LOCK_UN)


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
        err = _workdir_busy(wd, f)
        f.close()
        raise err from None
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
    ``keynames.STACK_OWNER``, value ``doc``, TTL :data:`OWNER_KEEP_S`, refreshed). The
    registry is free when nobody claims it, when its owner's ``up`` process is gone from
    this host, or when the claim is stale (not refreshed for :data:`OWNER_TTL_S` s) and
    its owner is not a process of this host that still exists: a frozen ``up`` (SIGSTOP)
    keeps its registry while its stack serves on. Raises ``click.ClickException`` naming
    the other stack when it is not free and ``take_over`` is false; with ``take_over``
    the key is overwritten. ``named_by``: what pointed this stack at that Redis
    (``--redis-url``, ``INFERGATE_REDIS_URL``, the file's ``redis.url``), named in the
    hint to leave it out."""
    if take_over:
        r.set(keynames.STACK_OWNER, doc, ex=OWNER_KEEP_S)
        return
    cur = r.eval(_OWNER_REFRESH_LUA, 1, keynames.STACK_OWNER, doc, OWNER_KEEP_S)
    if cur == 1:
        return
    raw, ttl = cur
    idle, pid = _owner_idle_s(ttl), _owner_pid_here(raw)
    stale = idle > OWNER_TTL_S
    # a stale claim is kept only by an up of this host that still runs (frozen)
    alive_here = pid is not None and (_runs_infergate(pid) if stale else _pid_exists(pid))
    if (pid is not None or stale) and not alive_here:
        # killed outright (its claim not yet stale), or stale and not running here
        if r.eval(_OWNER_REPLACE_LUA, 1, keynames.STACK_OWNER, raw, doc, OWNER_KEEP_S) == 1:
            why = "is gone" if pid is not None else f"has not renewed its claim for {idle:.0f} s"
            _say(f"the node registry's last owner, {_describe_owner(raw)}, {why}: taking it over")
            return
        cur = r.eval(_OWNER_REFRESH_LUA, 1, keynames.STACK_OWNER, doc, OWNER_KEEP_S)
        if cur == 1:
            return
        raw, alive_here = cur[0], False
    stopped = ""
    if alive_here and stale:
        stopped = (f" Its process still exists but has not renewed its claim for {idle:.0f} s "
                   f"(stopped? `kill -CONT {pid}` resumes it).")
    raise click.ClickException(
        f"the node registry in the Redis at {where} belongs to another running "
        f"infergate up: {_describe_owner(raw)}.{stopped} Stop it (its claim is free "
        f"{OWNER_TTL_S} s after it stops), pass --take-over to replace its registry "
        f"entries, or give this stack its own Redis: leave out {named_by}")


def refresh_owner(r: redis_lib.Redis, doc: str) -> str | None:
    """Renew the stack-owner key; ``None`` when it is ours (or was gone and is ours
    again), else the description of the stack that took it over. Raises
    ``redis.RedisError``."""
    cur = r.eval(_OWNER_REFRESH_LUA, 1, keynames.STACK_OWNER, doc, OWNER_KEEP_S)
    return None if cur == 1 else _describe_owner(cur[0])


def _release_owner(r: redis_lib.Redis, doc: str) -> None:
    """Delete the stack-owner key if it is still ours (a clean stop frees the registry
    at once); Redis errors are ignored (the key expires on its own)."""
    try:
        r.eval("if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end "
               "return 0", 1, keynames.STACK_OWNER, doc)
    except redis_lib.RedisError:
        pass
