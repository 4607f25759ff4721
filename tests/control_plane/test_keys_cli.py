"""``infergate keys create|list|edit|revoke`` with click's CliRunner against a real redis-server."""

from __future__ import annotations

import getpass
import json
import re

import pytest
from click.testing import CliRunner

from controlplane import procs
from controlplane.admin import apikeys
from controlplane.routing import keycopies, registry
from controlplane.cli import main


@pytest.fixture
def run(redis_server):
    runner = CliRunner()

    def _run(*args: str):
        return runner.invoke(main, ["keys", "--redis-url", redis_server.url, *args])

    return _run


def test_create_list_revoke(run, redis_server) -> None:
    r = redis_server.client()
    assert run("list").output.strip() == "no keys"

    res = run("create", "--tenant", "acme", "--rpm", "60", "--tpm", "10000", "--label", "ci bot")
    assert res.exit_code == 0, res.output
    m = re.search(r"created key ([0-9a-f]{8}) for tenant acme \(rpm 60, tpm 10000, weight "
                  r"default, priority default\)\n(ig-\S+)\n",
                  res.output)
    assert m, res.output
    key_id, key = m.groups()
    assert len(key) == 46
    rec = apikeys.lookup(r, key)
    assert rec is not None and rec.id == key_id and rec.rpm == 60 and rec.tpm == 10000
    assert rec.label == "ci bot"

    res = run("create", "--tenant", "beta", "--json")
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["tenant"] == "beta" and data["rpm"] is None and data["key"].startswith("ig-")
    beta_id = data["id"]

    res = run("list")
    assert res.exit_code == 0
    lines = res.output.splitlines()
    assert lines[0].split() == ["ID", "TENANT", "LABEL", "RPM", "TPM", "WEIGHT", "PRIORITY",
                                "CREATED", "(UTC)", "REVOKED", "(UTC)"]
    rows = {line.split()[0]: line for line in lines[1:]}
    assert set(rows) == {key_id, beta_id}
    assert rows[key_id].split()[1:8] == ["acme", "ci", "bot", "60", "10000", "default",
                                         "default"]
    assert rows[key_id].rstrip().endswith("-")  # not revoked
    assert key not in res.output and data["key"] not in res.output  # never the key

    res = run("revoke", key_id)
    assert res.exit_code == 0, res.output
    assert f"revoked {key_id} (tenant acme)" in res.output and "within 5 s" in res.output
    assert "warning" not in res.output   # no control plane keeps a copy: nothing to confirm
    assert apikeys.lookup(r, key) is None
    res = run("revoke", key_id)
    assert res.exit_code == 0 and "already revoked" in res.output

    listed = json.loads(run("list", "--json").output)
    revoked = {k["id"]: k["revoked"] for k in listed}
    assert revoked[key_id] is not None and revoked[beta_id] is None
    assert "key" not in listed[0]
    active = json.loads(run("list", "--active", "--json").output)
    assert [k["id"] for k in active] == [beta_id]

    events = [(e["kind"], e["actor"], e["detail"]["id"])
              for e in registry.recent_events(r, 10)]
    user = f"cli:{getpass.getuser()}"
    assert events == [("key_revoke", user, key_id), ("key_create", user, beta_id),
                      ("key_create", user, key_id)]


@pytest.mark.parametrize("args, message", [
    (["create", "--tenant", "bad tenant"], "tenant"),
    (["create", "--tenant", "acme", "--rpm", "0"], "rpm must be between 1"),
    (["create", "--tenant", "acme", "--tpm", "-5"], "tpm must be between 1"),
    (["create", "--tenant", "acme", "--rpm", "many"], "not a valid integer"),
    (["create", "--tenant", "acme", "--weight", "0"], "weight must be a number"),
    (["create", "--tenant", "acme", "--priority", "urgent"], "'urgent' is not one of"),
    (["create"], "Missing option '--tenant'"),
    (["revoke", "00000000"], "no key with id '00000000'"),
    (["revoke", "not-an-id"], "no key with id"),
])
def test_bad_input_is_refused(run, args, message) -> None:
    res = run(*args)
    assert res.exit_code != 0
    assert message in res.output


def test_redis_unreachable() -> None:
    port = procs.free_port()
    res = CliRunner().invoke(main, ["keys", "--redis-url", f"redis://127.0.0.1:{port}/0", "list"])
    assert res.exit_code == 1
    assert f"cannot reach Redis at redis://127.0.0.1:{port}/0" in res.output
    # a password in the URL is not printed, in either form of the user info
    for userinfo, shown in ((":s3cret", ":***"), ("s3cret", "***"), ("app:s3cret", "app:***")):
        res = CliRunner().invoke(main, ["keys", "--redis-url",
                                        f"redis://{userinfo}@127.0.0.1:{port}/0", "list"])
        assert res.exit_code == 1 and "s3cret" not in res.output
        assert f"cannot reach Redis at redis://{shown}@127.0.0.1:{port}/0" in res.output


def test_redis_unreachable_by_the_banners_variable_says_its_stack_may_have_stopped() -> None:
    url = f"redis://127.0.0.1:{procs.free_port()}/0"
    res = CliRunner().invoke(main, ["keys", "list"], env={"INFERGATE_REDIS_URL": url})
    assert res.exit_code == 1
    assert "INFERGATE_REDIS_URL names it" in res.output and "may have stopped" in res.output
    res = CliRunner().invoke(main, ["keys", "--redis-url", url, "list"],
                             env={"INFERGATE_REDIS_URL": ""})
    assert res.exit_code == 1 and "as its banner shows" in res.output


def test_edit_changes_limits_and_label_with_an_event(run, redis_server) -> None:
    r = redis_server.client()
    key_id = json.loads(run("create", "--tenant", "acme", "--rpm", "60", "--json").output)["id"]
    res = run("edit", key_id, "--rpm", "none", "--tpm", "500", "--label", "batch jobs")
    assert res.exit_code == 0, res.output
    assert (f"saved {key_id} (tenant acme): rpm -, tpm 500, weight default, priority "
            "default, label batch jobs") in res.output
    rec = apikeys.get_key(r, key_id)
    assert rec.rpm is None and rec.tpm == 500 and rec.label == "batch jobs"
    ev = registry.recent_events(r, 1)[0]
    assert ev["kind"] == "key_edit" and ev["actor"] == f"cli:{getpass.getuser()}"
    assert ev["detail"] == {"id": key_id, "tenant": "acme", "rpm": None, "tpm": 500,
                            "label": "batch jobs"}
    res = run("edit", key_id, "--weight", "3", "--priority", "sheddable")
    assert res.exit_code == 0, res.output
    assert (f"saved {key_id} (tenant acme): rpm -, tpm 500, weight 3, priority sheddable, "
            "label batch jobs") in res.output
    row = next(x for x in run("list").output.splitlines() if x.startswith(key_id))
    assert row.split()[5:8] == ["500", "3", "sheddable"]
    res = run("edit", key_id, "--weight", "3")
    assert res.exit_code == 0 and f"{key_id} (tenant acme): nothing changed" in res.output
    rec = apikeys.get_key(r, key_id)
    assert rec.weight == 3 and rec.priority == "sheddable"
    assert run("edit", key_id, "--weight", "none").exit_code == 0
    assert apikeys.get_key(r, key_id).weight is None
    for args, message in [((key_id,), "nothing to change"),
                          ((key_id, "--rpm", "0"), "rpm must be between 1"),
                          (("00000000", "--rpm", "5"), "no API key with id '00000000'")]:
        res = run("edit", *args)
        assert res.exit_code != 0 and message in res.output, res.output
    assert len(registry.recent_events(r, 10)) == 4  # no event for a refused edit


def test_revoke_warns_when_no_copy_confirms_it(run, redis_server) -> None:
    """A control plane reports a copy of the state that does not move (frozen): the
    revocation is made, and the command says that no copy confirmed it (a Redis that lost
    its data before the copies read it would have the key written back valid)."""
    r = redis_server.client()
    _, rec = apikeys.create_key(r, "acme")
    keycopies.report(r, "frozen", keycopies.current_gen(r), every_s=0.1)
    res = run("revoke", rec.id)
    assert res.exit_code == 0, res.output
    assert f"revoked {rec.id}" in res.output and "warning: no confirmation" in res.output
    assert apikeys.get_key(r, rec.id).revoked is not None
