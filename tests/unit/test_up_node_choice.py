"""Which nodes ``infergate up`` fronts: ``--node`` servers replace the file's
``[[nodes]]``, and ``up`` says so rather than drop them silently."""

from __future__ import annotations

from types import SimpleNamespace

from controlplane.cli.up import command
from controlplane.config import NodeSettings, settings_from_dict


def _run(file_nodes: list[dict], node_urls: tuple[str, ...]) -> SimpleNamespace:
    s = settings_from_dict({"nodes": file_nodes})
    given = [NodeSettings(name=f"node-{i}", url=u) for i, u in enumerate(node_urls, 1)]
    return SimpleNamespace(settings=s, node_urls=node_urls, nodes=given)


def test_node_urls_replace_the_files_nodes_and_say_so(capsys) -> None:
    run = _run([{"name": "gpu-a", "url": "http://10.0.0.1:8000"},
                {"name": "gpu-b", "url": "http://10.0.0.2:8000"}], ("http://127.0.0.1:9000",))
    command.start_nodes(run)
    assert [n.name for n in run.nodes] == ["node-1"]
    assert [n.name for n in run.settings.nodes] == ["node-1"]
    out = capsys.readouterr().out
    assert "--node replaces the nodes of the file (gpu-a, gpu-b)" in out


def test_node_urls_without_file_nodes_say_nothing(capsys) -> None:
    run = _run([], ("http://127.0.0.1:9000",))
    command.start_nodes(run)
    assert [n.name for n in run.nodes] == ["node-1"]
    assert "replaces" not in capsys.readouterr().out


def test_the_files_nodes_without_node_urls_are_fronted(capsys) -> None:
    run = _run([{"name": "gpu-a", "url": "http://10.0.0.1:8000"}], ())
    command.start_nodes(run)
    assert [n.name for n in run.nodes] == ["gpu-a"]
    assert "replaces" not in capsys.readouterr().out
