"""``python -m bench.realnode build`` | ``serve --port PORT [--parallel N] [--threads T]
[--host H] [--no-metrics]`` | ``compare [options]`` (see the package docstring and
:mod:`bench.realnode.compare`)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from bench.realnode import compare
from bench.realnode.build import BuildError, ensure_binary
from bench.realnode.launch import READY_TIMEOUT_S, RealNode
from controlplane.procs import StartError


def _build() -> int:
    built = ensure_binary(say=lambda s: print(s, flush=True))
    if built.built:
        print(f"{built.path} (built in {built.seconds:.1f} s)", flush=True)
    elif built.seconds >= 1.0:
        print(f"{built.path} (built by another process; waited {built.seconds:.1f} s)", flush=True)
    else:
        print(f"{built.path} (already built)", flush=True)
    return 0


def _serve(args: argparse.Namespace) -> int:
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    node = RealNode(port=args.port, host=args.host, parallel=args.parallel,
                    threads=args.threads, metrics=args.metrics)
    node.start(timeout_s=args.ready_timeout)
    print(f"ready {node.url}", flush=True)
    try:
        while not stop.wait(0.5):
            if not node.alive():
                print("llama-server exited:\n" + node.managed.log_tail(), file=sys.stderr)
                return 1
    finally:
        node.stop()
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.realnode")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build or reuse llama-server; print its path and the time")
    s = sub.add_parser("serve", help="run llama-server with Gemma 3 270M until SIGTERM/SIGINT")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--parallel", type=int, default=2, help="slots (default 2)")
    s.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    s.add_argument("--metrics", action=argparse.BooleanOptionalAction, default=True,
                   help="serve /metrics (default on)")
    s.add_argument("--ready-timeout", type=float, default=READY_TIMEOUT_S,
                   help="seconds to wait for /health (default %(default)s)")
    c = sub.add_parser("compare", help="infergate against nginx least_conn on a pool of "
                       "llama-servers; writes bench/results/realnode_compare.json")
    compare.add_arguments(c)
    args = p.parse_args(argv)
    if args.cmd == "compare":
        return compare.run(args, list(sys.argv[2:] if argv is None else argv[1:]))
    try:
        return _build() if args.cmd == "build" else _serve(args)
    except (BuildError, StartError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
