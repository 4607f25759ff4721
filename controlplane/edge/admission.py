"""Admission control settings handed to the edge.

The ``[auth]``, ``[limits]``, ``[admission]`` and ``[deadlines]`` sections of the TOML
file (``controlplane.config``) become the ``admission`` object of the edge options that
``infergate render-nginx`` embeds in ``init_by_lua``; ``lua/infergate/admission/options.lua``
validates it again and fills in the same defaults. What the edge does with them is
described in ``lua/infergate/admission/auth.lua``, ``ratelimit.lua``, ``admission.lua`` and
``deadline.lua`` and in docs/internals.md ("Admission control").
"""

from __future__ import annotations

from controlplane.config import Settings


def edge_admission_options(settings: Settings) -> dict:
    """The ``admission`` edge option: ``{"auth", "limits", "shed", "deadlines"}``.

    Units as in the TOML (``_s`` seconds, ``_ms`` milliseconds). Per-path deadline
    entries carry only the fields the file sets; the edge fills in the global values."""
    a, lim, adm, d = settings.auth, settings.limits, settings.admission, settings.deadlines
    routes = {path: r.model_dump(exclude_none=True) for path, r in d.routes.items()}
    return {
        "auth": {
            "mode": a.mode,
            "cache_ttl_s": float(a.cache_ttl_s),
            "negative_ttl_s": float(a.negative_ttl_s),
            "stale_ttl_s": float(a.stale_ttl_s),
        },
        "limits": {
            "enabled": lim.enabled,
            "global_rpm": lim.global_rpm,
            "global_tpm": lim.global_tpm,
            "chars_per_token": float(lim.chars_per_token),
            "redis_retry_s": float(lim.redis_retry_s),
        },
        "shed": {
            "enabled": adm.shed,
            "max_wait_ms": adm.max_wait_ms,
            "poll_ms": adm.poll_ms,
            "retry_after_s": adm.retry_after_s,
        },
        "deadlines": {
            "request_ms": d.request_ms,
            "stream_idle_ms": d.stream_idle_ms,
            "routes": routes,
        },
    }
