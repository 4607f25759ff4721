"""Simulated inference node (``infergate simnode``): an aiohttp server that behaves
like vLLM (or TGI / SGLang / a JSON-metrics server / a metrics-less server) closely
enough to test and benchmark the load balancer against.

Modules: :mod:`.engine` (pure continuous-batching model), :mod:`.scheduler` (asyncio
step loops), :mod:`.wire` (OpenAI request/response shapes), :mod:`.textgen`
(deterministic text), :mod:`.metrics` (``/metrics`` dialects), :mod:`.faults`,
:mod:`.server` (HTTP), :mod:`.launch` (start nodes as processes on free ports and
drive them: the launcher of ``infergate up``, the benchmarks and the tests); the
command itself is controlplane/cli/simnode.py.
"""
