"""Where the non-Python parts live (``lua/``, ``nginx/``, ``templates/``).

They sit beside the package in the source tree; ``INFERGATE_HOME`` points elsewhere
(e.g. ``/opt/infergate`` in the container image)."""

from __future__ import annotations

import os
from pathlib import Path


def home() -> Path:
    """Root folder holding ``lua/``, ``nginx/`` and ``templates/``."""
    env = os.environ.get("INFERGATE_HOME")
    if env:
        return Path(env).resolve()
    return Path(__file__).resolve().parent.parent


def lua_dir() -> Path:
    return home() / "lua"


def nginx_templates_dir() -> Path:
    return home() / "nginx"


def web_templates_dir() -> Path:
    return home() / "templates"
