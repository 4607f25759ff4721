"""``infergate up``: the whole stack on one machine.

Starts, in order: its own ``redis-server`` on a free loopback port (with ``maxmemory``,
``volatile-lru`` and an append-only file in the work folder, as recommended for
production) -- or, when a Redis is named (``--redis-url``, the file's ``redis.url``,
``INFERGATE_REDIS_URL``), that one (started there when nothing answers at a local
address); three simulated
nodes of different speeds unless ``--node URL`` names real servers; the control plane
(poller, scorer, admin page and API); nginx with the rendered infergate config. The
edge requires API keys (``auth.mode = "required"``) unless the file sets ``auth.mode``:
a key for the tenant ``demo`` is created at start (the one of an earlier start is
revoked). The response cache is on unless the file sets ``cache.enabled``, with the
semantic-cache embedder (``infergate embedder``, model ``cache.embedder_model``)
started on ``cache.embedder_url`` before nginx; when the
embedder cannot start (package missing, model not loadable, port taken), the stack runs
on with the exact cache only and says so ("semantic cache off"); when it exits later,
the edge is rendered again with the semantic cache off and nginx reloaded, the embedder is
started again (on a free port when another process holds its own) and the edge pointed at
it once it answers with this stack's id (:class:`EmbedderKeeper`); the rest keeps running. Prints the URLs, the key and
a curl example; Ctrl-C or SIGTERM stops every process it started, in reverse order.

Stays up: a part that dies is restarted with back-off (0.5 s doubling to 10 s; one
line per exit with the part, its exit code, the restarts so far, its log file and, after
an error exit, the log's last line); a
part that fails 5 times within 60 s stops everything and ``up`` exits non-zero naming
it (the embedder is optional: it then stays off). Stays alone: the node registry of a
shared Redis belongs to one running ``up`` (key ``infergate:v1:stack_owner``, which the
owner refreshes; a stale claim is kept while its ``up`` still exists on this host, see
:func:`.owner.claim_registry`); another refuses to start on it unless ``--take-over`` (the
old owner then says so and runs on without renewing the key). Every part
inherits the stack's instance id (``INFERGATE_INSTANCE_ID``) and echoes it in its health
answer; ``up`` counts a part ready only with its own id there, so a process of another
stack that took a port first is never adopted (the part is retried on a new free port).
While it starts, it prints one line per part as it starts it (``starting ...``), flushed,
so a slow start (the embedder loading its model) shows where it is.

Modules: :mod:`.plan` (options and settings checked before anything starts),
:mod:`.store` (Redis), :mod:`.owner` (work-folder lock, registry owner key),
:mod:`.nodes`, :mod:`.embedder`, :mod:`.edge` (control plane and nginx), :mod:`.banner`,
:mod:`.supervise`, :mod:`.logs` (the log files kept under a size cap), and
:mod:`.command`, the command itself: a short list of these steps.
"""

from __future__ import annotations

import sys

from .banner import _again_command, banner, cli_name
from .command import DEMO_KEY_LABEL, up_cmd
from .common import LOCAL_HOSTS, START_ATTEMPTS, _say, _split_hostport, _write_runtime_config
from .edge import CP_PROBE_EVERY_S, CP_PROBE_FAILS, CP_PROBE_TIMEOUT_S, NGINX_FINISH_S
from .embedder import (EMBEDDER_START_S, PORT_RELEASE_S, EmbedderKeeper, _embedder_healthy,
                       _port_free, _start_embedder)
from .nodes import SIM_NODES, _first_model, _real_nodes, _sim_nodes
from .owner import (OWNER_REFRESH_S, OWNER_TTL_S, _describe_owner, _lock_workdir, _owner_doc,
                    _release_owner, claim_registry, refresh_owner)
from .plan import UpRun, make_plan
from .store import _ensure_redis, _own_redis, _redis_answers
from .supervise import SUPERVISE_EVERY_S, _supervise

__all__ = [
    "CP_PROBE_EVERY_S", "CP_PROBE_FAILS", "CP_PROBE_TIMEOUT_S", "DEMO_KEY_LABEL",
    "EMBEDDER_START_S", "LOCAL_HOSTS", "NGINX_FINISH_S", "OWNER_REFRESH_S", "OWNER_TTL_S",
    "PORT_RELEASE_S", "SIM_NODES", "START_ATTEMPTS", "SUPERVISE_EVERY_S", "EmbedderKeeper",
    "UpRun", "_again_command", "_describe_owner", "_embedder_healthy", "_ensure_redis",
    "_first_model", "_lock_workdir", "_own_redis", "_owner_doc", "_port_free",
    "_real_nodes", "_redis_answers", "_release_owner", "_say", "_sim_nodes",
    "_split_hostport", "_start_embedder", "_supervise", "_write_runtime_config", "banner",
    "claim_registry", "cli_name", "make_plan", "refresh_owner", "sys", "up_cmd",
]
