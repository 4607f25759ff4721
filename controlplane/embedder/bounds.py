"""Confidence bounds of a rate without numpy, for the control plane as well as the
calibration (:mod:`controlplane.embedder.calibration` re-exports them)."""

from __future__ import annotations

import math

Z95 = 1.6448536269514722
"""One-sided 95 % normal quantile."""


def wilson_upper(k: int, n: int, z: float = Z95) -> float:
    """Upper end of the Wilson score interval for ``k`` successes out of ``n`` (0-1).

    ``n == 0`` returns 1.0 (nothing measured: no bound). Raises ``ValueError`` for
    ``k < 0``, ``k > n``."""
    if k < 0 or k > n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    if n == 0:
        return 1.0
    p = k / n
    z2 = z * z
    centre = p + z2 / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    return min(1.0, (centre + half) / (1 + z2 / n))
