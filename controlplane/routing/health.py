"""Node health with hysteresis, so one lost poll does not flap a node out of the pool.

- A node starts healthy.
- K = ``controlplane.unhealthy_after`` consecutive failed polls -> unhealthy.
- M = ``controlplane.healthy_after`` consecutive good polls -> healthy again.
- Values below 1 are read as 1.

What counts as a failed poll is decided by the poller (:mod:`controlplane.routing.poller`):
connect error or timeout, a non-2xx health answer, or, for nodes with a metrics
endpoint, a metrics body that cannot be parsed. A 5xx (or other non-2xx) ``/metrics``
while ``/health`` answers 2xx is a *good* poll without metrics: the server is up and
serving, only its metrics exporter failed, so the node stays routable (score
``null``) instead of being taken out of the pool.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HealthTracker:
    """Consecutive-count hysteresis for one node. Pure state, no I/O."""

    unhealthy_after: int = 3
    healthy_after: int = 2
    healthy: bool = True
    consecutive_failures: int = 0
    consecutive_successes: int = 0

    def observe(self, ok: bool) -> bool:
        """Record one poll (``ok`` = good poll). Returns True when ``healthy`` changed."""
        if ok:
            self.consecutive_successes += 1
            self.consecutive_failures = 0
            if not self.healthy and self.consecutive_successes >= max(self.healthy_after, 1):
                self.healthy = True
                return True
        else:
            self.consecutive_failures += 1
            self.consecutive_successes = 0
            if self.healthy and self.consecutive_failures >= max(self.unhealthy_after, 1):
                self.healthy = False
                return True
        return False
