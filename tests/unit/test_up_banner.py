"""What `infergate up`'s banner says about the nodes and the admin token after a start
on a folder an earlier run left (controlplane/cli/up/banner.py), pure formatting."""

from __future__ import annotations

import os
from types import SimpleNamespace

import click
import pytest

from controlplane.cli.up.banner import _nodes_line, _token_note
from controlplane.config import NodeSettings


def _node(name: str, port: int) -> NodeSettings:
    return NodeSettings(name=name, url=f"http://127.0.0.1:{port}")


def test_the_nodes_line_lists_every_registered_node_with_its_state() -> None:
    run = SimpleNamespace(nodes=[_node("sim-fast", 9001)], registered=[
        (_node("extra", 9100), "active"), (_node("sim-fast", 9001), "draining"),
        (_node("sim-slow", 9003), "drained")])
    assert _nodes_line(run) == ("extra=http://127.0.0.1:9100, sim-fast=http://127.0.0.1:9001 "
                                "(draining), sim-slow=http://127.0.0.1:9003 (drained)")
    # before the registry was read: the run's own nodes; none at all: how to add one
    assert _nodes_line(SimpleNamespace(nodes=[_node("a", 1)], registered=[])) == "a=http://127.0.0.1:1"
    assert "infergate nodes add" in _nodes_line(SimpleNamespace(nodes=[], registered=[]))


def test_the_admin_token_says_whether_it_was_kept() -> None:
    assert _token_note(SimpleNamespace(generated_token=True, token_kept=False)) == " (generated)"
    assert "kept" in _token_note(SimpleNamespace(generated_token=False, token_kept=True))
    assert _token_note(SimpleNamespace(generated_token=False, token_kept=False)) == ""


def test_a_start_on_an_earlier_folder_keeps_its_generated_admin_token(tmp_path) -> None:
    from controlplane.cli.up.plan import _keep_admin_token
    from controlplane.config import settings_from_dict

    earlier = tmp_path / "infergate.toml"
    earlier.write_text('[controlplane]\nadmin_token = "kept-token-123456789"\n')
    run = SimpleNamespace(settings=settings_from_dict({}), generated_token=True, token_kept=False)
    run.settings.controlplane.admin_token = "new-token-abcdefghij"
    _keep_admin_token(run, earlier)
    assert run.settings.controlplane.admin_token == "kept-token-123456789"
    assert run.token_kept and not run.generated_token
    # no earlier file, or an unreadable one: the new token stays
    for path in (tmp_path / "none.toml", tmp_path / "bad.toml"):
        (tmp_path / "bad.toml").write_text("not [toml")
        run = SimpleNamespace(settings=settings_from_dict({}), generated_token=True, token_kept=False)
        run.settings.controlplane.admin_token = "new-token-abcdefghij"
        _keep_admin_token(run, path)
        assert run.settings.controlplane.admin_token == "new-token-abcdefghij" and run.generated_token


def test_the_admin_session_key_is_made_once_per_folder_and_kept_private(tmp_path) -> None:
    from controlplane.cli.up.plan import ADMIN_SECRET_FILE, admin_secret_key

    key = admin_secret_key(tmp_path)
    path = tmp_path / ADMIN_SECRET_FILE
    assert len(key) == 64 and path.stat().st_mode & 0o777 == 0o600
    assert admin_secret_key(tmp_path) == key          # the next start on the folder
    os.chmod(path, 0o644)
    assert admin_secret_key(tmp_path) == key and path.stat().st_mode & 0o777 == 0o600
    for bad in ("", "short", "x" * 40 + " y" * 10, "\x00" * 40):
        path.write_text(bad)
        new = admin_secret_key(tmp_path)
        assert new != key and len(new) == 64 and path.read_text().strip() == new
    (tmp_path / "ro").mkdir(mode=0o500)
    if os.geteuid() != 0:   # root writes anywhere
        with pytest.raises(click.ClickException, match="admin session key"):
            admin_secret_key(tmp_path / "ro")
