"""What the parts of ``infergate up`` share: progress lines, address parsing, the
runtime config file."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from controlplane.config import HostPort, HostPortError, Settings


LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}
#: Tries of a part on a port a free-port helper chose, when it fails to bind it.
START_ATTEMPTS = 3


def _say(line: str) -> None:
    """One progress line on stdout, flushed at once (``up`` may run under a pipe)."""
    click.echo(line)
    sys.stdout.flush()


def _split_hostport(value: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) -> (host, port) (:class:`HostPort`); raises
    ``click.BadParameter`` naming ``what``."""
    try:
        hp = HostPort.parse(value, what)
    except HostPortError as exc:
        raise click.BadParameter(str(exc)) from None
    return hp.host, hp.port


def _write_runtime_config(settings: Settings, path: Path) -> None:
    import tomli_w  # small and only needed here

    data = settings.model_dump(mode="json", exclude_none=True)
    path.write_text(tomli_w.dumps(data), encoding="utf-8")
    os.chmod(path, 0o600)
