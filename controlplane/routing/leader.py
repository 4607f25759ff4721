"""Leader election among control planes sharing one Redis.

The leader holds ``keynames.LEADER`` (value: its id, ``hostname:pid:random``).

- Taking it: ``SET <leader> <id> NX PX <ttl_ms>`` -- succeeds only when no
  one holds it (never held, released, or the holder stopped renewing and the key
  expired after ``controlplane.leader_ttl_s``) -- and, in the same script, ``INCR`` of
  the fencing counter ``keynames.LEADER_FENCE``: the new value is this leadership's
  fencing token (:attr:`LeaderElector.fence`). The snapshot is written only by a script
  that finds both the holder and the counter unchanged
  (``controlplane.routing.service.SNAPSHOT_IF_LEADER_LUA``), so a control plane whose
  leadership ended -- its lease expired, or was lost with a Redis Cluster master that
  failed over before replicating it -- never overwrites its successor's snapshot, even
  when it takes the lease again under the same id. The three keys share one hash slot.
- Keeping it: every cycle the holder runs a compare-and-extend script (``EVAL``): the
  TTL is reset only if the key still holds *its* id, so a holder that was too slow and
  lost the key never extends someone else's lease.
- Giving it up (SIGTERM/SIGINT): a compare-and-delete script removes the key only if it
  is still ours, so the standby takes over at its next cycle instead of a TTL later.

All methods raise ``redis.exceptions.RedisError`` while Redis is unreachable; the
caller keeps its last belief (its writes fail anyway) and asks again next cycle.
"""

from __future__ import annotations

import os
import secrets
import socket

import redis

from controlplane.redisdb import keynames

#: KEYS[1] = leader key, ARGV[1] = our id, ARGV[2] = ttl ms. Returns 1 if extended.
RENEW_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""

#: KEYS[1] = leader key, KEYS[2] = fencing counter, ARGV[1] = our id, ARGV[2] = ttl ms.
#: Takes the lock if free and returns the new fencing token, else 0.
ACQUIRE_LUA = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return redis.call('INCR', KEYS[2])
end
return 0
"""

#: KEYS[1] = leader key, ARGV[1] = our id. Returns 1 if deleted.
RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def make_id() -> str:
    """``hostname:pid:random`` (6 hex digits), unique per process start."""
    return f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"


class LeaderElector:
    """One control plane's view of the leader lock."""

    def __init__(self, r: redis.Redis, ident: str, ttl_s: float, key: str = keynames.LEADER,
                 fence_key: str = keynames.LEADER_FENCE):
        self.r = r
        self.id = ident
        self.key = key
        self.fence_key = fence_key
        self.ttl_ms = max(int(ttl_s * 1000), 1)
        self.is_leader = False
        #: The fencing token of the current (or last) leadership, 0 before the first.
        self.fence = 0

    def tick(self) -> tuple[bool, bool]:
        """Renew (if ours) or try to take the lock. Returns ``(is_leader, gained)``
        where ``gained`` is True when this call took the lock with ``SET NX`` (a
        renewal is not a gain). Raises RedisError."""
        if int(self.r.eval(RENEW_LUA, 1, self.key, self.id, self.ttl_ms)):
            self.is_leader = True
            return True, False
        # Not (or no longer) ours: whoever held it may have written in between, so
        # taking it now is a new leadership even if we believed we held it.
        token = int(self.r.eval(ACQUIRE_LUA, 2, self.key, self.fence_key, self.id, self.ttl_ms))
        self.is_leader = token > 0
        if self.is_leader:
            self.fence = token
        return self.is_leader, self.is_leader

    def holder(self) -> str | None:
        """Id of the current holder, ``None`` when nobody holds it. Raises RedisError."""
        return self.r.get(self.key)

    def release(self) -> bool:
        """Delete the lock if it is still ours. True if deleted. Raises RedisError."""
        self.is_leader = False
        return bool(int(self.r.eval(RELEASE_LUA, 1, self.key, self.id)))
