"""Helpers shared by the benchmarks: statistics, machine facts, prompt data, tables,
JSON output and a process stack that is torn down on exit, Ctrl-C or SIGTERM.

Everything here except :class:`Stack` is pure and is tested in tests/unit/test_bench_smoke.py.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from controlplane import procs

REPO_ROOT = Path(__file__).resolve().parent.parent
#: Default location of the labelled paraphrase sets (see /work/shared/DESIGN.md).
DEFAULT_DATA_DIR = REPO_ROOT.parent / "shared" / "data" / "cache-eval"
RESULTS_DIR = REPO_ROOT / "bench" / "results"


class BenchError(RuntimeError):
    """A benchmark cannot run (missing tool or data, bad option); the message says why."""


# --------------------------------------------------------------------------- statistics

def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) of ``values`` with linear interpolation between
    closest ranks (numpy's default "linear" method). ``None`` for no values.

    Raises ``ValueError`` when ``q`` is outside 0-100."""
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within 0-100, got {q}")
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    frac = pos - lo
    return float(xs[lo] + (xs[hi] - xs[lo]) * frac)


def mean(values: Iterable[float]) -> float | None:
    """Arithmetic mean, ``None`` for no values."""
    xs = list(values)
    return sum(xs) / len(xs) if xs else None


def rounded(value: float | None, digits: int = 4) -> float | None:
    """``round(value, digits)`` that keeps ``None``."""
    return None if value is None else round(float(value), digits)


# --------------------------------------------------------------------------- machine

def machine_info() -> dict[str, Any]:
    """Facts about the machine a run is on: ``nproc`` (CPUs usable by this process),
    ``cpu_model`` (first "model name" of /proc/cpuinfo), ``mem_total_gib`` (MemTotal of
    /proc/meminfo), ``loadavg_1m`` at the time of the call, kernel, Python and nginx
    versions, and the git commit of the code measured. Missing sources give ``None``,
    never an error."""
    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem_gib = None
    try:
        m = re.search(r"^MemTotal:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        if m:
            mem_gib = round(int(m.group(1)) / 1024 / 1024, 1)
    except OSError:
        pass
    try:
        load1 = round(os.getloadavg()[0], 2)
    except OSError:
        load1 = None
    return {
        "nproc": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "cpu_model": cpu_model,
        "mem_total_gib": mem_gib,
        "loadavg_1m": load1,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "nginx": tool_version(["nginx", "-v"]),
        "commit": git_commit(),
    }


def git_commit(path: Path = REPO_ROOT) -> str | None:
    """``git describe --always --dirty`` of the tree at ``path`` (the code measured), or
    ``None`` when it is not a git checkout."""
    try:
        res = subprocess.run(["git", "-C", str(path), "describe", "--always", "--dirty"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return res.stdout.strip() or None if res.returncode == 0 else None


def tool_version(argv: list[str]) -> str | None:
    """First line a ``--version``-like command prints (stdout or stderr), or ``None``."""
    exe = shutil.which(argv[0]) or shutil.which(argv[0], path="/usr/sbin:/sbin")
    if not exe:
        return None
    try:
        res = subprocess.run([exe, *argv[1:]], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    out = (res.stdout or res.stderr).strip().splitlines()
    return out[0] if out else None


# --------------------------------------------------------------------------- prompts

def _texts_from_jsonl(path: Path) -> list[str]:
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out += [v for v in obj.values() if isinstance(v, str)]
        elif isinstance(obj, str):
            out.append(obj)
    return out


def _texts_from_tsv(path: Path) -> list[str]:
    out = []
    lines = path.read_text(encoding="utf-8").splitlines()
    if not lines:
        return out
    header = lines[0].split("\t")
    cols = [i for i, h in enumerate(header) if h.startswith("text")] or [0]
    for line in lines[1:]:
        parts = line.split("\t")
        out += [parts[i] for i in cols if i < len(parts)]
    return out


def load_prompts(path: str | Path | None = None) -> list[str]:
    """Distinct, non-empty prompts, in a stable order.

    ``path``: a folder in the layout of ``shared/data/cache-eval`` (every ``*.jsonl``:
    the string fields of each object; every ``*.tsv``: the ``text*`` columns), or any
    text file (one prompt per non-empty line). ``None``: :data:`DEFAULT_DATA_DIR`.

    Raises :class:`BenchError` when the path does not exist or holds no prompt."""
    p = Path(path) if path is not None else DEFAULT_DATA_DIR
    if not p.exists():
        if path is None:
            raise BenchError(f"prompt data not found: {p} does not exist. Pass --prompts FILE "
                             "(a text file, one prompt per line) or a folder laid out like "
                             "shared/data/cache-eval")
        raise BenchError(f"--prompts {p}: no such file or folder")
    texts: list[str] = []
    if p.is_dir():
        for f in sorted(p.iterdir()):
            if f.suffix == ".jsonl":
                texts += _texts_from_jsonl(f)
            elif f.suffix == ".tsv":
                texts += _texts_from_tsv(f)
    else:
        try:
            texts = p.read_text(encoding="utf-8").splitlines()
        except UnicodeDecodeError:
            raise BenchError(f"--prompts {p}: not a UTF-8 text file") from None
    seen: set[str] = set()
    out = []
    for t in texts:
        t = t.strip()
        if t and t not in seen:
            seen.add(t)
            out.append(t)
    if not out:
        raise BenchError(f"{p}: no prompt found (expected *.jsonl / *.tsv files in a folder, "
                         "or a text file with one prompt per line)")
    return out


# --------------------------------------------------------------------------- output

def format_table(rows: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    """A plain-text table (also valid Markdown): ``columns`` are (key, header) pairs;
    floats are printed with 3 significant decimals, ``None`` as ``-``."""
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            if v == 0:
                return "0"
            if abs(v) >= 100:
                return f"{v:.0f}"
            if abs(v) >= 10:
                return f"{v:.1f}"
            if abs(v) >= 1:
                return f"{v:.2f}"
            return f"{v:.3f}"
        return str(v)

    head = [h for _, h in columns]
    body = [[cell(r.get(k)) for k, _ in columns] for r in rows]
    widths = [max(len(head[i]), *(len(b[i]) for b in body)) if body else len(head[i])
              for i in range(len(head))]
    lines = ["| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    for b in body:
        lines.append("| " + " | ".join(c.rjust(w) if i else c.ljust(w)
                                       for i, (c, w) in enumerate(zip(b, widths))) + " |")
    return "\n".join(lines)


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON (atomically: temp file, then rename)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_suffix(p.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    tmp.replace(p)
    return p


# --------------------------------------------------------------------------- processes

class Stack(procs.ProcessSet):
    """Processes of one benchmark plus a scratch folder (mode 0755 so nginx workers
    running as ``nobody`` can read their configuration). Use as a context manager:
    everything is stopped and the folder removed on exit, on an exception and on
    Ctrl-C; :func:`sigterm_as_interrupt` turns SIGTERM into the same path."""

    def __init__(self, prefix: str = "infergate-bench-", keep: bool = False) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix=prefix))
        os.chmod(self.dir, 0o755)
        self.keep = keep

    def __enter__(self) -> "Stack":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every process (last started first) and remove the scratch folder."""
        try:
            self.stop_all()
        finally:
            if not self.keep:
                shutil.rmtree(self.dir, ignore_errors=True)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises ``KeyboardInterrupt`` (so ``finally`` blocks
    and context managers tear the stack down as on Ctrl-C)."""
    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def log(msg: str) -> None:
    """Progress line on stderr with the wall-clock time."""
    print(time.strftime("%H:%M:%S ") + msg, file=sys.stderr, flush=True)


#: The start of the plain nginx configs the benchmarks render (a ``str.format`` template
#: with ``{prefix}``; the ``http {{`` block stays open for the caller's lines).
NGINX_HEAD = """\
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/logs/error.log warn;
events {{ worker_connections 4096; }}
http {{
    log_format bench '$remote_addr [$time_local] "$request" $status $body_bytes_sent '
                     'rt=$request_time ua="$upstream_addr" us="$upstream_status"';
    access_log {prefix}/logs/access.log bench;
    client_body_temp_path {prefix}/client_body_temp;
    proxy_temp_path {prefix}/proxy_temp;
    fastcgi_temp_path {prefix}/fastcgi_temp;
    uwsgi_temp_path {prefix}/uwsgi_temp;
    scgi_temp_path {prefix}/scgi_temp;
"""


def comma_names(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    """The comma-separated names of a command-line option, each one of ``allowed``.
    Raises click.BadParameter naming the unknown ones."""
    import click

    out = [x.strip() for x in value.split(",") if x.strip()]
    bad = [x for x in out if x not in allowed]
    if bad or not out:
        raise click.BadParameter(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return out
