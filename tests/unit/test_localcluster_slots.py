"""The even split of the 16384 hash slots over the masters of a loopback cluster
(controlplane.redisdb.localcluster.slot_ranges)."""

from __future__ import annotations

import pytest

from controlplane.redisdb.localcluster import SLOTS, slot_ranges


def test_slot_ranges_cover_every_slot_once() -> None:
    for masters in (1, 3, 5):
        ranges = slot_ranges(masters)
        covered = [s for lo, hi in ranges for s in range(lo, hi + 1)]
        assert covered == list(range(SLOTS))
        sizes = [hi - lo + 1 for lo, hi in ranges]
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        slot_ranges(0)
