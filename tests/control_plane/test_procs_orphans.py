"""What a dead nginx master left in its process group (its workers, asked to finish by
:meth:`Managed.release_group` when the supervisor restarts it) is killed when the part
is stopped for good, and nothing else is: by then the workers may have ended long ago
and the group's number may belong to another process (pid numbers wrap quickly under
``kernel.pid_max = 32768``; every part of every ``infergate up`` on the host leads a
process group of its own), which a Ctrl-C of this stack must not kill."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from controlplane import procs


def _stat(pid: int) -> tuple[int, int]:
    """(process group, start time in clock ticks since boot) of ``pid``."""
    rest = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(rest[2]), int(rest[19])


def _gone(p: subprocess.Popen) -> bool:
    return p.poll() is not None


def test_the_orphans_of_a_dead_leader_are_killed_at_the_stop(tmp_path: Path) -> None:
    # a leader that starts a worker in its group (it ignores SIGQUIT, as a busy worker
    # finishing a stream would go on) and dies
    script = ("import os, signal, subprocess, sys, time\n"
              "w = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
              "signal.signal(signal.SIGQUIT, signal.SIG_IGN); print(1, flush=True); "
              "time.sleep(60)'], stdout=subprocess.PIPE)\n"
              "w.stdout.readline()\n"
              "print(w.pid, flush=True)\n"
              "os._exit(0)\n")
    m = procs.Managed("leader", [sys.executable, "-c", script], tmp_path / "leader.log",
                      orphans_signal=signal.SIGQUIT).start()
    try:
        m.proc.wait(timeout=20)
        worker = int(m.log_path.read_text().split()[0])
        assert _stat(worker)[0] == m.proc.pid
        assert m.release_group()
        assert m.orphan_groups == [m.proc.pid]
        m.stop(grace=1.0)
        procs.wait_until(lambda: not Path(f"/proc/{worker}").exists()
                         or Path(f"/proc/{worker}/stat").read_text().split(")")[1].split()[0] == "Z",
                         5, what="the orphaned worker killed")
    finally:
        try:
            os.killpg(m.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_a_group_number_taken_over_by_another_process_is_left_alone(tmp_path: Path) -> None:
    # another stack's part: the leader of a process group of its own
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    try:
        pgid, started = _stat(other.pid)
        assert pgid == other.pid
        m = procs.Managed("nginx", ["true"], tmp_path / "nginx.log",
                          orphans_signal=signal.SIGQUIT).start()
        m.proc.wait(timeout=10)
        # as left by release_group for a master whose workers have finished since: the
        # group's number was this pid's, recorded with a process that has gone (another
        # start time), and now leads the other process's group
        m.orphan_groups.append(pgid)
        vars(m).setdefault("orphan_members", {})[pgid] = {other.pid: started - 100}
        m.stop(grace=1.0)
        time.sleep(0.2)
        assert not _gone(other), "stopping the part killed another process's group"
    finally:
        other.kill()
        other.wait()
