"""``HOST:PORT`` values (listen addresses): :class:`HostPort`."""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from pydantic import GetCoreSchemaHandler
from pydantic_core import core_schema

from controlplane.errors import InfergateError


class HostPortError(InfergateError, ValueError):
    """A ``host:port`` value that is not one."""


_HOST_RE = re.compile(r"^(\*|[A-Za-z0-9_][A-Za-z0-9_.-]{0,252})\Z")


class HostPort(str):
    """``HOST:PORT`` or ``[IPv6]:PORT`` (``127.0.0.1:8080``, ``edge.internal:80``,
    ``[::1]:8080``, ``0.0.0.0:8080``, ``*:8080``): a ``str`` that also carries its parts.

    ``host`` is the name or address without brackets, ``port`` an ``int`` from 1 to
    65535. :meth:`parse` raises :class:`HostPortError` (a ``ValueError``) with one message
    for every malformed value; as a pydantic field type it validates and keeps the text."""

    host: str
    port: int

    @classmethod
    def parse(cls, value: Any, what: str = "address") -> HostPort:
        """``value`` checked and split; ``what`` names it in the error."""
        if isinstance(value, HostPort):
            return value
        text = value if isinstance(value, str) else ""
        host = port = None
        if text.startswith("["):
            inner, sep, rest = text[1:].partition("]")
            if sep and rest.startswith(":"):
                try:
                    ipaddress.IPv6Address(inner)
                    host, port = inner, rest[1:]
                except ValueError:
                    pass
        else:
            h, sep, p = text.rpartition(":")
            if sep and _HOST_RE.match(h):
                host, port = h, p
        if host is None or not (port or "").isdigit() or not 0 < int(port) < 65536:
            raise HostPortError(f"{what} must be HOST:PORT or [IPv6]:PORT with a port from 1 "
                                f"to 65535, got {value!r}")
        out = str.__new__(cls, text)
        out.host, out.port = host, int(port)
        return out

    @property
    def url_host(self) -> str:
        """The host as it goes in a URL or an nginx ``server`` line (IPv6 in brackets)."""
        return f"[{self.host}]" if ":" in self.host else self.host

    @property
    def client_host(self) -> str:
        """Where a client on this machine connects: the wildcard addresses (``0.0.0.0``,
        ``*``, ``::``) become the loopback address."""
        if self.host in ("0.0.0.0", "*"):
            return "127.0.0.1"
        if self.host == "::":
            return "::1"
        return self.host

    @property
    def client_url(self) -> str:
        """``http://client_host:port`` (brackets for IPv6)."""
        h = self.client_host
        return f"http://{f'[{h}]' if ':' in h else h}:{self.port}"

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any,
                                     handler: GetCoreSchemaHandler) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(
            cls.parse, core_schema.str_schema(),
            serialization=core_schema.plain_serializer_function_ser_schema(str))
