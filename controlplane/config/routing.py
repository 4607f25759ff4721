"""The control plane's sections: ``[controlplane]``, ``[scoring]`` and the
``[[nodes]]`` list."""

from __future__ import annotations

import re
from typing import Literal
from urllib.parse import urlsplit

from pydantic import Field, ValidationInfo, field_validator, model_validator

from controlplane.config.base import _Section
from controlplane.config.hostport import HostPort

NodeKind = Literal["vllm", "tgi", "sglang", "json", "openai"]
"""Metrics dialect of a node. ``openai`` means "no metrics endpoint" (llama.cpp without
``--metrics``, Ollama, any OpenAI-compatible server): the node is routed on what the
edge observes itself. ``vllm`` also accepts the pre-0.10 names (auto-detected)."""

ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}\Z")


def check_api_key_env(v: str) -> str:
    """``api_key_env`` of a node or an endpoint: the name of an environment variable
    (letters, digits, '_'), never the key itself. Raises ValueError."""
    if v and not ENV_NAME_RE.match(v):
        raise ValueError("api_key_env: the name of an environment variable (letters, "
                         "digits, '_'), not the key itself")
    return v


def check_abs_file(v: str) -> str:
    """``api_key_file`` / ``ca_file``: an absolute path without spaces, quotes, ';', '#',
    '$' or braces (it may be written into the nginx configuration). Raises ValueError."""
    if v and (not v.startswith("/") or any(c.isspace() or not c.isprintable()
                                           or c in ';#$"\'{}\\' for c in v)):
        raise ValueError("must be an absolute file path without spaces, quotes, ';', "
                         "'#', '$' or braces")
    return v
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
PATH_RE = re.compile(r"^/[A-Za-z0-9/_.-]{0,200}\Z")
#: Longest health or metrics path (characters).
PATH_MAX = 201
#: A plain decimal number ("1", "0.5", "2.", ".5", "1e3" refused), for values given as text.
DECIMAL_RE = re.compile(r"^[0-9]+(?:\.[0-9]*)?\Z|^\.[0-9]+\Z")
#: Most model ids a node's ``models`` may list. The registry's nodes are parsed again at
#: every control-plane cycle: twenty thousand ids took seconds each time, past the
#: leader's lease, so leadership changed hands every few seconds.
MAX_NODE_MODELS = 1000


class ControlPlaneSettings(_Section):
    listen: HostPort = HostPort.parse("127.0.0.1:8081")
    """host:port of the admin page and ``/api/v1``."""
    poll_interval_s: float = Field(default=1.0, ge=0.01, le=3600)
    """Seconds between two polls of a node's health and metrics."""
    poll_timeout_s: float = Field(default=0.8, ge=0.01, le=600)
    """Timeout of one health or metrics poll of a node, seconds (a metrics page is read
    and parsed within it, or the poll is not good)."""
    max_metrics_bytes: int = Field(default=1024 * 1024, ge=16 * 1024, le=8 * 1024 * 1024)
    """Largest ``/metrics`` page read, bytes; a larger page makes the poll not good (that
    node only). Engines serve tens of KB (a vLLM-style page with 8 engines ~125 KB);
    parsing costs ~0.5 s per MB, in the node's own poll worker."""
    stall_counters_s: float = Field(default=30.0, ge=0, le=86400)
    """A node whose metrics say requests are running and whose token counters
    (generated and prompt tokens) and finished-request count have not advanced for this
    many seconds is **stalled** (a hung engine behind a live HTTP server): its polls
    fail, with ``stalled`` as the reason. 0 = off (the edges' evidence only)."""
    unhealthy_after: int = Field(default=3, ge=1, le=1000)
    """K consecutive failed polls -> unhealthy."""
    healthy_after: int = Field(default=2, ge=1, le=1000)
    """M consecutive good polls -> healthy again."""
    leader_ttl_s: float = Field(default=5.0, ge=0.1, le=3600)
    """Lifetime of the leader lock in Redis, seconds: a standby takes over at most this
    long after the leader stops renewing it."""
    metrics_ttl_s: float = Field(default=30.0, ge=0.1, le=86400)
    """Lifetime of a node's latest metrics in Redis, seconds."""
    history_points: int = Field(default=300, ge=1, le=100000)
    """Polls of each node kept in its history (the admin page's charts)."""
    admin_token: str = ""
    drain_timeout_s: float = Field(default=600.0, ge=0, le=604800)
    """A draining node counts as drained after this many seconds even with requests still
    in flight."""
    slow_start_s: float = Field(default=30.0, ge=0, le=86400)
    """Seconds over which a node's share ramps from 10 % to its full weight after it was
    undrained, added at run time, or came back from unhealthy."""
    models_refresh_s: float = Field(default=60.0, ge=5.0, le=86400.0)
    """How often (s) the served models of a node are read again from its ``GET
    /v1/models`` (also at once when a node is added); never on the health-check path."""
    models_timeout_s: float = Field(default=2.0, gt=0.0, le=30.0)
    """Timeout (s) of one ``GET /v1/models`` of a node (connect and whole body)."""
    node_ca_file: str = ""
    """PEM file of the CA certificates that sign the ``https://`` nodes' certificates
    (the control plane's polls and the edge); empty: the system bundle. A node's own
    ``ca_file`` is trusted as well."""
    events_max: int = Field(default=10000, ge=1, le=10000000)
    """Most entries kept in the event log (oldest dropped first)."""
    cookie_secure: bool = False
    """Mark the admin session cookie ``Secure`` always (it is anyway on a page served
    over TLS, or through a ``trusted_proxies`` proxy that sends
    ``X-Forwarded-Proto: https``)."""
    trusted_proxies: list[str] = Field(default_factory=list)
    """Addresses or CIDRs (e.g. ``"10.0.0.0/8"``) of reverse proxies in front of the admin
    page whose ``X-Forwarded-Proto`` and ``X-Forwarded-For`` are believed (TLS detection,
    the client address the login throttle counts)."""
    node_url_allow: list[str] = Field(default_factory=list)
    """Node URL hosts allowed although they are refused by default: link-local and
    cloud-metadata addresses (169.254.0.0/16, fe80::/10, fd00:ec2::254,
    ``metadata.google.internal``) and this stack's own Redis and admin ports. Entries are
    host names, addresses or CIDRs (``"169.254.10.0/24"``), optionally ``host:port``."""

    @field_validator("trusted_proxies")
    @classmethod
    def _proxies(cls, v: list[str]) -> list[str]:
        import ipaddress

        for item in v:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"trusted_proxies: {item!r} is not an address or CIDR") from None
        return v


class ScoringSettings(_Section):
    """Health score = (w_queue*q + w_kv*kv + w_latency*lat) / weight, lower is better.

    q = min(queue_depth / queue_norm, 1) ... see docs/internals.md "How a node is chosen"."""

    w_queue: float = Field(default=0.5, ge=0, le=1000)
    """Weight of the queue term (0 = ignored)."""
    w_kv: float = Field(default=0.3, ge=0, le=1000)
    """Weight of the KV-cache term (0 = ignored)."""
    w_latency: float = Field(default=0.2, ge=0, le=1000)
    """Weight of the latency term (0 = ignored)."""
    queue_norm: float = Field(default=16.0, ge=0.01, le=1000000)
    """Queue depth that counts as fully loaded (term = 1)."""
    latency_norm_s: float = Field(default=30.0, ge=0.001, le=86400)
    """Recent e2e latency (s) that counts as fully loaded (term = 1); the edge's balancer
    normalises its latency term with it too."""
    saturation_queue: float = Field(default=32.0, ge=1, le=1000000)
    """Queue depth at or above which a node is saturated."""
    saturation_kv: float = Field(default=0.98, gt=0, le=1)
    """KV-cache usage (0-1) at or above which a node is saturated."""


class NodeSettings(_Section):
    name: str
    url: str
    """Server root, e.g. ``http://10.0.0.5:8000`` or ``https://vllm-1.internal:8443``;
    the OpenAI API is under ``/v1``. ``https://``: the certificate is verified (CA from
    ``ca_file``, ``controlplane.node_ca_file`` or the system bundle) against the URL's
    host name, which is also sent as SNI."""
    kind: NodeKind = "vllm"
    weight: float = Field(default=1.0, ge=0.001, le=1000)
    max_concurrency: int = Field(default=64, ge=1, le=100000)
    metrics_path: str = "/metrics"
    health_path: str = "/health"
    models: list[str] = Field(default_factory=list)
    """Model ids the node serves (the ``model`` of a request, as in ``GET /v1/models``).
    Empty: read from the node's ``GET /v1/models`` (see ``poll_models``); still unknown,
    the node may be sent any model."""
    poll_models: bool | None = None
    """Read the served models from ``GET /v1/models`` every
    ``controlplane.models_refresh_s``: ``None`` = yes unless ``kind`` is ``openai``
    (llama-cpp-python's ``/v1/models`` waits for the model lock and can cut a running
    stream) or ``models`` is set."""

    ca_file: str = ""
    """PEM file of the CA that signs this ``https://`` node's certificate, trusted in
    addition to ``controlplane.node_ca_file`` (the edge trusts every configured CA for
    every node). Set in the TOML file only."""
    api_key_env: str = ""
    """Name of an environment variable of the control plane (and of ``render-nginx``)
    holding the node's API key (vLLM ``--api-key``), sent to the node as
    ``Authorization: Bearer KEY`` by the edge and the control plane. The key itself never
    goes into the TOML file, the registry or any answer. Set in the TOML file only."""
    api_key_file: str = ""
    """Absolute path of a file holding the node's API key (first line; read again when
    it changes), as ``api_key_env``. Set in the TOML file only."""

    _key_env = field_validator("api_key_env")(classmethod(
        lambda cls, v: check_api_key_env(v)))
    _abs_file = field_validator("api_key_file", "ca_file")(classmethod(
        lambda cls, v: check_abs_file(v)))

    @model_validator(mode="after")
    def _access(self) -> NodeSettings:
        if self.api_key_env and self.api_key_file:
            raise ValueError("set one of api_key_env and api_key_file, not both")
        if self.ca_file and not self.url.startswith("https://"):
            raise ValueError("ca_file needs an https:// node url")
        return self

    def has_credential(self) -> bool:
        """Whether the node is given an API key (``api_key_env`` or ``api_key_file``)."""
        return bool(self.api_key_env or self.api_key_file)

    @field_validator("models")
    @classmethod
    def _models(cls, v: list[str]) -> list[str]:
        if len(v) > MAX_NODE_MODELS:
            raise ValueError(f"models: at most {MAX_NODE_MODELS} model ids, got {len(v)}")
        seen: set[str] = set()
        out: list[str] = []
        for m in v:
            if not isinstance(m, str) or not m or len(m) > 256 or not m.isprintable():
                raise ValueError("models: each entry is a non-empty model id of at most 256 "
                                 "printable characters")
            if m not in seen:
                seen.add(m)
                out.append(m)
        return out

    def polls_models(self) -> bool:
        """Whether the control plane reads this node's ``GET /v1/models`` (see
        ``poll_models``)."""
        if self.poll_models is not None:
            return self.poll_models
        return self.kind != "openai" and not self.models

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("node name: letters, digits, '-', '_', '.', at most 63")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if any(c.isspace() or not c.isprintable() for c in v):
            raise ValueError("node url must not hold spaces, line breaks or control characters")
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("node url must be http://host[:port] or https://host[:port]")
        if parts.path not in ("", "/") or "?" in v or "#" in v:
            raise ValueError("node url is the server root, without a path, query or fragment "
                             "(the edge adds /v1/...)")
        try:
            port = parts.port
        except ValueError:
            raise ValueError("node url port must be 1-65535") from None
        if port == 0:
            raise ValueError("node url port must be 1-65535")
        if parts.username is not None or parts.password is not None:
            raise ValueError("node url must not carry credentials (user:password@)")
        # urlsplit reads the host of "[::1]]:5" or "[::1]x:5" as ::1: the address part must
        # be the host alone, [IPv6] bracketed, then at most ":port"
        host = parts.hostname
        shown = f"[{host}]" if ":" in host else host
        netloc = parts.netloc.lower()
        if netloc != shown and not netloc.startswith(shown + ":"):
            raise ValueError("node url host must be a name, an IPv4 address or an [IPv6] "
                             "address, then at most :port")
        return v.rstrip("/")

    @field_validator("metrics_path", "health_path")
    @classmethod
    def _path(cls, v: str, info: ValidationInfo) -> str:
        # appended to the node URL: a path on the same server, nothing that could name
        # another host ("@", "//") or leave the path ("..", "?", "#")
        if len(v) > PATH_MAX:
            raise ValueError(f"at most {PATH_MAX} characters, got {len(v)}")
        if not PATH_RE.match(v) or "//" in v or ".." in v:
            example = "/health" if info.field_name == "health_path" else "/metrics"
            raise ValueError(f"must be an absolute path such as {example} (letters, digits, "
                             "'/', '-', '_', '.')")
        return v

    @field_validator("weight", mode="before")
    @classmethod
    def _plain_number(cls, v: object) -> object:
        # a weight written as text (the page's form, the CLI) is a plain decimal number:
        # Python's float() would also read "1_000", "1e3 " or "inf"
        if isinstance(v, str) and not DECIMAL_RE.match(v.strip()):
            raise ValueError(f"must be a plain decimal number such as 1 or 0.5, got {v!r}")
        return v
