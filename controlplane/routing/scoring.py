"""Health score of a node (lower is better) and the saturation flag. Pure functions.

Formula, with the settings of ``[scoring]``::

    q   = min(queue_depth / queue_norm, 1)         # requests waiting, 0-1
    kv  = kv_cache_usage                           # 0-1 fraction of KV-cache blocks in use
    lat = min(e2e_avg_s / latency_norm_s, 1)       # recent mean e2e latency, 0-1

    score = (w_queue*q + w_kv*kv + w_latency*lat) / (sum of the weights of the terms used)
            / node weight

so a node's score lies in [0, 1/weight]: 0 is idle, 1 is fully loaded on every term
(for weight 1). A term whose input is missing in this poll uses the last known value
when it is at most ``hold_s`` old (see :class:`LastKnown`); after that the term is
dropped and the remaining weights are renormalised (the division by the weights
*used*), so a TGI node (no KV-cache gauge) or an idle node (no recent latency) is
scored on what it reports. Terms with a weight <= 0 never count. No term left ->
score ``None`` (the edge then balances that node on its own signals).

A node is *saturated* when ``queue_depth >= saturation_queue`` or
``kv_cache_usage >= saturation_kv`` (on the same held values); the edge answers 429
when every eligible node is saturated.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from controlplane.config import ScoringSettings


@dataclass(frozen=True)
class ScoreInputs:
    """Raw inputs: queue depth (requests), KV-cache usage (0-1), recent e2e mean (s).
    ``None`` = unknown in this poll."""

    queue_depth: float | None = None
    kv_cache_usage: float | None = None
    e2e_avg_s: float | None = None


@dataclass(frozen=True)
class ScoreResult:
    score: float | None
    """Lower is better, already divided by the node weight; ``None`` = no term."""
    saturated: bool
    terms: dict[str, float] = field(default_factory=dict)
    """Normalised terms used (``q``, ``kv``, ``lat``), each 0-1."""


def terms(inputs: ScoreInputs, s: ScoringSettings) -> dict[str, float]:
    """Normalised 0-1 terms for the inputs that are known."""
    out: dict[str, float] = {}
    if inputs.queue_depth is not None:
        norm = s.queue_norm if s.queue_norm > 0 else 1.0
        out["q"] = min(max(inputs.queue_depth, 0.0) / norm, 1.0)
    if inputs.kv_cache_usage is not None:
        out["kv"] = min(max(inputs.kv_cache_usage, 0.0), 1.0)
    if inputs.e2e_avg_s is not None:
        norm = s.latency_norm_s if s.latency_norm_s > 0 else 1.0
        out["lat"] = min(max(inputs.e2e_avg_s, 0.0) / norm, 1.0)
    return out


def is_saturated(inputs: ScoreInputs, s: ScoringSettings) -> bool:
    """``queue_depth >= saturation_queue`` or ``kv_cache_usage >= saturation_kv``."""
    return ((inputs.queue_depth is not None and inputs.queue_depth >= s.saturation_queue)
            or (inputs.kv_cache_usage is not None and inputs.kv_cache_usage >= s.saturation_kv))


def compute_score(inputs: ScoreInputs, s: ScoringSettings, weight: float = 1.0) -> ScoreResult:
    """Score and saturation of one node (formula in the module docstring).

    ``weight`` is the node's configured weight (> 0; a non-positive one is read as 1)."""
    t = terms(inputs, s)
    weights = {"q": s.w_queue, "kv": s.w_kv, "lat": s.w_latency}
    used = {k: v for k, v in t.items() if weights[k] > 0}
    total_w = sum(weights[k] for k in used)
    score: float | None = None
    if used and total_w > 0:
        w = weight if weight > 0 else 1.0
        score = round(sum(weights[k] * v for k, v in used.items()) / total_w / w, 6)
    return ScoreResult(score, is_saturated(inputs, s), used)


@dataclass
class LastKnown:
    """Holds each input's last known value for ``hold_s`` seconds, so that one missing
    poll (or an idle spell with no finished request) does not swing the score."""

    hold_s: float
    _values: dict[str, tuple[float, float]] = field(default_factory=dict)

    def fill(self, inputs: ScoreInputs, now: float) -> ScoreInputs:
        """Record the known inputs at time ``now`` (epoch s) and return ``inputs`` with
        missing ones replaced by values at most ``hold_s`` old."""
        out = {}
        for name in ("queue_depth", "kv_cache_usage", "e2e_avg_s"):
            v = getattr(inputs, name)
            if v is not None:
                self._values[name] = (v, now)
                continue
            held = self._values.get(name)
            if held is not None and now - held[1] <= self.hold_s:
                out[name] = held[0]
            elif held is not None:
                del self._values[name]
        return replace(inputs, **out)
