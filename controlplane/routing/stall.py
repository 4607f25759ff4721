"""Proof of life from the edges: which nodes are **stalled** rather than busy.

A frozen or hung inference server (SIGSTOP, a hung engine behind a live HTTP server)
still accepts connections, so a health poll that connects and gets no answer looks like
a busy node. Busy needs evidence of progress. The edges see it: every chunk a node sends
is recorded (``lua/infergate/routing/stall.lua``), and an edge that has streams on a node
in the middle of their answer and got no byte from it for longer than the node's stall
threshold reports it ``stalled`` in its stats (``infergate:v1:edges``, node field
``stalled``, with ``silent_s``: seconds since its last byte there). One fresh edge
reporting it is enough: the poll of that node counts as failed and its status says
``stalled`` (:meth:`controlplane.routing.poller.NodeTracker.update`), whatever its health
endpoint answers. The edge itself stops sending it new requests at once; this makes the
control plane's view agree.
"""

from __future__ import annotations

from controlplane.routing.wire import fresh_edge_reports


def stalled_nodes(edges_raw: dict[str, str], now: float, max_age_s: float) -> dict[str, float]:
    """Nodes that at least one edge report at most ``max_age_s`` old calls stalled:
    name -> the longest silence (s) those edges report (0.0 when none says). Malformed
    reports are ignored."""
    out: dict[str, float] = {}
    for rep in fresh_edge_reports(edges_raw, now, max_age_s):
        for name, st in rep.nodes.items():
            if st.stalled:
                out[name] = max(out.get(name, 0.0), st.silent_s or 0.0)
    return out


def stalled_error(silent_s: float) -> str:
    """The poll error text of a stalled node."""
    if silent_s > 0:
        return (f"stalled: requests in flight at the edges and no byte from the node "
                f"for {silent_s:.1f} s")
    return "stalled: requests in flight at the edges and no byte from the node"
