"""Which URLs may be node URLs: not a cloud-metadata or link-local address (in any
spelling a client would connect to), a host name that resolves within
:data:`RESOLVE_TIMEOUT_S`, and not the stack's own Redis, admin, embedder, edge-metrics or
edge API port (:func:`node_url_refusal`). Shared by the admin API, page and CLI through
:mod:`controlplane.admin.ops`.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import threading
from urllib.parse import urlsplit

from controlplane.config import Settings
from controlplane.routing import ownaddrs, registry


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
            shown = registry.shorten(f"[{host}]" if ":" in host else host)
            return (f"url: {shown}:{port} is this stack's own {what} port; add it to "
                    "controlplane.node_url_allow to use it anyway")
    return None
