"""The admin web page and JSON API (Flask), served by the control plane under waitress.

``create_app(settings, r)`` builds the app; the control plane serves it on
``controlplane.listen``. Every route except ``GET /healthz`` needs the admin token
(``controlplane.admin_token`` / env ``INFERGATE_ADMIN_TOKEN``).
"""

from __future__ import annotations

import flask
import redis

from ..config import Settings
from ..paths import web_templates_dir


def create_app(settings: Settings, r: redis.Redis) -> flask.Flask:
    """Build the admin Flask app bound to ``settings`` and the Redis client ``r``
    (built with ``decode_responses=True``).

    ``GET /healthz`` -> ``{"ok": true}`` (no auth; liveness of the web server only)."""
    app = flask.Flask(__name__, template_folder=str(web_templates_dir()))
    app.extensions["infergate"] = {"settings": settings, "redis": r}

    @app.get("/healthz")
    def healthz() -> flask.Response:
        return flask.jsonify({"ok": True})

    return app
