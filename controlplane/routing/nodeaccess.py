"""How the control plane and the edge reach a node: TLS verification and the node's API
key.

- ``https://`` nodes: the certificate is verified against the URL's host name with the
  node's ``ca_file`` and ``controlplane.node_ca_file`` (or the system bundle when neither
  is set).
- API key: read from the environment variable ``api_key_env`` or the file
  ``api_key_file`` (its first line; read again when its modification time or size
  changes), sent as ``Authorization: Bearer KEY``. The key is never stored in the
  registry (which holds only the variable's name or the file's path), never logged and
  never part of an answer: it travels to the edges only inside the routing snapshot
  (``auth`` of a node), which every serving path redacts (:func:`redact_snapshot`).

A key that cannot be read (variable unset, file missing or empty, a line break or a
control character in it) leaves the node without credentials: its polls then fail with
``credentials refused`` if the node insists on one, and :func:`resolve` says why.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

from controlplane.config import NodeSettings
from controlplane.errors import InfergateError

#: Longest API key accepted (characters).
MAX_KEY_LEN = 4096
#: What the serving paths show instead of a node's Authorization value.
REDACTED = "[redacted]"


class CredentialError(InfergateError, ValueError):
    """A node's API key cannot be read (the message never holds the key)."""


def _check_key(key: str, where: str) -> str:
    key = key.strip()
    if not key:
        raise CredentialError(f"{where} is empty")
    if len(key) > MAX_KEY_LEN:
        raise CredentialError(f"{where} is longer than {MAX_KEY_LEN} characters")
    if any(not c.isprintable() or c.isspace() for c in key):
        raise CredentialError(f"{where} holds a space, line break or control character")
    return key


class KeyFiles:
    """API keys read from files, cached by (path, mtime, size); thread-safe."""

    def __init__(self) -> None:
        self._cache: dict[str, tuple[tuple[int, int], str]] = {}
        self._lock = threading.Lock()

    def read(self, path: str) -> str:
        """The key in ``path`` (first line). Raises :class:`CredentialError`."""
        try:
            st = os.stat(path)
        except OSError as exc:
            raise CredentialError(f"api_key_file {path}: {exc.strerror}") from None
        stamp = (st.st_mtime_ns, st.st_size)
        with self._lock:
            hit = self._cache.get(path)
        if hit is not None and hit[0] == stamp:
            return hit[1]
        try:
            with open(path, encoding="utf-8") as f:
                first = f.readline(MAX_KEY_LEN + 2)
        except (OSError, UnicodeDecodeError) as exc:
            raise CredentialError(f"api_key_file {path}: cannot read it "
                                  f"({type(exc).__name__})") from None
        key = _check_key(first, f"api_key_file {path}")
        with self._lock:
            self._cache[path] = (stamp, key)
        return key


_FILES = KeyFiles()


def resolve(node: NodeSettings, files: KeyFiles | None = None) -> str | None:
    """The ``Authorization`` value of ``node`` (``"Bearer KEY"``), ``None`` when it has no
    ``api_key_env`` / ``api_key_file``. Raises :class:`CredentialError` when the key is
    configured but cannot be read."""
    if node.api_key_env:
        value = os.environ.get(node.api_key_env)
        if value is None:
            raise CredentialError(f"environment variable {node.api_key_env} is not set")
        return "Bearer " + _check_key(value, f"environment variable {node.api_key_env}")
    if node.api_key_file:
        return "Bearer " + (files or _FILES).read(node.api_key_file)
    return None


def resolve_quiet(node: NodeSettings) -> tuple[str | None, str | None]:
    """:func:`resolve` as ``(auth, error)``: never raises."""
    try:
        return resolve(node), None
    except CredentialError as exc:
        return None, str(exc)


def origin(url: str) -> str:
    """``scheme://host:port`` of a URL (lower case; the default port written out)."""
    p = urlsplit(url)
    scheme = p.scheme.lower()
    try:
        port = p.port or (443 if scheme == "https" else 80)
    except ValueError:
        port = 0
    host = (p.hostname or "").lower()
    if ":" in host:
        host = f"[{host}]"
    return f"{scheme}://{host}:{port}"


def tls_name(node: NodeSettings) -> str | None:
    """Host name the edge sends as SNI and verifies the certificate against (``https://``
    nodes only)."""
    p = urlsplit(node.url)
    return p.hostname if p.scheme == "https" else None


@dataclass(frozen=True)
class Access:
    """How to reach one node: the ``Authorization`` value (``None``: none) and the
    ``verify`` argument of ``requests`` (a CA bundle path, or True for the system one)."""

    auth: str | None = None
    verify: str | bool = True


def ca_bundle_paths(nodes: list[NodeSettings], global_ca: str) -> list[str]:
    """The CA files every ``https://`` node is verified with: ``global_ca`` (else none:
    the system bundle) and each node's ``ca_file``, without repeats."""
    out = [global_ca] if global_ca else []
    for n in nodes:
        if n.ca_file and n.ca_file not in out:
            out.append(n.ca_file)
    return out


class AccessTable:
    """Per node origin (:func:`origin`), the :class:`Access` its polls use; thread-safe.
    :meth:`update` is called by the poll cycle with the registered nodes."""

    def __init__(self, global_ca: str = "") -> None:
        self.global_ca = global_ca
        self._by_origin: dict[str, Access] = {}
        self._lock = threading.Lock()

    def update(self, nodes: list[NodeSettings]) -> dict[str, str | None]:
        """Read every node's key; returns ``{name: error}`` (``None`` when the node's key
        was read or it has none)."""
        table: dict[str, Access] = {}
        errors: dict[str, str | None] = {}
        for n in nodes:
            auth, err = resolve_quiet(n)
            errors[n.name] = err
            verify: str | bool = n.ca_file or self.global_ca or True
            table[origin(n.url)] = Access(auth=auth, verify=verify)
        with self._lock:
            self._by_origin = table
        return errors

    def for_url(self, url: str) -> Access:
        """The :class:`Access` of the node ``url`` belongs to (no key, system CAs when
        unknown)."""
        with self._lock:
            a = self._by_origin.get(origin(url))
        return a if a is not None else Access(verify=self.global_ca or True)


def redact_snapshot(raw: str) -> str:
    """The routing snapshot JSON with every node's ``auth`` replaced by
    :data:`REDACTED` (what any serving path shows). Unparseable input is returned as is
    (the caller reports it)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return raw
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        return raw
    for n in doc["nodes"]:
        if isinstance(n, dict) and n.get("auth"):
            n["auth"] = REDACTED
    return json.dumps(doc, separators=(",", ":"))
