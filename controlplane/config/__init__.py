"""Configuration: one TOML file (``infergate.toml``) read into pydantic models.

Modules: :mod:`~controlplane.config.base` (section base, the words of a refusal),
:mod:`~controlplane.config.hostport`, one module per group of sections
(:mod:`~controlplane.config.edge` ``[redis]`` ``[edge]``, :mod:`~controlplane.config.admission`
``[auth]`` ``[limits]`` ``[admission]`` ``[deadlines]``, :mod:`~controlplane.config.cache`
``[cache]``, :mod:`~controlplane.config.routing` ``[controlplane]`` ``[scoring]``
``[[nodes]]``) and :mod:`~controlplane.config.load` (:class:`Settings` and loading). Every
name is imported from here (``from controlplane.config import Settings``).

Every section and field is optional; defaults are those of the section modules. Units are in the
field names (``_s`` seconds, ``_ms`` milliseconds, ``0-1`` fractions). Environment
variables override a few fields so secrets need not sit in the file:

- ``INFERGATE_REDIS_URL`` -> ``redis.url``
- ``INFERGATE_ADMIN_TOKEN`` -> ``controlplane.admin_token``

Every default, unit and range of the edge's options lives here, once: the sections
in :data:`EDGE_SECTIONS` are rendered into the edge's options document, and the spec
the edge validates that document against (``lua/infergate/core/options.lua``) is
generated from these fields (:mod:`controlplane.edge.options`). A refused value of
any section is reported in the edge's own words, e.g.
``edge.redis_timeout_ms: 100000 is above the maximum 60000`` (:func:`bound_message`).
Every number has a lower and an upper bound.

Errors: :func:`load_settings` raises :class:`ConfigError` (a ``click`` friendly
``ValueError``) naming the file and the field for unreadable TOML or invalid values, in
one line when one field is refused
(``f.toml: invalid configuration: controlplane.poll_interval_s: -1 is below the minimum
0.01``).
"""

from __future__ import annotations

from controlplane.config.admission import (
    API_PATHS,
    PROXIED_API_PATHS,
    TOKENIZER_PATHS,
    AdmissionSettings,
    AuthSettings,
    DeadlineSettings,
    LimitSettings,
    RouteDeadlineSettings,
)
from controlplane.config.base import (
    BOUND_WORDS,
    TYPE_WORDS,
    ConfigError,
    bound_message,
    enum_message,
    key_message,
    key_path,
    number_text,
    value_text,
)
from controlplane.config.cache import (
    CACHE_PATHS,
    CacheSettings,
    SemanticDomain,
    Similarity,
)
from controlplane.config.edge import (
    EdgeSettings,
    RedisSettings,
)
from controlplane.config.hostport import (
    HostPort,
    HostPortError,
)
from controlplane.config.load import (
    EDGE_SECTIONS,
    Settings,
    check_settings,
    edge_message,
    load_settings,
    settings_from_dict,
    unwrap_annotation,
)
from controlplane.config.routing import (
    NAME_RE,
    PATH_RE,
    ControlPlaneSettings,
    NodeKind,
    NodeSettings,
    ScoringSettings,
)

__all__ = [
    "API_PATHS",
    "PROXIED_API_PATHS",
    "TOKENIZER_PATHS",
    "AdmissionSettings",
    "AuthSettings",
    "BOUND_WORDS",
    "CACHE_PATHS",
    "CacheSettings",
    "ConfigError",
    "ControlPlaneSettings",
    "DeadlineSettings",
    "EDGE_SECTIONS",
    "EdgeSettings",
    "HostPort",
    "HostPortError",
    "LimitSettings",
    "NAME_RE",
    "NodeKind",
    "NodeSettings",
    "PATH_RE",
    "RedisSettings",
    "RouteDeadlineSettings",
    "ScoringSettings",
    "SemanticDomain",
    "Settings",
    "Similarity",
    "TYPE_WORDS",
    "bound_message",
    "check_settings",
    "edge_message",
    "enum_message",
    "key_message",
    "key_path",
    "load_settings",
    "number_text",
    "settings_from_dict",
    "unwrap_annotation",
    "value_text",
]
