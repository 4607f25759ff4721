"""A real inference engine for tests and benchmarks: llama.cpp's ``llama-server``
(continuous batching, ``--parallel`` slots, ``/health``, ``/metrics``, ``/slots``,
``/props``, the OpenAI API) serving Gemma 3 270M on the CPU.

``python -m bench.realnode build`` builds or reuses the binary (:mod:`.build`);
``python -m bench.realnode serve --port PORT`` runs one server until SIGTERM/SIGINT
(:mod:`.launch`); ``python -m bench.realnode compare`` runs infergate against nginx
``least_conn`` on a pool of them (:mod:`.compare`). Tests use :class:`RealNode` directly."""

from bench.realnode.build import VERSION, BuildError, Built, cache_dir, ensure_binary, find_binary
from bench.realnode.launch import MODEL_ALIAS, RealNode, model_path, server_argv

__all__ = ["MODEL_ALIAS", "VERSION", "BuildError", "Built", "RealNode", "cache_dir",
           "ensure_binary", "find_binary", "model_path", "server_argv"]
