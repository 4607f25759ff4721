"""``python -m bench.cluster.failover [--node-timeouts MS,MS] [--repeats N] [--rate N]``

The master-kill drill of :mod:`bench.cluster` (``--parts kill``: the master of the
routing/API-key slots SIGKILLed under load, two control planes cycling every 0.2 s with
a 2 s leader TTL) run ``--repeats`` times for each ``cluster-node-timeout`` in
``--node-timeouts``, each on a new loopback cluster and stack (one ``bench.cluster``
process per drill). Per drill: the phases after the kill (PFAIL, FAIL, replica
promoted, every node ok, first routing snapshot written), the control plane's part
(first snapshot after the recovery), failed requests and 401s. Writes
``redis_cluster_failover.json``; the table goes to docs/performance.md
(``python -m bench.report``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import click

from bench.common import RESULTS_DIR, format_table, log, machine_info, write_json

COLUMNS = [("node_timeout_ms", "node timeout ms"), ("pfail", "PFAIL s"), ("fail", "FAIL s"),
           ("promoted", "promoted s"), ("recovered", "cluster ok s"),
           ("snapshot", "first snapshot s"), ("cp_part", "control plane s"),
           ("requests", "requests"), ("failed", "failed"), ("status_401", "401")]


def drill(node_timeout_ms: int, rate: float) -> dict[str, Any]:
    """One master-kill drill in its own ``bench.cluster`` process; its row."""
    with tempfile.TemporaryDirectory(prefix="infergate-bench-failover-") as tmp:
        subprocess.run([sys.executable, "-m", "bench.cluster", "--parts", "kill",
                        "--node-timeout-ms", str(node_timeout_ms), "--rate", str(rate),
                        "--out", tmp, "--name", "kill"], check=True, timeout=600,
                       stdout=subprocess.DEVNULL)
        mk = json.loads((Path(tmp) / "kill.json").read_text())["master_kill"]
    ph = mk.get("phases_s") or {}
    return {"node_timeout_ms": node_timeout_ms, **{k: ph.get(k) for k in
                                                  ("pfail", "fail", "promoted", "recovered")},
            "snapshot": mk["snapshot_gap_s"], "cp_part": mk["takeover_after_recovery_s"],
            "requests": mk["requests"], "failed": mk["failed"], "status_401": mk["status_401"],
            "leaders_after": mk["leaders_after"], "fence": mk["fence"]}


def print_report(data: dict[str, Any]) -> None:
    print(format_table(data["drills"], COLUMNS))
    print(f"master-kill drills under {data['rate']:g} req/s, seconds after the SIGKILL; "
          "control plane = first snapshot after every node was ok again")


@click.command()
@click.option("--node-timeouts", default="500,1000", show_default=True,
              help="Comma-separated cluster-node-timeout values (ms).")
@click.option("--repeats", default=3, show_default=True)
@click.option("--rate", default=200.0, show_default=True)
@click.option("--out", "out_dir", default=str(RESULTS_DIR), show_default=True)
def main(node_timeouts: str, repeats: int, rate: float, out_dir: str) -> None:
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    rows = []
    for _ in range(repeats):  # interleaved: each round runs every timeout once
        for nt in (int(x) for x in node_timeouts.split(",")):
            log(f"master kill, cluster-node-timeout {nt} ms")
            rows.append(drill(nt, rate))
    rows.sort(key=lambda r: r["node_timeout_ms"])
    data = {"meta": {"command": "python -m bench.cluster.failover", "started": started,
                     "machine": machine_info()}, "rate": rate, "drills": rows}
    path = write_json(Path(out_dir) / "redis_cluster_failover.json", data)
    print_report(data)
    log(f"wrote {path}")


if __name__ == "__main__":
    main()
