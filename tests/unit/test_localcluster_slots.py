"""The even split of the 16384 hash slots over the masters of a loopback cluster
(controlplane.redisdb.localcluster.slot_ranges), and how a persistent one is found again
in its folder (known_ports, covered_slots)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from controlplane import procs
from controlplane.redisdb.localcluster import SLOTS, covered_slots, known_ports, slot_ranges

# nodes.conf lines as Redis 7.0 writes them (three masters, one replica, a migration mark)
FORMED = """\
a1 127.0.0.1:7001@17001,, myself,master - 0 0 1 connected 0-5460 [5461->-b2]
b2 127.0.0.1:7002@17002,, master - 0 0 2 connected 5461-10922
c3 127.0.0.1:7003@17003,, master - 0 0 3 connected 10923-16383
d4 127.0.0.1:7004@17004,, slave a1 0 0 1 connected
vars currentEpoch 3 lastVoteEpoch 0
"""
FRESH = "a9 :0@0,, myself,master - 0 0 0 connected 476\nvars currentEpoch 0 lastVoteEpoch 0\n"


def test_slot_ranges_cover_every_slot_once() -> None:
    for masters in (1, 3, 5):
        ranges = slot_ranges(masters)
        covered = [s for lo, hi in ranges for s in range(lo, hi + 1)]
        assert covered == list(range(SLOTS))
        sizes = [hi - lo + 1 for lo, hi in ranges]
        assert max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError):
        slot_ranges(0)


def test_a_formed_cluster_is_found_again_on_its_ports(tmp_path: Path) -> None:
    assert known_ports(tmp_path, 2) is None                  # nothing there: form a new one
    for i, port in enumerate((7001, 7002)):
        d = tmp_path / f"node{i}"
        d.mkdir()
        (d / f"nodes-{port}.conf").write_text(FORMED)
        # a node that was started on another port later and never joined: not the cluster
        stray = d / f"nodes-{port + 100}.conf"
        stray.write_text(FRESH)
        os.utime(stray, (2e9, 2e9))
    assert covered_slots(tmp_path / "node0" / "nodes-7001.conf") == SLOTS
    assert covered_slots(tmp_path / "node0" / "nodes-7101.conf") == 1
    assert known_ports(tmp_path, 2) == [7001, 7002]


def test_a_folder_with_part_of_a_cluster_is_refused(tmp_path: Path) -> None:
    (tmp_path / "node0").mkdir()
    (tmp_path / "node0" / "nodes-7001.conf").write_text(FORMED)
    (tmp_path / "node1").mkdir()
    with pytest.raises(procs.StartError, match="only some of its 2 nodes"):
        known_ports(tmp_path, 2)
