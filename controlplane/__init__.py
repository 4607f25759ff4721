"""infergate's Python side: the control plane, the admin, the embedder, the simulated
node and the ``infergate`` command line.

Package map (docs/internals.md "Source tree" has the same map with the Lua edge):

- ``config`` -- every option: the TOML file as pydantic ``Settings``, defaults, bounds.
- ``errors`` -- ``InfergateError``, the base of every exception the package raises.
- ``edge/`` -- what the edge is handed: its options document and spec, and the nginx
  config rendered from ``nginx/*.j2`` (``infergate render-nginx``).
- ``routing/`` -- the control-plane loop (``infergate controlplane``): poll, parse
  (``nodemetrics/``), score, lead, write the routing snapshot; registry, ``wire``.
- ``cache/`` -- the response cache as stored in Redis (``store``: entries, indexes,
  counters, purge), its keys computed like the edge does (``key``), warm-up (``warmup``).
- ``embedder/`` -- the semantic-cache service (``infergate embedder``): embedding models,
  the vector index in Redis, the precision guard, its HTTP API.
- ``admin/`` -- the admin web page and JSON API (Flask, served by the control plane);
  every operator change (nodes, drain, API keys, cache purge) is one function in
  ``admin.ops``, shared with the CLI.
- ``redisdb/`` -- Redis connections and URLs (Sentinel included) and ``keynames``, every
  Redis key name.
- ``simnode/`` -- a simulated vLLM/TGI/SGLang node (``infergate simnode``) for tests,
  demos and benchmarks.
- ``cli/`` -- every click command (``up``, ``nodes``, ``keys``, ``cache``, ``embedder``,
  ``simnode``, ...); ``procs`` -- starting and stopping processes (redis-server, nginx)
  with deadlines; ``paths`` -- where ``lua/``, ``nginx/`` and ``templates/`` live.

On the request path: none of this runs per request except the embedder's
``POST /v1/lookups`` (semantic lookups after an exact-cache miss, grouped per nginx
worker, inside the edge's time budget, fail-open). Routing, admission and exact-cache hits are the Lua edge
(``lua/infergate/``) alone; the control plane only writes what the edge reads.
"""

__version__ = "0.1.0"
