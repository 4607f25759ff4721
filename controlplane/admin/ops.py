"""Every change an operator makes, shared by the API, the page and the CLI: the node
registry (add, edit, remove), drain/undrain, API keys (create, edit, revoke) and the
response-cache purge.

Every change writes an event (``registry.add_event``) naming the actor: ``admin`` for
the web page and API, ``cli:<user>`` for the command line. Event kinds and details:

- ``node_add`` (the node document), ``node_edit`` (``{field: [old, new]}``; none when
  nothing changed), ``node_remove``, ``drain`` / ``undrain`` (``{"from": state}``; none
  when nothing changed);
- ``key_create`` (``{"id", "tenant"}``), ``key_edit`` (``{"id", "tenant"}`` + the new
  value of each changed field; none when nothing changed), ``key_revoke`` (``{"id",
  "tenant"}``; none when the key was already revoked);
- ``cache_purge`` (the scope + ``"purged"``, the entries deleted);
- ``cache_flag`` (``{"id", "namespace"}``: an answer flagged as wrong and dropped; none
  when it was flagged before).

Errors are :class:`AdminError` subclasses carrying an HTTP status, an error type and a
code, so each front end can render them its own way (JSON error, flash message, exit
1). Redis being unreachable raises ``redis.exceptions.RedisError`` unchanged.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
import threading
import time
from urllib.parse import urlsplit
from dataclasses import asdict, dataclass

import redis
from pydantic import ValidationError

from controlplane.admin import apikeys
from controlplane.cache import store as cache_store
from controlplane.config import NodeSettings, Settings
from controlplane.errors import InfergateError
from controlplane.redisdb import keynames
from controlplane.routing import ownaddrs, registry
from controlplane.routing.registry import NodeState

EDITABLE: tuple[str, ...] = ("url", "kind", "weight", "max_concurrency", "metrics_path",
                             "health_path", "models", "poll_models")
"""Fields ``PATCH /nodes/<name>`` may change (the name is the identity and cannot)."""


class AdminError(InfergateError):
    """A request the admin cannot carry out; ``status`` is the HTTP status to answer."""

    status = 400
    type = "invalid_request_error"
    code = "bad_request"

    def __init__(self, message: str, code: str | None = None):
        super().__init__(message)
        self.message = message
        if code:
            self.code = code


class BadInput(AdminError):
    status = 400
    code = "invalid_value"


class NotFound(AdminError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class Conflict(AdminError):
    status = 409
    type = "conflict_error"
    code = "already_exists"


def validation_message(exc: ValidationError) -> str:
    """One line per invalid field: ``field: reason``."""
    parts = []
    for e in exc.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "body"
        msg = str(e["msg"]).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def parse_node(data: object) -> NodeSettings:
    """Validate a node document through :class:`NodeSettings`; raises :class:`BadInput`
    with every invalid field named (bad name, url, unknown kind, weight <= 0, ...)."""
    if not isinstance(data, dict):
        raise BadInput("expected a JSON object with name, url, kind, weight, max_concurrency")
    try:
        return NodeSettings.model_validate(data)
    except ValidationError as exc:
        raise BadInput(validation_message(exc)) from None


#: Networks a node URL may not point at unless ``controlplane.node_url_allow`` says so:
#: link-local (where most cloud instance metadata lives: AWS, GCP, Azure, Oracle,
#: OpenStack), Alibaba Cloud's metadata address, Oracle Cloud Classic's, Azure's
#: platform wire server, and AWS' IPv6 metadata address. An IPv6 address that embeds
#: one of the IPv4 ones (:func:`_embedded_ipv4`) is refused too.
REFUSED_NODE_NETS = tuple(ipaddress.ip_network(n) for n in
                          ("169.254.0.0/16", "100.100.100.200/32", "192.0.0.192/32",
                           "168.63.129.16/32", "fe80::/10", "fd00:ec2::254/128"))
#: IPv6 prefixes that carry an IPv4 address in their last 32 bits: IPv4-mapped,
#: IPv4-translated (SIIT), IPv4-compatible (deprecated, still routed by some stacks),
#: NAT64 well-known and local-use prefixes (RFC 6052, RFC 8215).
_V4_IN_LOW_BITS = tuple(ipaddress.ip_network(n) for n in
                        ("::ffff:0:0/96", "::ffff:0:0:0/96", "::/96", "64:ff9b::/96",
                         "64:ff9b:1::/48"))
#: Host names of cloud metadata services, refused like :data:`REFUSED_NODE_NETS`.
REFUSED_NODE_HOSTS = frozenset({"metadata.google.internal", "metadata.goog"})
_LOCAL_NAMES = frozenset({"localhost", "0.0.0.0", "::"})
#: The IPv4 spellings ``inet_aton`` (and so every C resolver and HTTP client) accepts:
#: one to four parts, each decimal, octal (leading 0) or hexadecimal (0x), e.g.
#: ``2852039166``, ``0xa9fea9fe``, ``0251.0376.0251.0376``, ``127.1``.
_IPV4_SHORTHAND = re.compile(r"^(?:0x[0-9a-f]*|[0-9]+)(?:\.(?:0x[0-9a-f]*|[0-9]+)){0,3}\Z")
#: Longest wait for a node URL's host name to resolve, seconds.
RESOLVE_TIMEOUT_S = 2.0

IP = ipaddress.IPv4Address | ipaddress.IPv6Address


def _ip(host: str) -> IP | None:
    """The address ``host`` spells, in any form a client would connect to (IPv6,
    IPv4-mapped IPv6 as IPv4, IPv4 shorthand / octal / hexadecimal), or None for a name."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        if not _IPV4_SHORTHAND.match(host):
            return None
        try:
            return ipaddress.IPv4Address(socket.inet_aton(host))
        except (OSError, ValueError):
            return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _embedded_ipv4(ip: IP) -> list[ipaddress.IPv4Address]:
    """The IPv4 addresses an IPv6 address carries (a packet to it may reach them through
    a translator or tunnel): the low 32 bits under :data:`_V4_IN_LOW_BITS` (except ``::``
    and ``::1``), the 6to4 address (``2002:a9fe:a9fe::``) and both Teredo addresses
    (``2001::/32``: server and de-obfuscated client). Empty for IPv4."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return []
    out: list[ipaddress.IPv4Address] = []
    if any(ip in n for n in _V4_IN_LOW_BITS) and int(ip) > 1:
        out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    if ip.sixtofour is not None:
        out.append(ip.sixtofour)
    if ip.teredo is not None:
        out.extend(ip.teredo)
    return out


def _refused_ip(ip: IP) -> bool:
    """``ip``, or an IPv4 address it embeds, is in :data:`REFUSED_NODE_NETS`."""
    return any(a in n for a in (ip, *_embedded_ipv4(ip)) for n in REFUSED_NODE_NETS
               if n.version == a.version)


def resolve_host(host: str, port: int, timeout: float = RESOLVE_TIMEOUT_S) -> list[IP] | None:
    """Every address ``host`` resolves to (``getaddrinfo``, IPv4-mapped IPv6 as IPv4),
    or None when it does not resolve within ``timeout`` seconds. The lookup runs in a
    daemon thread: a hung resolver costs the caller ``timeout``, never more."""
    out: list[list[IP]] = []

    def run() -> None:
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return
        ips: list[IP] = []
        for info in infos or ():
            ip = _ip(str(info[4][0]).split("%", 1)[0])
            if ip is not None and ip not in ips:
                ips.append(ip)
        out.append(ips)

    t = threading.Thread(target=run, name="infergate-resolve", daemon=True)
    t.start()
    t.join(timeout)
    return out[0] if out and out[0] else None


def _is_local(host: str, ips: list[IP] | None = None) -> bool:
    if ips is None:
        ip = _ip(host)
        ips = [ip] if ip is not None else []
    return host in _LOCAL_NAMES or any(ip.is_loopback or ip.is_unspecified for ip in ips)


def _allowed(host: str, port: int, allow: list[str]) -> bool:
    """``host:port`` matches an entry of ``controlplane.node_url_allow`` (a host name, an
    address or a CIDR, each optionally with ``:port``)."""
    ip = _ip(host)
    if ip is not None:
        host = str(ip)
    for entry in allow:
        e_host, e_port = entry.strip().lower(), None
        if e_host.count(":") == 1 or (e_host.startswith("[") and "]:" in e_host):
            e_host, _, p = e_host.rpartition(":")
            e_port = int(p) if p.isdigit() else None
        e_host = e_host.strip("[]")
        if e_port is not None and e_port != port:
            continue
        if e_host == host:
            return True
        if ip is not None:
            try:
                if ip in ipaddress.ip_network(e_host, strict=False):
                    return True
            except ValueError:
                pass
    return False


def _non_ascii_refusal(host: str) -> str:
    """Why a host name that is not ASCII is refused: the poller's HTTP client would
    encode it (or refuse it) its own way, and "①②⑦.0.0.1" is 127.0.0.1 in disguise: the
    ASCII (IDNA) form only."""
    import idna

    short = registry.shorten(host)
    try:
        ascii_host = idna.encode(host, uts46=True).decode("ascii")
    except (idna.IDNAError, UnicodeError) as exc:
        return f"url: {short} is not a valid host name ({registry.shorten(str(exc))})"
    return f"url: write the host name in ASCII, as {registry.shorten(ascii_host)}"


def _refused_address(host: str, port: int) -> tuple[list[IP], str | None]:
    """(the addresses ``host`` spells or resolves to, why it is refused: a name that
    does not resolve, a link-local or cloud-metadata address; None when it is not)."""
    ip = _ip(host)
    if ip is not None:
        ips: list[IP] = [ip]
    elif host in REFUSED_NODE_HOSTS:
        ips = []
    else:
        resolved = resolve_host(host, port)
        if resolved is None:
            return [], (f"url: the host name {registry.shorten(host)} does not resolve; add it to "
                        "controlplane.node_url_allow to use it anyway")
        ips = resolved
    bad = [a for a in ips if _refused_ip(a)]
    if host in REFUSED_NODE_HOSTS or bad:
        shown = registry.shorten(host) if ip is not None or not bad \
            else f"{registry.shorten(host)} ({bad[0]})"
        return ips, (f"url: {shown} is a link-local or cloud-metadata address; add it to "
                     "controlplane.node_url_allow to use it anyway")
    return ips, None


def node_url_refusal(url: str, settings: Settings | None = None,
                     published: list[ownaddrs.OwnAddress] | tuple = ()) -> str | None:
    """Why ``url`` may not be a node URL, or ``None`` when it may. Refused: hosts in
    :data:`REFUSED_NODE_NETS` / :data:`REFUSED_NODE_HOSTS` (IPv4-mapped IPv6 and the
    shorthand, octal and hexadecimal IPv4 spellings too, see :func:`_ip`), host names
    that resolve to any address in those networks or do not resolve at all within
    :data:`RESOLVE_TIMEOUT_S` (:func:`resolve_host`), and the stack's own Redis, admin,
    embedder, edge-metrics and edge API (``edge.listen``) ports -- those of ``settings``
    and the ``published`` ones of the running stack
    (:func:`controlplane.routing.ownaddrs.published`) -- on the same host or on a
    loopback address (a node there would loop requests back into the edge), unless
    ``settings.controlplane.node_url_allow`` allows the host. The check holds for the
    addresses the name has now; a name whose owner points it elsewhere later is not
    watched."""
    parts = urlsplit(url)
    host = (parts.hostname or "").lower().rstrip(".")
    try:
        port = parts.port or 80
    except ValueError:
        return None  # NodeSettings reports a bad port
    if host and not host.isascii():
        return _non_ascii_refusal(host)
    allow = settings.controlplane.node_url_allow if settings is not None else []
    if _allowed(host, port, allow):
        return None
    ips, refusal = _refused_address(host, port)
    own = (ownaddrs.of_settings(settings) if settings is not None else []) + list(published)
    if refusal is not None or not own:
        return refusal
    for what, o_host, o_port in ((a.what, a.host, a.port) for a in own):
        o_ip = _ip(o_host)
        same = host == o_host or (o_ip is not None and o_ip in ips)
        if port == o_port and (same or (_is_local(host, ips) and _is_local(o_host))):
            return (f"url: {registry.shorten(host)}:{port} is this stack's own {what} port; add it to "
                    "controlplane.node_url_allow to use it anyway")
    return None


def check_node_url(node: NodeSettings, settings: Settings | None,
                   published: list[ownaddrs.OwnAddress] | tuple = ()) -> NodeSettings:
    """``node`` when its URL may be used (:func:`node_url_refusal`), else raises
    :class:`BadInput` (code ``node_url_refused``)."""
    why = node_url_refusal(node.url, settings, published)
    if why:
        raise BadInput(why, "node_url_refused")
    return node


def _no_node(name: str) -> NotFound:
    return NotFound(f"no node named {registry.shorten(name)!r}", "node_not_found")


def _require(r: redis.Redis, name: str) -> NodeSettings:
    node = registry.get_node(r, name)
    if node is None:
        raise _no_node(name)
    return node


def _taken(exc: registry.UrlTaken | registry.NameTaken) -> Conflict:
    """A registry refusal as :class:`Conflict`: ``node_url_taken`` or ``node_exists``."""
    if isinstance(exc, registry.NameTaken):
        return Conflict(str(exc), "node_exists")
    return Conflict(f"{exc} (drain, edit or remove that one)", "node_url_taken")


def _put_unique(r: redis.Redis, node: NodeSettings, only_new: bool = False) -> bool:
    """:func:`registry.put_node_unique`, its refusals as :class:`Conflict`
    (``node_url_taken``, ``node_exists``)."""
    try:
        return registry.put_node_unique(r, node, only_new=only_new)
    except (registry.UrlTaken, registry.NameTaken) as exc:
        raise _taken(exc) from None


def add_node(r: redis.Redis, data: object, actor: str, events_max: int = 10000,
             settings: Settings | None = None) -> NodeSettings:
    """Register a new node. Raises :class:`BadInput` (also for a refused URL, see
    :func:`node_url_refusal`: the running stack's published addresses are refused
    whatever ``settings``; ``settings`` adds its own addresses and the allow list),
    :class:`Conflict` (name taken, also in another case: ``node_exists``; its server
    registered under another name: ``node_url_taken``). The node starts ``active``."""
    node = parse_node(data)
    if node.has_credential() or node.ca_file:
        # a path or variable name given here would be read on the control plane's host
        # and sent to the node: only the TOML file may name them
        raise BadInput("api_key_env, api_key_file and ca_file are set in the TOML file's "
                       "[[nodes]] only", "node_access_refused")
    check_node_url(node, settings, ownaddrs.published(r))
    if not _put_unique(r, node, only_new=True):
        raise Conflict(f"a node named {node.name!r} already exists", "node_exists")
    registry.add_event(r, "node_add", node.name, actor, node.model_dump(), maxlen=events_max)
    return node


class Stale(Conflict):
    """A form's change to a field that someone else changed since the form was shown
    (409 ``changed_meanwhile``): nothing is written."""

    code = "changed_meanwhile"


def _field(base: NodeSettings, field: str, value: object) -> object:
    """``value`` of node ``field`` as stored (validated, normalised: ``"2"`` -> 2.0, a URL
    without its trailing slash), on ``base``'s other fields. Raises :class:`BadInput`."""
    return getattr(parse_node({**base.model_dump(), field: value, "name": base.name}), field)


@dataclass
class NodeEdit:
    """Result of :func:`change_node`: the node as stored now, and ``{field: [old, new]}``
    of what this call changed (empty: nothing changed, nothing written)."""

    node: NodeSettings
    diff: dict[str, list]


def _check_changes(name: str, changes: object) -> dict:
    if not isinstance(changes, dict) or not changes:
        raise BadInput(f"expected a JSON object with some of {', '.join(EDITABLE)}")
    if "name" in changes and changes["name"] != name:
        raise BadInput("name: a node cannot be renamed; remove it and add it again")
    unknown = sorted(set(changes) - set(EDITABLE) - {"name"})
    if unknown:
        raise BadInput(f"unknown field(s): {', '.join(unknown)}; editable: {', '.join(EDITABLE)}")
    return {k: v for k, v in changes.items() if k != "name"}


def change_node(r: redis.Redis, name: str, changes: object, actor: str,
                events_max: int = 10000, settings: Settings | None = None,
                seen: dict | None = None) -> NodeEdit:
    """Change some fields of a node (see :data:`EDITABLE`), each on the document as
    stored when it is written: the check that the node exists, the merge and the write
    are one transaction (:func:`registry.update_node`), so a concurrent change of
    another field is kept and a concurrent removal wins (404).

    ``seen`` (a form): the values the form showed, by field. A field whose new value
    equals what the form showed was not changed by the user and is left alone; a field
    the user changed that someone else changed meanwhile to another value (the stored
    value is neither the one shown nor the user's) refuses the whole edit
    (:class:`Stale`). Without ``seen`` (the API,
    the CLI) every field given is applied.

    Writes ``node_edit`` (``{field: [old, new]}``) when something changed, nothing
    otherwise. Raises :class:`NotFound`, :class:`BadInput` (unknown or invalid field, a
    refused URL as in :func:`add_node`, or a rename attempt), :class:`Conflict` (a new
    URL another node has), :class:`Stale`."""
    changes = _check_changes(name, changes)
    current = _require(r, name)
    # validated first, outside the transaction (the URL check may resolve a name)
    probe = parse_node({**current.model_dump(), **changes, "name": name})
    if "url" in changes:
        check_node_url(probe, settings, ownaddrs.published(r))
    shown = {k: _field(current, k, seen[k]) for k in changes if seen is not None and k in seen}

    def apply(now: NodeSettings) -> NodeSettings:
        wanted = {}
        stale = []
        for k, v in changes.items():
            if k in shown:
                mine = _field(now, k, v)
                if mine == shown[k] or mine == getattr(now, k):
                    continue            # as shown (not changed by this user), or as stored
                if getattr(now, k) != shown[k]:
                    stale.append(k)     # changed by someone else since it was shown
                    continue
            wanted[k] = v
        if stale:
            raise Stale(", ".join(f"{k} was changed by someone else since you opened this "
                                  f"page (now {registry.shorten(str(getattr(now, k)))})"
                                  for k in stale)
                        + "; reload the page and make your change again. Nothing was saved.")
        return parse_node({**now.model_dump(), **wanted, "name": name})

    try:
        res = registry.update_node(r, name, apply)
    except (registry.UrlTaken, registry.NameTaken) as exc:
        raise _taken(exc) from None
    if res is None:
        raise _no_node(name)
    diff = {k: [getattr(res.before, k), getattr(res.after, k)] for k in EDITABLE
            if getattr(res.before, k) != getattr(res.after, k)}
    if diff:
        registry.add_event(r, "node_edit", name, actor, diff, maxlen=events_max)
    return NodeEdit(res.after, diff)


def edit_node(r: redis.Redis, name: str, changes: object, actor: str,
              events_max: int = 10000, settings: Settings | None = None) -> NodeSettings:
    """:func:`change_node` without ``seen`` (field-level merge, as ``PATCH``); returns
    the node as stored now."""
    return change_node(r, name, changes, actor, events_max, settings).node


def remove_node(r: redis.Redis, name: str, actor: str, events_max: int = 10000) -> None:
    """Delete a node with its state, metrics and history (entry and state in one
    transaction, :func:`registry.remove_node`). Raises :class:`NotFound`, also to the
    second of two removals at once."""
    if not registry.remove_node(r, name):
        raise _no_node(name)
    registry.add_event(r, "node_remove", name, actor, maxlen=events_max)


@dataclass
class StateChange:
    """Result of drain/undrain: the state now, whether this call changed it, and a
    ``warning`` for the operator (empty when none: see :func:`drain_warning`)."""

    name: str
    state: str
    since: float
    actor: str
    changed: bool
    warning: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def _state_change(name: str, st: NodeState, changed: bool) -> StateChange:
    return StateChange(name, st.state, st.since, st.actor, changed)


def _served(node: NodeSettings, routed: dict[str, list[str] | None]) -> list[str] | None:
    """The models ``node`` serves: configured, else as the routing snapshot lists them
    (read from its ``/v1/models``); None = unknown (the edge may send it any model)."""
    return node.models or routed.get(node.name) or None


def _routed_models(r: redis.Redis) -> dict[str, list[str] | None]:
    """Node name -> its models in the routing snapshot (missing or unreadable: none)."""
    try:
        snap = json.loads(r.get(keynames.ROUTING) or "{}")
        return {str(n["name"]): (n.get("models") or None) for n in snap.get("nodes") or ()
                if isinstance(n, dict) and "name" in n}
    except (ValueError, TypeError, AttributeError):
        return {}


def drain_warning(r: redis.Redis, name: str) -> str:
    """What a drain of ``name`` leaves without an active node, in words for the operator
    (empty when nothing): no active node at all, or the models ``name`` serves (configured
    or listed in the routing snapshot) that no other active node serves -- requests for
    them get 503 ``no_healthy_upstream`` until a node is undrained or added. A node whose
    models are unknown counts as serving every model."""
    nodes = registry.list_nodes(r)
    me = next((n for n in nodes if n.name == name), None)
    if me is None:
        return ""
    states = registry.get_states(r)
    active = [n for n in nodes
              if n.name != name and states.get(n.name, NodeState()).state == "active"]
    if not active:
        return ("no active node is left: every request will get 503 no_healthy_upstream "
                "until a node is undrained or added")
    routed = _routed_models(r)
    mine = _served(me, routed)
    others = [_served(n, routed) for n in active]
    if mine is None or any(o is None for o in others):
        return ""
    left = {m for o in others for m in (o or ())}
    alone = [m for m in mine if m not in left]
    if not alone:
        return ""
    return (f"no active node is left for model(s) {', '.join(alone)}: requests for "
            f"{'it' if len(alone) == 1 else 'them'} will get 503 no_healthy_upstream until "
            "a node serving it is undrained or added")


def drain(r: redis.Redis, name: str, actor: str, events_max: int = 10000) -> StateChange:
    """Set the node ``draining`` (the leader turns it ``drained`` later, see
    docs/internals.md "Drain and slow start"). Idempotent: a node already draining or
    drained keeps its state and ``since``. Checked and written in one transaction
    (:func:`registry.change_state`): a node removed meanwhile is 404, never given a state
    back. Never refused for leaving a model without an active node (maintenance), but
    ``warning`` says so (:func:`drain_warning`). Raises :class:`NotFound`."""
    res = registry.change_state(r, name, lambda st: None if st.state in ("draining", "drained")
                                else NodeState("draining", time.time(), actor))
    if res is None:
        raise _no_node(name)
    before, st = res
    changed = before != st
    if changed:
        registry.add_event(r, "drain", name, actor, {"from": before.state}, maxlen=events_max)
    out = _state_change(name, st, changed)
    out.warning = drain_warning(r, name)
    return out


def undrain(r: redis.Redis, name: str, actor: str, events_max: int = 10000) -> StateChange:
    """Set the node ``active`` with a new ``since`` (slow start runs from it).
    Idempotent: an active node keeps its ``since``. One transaction, as :func:`drain`.
    Raises :class:`NotFound`."""
    res = registry.change_state(r, name, lambda st: None if st.state == "active"
                                else NodeState("active", time.time(), actor))
    if res is None:
        raise _no_node(name)
    before, st = res
    changed = before != st
    if changed:
        registry.add_event(r, "undrain", name, actor, {"from": before.state},
                           maxlen=events_max)
    return _state_change(name, st, changed)


def node_json(node: NodeSettings) -> dict:
    """The registry document of a node as plain JSON types."""
    return json.loads(node.model_dump_json())


# ---- API keys --------------------------------------------------------------------------

KEY_FIELDS: tuple[str, ...] = ("tenant", "rpm", "tpm", "label", "weight", "priority")
"""Fields of a new key: ``tenant`` (required), ``rpm`` / ``tpm`` (per minute, ``None`` =
no limit), ``label``, ``weight`` / ``priority`` (the fair share, ``None`` = the tenant's
default)."""
KEY_EDITABLE: tuple[str, ...] = ("rpm", "tpm", "label", "weight", "priority")
"""Fields ``edit_key`` may change (the tenant is fixed at creation)."""


def _key_event(r: redis.Redis, kind: str, rec: apikeys.ApiKey, actor: str, events_max: int,
               **extra: object) -> None:
    registry.add_event(r, kind, "", actor, {"id": rec.id, "tenant": rec.tenant, **extra},
                       maxlen=events_max)


def create_key(r: redis.Redis, data: object, actor: str,
               events_max: int = 10000) -> tuple[str, apikeys.ApiKey]:
    """Create a key from ``{"tenant", "rpm"?, "tpm"?, "label"?, "weight"?, "priority"?}``;
    returns ``(plaintext,
    record)`` -- the plaintext is shown once and never stored. Writes ``key_create``.
    Raises :class:`BadInput` (unknown field, bad tenant, limit or label)."""
    if not isinstance(data, dict):
        raise BadInput("expected a JSON object with tenant, rpm, tpm, label")
    unknown = sorted(set(data) - set(KEY_FIELDS))
    if unknown:
        raise BadInput(f"unknown field(s): {', '.join(unknown)}; expected {', '.join(KEY_FIELDS)}")
    try:
        plaintext, rec = apikeys.create_key(r, data.get("tenant"), rpm=data.get("rpm"),
                                            tpm=data.get("tpm"), label=data.get("label"),
                                            weight=data.get("weight"),
                                            priority=data.get("priority"))
    except apikeys.ApiKeyError as exc:
        raise BadInput(str(exc)) from None
    _key_event(r, "key_create", rec, actor, events_max)
    return plaintext, rec


@dataclass
class KeyEdit:
    """Result of :func:`change_key`: the record as stored now and the fields this call
    changed (empty: nothing changed, nothing written)."""

    record: apikeys.ApiKey
    changed: list[str]


def change_key(r: redis.Redis, key_id: str, changes: object, actor: str,
               events_max: int = 10000, seen: dict | None = None) -> KeyEdit:
    """Change some of ``rpm``, ``tpm`` (``None`` or empty = no limit), ``weight``,
    ``priority`` (``None`` = the tenant's default) and ``label`` of a key, in one
    transaction (:func:`.apikeys.change_key`; ``seen``: the values a form showed, see
    there). Writes ``key_edit`` with the new value of each changed field, nothing when
    nothing changed. Raises :class:`BadInput` (nothing to change, unknown field, bad
    value), :class:`NotFound`, :class:`Conflict` (409, ``key_revoked``: a revoked key
    does not change), :class:`Stale` (409 ``changed_meanwhile``: a field the form's user
    changed was changed by someone else since the form was shown)."""
    if not isinstance(changes, dict) or not changes or set(changes) - set(KEY_EDITABLE):
        raise BadInput(f"expected some of {', '.join(KEY_EDITABLE)}")
    try:
        res = apikeys.change_key(r, key_id, changes, seen)
    except apikeys.KeyRevoked as exc:
        raise Conflict(str(exc), "key_revoked") from None
    except apikeys.KeyChanged as exc:
        raise Stale(str(exc)) from None
    except apikeys.ApiKeyError as exc:
        raise BadInput(str(exc)) from None
    if res is None:
        raise NotFound(f"no API key with id {registry.shorten(str(key_id))!r}", "key_not_found")
    rec, changed = res
    if changed:
        _key_event(r, "key_edit", rec, actor, events_max, **{k: getattr(rec, k) for k in changed})
    return KeyEdit(rec, changed)


def edit_key(r: redis.Redis, key_id: str, changes: object, actor: str,
             events_max: int = 10000) -> apikeys.ApiKey:
    """:func:`change_key` without ``seen`` (as ``PATCH``); returns the record."""
    return change_key(r, key_id, changes, actor, events_max).record


@dataclass
class KeyRevocation:
    """Result of :func:`revoke_key`: the record (``revoked`` set, epoch s) and whether
    this call revoked it (``False``: it was revoked before, at ``record.revoked``)."""

    record: apikeys.ApiKey
    changed: bool


def revoke_key(r: redis.Redis, key_id: str, actor: str, events_max: int = 10000,
               now: float | None = None) -> KeyRevocation:
    """Revoke a key (the edges refuse it at most ``auth.cache_ttl_s`` later). Idempotent:
    the first revocation time is kept and only the first call writes ``key_revoke``.
    Raises :class:`NotFound`."""
    when = time.time() if now is None else now
    rec = apikeys.revoke_key(r, key_id, now=when)
    if rec is None:
        raise NotFound(f"no API key with id {registry.shorten(str(key_id))!r}", "key_not_found")
    changed = rec.revoked == when
    if changed:
        _key_event(r, "key_revoke", rec, actor, events_max)
    return KeyRevocation(rec, changed)


# ---- response cache --------------------------------------------------------------------

PURGE_FIELDS: tuple[str, ...] = ("tenant", "model", "namespace", "all")


def purge_scope(data: object) -> dict:
    """Validate a purge scope: ``{"all": true}`` or some of tenant/model/namespace
    (non-empty strings of at most 256 characters, combined with AND); returns the scope
    with only those keys. Raises :class:`BadInput`."""
    if not isinstance(data, dict):
        raise BadInput("expected a JSON object with tenant, model, namespace or all")
    unknown = sorted(set(data) - set(PURGE_FIELDS))
    if unknown:
        raise BadInput(f"unknown field(s): {', '.join(unknown)}; expected tenant, model, "
                       "namespace or all")
    if "all" in data:
        if data["all"] is not True:
            raise BadInput("all: must be true (or left out)")
        if len(data) > 1:
            raise BadInput("all: cannot be combined with tenant, model or namespace")
        return {"all": True}
    scope = {}
    for f in ("tenant", "model", "namespace"):
        if f in data:
            v = data[f]
            if not isinstance(v, str) or not v or len(v) > 256:
                raise BadInput(f"{f}: a non-empty string of at most 256 characters")
            scope[f] = v
    if not scope:
        raise BadInput("purge scope: give tenant, model, namespace or all: true")
    return scope


@dataclass
class PurgeResult:
    """Result of :func:`purge_cache`."""

    scope: dict
    """The validated scope: ``{"all": True}`` or some of tenant/model/namespace."""
    purged: int
    """Cache entries (answers) deleted."""
    vectors: int
    """Semantic-index vector hashes deleted with them."""


def purge_cache(r: redis.Redis, data: object, actor: str,
                events_max: int = 10000) -> PurgeResult:
    """Delete the cache entries of a scope (see :func:`purge_scope`) **and** their
    semantic-index vectors (:func:`controlplane.cache.store.purge_counts`); counters are
    kept. Writes ``cache_purge`` with the scope and ``purged``. Raises :class:`BadInput`."""
    scope = purge_scope(data)
    try:
        n = cache_store.purge_counts(r, **scope)
    except cache_store.CacheStoreError as exc:
        raise BadInput(str(exc)) from None
    registry.add_event(r, "cache_purge", "", actor, {**scope, "purged": n.entries},
                       maxlen=events_max)
    return PurgeResult(scope, n.entries, n.vectors)


@dataclass
class FlagResult:
    """Result of :func:`flag_entry`."""

    id: str
    """The entry id (its exact key hex, as in ``X-Cache-Entry``)."""
    namespace: str
    """The entry's semantic namespace hex (``""`` when it had none)."""
    dropped: bool
    """This call dropped the entry (False: it was flagged or dropped before)."""
    flagged: int
    """Flags counted for the namespace so far."""

    def to_dict(self) -> dict:
        return asdict(self)


def flag_entry(r: redis.Redis, entry_id: str, actor: str,
               events_max: int = 10000) -> FlagResult:
    """Flag a served answer as wrong: drop the entry ``entry_id`` (the ``X-Cache-Entry``
    of a hit: its exact key hex), its index memberships and its semantic vectors, and
    count a ``flagged`` for its namespace (``keynames.cache_ns_stats``). Idempotent:
    flagging an entry already dropped (its mark lives as long as the entry would have)
    changes nothing and counts nothing. Writes ``cache_flag``. Raises :class:`NotFound`
    (``entry_not_found``) for an id that is not an entry's, or whose entry expired."""
    eid = entry_id.strip().lower() if isinstance(entry_id, str) else ""
    if not cache_store.HEX_RE.match(eid):
        raise NotFound(f"no cache entry with id {entry_id!r} (ids are the X-Cache-Entry "
                       "header of a hit: 16 to 128 hex digits)", "entry_not_found")
    doc = cache_store.drop_entry(r, eid)
    if doc is None:
        ns = cache_store.dropped_namespace(r, eid)
        if ns is None:
            raise NotFound(f"no cache entry with id {eid!r} (expired, purged or never "
                           "stored)", "entry_not_found")
        flagged = _ns_counter(r, ns, "flagged")
        return FlagResult(eid, ns, False, flagged)
    ns = doc.get("namespace") if isinstance(doc.get("namespace"), str) else ""
    flagged = cache_store.count_namespace(r, ns, "flagged") if cache_store.HEX_RE.match(ns) \
        else 0
    registry.add_event(r, "cache_flag", "", actor, {"id": eid, "namespace": ns},
                       maxlen=events_max)
    return FlagResult(eid, ns, True, flagged)


def _ns_counter(r: redis.Redis, namespace: str, field: str) -> int:
    if not namespace:
        return 0
    v = r.hget(keynames.cache_ns_stats(namespace), field)
    try:
        return int(v) if v is not None else 0
    except (TypeError, ValueError):
        return 0
