"""What ``infergate up`` prints once the stack is up, and how to start it again."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

import click

from controlplane.redisdb.url import redact

from .nodes import _first_model
from .plan import UpRun


def cli_name() -> str:
    """How to run this infergate from the shell ``up`` was started in: ``infergate`` when
    that name is on PATH (a venv that is activated, the runtime install's wrapper), else
    the script beside this interpreter: ``.venv/bin/infergate`` when that is where it is
    from the current folder (the README's commands), else by its absolute path, which
    works pasted in any folder."""
    if shutil.which("infergate"):
        return "infergate"
    here = Path(sys.executable).parent / "infergate"
    if not here.exists():
        return "infergate"
    local = Path(".venv", "bin", "infergate")
    try:
        if here.relative_to(Path.cwd()) == local:
            return str(local)
    except ValueError:
        pass
    return str(here)


#: How the printed command names a Redis URL that holds a password: the variable the
#: banner's ``export`` line sets (``up`` reads it when ``--redis-url`` is left out too).
REDIS_URL_FROM_ENV = '"$INFERGATE_REDIS_URL"'


def _again_command(workdir: Path) -> str:
    """The command line this ``up`` was started with (its options after ``up``, as
    typed, a ``--config`` file by its absolute path), with ``--workdir`` naming
    ``workdir``: what starts the same stack on its state again, pasted as it is. A
    ``--redis-url`` holding a password becomes ``--redis-url "$INFERGATE_REDIS_URL"``:
    the password stays off the screen and the logs, and a masked one pasted back would
    have started this stack's Redis with ``***`` for its password."""
    argv = sys.argv[1:]
    args = argv[argv.index("up") + 1:] if "up" in argv else []
    out: list[str] = []
    skip = False
    for a in args:
        if skip:
            skip = False
        elif a == "--workdir":
            skip = True
        elif a.startswith("--redis-url="):
            url = a.partition("=")[2]
            out.extend(["--redis-url", REDIS_URL_FROM_ENV if redact(url) != url else url])
        elif out and out[-1] == "--redis-url":
            out.append(REDIS_URL_FROM_ENV if redact(a) != a else a)
        elif out and out[-1] == "--config":
            out.append(os.path.abspath(a))   # pasted from any folder
        elif a.startswith("--config="):
            out.append("--config=" + os.path.abspath(a.partition("=")[2]))
        elif not a.startswith("--workdir="):
            out.append(a)
    words = [cli_name(), "up", *out, "--workdir", str(workdir)]
    return " ".join(w if w == REDIS_URL_FROM_ENV else shlex.quote(w) for w in words)


def _token_note(run: UpRun) -> str:
    if run.generated_token:
        return " (generated)"
    return " (kept from the earlier run on this folder)" if run.token_kept else ""


def _nodes_line(run: UpRun) -> str:
    """Every registered node as ``name=url``, with its state when it is not active
    (``(draining)``, ``(drained)``): after a restart on the same folder, what an earlier
    run or the operator left is shown too."""
    listed = run.registered or [(n, "active") for n in run.nodes]
    if not listed:
        return "none registered (infergate nodes add NAME URL)"
    return ", ".join(f"{n.name}={n.url}" + ("" if st == "active" else f" ({st})")
                     for n, st in listed)


def banner(run: UpRun) -> str:
    """The lines printed once every part is up: the addresses, the admin token, the
    Redis, the nodes, the caches, the demo key and a curl example."""
    settings, nodes, demo_key = run.settings, run.nodes, run.demo_key
    base = f"http://{run.edge_host}:{run.edge_port}"
    model = "sim-llama" if run.simulated else (_first_model(nodes) or "")
    model_note = "" if model else (
        "\n  (no node listed a model on GET /v1/models: put one your nodes serve, and check "
        f"they answer: {cli_name()} nodes list)")
    model = model or "<your model>"
    key_line = f"\n  API key (demo)      {demo_key}" if demo_key else ""
    key_header = f" -H 'Authorization: Bearer {demo_key}'" if demo_key else ""
    cli = cli_name()
    return f"""
infergate is up.
  edge (OpenAI API)   {base}/v1
  admin page and API  http://{run.admin_host}:{run.admin_port}/   token: {settings.controlplane.admin_token}{_token_note(run)}
  redis               {run.redis_desc}
  nodes               {_nodes_line(run)}
  response cache      {'on' if settings.cache.enabled else 'off'}; semantic cache {run.semantic_desc}
  edge metrics        {run.metrics_desc}
  logs and config     {run.wd}{key_line}

Try:
  curl -s {base}/v1/chat/completions -H 'Content-Type: application/json'{key_header} \\
    -d '{{"model": "{model}", "max_tokens": 32, "messages": [{{"role": "user", "content": "Hello!"}}]}}'{model_note}
  export INFERGATE_REDIS_URL={settings.redis.url}
  {cli} nodes list    # also: {cli} keys list, {cli} cache stats
  (or pass --config {run.cfg} to those commands)

Ctrl-C stops everything."""


def print_banner(run: UpRun) -> None:
    """Print :func:`banner` on stdout, flushed."""
    click.echo(banner(run), err=False)
    sys.stdout.flush()
