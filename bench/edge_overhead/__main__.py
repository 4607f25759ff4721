"""``python -m bench.edge_overhead [--duration S] [--rounds R] [--semantic/--no-semantic] [--out DIR]``

What the edge costs in front of an upstream that costs nothing: a static nginx that
answers every request with a fixed chat-completion JSON (``return 200 '...'``; the
request header ``X-Bench-Answer: length`` / ``filter`` picks an answer that finished
with ``length`` / ``content_filter``). Rows, each measured with ``wrk --latency`` (POST
bodies from a wrk Lua script) at the connections of its name (no suffix: -c16):

- ``direct``: wrk -> upstream.
- ``nginx_proxy`` (also ``_c256``, ``_c1000``): wrk -> plain nginx ``proxy_pass``
  (keepalive upstream) -> upstream.
- ``lua_floor``: wrk -> an nginx whose Lua does the least any Lua edge must: the
  access phase reads and decodes the JSON body, ``balancer_by_lua`` sets the one peer,
  and empty header filter, body filter and log phases; keepalive upstream -> upstream.
  What nginx's Lua module costs before an edge does anything of its own.
- ``lua_hit_floor``: wrk -> an nginx whose content phase reads and decodes the body, GETs
  one stored answer from Redis over a pooled cosocket and prints it: the least an exact
  hit from Redis can cost in Lua.
- ``infergate``: wrk -> infergate edge (rendered config, Redis, control plane; response
  cache off) -> upstream.
- ``infergate_admission`` (also ``_c256``, ``_c1000``): the same with API keys required
  (every request carries a valid key) and a global and a per-key rate limit configured
  (high enough never to refuse: the token-bucket script runs on every request).
- ``infergate_exact_hit``: one prompt answered from the exact cache (no node).
- ``infergate_two_nodes``: as ``infergate`` with two nodes (the upstream on a second
  port): the miss is relayed by the edge over cosockets (``edge.answer_relay``; with one
  node it takes nginx's proxy path, as in ``infergate``);
  ``infergate_two_nodes_proxy_path``: the same with ``edge.answer_relay`` off.
- ``infergate_exact_hit_local``: the same with ``cache.local_ttl_ms`` = LOCAL_TTL_MS (each
  worker answers repeats from its own copy of the entry, no Redis round trip).
- ``infergate_all_hit_c1000``: ALL_HIT_PROMPTS distinct prompts, all stored, at -c1000;
  checked: share of HIT answers, 5xx, the edges' error logs (timer alerts, snapshot
  syncs that failed or were skipped) and the admin cache statistics (the Redis counters
  ``controlplane.cache.store.stats`` reads) against the edge's Prometheus counters.
- ``infergate_semantic_hit``: paraphrases answered by the semantic cache (needs the
  embedder and its bundled model; ``--no-semantic`` leaves it out).
- ``length_coalesce_on`` / ``_off``: identical requests whose answer finished with
  ``length`` (stored: ``max_tokens`` is part of the key), coalescing on and off, -c256.
- ``unstored_coalesce_on`` / ``_off``: identical requests whose answer is never stored
  (``content_filter``), coalescing on and off, -c256.

Every nginx runs one worker; wrk runs one thread. Each row is measured ``--rounds``
times, interleaved with the other rows, and the round with the median requests/s is
reported. Ratios are against the reference row of the same run (``nginx_proxy`` at the
same connections; ``*_coalesce_off`` for the coalescing rows); ``p99 added`` is the
row's p99 minus the reference's. ``CPU us/req`` is the CPU time (user + system, from
/proc) the row's own nginx worker spent per request (for ``direct`` the upstream's, for
the others the proxy's or edge's, not the upstream behind them), and ``CPU ratio`` the
reference's CPU per request over the row's: the requests/s ratio of two fully busy
workers, which other load on a shared machine moves much less than the req/s ratio.
Writes ``edge_overhead.json`` with the commit and the load average before and after.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import click
import redis
import requests

from controlplane import paths, procs
from controlplane.redisdb import keynames
from controlplane.config import Settings, settings_from_dict
from controlplane.edge.render import default_modules_dir, render_nginx, start_nginx

from ..common import (NGINX_HEAD, RESULTS_DIR, BenchError, Stack, format_table, log, machine_info,
                      sigterm_as_interrupt, tool_version, write_json)
from . import wrk

#: row -> (target, wrk connections, reference row of its ratios or None, request headers).
CASES: dict[str, tuple[str, int, str | None, dict[str, str]]] = {
    "direct": ("direct", 16, "nginx_proxy", {}),
    "nginx_proxy": ("proxy", 16, None, {}),
    "lua_floor": ("floor", 16, "nginx_proxy", {}),
    "lua_hit_floor": ("floor_hit", 16, "nginx_proxy", {}),
    "infergate": ("edge", 16, "nginx_proxy", {}),
    "infergate_two_nodes": ("edge_two", 16, "nginx_proxy", {}),
    "infergate_two_nodes_proxy_path": ("edge_two_proxy", 16, "nginx_proxy", {}),
    "infergate_admission": ("edge_admission", 16, "nginx_proxy", {}),
    "infergate_exact_hit": ("edge_cache", 16, "nginx_proxy", {}),
    "infergate_exact_hit_local": ("edge_cache_local", 16, "nginx_proxy", {}),
    "infergate_semantic_hit": ("edge_semantic", 16, "nginx_proxy", {}),
    "nginx_proxy_c256": ("proxy", 256, None, {}),
    "infergate_admission_c256": ("edge_admission", 256, "nginx_proxy_c256", {}),
    "nginx_proxy_c1000": ("proxy", 1000, None, {}),
    "infergate_admission_c1000": ("edge_admission", 1000, "nginx_proxy_c1000", {}),
    "infergate_all_hit_c1000": ("edge_cache_all", 1000, "nginx_proxy_c1000", {}),
    "length_coalesce_on": ("edge_coalesce_on", 256, "length_coalesce_off",
                           {"X-Bench-Answer": "length"}),
    "length_coalesce_off": ("edge_coalesce_off", 256, None, {"X-Bench-Answer": "length"}),
    "unstored_coalesce_on": ("edge_coalesce_on", 256, "unstored_coalesce_off",
                             {"X-Bench-Answer": "filter"}),
    "unstored_coalesce_off": ("edge_coalesce_off", 256, None, {"X-Bench-Answer": "filter"}),
}
ROWS = tuple(CASES)
#: cache.local_ttl_ms of the infergate_exact_hit_local row.
LOCAL_TTL_MS = 1000
MODEL = "static"


def _answer(finish: str, content: str) -> str:
    return json.dumps({
        "id": "chatcmpl-static", "object": "chat.completion", "created": 0, "model": MODEL,
        "choices": [{"index": 0, "finish_reason": finish,
                     "message": {"role": "assistant", "content": content}}],
        "usage": {"prompt_tokens": 9, "completion_tokens": 7, "total_tokens": 16}},
        separators=(",", ":"))


#: The upstream's answers (complete, small chat completions).
STATIC_ANSWER = _answer("stop", "Paris is the capital of France.")
LENGTH_ANSWER = _answer("length", "Paris is the")
FILTER_ANSWER = _answer("content_filter", "")
#: edge.redis_pool_size of the edges: the most wrk connections of a row, so that a worker
#: keeps a Redis connection for each request it may hold at once (with the default 64,
#: the calls beyond 64 at once connect anew, and at -c1000 those connects time out).
REDIS_POOL = 1024
#: Distinct stored prompts of the all-hit row.
ALL_HIT_PROMPTS = 500
#: A rate limit that never refuses in a run (requests per minute), global and per key.
BENCH_RPM = 10**9
#: Error-log lines that break the all-hit row's checks.
TIMER_ALERT = "lua_max_running_timers are not enough"
SNAPSHOT_SKIP = ("snapshot sync failed", "cannot start the sync timer",
                 "lua_max_pending_timers are not enough")
PROMPT = "What is the capital of France?"
#: The semantic-hit row has its own prompt (the exact-hit edge shares Redis and has
#: already stored PROMPT), paraphrases cycled by wrk, and a probe paraphrase used only
#: to wait until the embedder has indexed SEM_PROMPT.
SEM_PROMPT = "How can I improve my English speaking skills?"
#: Rewordings: the default verifier (min_verifier_score 0.95) serves only the first two,
#: which differ from SEM_PROMPT in case and punctuation; the others score lower (0.88,
#: 0.54 and 0.68 for the next three) and miss unless a domain lowers the threshold (the
#: row keeps those that hit).
PARAPHRASES = ["how can i improve my english speaking skills",
               "HOW CAN I IMPROVE MY ENGLISH SPEAKING SKILLS?",
               "How do I improve my English speaking skills?",
               "How can I improve my skills in speaking English?",
               "What can I do to improve my English speaking skills?",
               "How can I improve my spoken English?"]
PROBE = "How can I improve my English-speaking skills?"
#: Distinct bodies of the semantic-hit row (space variants of the paraphrases); more than
#: wrk sends in one measurement, so each request is new to the cache.
SEMANTIC_BODIES = 20000
#: Time budget of a semantic lookup in this row (the default 150 ms is often exceeded by
#: a CPU-only embedder on a busy 2-core machine, and the row would measure bypasses).
SEMANTIC_BUDGET_MS = 2000
MIN_SIMILARITY = 0.8

UPSTREAM_CONF = """\
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/client_body_temp;
    proxy_temp_path {prefix}/proxy_temp;
    fastcgi_temp_path {prefix}/fastcgi_temp;
    uwsgi_temp_path {prefix}/uwsgi_temp;
    scgi_temp_path {prefix}/scgi_temp;
    map $http_x_bench_answer $bench_answer {{
        default '{answer}';
        length '{length_answer}';
        filter '{filter_answer}';
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        listen 127.0.0.1:{port2} backlog=4096;
        location / {{
            default_type application/json;
            return 200 $bench_answer;
        }}
    }}
}}
"""

PROXY_CONF = NGINX_HEAD + """\
    upstream static_upstream {{
        server 127.0.0.1:{upstream_port};
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        location /v1/ {{
            proxy_pass http://static_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""

#: Redis key of the answer the hit floor serves (the benchmark's own Redis).
FLOOR_KEY = "infergate-bench:floor-answer"

#: The floors (``lua_floor``, ``lua_hit_floor``): nginx's Lua module with no logic of
#: the edge's, the same body limits as the rendered locations.
FLOOR_CONF = """\
load_module {modules_dir}/ndk_http_module.so;
load_module {modules_dir}/ngx_http_lua_module.so;
""" + NGINX_HEAD + """\
    upstream floor_upstream {{
        server 0.0.0.1;
        balancer_by_lua_block {{
            require("ngx.balancer").set_current_peer("127.0.0.1", {upstream_port})
        }}
        keepalive 64;
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 8m;
        client_body_buffer_size 8m;
        location = /v1/chat/completions {{
            access_by_lua_block {{
                ngx.req.read_body()
                local obj = require("cjson.safe").decode(ngx.req.get_body_data())
                if type(obj) ~= "table" then
                    return ngx.exit(400)
                end
            }}
            header_filter_by_lua_block {{ }}
            body_filter_by_lua_block {{ }}
            log_by_lua_block {{ }}
            proxy_pass http://floor_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
        location = /floor/hit {{
            default_type application/json;
            content_by_lua_block {{
                ngx.req.read_body()
                local obj = require("cjson.safe").decode(ngx.req.get_body_data())
                if type(obj) ~= "table" then
                    return ngx.exit(400)
                end
                local sock = ngx.socket.tcp()
                sock:settimeout(1000)
                local ok = sock:connect("127.0.0.1", {redis_port})
                local key = "{key}"
                if ok then
                    ok = sock:send("*2\\r\\n$3\\r\\nGET\\r\\n$" .. #key .. "\\r\\n" .. key .. "\\r\\n")
                end
                local line = ok and sock:receive()
                local n = line and tonumber(line:sub(2))
                local data = n and n >= 0 and sock:receive(n + 2)
                if not data then
                    return ngx.exit(502)
                end
                sock:setkeepalive(60000, 64)
                ngx.print(data:sub(1, n))
            }}
        }}
    }}
}}
"""


def space_variant(text: str, i: int) -> str:
    """``text`` with the k-th gap between words doubled where bit k of ``i`` is set, and
    ``i >> gaps`` spaces appended: ``i`` = 0 is ``text`` itself, and distinct ``i`` give
    distinct texts. The embedders' tokenizers drop repeated and trailing whitespace, so
    every variant has the same embedding (the default use-multilingual-v3 is cased: a
    case variant would not), while the exact cache key keeps the text as sent."""
    words = text.split(" ")
    gaps = len(words) - 1
    out = [words[0]]
    for k, w in enumerate(words[1:]):
        out.append("  " if (i >> k) & 1 else " ")
        out.append(w)
    return "".join(out) + " " * (i >> gaps)


def body(prompt: str) -> str:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": prompt}],
                       "temperature": 0}, separators=(",", ":"))


def cache_support(home: Path) -> tuple[bool, str]:
    """Whether this tree's edge has a response cache the bench can turn on: returns
    (available, reason when not)."""
    if not (home / "lua" / "infergate" / "cache" / "lookup.lua").exists():
        return False, ("the edge has no response cache in this tree (lua/infergate/cache/lookup.lua "
                       "is missing)")
    cache = Settings.model_fields.get("cache")
    if cache is None or "enabled" not in getattr(cache.annotation, "model_fields", {}):
        return False, "the settings have no [cache] section with 'enabled'"
    return True, ""


def edge_settings(redis_url: str, upstream_url: str, cache: dict | None,
                  metrics: bool = False, second: str = "", **sections: dict) -> Settings:
    """One-worker edge with the static upstream as its only node (kind ``openai``: no
    metrics endpoint; max_concurrency above any wrk connection count, so admission
    control never sheds what plain nginx would pass; :data:`REDIS_POOL` pooled Redis
    connections). ``cache`` is the ``[cache]``
    section (``None``: ``enabled = false``); ``metrics``: the edge's Prometheus listener
    on a free port (else none: several edges run at once); ``sections``: more settings
    sections (``auth``, ``limits``, ``edge``: more ``[edge]`` fields); ``second``: the URL
    of a second node serving the model."""
    edge = sections.pop("edge", {})
    data: dict = {"redis": {"url": redis_url},
                  "edge": {"workers": 1, "redis_pool_size": REDIS_POOL, **edge},
                  "nodes": [{"name": "static", "url": upstream_url, "kind": "openai",
                             "max_concurrency": 100000}]}
    if second:
        data["nodes"].append({"name": "static-2", "url": second, "kind": "openai",
                              "max_concurrency": 100000})
    data["edge"]["metrics_listen"] = f"127.0.0.1:{procs.free_port()}" if metrics else ""
    data["cache"] = cache if cache is not None else {"enabled": False}
    data.update(sections)
    return settings_from_dict(data, "edge overhead benchmark")


class EdgeProc:
    """A running infergate edge (nginx with the rendered config)."""

    def __init__(self, stack: Stack, name: str, settings: Settings) -> None:
        port = procs.free_port()
        d = stack.dir / name
        rendered = render_nginx(settings, d / "conf", listen=f"127.0.0.1:{port}",
                                prefix=d / "prefix", source="edge overhead benchmark")
        self.managed = stack.add(start_nginx(rendered.nginx_conf, rendered.prefix))
        self.rendered = rendered
        self.url = f"http://127.0.0.1:{port}"
        listen = settings.edge.metrics_listen
        self.metrics_url = f"http://{listen}/metrics" if listen else ""
        procs.wait_until(self._routes, 20, what=f"edge {name} to route on the snapshot")

    def _routes(self) -> bool:
        st = requests.get(f"{self.url}/infergate/status", timeout=2).json()
        return st["snapshot"]["source"] == "redis" and any(n["eligible"] for n in st["nodes"])

    def post(self, prompt: str, headers: dict | None = None) -> requests.Response:
        return requests.post(f"{self.url}/v1/chat/completions", data=body(prompt),
                             headers={"Content-Type": "application/json", **(headers or {})},
                             timeout=10)

    def error_log(self) -> str:
        try:
            return self.rendered.error_log.read_text(errors="replace")
        except OSError:
            return ""

    def cache_counters(self) -> dict[str, float]:
        """``infergate_edge_cache_requests_total`` by result, from /metrics."""
        out: dict[str, float] = {}
        text = requests.get(self.metrics_url, timeout=5).text
        for line in text.splitlines():
            if line.startswith("infergate_edge_cache_requests_total{"):
                result = line.split('result="', 1)[1].split('"', 1)[0]
                out[result] = float(line.rsplit(" ", 1)[1])
        return out


def _wait_hit(edge: EdgeProc, prompt: str, timeout: float, headers: dict | None = None) -> str:
    """Post ``prompt`` until the answer carries ``X-Cache-Status: HIT``; returns the
    last status seen. Raises ``procs.StartError`` on timeout."""
    seen = {"status": ""}

    def hit() -> bool:
        r = edge.post(prompt, headers)
        seen["status"] = r.headers.get("X-Cache-Status", f"(no X-Cache-Status, HTTP {r.status_code})")
        return r.status_code == 200 and seen["status"].upper().startswith("HIT")

    procs.wait_until(hit, timeout, interval=0.2, what=f"a cache HIT for {prompt!r}")
    return seen["status"]


@click.command()
@click.option("--duration", type=click.FloatRange(1, 120), default=4.0, show_default=True,
              help="Seconds of each wrk measurement.")
@click.option("--rounds", type=click.IntRange(1, 9), default=3, show_default=True,
              help="Measurements per row (interleaved); the median one is reported.")
@click.option("--semantic/--no-semantic", default=True, show_default=True,
              help="Measure the semantic-hit row (starts the embedder and its model).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False), default=str(RESULTS_DIR),
              show_default=True, help="Folder for edge_overhead.json.")
@click.option("--rows", "only", default="", show_default=False,
              help="Comma-separated rows to measure (default: all; their reference rows are "
                   "added).")
@click.option("--keep", is_flag=True, help="Keep the scratch folder (configs, logs).")
def main(duration: float, rounds: int, semantic: bool, out_dir: str, keep: bool,
         only: str) -> None:
    """Requests/s and p50/p99 latency of the infergate edge against plain nginx (wrk)."""
    home = paths.home()
    out = Path(out_dir)
    meta = {"benchmark": "edge_overhead", "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": " ".join(["python -m bench.edge_overhead", *sys.argv[1:]]),
            "commit": _commit(home), "loadavg_before": _loadavg(),
            "machine": machine_info(), "wrk": tool_version(["wrk", "-v"]),
            "duration_s": duration, "threads": 1, "rounds": rounds,
            "connections": {row: c[1] for row, c in CASES.items()},
            "nginx_workers": 1, "request_body": body(PROMPT), "upstream_answer": STATIC_ANSWER}
    rows: dict[str, dict] = {}
    checks: dict = {}
    t0 = time.monotonic()
    try:
        wrk.wrk_binary()
        with sigterm_as_interrupt(), Stack("infergate-bench-edge-", keep=keep) as stack:
            env = _start_targets(stack, home, rows, semantic)
            targets = env["targets"]
            cases = {row: c for row, c in CASES.items() if c[0] in targets}
            if only:
                wanted = {w.strip() for w in only.split(",") if w.strip()}
                unknown = wanted - set(CASES)
                if unknown:
                    raise BenchError(f"unknown rows: {', '.join(sorted(unknown))}")
                wanted |= {CASES[w][2] for w in wanted if CASES[w][2]}
                cases = {row: c for row, c in cases.items() if row in wanted}
            scripts = {}
            for row, (target, _, _, headers) in cases.items():
                p = stack.dir / f"{row}.lua"
                bodies = targets[target][1]
                if target.startswith("edge_coalesce_"):
                    # a prompt of the row's own: the length answer is stored, the
                    # filtered one never, and neither may answer the other row
                    bodies = [body(f"{PROMPT} ({row})")]
                p.write_text(wrk.post_script(bodies,
                                             {"Content-Type": "application/json",
                                              **env["headers"].get(target, {}), **headers}))
                scripts[row] = p
            all_hit = env.get("all_hit")
            results: dict[str, list[wrk.WrkResult]] = {n: [] for n in cases}
            cpu_us: dict[str, list[float]] = {n: [] for n in cases}
            all_hit_rounds: list[dict] = []
            for rnd in range(rounds):
                for row, (target, conns, _, _) in cases.items():
                    url = targets[target][0]
                    before = _counters(all_hit, env["redis"]) if row == "infergate_all_hit_c1000" else None
                    # a short warm-up fills keepalive pools and the Lua code cache
                    wrk.run(url, scripts[row], duration_s=1, connections=conns)
                    pid = env["pids"].get(target)
                    c0 = cpu_seconds(pid)
                    res = wrk.run(url, scripts[row], duration_s=duration, connections=conns)
                    c1 = cpu_seconds(pid)
                    if c0 is not None and c1 is not None and res.requests:
                        cpu_us[row].append(1e6 * (c1 - c0) / res.requests)
                    results[row].append(res)
                    if before is not None:
                        time.sleep(0.5)  # the flush timer writes the last counters
                        all_hit_rounds.append(_counter_delta(before, _counters(all_hit, env["redis"])))
                    log(f"round {rnd + 1}/{rounds} {row} (-c{conns}): {res.rps:.0f} req/s, p50 "
                        f"{res.p50_ms:.3f} ms, p99 {res.p99_ms:.3f} ms, non-2xx {res.non_2xx}, "
                        f"statuses {res.statuses}")
            for row, rs in results.items():
                ordered = sorted(rs, key=lambda r: r.rps)
                best = ordered[len(ordered) // 2]
                cpus = sorted(cpu_us[row])
                rows[row] = {"row": row, "available": True, "reason": None,
                             "connections": cases[row][1], **asdict(best),
                             "rounds_rps": [round(r.rps, 1) for r in rs],
                             "cpu_us_per_request": round(cpus[len(cpus) // 2], 1) if cpus else None,
                             "rounds_cpu_us": [round(c, 1) for c in cpu_us[row]]}
            if all_hit is not None and "infergate_all_hit_c1000" in results:
                checks["all_hit"] = _all_hit_checks(results["infergate_all_hit_c1000"],
                                                    all_hit_rounds, env["edges"])
            if "edge_semantic" in targets:
                # one connection: the cost of a lookup without queueing behind others
                url, _ = targets["edge_semantic"]
                one = wrk.run(url, scripts["infergate_semantic_hit"], duration_s=duration,
                              connections=1)
                rows["infergate_semantic_hit"]["one_connection"] = asdict(one)
                log(f"infergate_semantic_hit, 1 connection: {one.rps:.0f} req/s, p50 "
                    f"{one.p50_ms:.3f} ms, p99 {one.p99_ms:.3f} ms, statuses {one.statuses}")
    except KeyboardInterrupt:
        log("interrupted: every process started was stopped")
        sys.exit(130)
    except (procs.StartError, wrk.WrkError, BenchError) as exc:
        raise click.ClickException(str(exc)) from None

    records = finish_records(rows)
    checks["targets"] = target_checks(records, checks.get("all_hit"))
    meta["elapsed_s"] = round(time.monotonic() - t0, 1)
    meta["loadavg_after"] = _loadavg()
    write_json(out / "edge_overhead.json", {"meta": meta, "rows": records, "checks": checks})
    print(format_table(table_rows(records), COLUMNS))
    for r in records:
        if not r["available"]:
            print(f"{r['row']}: not available: {r['reason']}")
    print()
    for line in checks["targets"]:
        print(line)
    print(f"\nwrk -t1 --latency -d{duration:g}s, median of {rounds} rounds; "
          f"{meta['machine']['nproc']} CPUs; commit {meta['commit']}; load average "
          f"{meta['loadavg_before']} before, {meta['loadavg_after']} after; "
          f"wrote {out / 'edge_overhead.json'}")


def worker_pid(prefix: Path) -> int | None:
    """The pid of the (single) worker of the nginx whose prefix is ``prefix``, or None."""
    import os

    pids = list(Path(prefix).rglob("nginx.pid"))
    if not pids:
        return None
    master = pids[0].read_text().strip()
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        if stat.rsplit(")", 1)[1].split()[1] == master:
            return int(p)
    return None


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (None when unknown)."""
    import os

    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _commit(home: Path) -> str:
    """Short commit of the tree (``+dirty`` with uncommitted changes), or "unknown"."""
    import subprocess

    try:
        head = subprocess.run(["git", "-C", str(home), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(home), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head + ("+dirty" if dirty else "")) if head else "unknown"


def _loadavg() -> list[float]:
    import os

    return [round(x, 2) for x in os.getloadavg()]


def _counters(edge: "EdgeProc", r: redis.Redis) -> dict:
    """The edge's Prometheus cache counters and the admin cache statistics (Redis)."""
    from controlplane.cache import store

    st = store.stats(r)
    return {"prom": edge.cache_counters(),
            "admin": {"lookups": st.lookups, "hits_exact": st.hits_exact, "misses": st.misses,
                      "bypass": st.bypass}}


def _counter_delta(before: dict, after: dict) -> dict:
    prom = {k: after["prom"].get(k, 0) - before["prom"].get(k, 0)
            for k in set(after["prom"]) | set(before["prom"])}
    admin = {k: after["admin"][k] - before["admin"][k] for k in after["admin"]}
    return {"prom": prom, "admin": admin}


def _all_hit_checks(runs: list[wrk.WrkResult], deltas: list[dict], edges: list[EdgeProc]) -> dict:
    """The all-hit row's checks over every round: HIT share, 5xx, error-log alerts,
    admin statistics against Prometheus (hits and lookups, as a relative difference)."""
    total = sum(r.requests for r in runs)
    hits = sum((r.statuses or {}).get("cache:HIT", 0) for r in runs)
    answered = sum(sum(v for k, v in (r.statuses or {}).items() if k.isdigit()) for r in runs)
    five = sum(v for r in runs for k, v in (r.statuses or {}).items() if k.isdigit() and k >= "500")
    logs = "".join(e.error_log() for e in edges)
    prom_hits = sum(d["prom"].get("hit_exact", 0) for d in deltas)
    admin_hits = sum(d["admin"]["hits_exact"] for d in deltas)
    prom_lookups = sum(d["prom"].get("hit_exact", 0) + d["prom"].get("miss", 0) for d in deltas)
    admin_lookups = sum(d["admin"]["lookups"] for d in deltas)

    def rel(a: float, b: float) -> float | None:
        return round(abs(a - b) / b, 5) if b else None

    return {"requests": total, "answered": answered, "hit": hits,
            "hit_share": round(hits / answered, 5) if answered else None, "5xx": five,
            "timer_alerts": logs.count(TIMER_ALERT),
            "snapshot_skips": sum(logs.count(s) for s in SNAPSHOT_SKIP),
            "prom_hits": prom_hits, "admin_hits": admin_hits,
            "prom_lookups": prom_lookups, "admin_lookups": admin_lookups,
            "stats_difference": rel(admin_hits, prom_hits),
            "lookups_difference": rel(admin_lookups, prom_lookups)}


def _start_targets(stack: Stack, home: Path, rows: dict[str, dict], semantic: bool) -> dict:
    """Start the upstream, the proxy, Redis, the control plane and the edges. Returns
    {"targets": target -> (url, bodies), "headers": target -> request headers, "redis",
    "all_hit": the all-hit edge, "edges": every edge}. Rows that cannot run are recorded
    in ``rows`` as not available."""
    up_port = procs.free_port()
    d = stack.dir / "upstream"
    (d / "logs").mkdir(parents=True)
    conf = d / "nginx.conf"
    up_port2 = procs.free_port()
    conf.write_text(UPSTREAM_CONF.format(prefix=d, port=up_port, port2=up_port2,
                                         answer=STATIC_ANSWER,
                                         length_answer=LENGTH_ANSWER, filter_answer=FILTER_ANSWER))
    stack.add(start_nginx(conf, d))
    upstream = f"http://127.0.0.1:{up_port}"

    px_port = procs.free_port()
    d = stack.dir / "proxy"
    (d / "logs").mkdir(parents=True)
    conf = d / "nginx.conf"
    conf.write_text(PROXY_CONF.format(prefix=d, port=px_port, upstream_port=up_port))
    stack.add(start_nginx(conf, d))
    proxy = f"http://127.0.0.1:{px_port}"

    rport = procs.free_port()
    stack.add(procs.start_redis(stack.dir / "redis", rport))
    redis_url = f"redis://127.0.0.1:{rport}/0"
    r = redis.Redis.from_url(redis_url, socket_timeout=5, decode_responses=True)
    base = edge_settings(redis_url, upstream, None)
    _start_controlplane(stack, base)

    chat = "/v1/chat/completions"
    targets = {"direct": (upstream + chat, [body(PROMPT)]),
               "proxy": (proxy + chat, [body(PROMPT)])}
    headers: dict[str, dict] = {}
    edges: list[EdgeProc] = []
    pids = {"direct": worker_pid(stack.dir / "upstream"), "proxy": worker_pid(stack.dir / "proxy")}
    env = {"targets": targets, "headers": headers, "redis": r, "all_hit": None, "edges": edges,
           "pids": pids}

    fl_port = procs.free_port()
    d = stack.dir / "floor"
    (d / "logs").mkdir(parents=True)
    conf = d / "nginx.conf"
    conf.write_text(FLOOR_CONF.format(prefix=d, port=fl_port, upstream_port=up_port,
                                      redis_port=rport, key=FLOOR_KEY,
                                      modules_dir=default_modules_dir()))
    r.set(FLOOR_KEY, STATIC_ANSWER)
    stack.add(start_nginx(conf, d))
    targets["floor"] = (f"http://127.0.0.1:{fl_port}{chat}", [body(PROMPT)])
    targets["floor_hit"] = (f"http://127.0.0.1:{fl_port}/floor/hit", [body(PROMPT)])
    pids["floor"] = pids["floor_hit"] = worker_pid(d)

    edge = EdgeProc(stack, "edge", base)
    edges.append(edge)
    targets["edge"] = (edge.url + chat, [body(PROMPT)])
    pids["edge"] = worker_pid(edge.rendered.prefix)

    # two nodes: their own routing snapshot, in Redis database 1
    second, redis_two = f"http://127.0.0.1:{up_port2}", f"redis://127.0.0.1:{rport}/1"
    _start_controlplane(stack, edge_settings(redis_two, upstream, None, second=second), "two")
    for target, relay in (("edge_two", True), ("edge_two_proxy", False)):
        two = EdgeProc(stack, target.replace("_", "-"),
                       edge_settings(redis_two, upstream, None, second=second,
                                     edge={"answer_relay": relay}))
        edges.append(two)
        targets[target] = (two.url + chat, [body(PROMPT)])
        pids[target] = worker_pid(two.rendered.prefix)

    from controlplane.admin import apikeys

    key, _ = apikeys.create_key(r, "bench", rpm=BENCH_RPM, label="edge overhead benchmark")
    adm = EdgeProc(stack, "edge-admission", edge_settings(
        redis_url, upstream, None, auth={"mode": "required"},
        limits={"global_rpm": BENCH_RPM}))
    edges.append(adm)
    headers["edge_admission"] = {"Authorization": f"Bearer {key}"}
    if adm.post(PROMPT, headers["edge_admission"]).status_code != 200:
        raise BenchError("the edge with API keys and rate limits refused the benchmark's key")
    targets["edge_admission"] = (adm.url + chat, [body(PROMPT)])
    pids["edge_admission"] = worker_pid(adm.rendered.prefix)

    ok, reason = cache_support(home)
    if not ok:
        for row, c in CASES.items():
            if c[0].startswith("edge_cache") or c[0].startswith("edge_coalesce") or c[0] == "edge_semantic":
                rows[row] = {"row": row, "available": False, "reason": reason}
        return env
    try:
        exact = EdgeProc(stack, "edge-exact",
                         edge_settings(redis_url, upstream, {"enabled": True, "semantic": False},
                                       metrics=True))
        edges.append(exact)
        status = _wait_hit(exact, PROMPT, 15)
        log(f"exact-hit edge primed ({status})")
        targets["edge_cache"] = (exact.url + chat, [body(PROMPT)])
        prompts = [f"{PROMPT} (all-hit {i})" for i in range(ALL_HIT_PROMPTS)]
        for p in prompts:
            exact.post(p)
        for p in prompts:
            _wait_hit(exact, p, 15)
        log(f"all-hit: {len(prompts)} prompts stored")
        targets["edge_cache_all"] = (exact.url + chat, [body(p) for p in prompts])
        pids["edge_cache"] = pids["edge_cache_all"] = worker_pid(exact.rendered.prefix)
        env["all_hit"] = exact
    except (procs.StartError, requests.RequestException, ValueError) as exc:
        for row in ("infergate_exact_hit", "infergate_all_hit_c1000"):
            rows[row] = {"row": row, "available": False,
                         "reason": f"cache on, but no exact hit: {exc}"}
    try:
        local = EdgeProc(stack, "edge-exact-local",
                         edge_settings(redis_url, upstream, {"enabled": True, "semantic": False,
                                                             "local_ttl_ms": LOCAL_TTL_MS}))
        edges.append(local)
        status = _wait_hit(local, PROMPT, 15)
        log(f"exact-hit edge with worker copies primed ({status})")
        targets["edge_cache_local"] = (local.url + chat, [body(PROMPT)])
        pids["edge_cache_local"] = worker_pid(local.rendered.prefix)
    except (procs.StartError, requests.RequestException, ValueError) as exc:
        rows["infergate_exact_hit_local"] = {"row": "infergate_exact_hit_local", "available": False,
                                             "reason": f"cache on, but no exact hit: {exc}"}
    for onoff, flag in (("on", True), ("off", False)):
        e = EdgeProc(stack, f"edge-coalesce-{onoff}", edge_settings(
            redis_url, upstream, {"enabled": True, "semantic": False, "coalesce": flag}))
        edges.append(e)
        targets[f"edge_coalesce_{onoff}"] = (e.url + chat, [body(PROMPT)])
        pids[f"edge_coalesce_{onoff}"] = worker_pid(e.rendered.prefix)
    if semantic:
        try:
            targets["edge_semantic"] = _semantic_target(stack, redis_url, upstream)
        except (procs.StartError, requests.RequestException, ValueError, BenchError) as exc:
            rows["infergate_semantic_hit"] = {"row": "infergate_semantic_hit", "available": False,
                                              "reason": f"semantic hit path could not be set up: {exc}"}
    else:
        rows["infergate_semantic_hit"] = {"row": "infergate_semantic_hit", "available": False,
                                          "reason": "left out (--no-semantic)"}
    return env


def _start_controlplane(stack: Stack, settings: Settings, name: str = "infergate") -> None:
    import tomli_w

    s = settings.model_copy(deep=True)
    cport = procs.free_port()
    s.controlplane.listen = f"127.0.0.1:{cport}"
    cfg = stack.dir / f"{name}.toml"
    cfg.write_text(tomli_w.dumps(s.model_dump(mode="json", exclude_none=True)), encoding="utf-8")
    m = stack.add(procs.Managed(f"controlplane ({name})",
                                procs.infergate_argv("controlplane", "--config", str(cfg)),
                                stack.dir / "logs" / f"controlplane-{name}.log").start())
    r = redis.Redis.from_url(s.redis.url, socket_timeout=2)
    m.wait_ready(lambda: r.get(keynames.ROUTING) is not None, 60)


def _semantic_target(stack: Stack, redis_url: str, upstream: str) -> tuple[str, list[str]]:
    """Start the embedder (its default model, in-process index) and an edge with the
    semantic cache on; store SEM_PROMPT, wait until a probe paraphrase hits it
    semantically, keep the paraphrases whose first space variant is a semantic hit, and
    return :data:`SEMANTIC_BODIES` other space variants of them (each text new to the
    cache).
    Raises :class:`BenchError` when no paraphrase hits."""
    eport = procs.free_port()
    emb = stack.add(procs.Managed("embedder", procs.infergate_argv(
        "embedder", "--listen", f"127.0.0.1:{eport}", "--redis-url", redis_url,
        "--index", "local", "--threads", "4"), stack.dir / "logs" / "embedder.log").start())
    emb.wait_ready(lambda: requests.get(f"http://127.0.0.1:{eport}/healthz", timeout=2).ok, 180)
    settings = edge_settings(redis_url, upstream, {
        "enabled": True, "semantic": True, "embedder_url": f"http://127.0.0.1:{eport}",
        "min_similarity": MIN_SIMILARITY, "semantic_budget_ms": SEMANTIC_BUDGET_MS})
    edge = EdgeProc(stack, "edge-semantic", settings)
    first = _wait_hit(edge, SEM_PROMPT, 30)
    log(f"semantic edge: the prompt is stored ({first})")
    seen = {"match": "", "n": 0}

    def probe_hits() -> bool:
        # a new text every time: a probe that hit once would be an exact hit afterwards
        seen["n"] += 1
        r = edge.post(space_variant(PROBE, seen["n"]))
        seen["match"] = (f"{r.status_code} {r.headers.get('X-Cache-Status')} "
                         f"{r.headers.get('X-Cache-Match')} {r.headers.get('X-Cache-Similarity')}")
        return r.headers.get("X-Cache-Match") == "semantic"

    try:
        procs.wait_until(probe_hits, 60, interval=0.2, what=f"a semantic hit for {PROBE!r}")
    except procs.StartError as exc:
        raise BenchError(f"{exc} (last answer: {seen['match']})") from None
    kept = []
    for p in PARAPHRASES:
        r = edge.post(space_variant(p, 1))
        match = r.headers.get("X-Cache-Match")
        log(f"paraphrase {p!r}: {r.headers.get('X-Cache-Status')} {match} "
            f"similarity {r.headers.get('X-Cache-Similarity')}")
        if match == "semantic":
            kept.append(p)
    if not kept:
        raise BenchError(f"no paraphrase hit semantically at min_similarity {MIN_SIMILARITY}")
    # A semantic hit is remembered under the paraphrase's own exact key, so only a text
    # never sent before takes the semantic path: every body is a new space variant (the
    # precision guard rejects added words or numbers; the tokenizer drops extra spaces).
    return edge.url + "/v1/chat/completions", [
        body(space_variant(kept[i % len(kept)], 2 + i // len(kept))) for i in range(SEMANTIC_BODIES)]


COLUMNS = [("row", "row"), ("connections", "-c"), ("rps", "req/s"), ("p50_ms", "p50 ms"),
           ("p99_ms", "p99 ms"), ("rps_ratio", "req/s ratio"), ("p99_added_ms", "p99 added ms"),
           ("cpu_us_per_request", "CPU us/req"), ("cpu_ratio", "CPU ratio"),
           ("non_2xx", "non-2xx"), ("hit_share", "HIT")]


def finish_records(rows: dict[str, dict]) -> list[dict]:
    """Rows in :data:`ROWS` order with the ratios to their reference row of the same run
    (:data:`CASES`): ``rps_ratio`` = rps / reference rps; ``p50_ratio``, ``p99_ratio`` =
    latency / reference latency; ``p99_added_ms`` = p99 - reference p99; ``cpu_ratio`` =
    reference CPU per request / CPU per request; ``hit_share`` = share of answers with
    X-Cache-Status HIT. Rows never measured become "not available"."""
    out = []
    for name in ROWS:
        r = dict(rows.get(name) or {"row": name, "available": False, "reason": "not measured"})
        ref_name = CASES[name][2]
        ref = rows.get(ref_name) if ref_name else None
        if r.get("available"):
            r.setdefault("connections", CASES[name][1])
            st = r.get("statuses") or {}
            answered = sum(v for k, v in st.items() if k.isdigit())
            if "cache:HIT" in st and answered:
                r["hit_share"] = round(st["cache:HIT"] / answered, 4)
            if ref and ref.get("available"):
                r["reference"] = ref_name
                r["rps_ratio"] = round(r["rps"] / ref["rps"], 3) if ref["rps"] else None
                r["p50_ratio"] = round(r["p50_ms"] / ref["p50_ms"], 3) if ref["p50_ms"] else None
                r["p99_ratio"] = round(r["p99_ms"] / ref["p99_ms"], 3) if ref["p99_ms"] else None
                r["p99_added_ms"] = round(r["p99_ms"] - ref["p99_ms"], 3)
                if r.get("cpu_us_per_request") and ref.get("cpu_us_per_request"):
                    # requests/s one fully busy worker would serve, against the reference's
                    r["cpu_ratio"] = round(ref["cpu_us_per_request"] / r["cpu_us_per_request"], 3)
        out.append(r)
    return out


def target_checks(records: list[dict], all_hit: dict | None) -> list[str]:
    """One line per target: the figure, the target and "met" or "MISSED"."""
    by = {r["row"]: r for r in records}
    lines = []

    def line(what: str, ok: bool | None, figure: str) -> None:
        verdict = "not measured" if ok is None else ("met" if ok else "MISSED")
        lines.append(f"{what}: {figure} -> {verdict}")

    for row in ("infergate_admission", "infergate_admission_c256"):
        r = by.get(row, {})
        if r.get("rps_ratio") is None:
            line(f"{row} >= 0.8x nginx req/s, p99 added <= 2 ms", None, "-")
            continue
        line(f"{row} (-c{r['connections']}) >= 0.8x nginx req/s, p99 added <= 2 ms",
             r["rps_ratio"] >= 0.8 and r["p99_added_ms"] <= 2.0,
             f"{r['rps_ratio']:.3f}x, p99 added {r['p99_added_ms']:.2f} ms{_cpu(r)}"
             f"{_floor(by.get('lua_floor'))}")
    for row in ("infergate_exact_hit", "infergate_exact_hit_local"):
        r = by.get(row, {})
        line(f"{row} >= 1.0x nginx proxy_pass req/s",
             None if r.get("rps_ratio") is None else r["rps_ratio"] >= 1.0,
             f"{r['rps_ratio']:.3f}x{_cpu(r)}{_floor(by.get('lua_hit_floor'))}"
             if r.get("rps_ratio") is not None else "-")
    if all_hit:
        diff = all_hit["stats_difference"]
        ok = (all_hit["hit_share"] is not None and all_hit["hit_share"] >= 0.99
              and all_hit["5xx"] == 0 and all_hit["timer_alerts"] == 0
              and all_hit["snapshot_skips"] == 0 and diff is not None and diff <= 0.01
              and (all_hit["lookups_difference"] or 0) <= 0.01)
        line("infergate_all_hit_c1000: >= 99 % HIT, 0 5xx, 0 timer alerts, 0 skipped snapshot "
             "syncs, admin statistics = Prometheus within 1 %", ok,
             f"{100 * (all_hit['hit_share'] or 0):.2f} % HIT, {all_hit['5xx']} 5xx, "
             f"{all_hit['timer_alerts']} timer alerts, {all_hit['snapshot_skips']} snapshot skips, "
             f"hits admin {all_hit['admin_hits']} vs Prometheus {all_hit['prom_hits']} "
             f"({100 * (diff or 0):.2f} %)")
    else:
        line("infergate_all_hit_c1000", None, "-")
    for row in ("length_coalesce_on", "unstored_coalesce_on"):
        r = by.get(row, {})
        line(f"{row}: coalescing on >= off req/s",
             None if r.get("rps_ratio") is None else r["rps_ratio"] >= 0.95,
             f"{r['rps_ratio']:.3f}x of off (met at >= 0.95: noise of a shared machine)"
             if r.get("rps_ratio") is not None else "-")
    return lines


def _cpu(r: dict) -> str:
    return f" ({r['cpu_ratio']:.3f}x by CPU per request)" if r.get("cpu_ratio") else ""


def _floor(r: dict | None) -> str:
    """``"; floor <row> 0.8x (0.78x by CPU)"``: the -c16 floor row's ratios, or ""."""
    if not r or r.get("rps_ratio") is None:
        return ""
    cpu = f", {r['cpu_ratio']:.3f}x by CPU" if r.get("cpu_ratio") else ""
    return f"; floor {r['row']}: {r['rps_ratio']:.3f}x{cpu}"


def table_rows(records: list[dict]) -> list[dict]:
    """Records for the printed table; unavailable rows say so in the req/s column."""
    out = []
    for r in records:
        if r.get("available"):
            out.append(r)
        else:
            out.append({"row": r["row"], "rps": "not available"})
    return out


if __name__ == "__main__":
    main()
