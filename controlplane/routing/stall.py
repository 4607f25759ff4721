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

The node's own counters are the second evidence (:class:`CounterWatch`): a node whose
metrics answer, say requests are running (``running`` > 0) and show no token counter
(generated or prompt tokens, vLLM / TGI / SGLang / llama.cpp; llama.cpp's decode calls,
``llamacpp:n_decode_total``, since it counts a request's tokens only when it ends, so a
generation longer than the window would look stalled), no finished-request count
advancing for ``controlplane.stall_counters_s`` is stalled as well (an engine hung
behind a live HTTP server, whatever the edges can see of non-streamed answers).
"""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.routing.nodemetrics.model import Window
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


@dataclass
class CounterWatch:
    """How long a node's own counters have stood still while it runs requests."""

    quiet_since: float | None = None
    """Epoch s of the first reading of the current quiet spell (``None``: none)."""

    def observe(self, w: Window | None, running: float | None, now: float) -> float | None:
        """One reading (its window ``w`` against the previous one, ``running``: requests
        running on the node; ``w`` ``None`` when the metrics did not answer). Returns the
        seconds the node has run requests with no token counter and no finished count
        advancing, ``None`` while it progresses, runs nothing or says nothing (no
        metrics, no earlier reading, no counters). A poll without metrics neither ends
        nor starts a quiet spell."""
        if w is None:
            return None if self.quiet_since is None else now - self.quiet_since
        deltas = [d for d in (w.generation_tokens_delta, w.prompt_tokens_delta, w.finished,
                              w.progress_delta) if d is not None]
        if not running or running <= 0 or not deltas or any(d > 0 for d in deltas):
            self.quiet_since = None
            return None
        if self.quiet_since is None:
            self.quiet_since = now
        return now - self.quiet_since


def counters_error(running: float, quiet_s: float) -> str:
    """The poll error text of a node whose counters stand still."""
    return (f"stalled: {running:g} requests running and no token counter advanced "
            f"for {quiet_s:.1f} s")


def stalled_error(silent_s: float) -> str:
    """The poll error text of a stalled node."""
    if silent_s > 0:
        return (f"stalled: requests in flight at the edges and no byte from the node "
                f"for {silent_s:.1f} s")
    return "stalled: requests in flight at the edges and no byte from the node"
