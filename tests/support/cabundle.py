"""A throwaway one-certificate CA as the system bundle of every part the tests start.

Every rendered API location loads the system CA bundle (controlplane.edge.render:
``$SSL_CERT_FILE``, else Debian's 144 certificates, 0.5 s of CPU per nginx start or
``nginx -t``). :func:`install` points ``SSL_CERT_FILE`` at a CA of one certificate for
the whole run, before any part starts, so that every nginx of the tests (edge_factory,
``infergate up``, render-nginx) starts in a few milliseconds. No test trusts it: the TLS
tests bring their own CAs. A child that reaches real TLS servers (pip) gets
:data:`ORIGINAL` back."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

#: ``SSL_CERT_FILE`` as it was before :func:`install` (None: unset).
ORIGINAL: str | None = os.environ.get("SSL_CERT_FILE")


def install() -> Path:
    """Write the CA into a temporary folder (removed at exit), set ``SSL_CERT_FILE``
    to it and return its path. Raises ``subprocess.CalledProcessError`` without openssl."""
    folder = Path(tempfile.mkdtemp(prefix="infergate-test-ca-"))
    atexit.register(shutil.rmtree, folder, True)
    ca = folder / "unused-ca.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2", "-subj",
                    "/CN=infergate tests unused CA", "-keyout", str(folder / "key.pem"),
                    "-out", str(ca)], check=True, capture_output=True)
    os.environ["SSL_CERT_FILE"] = str(ca)
    return ca


def real_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``SSL_CERT_FILE`` as it was before :func:`install`."""
    out = {k: v for k, v in env.items() if k != "SSL_CERT_FILE"}
    if ORIGINAL:
        out["SSL_CERT_FILE"] = ORIGINAL
    return out
