"""``infergate keys export`` / ``import``: a backup of the API key store (hashes and
records only) that brings every key back after Redis lost it."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from controlplane.admin import apikeys
from controlplane.cli import main
from controlplane.redisdb import keynames


@pytest.fixture
def run(redis_server):
    runner = CliRunner()

    def _run(*args: str, input: str | None = None):
        return runner.invoke(main, ["keys", "--redis-url", redis_server.url, *args], input=input)

    return _run


def test_export_flush_import_brings_every_key_back(run, redis_server, tmp_path) -> None:
    r = redis_server.client()
    k1, rec1 = apikeys.create_key(r, "acme", rpm=60, label="ci")
    k2, rec2 = apikeys.create_key(r, "beta", tpm=1000)
    apikeys.revoke_key(r, rec2.id)
    out = tmp_path / "keys.json"
    res = run("export", "--out", str(out))
    assert res.exit_code == 0, res.output
    assert (out.stat().st_mode & 0o777) == 0o600
    doc = json.loads(out.read_text())
    assert doc["format"] == "infergate-apikeys" and len(doc["keys"]) == 2
    assert k1 not in out.read_text() and k2 not in out.read_text(), "no plaintext in a backup"
    assert {k["hash"] for k in doc["keys"]} == {apikeys.hash_key(k1), apikeys.hash_key(k2)}

    r.delete(keynames.APIKEYS, keynames.APIKEY_IDS)  # the key store is lost
    assert apikeys.lookup(r, k1) is None
    res = run("import", str(out))
    assert res.exit_code == 0, res.output
    assert "imported 2 key(s), 0 already present" in res.output
    got = apikeys.lookup(r, k1)
    assert got is not None and got.id == rec1.id and got.rpm == 60 and got.label == "ci"
    assert apikeys.lookup(r, k2) is None, "a revoked key stays revoked"
    assert apikeys.get_key(r, rec2.id).revoked is not None
    # again: nothing changes
    res = run("import", "-", input=out.read_text())
    assert res.exit_code == 0 and "imported 0 key(s), 2 already present (kept" in res.output
    res = run("import", "--overwrite", str(out))
    assert res.exit_code == 0 and "imported 0 new key(s), replaced 2 already present" in res.output


def test_import_refuses_bad_files_and_taken_ids(run, redis_server, tmp_path) -> None:
    r = redis_server.client()
    _, rec = apikeys.create_key(r, "acme")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "something-else"}')
    res = run("import", str(bad))
    assert res.exit_code == 1 and "not an API key export" in res.output
    bad.write_text(json.dumps({"format": "infergate-apikeys", "version": 1,
                               "keys": [{"hash": "zz", "id": rec.id, "tenant": "x"}]}))
    res = run("import", str(bad))
    assert res.exit_code == 1 and "keys[0].hash" in res.output
    other = {"format": "infergate-apikeys", "version": 1,
             "keys": [{"hash": "a" * 64, "id": rec.id, "tenant": "intruder"}]}
    res = run("import", "-", input=json.dumps(other))
    assert res.exit_code == 1 and "id taken by another key" in res.output
    assert apikeys.get_key(r, rec.id).tenant == "acme"


def test_import_overwrite_of_an_older_backup_never_un_revokes_a_key(run, redis_server,
                                                                     tmp_path) -> None:
    """Create, export, revoke, import --overwrite: the key stays revoked (with its first
    revocation time), the output names it; the file's other fields still win."""
    r = redis_server.client()
    key, rec = apikeys.create_key(r, "acme", rpm=60)
    other, rec2 = apikeys.create_key(r, "beta")
    out = tmp_path / "old.json"
    assert run("export", "--out", str(out)).exit_code == 0
    revoked = apikeys.revoke_key(r, rec.id).revoked
    apikeys.set_limits(r, rec2.id, rpm=5)
    res = run("import", "--overwrite", str(out))
    assert res.exit_code == 0, res.output
    assert "replaced 2 already present" in res.output
    assert f"kept revoked: {rec.id} (revoked here, valid in the file: an import never " \
           "un-revokes a key" in res.output
    assert apikeys.lookup(r, key) is None, "a revoked key answered again after an import"
    assert apikeys.get_key(r, rec.id).revoked == revoked
    assert apikeys.lookup(r, other).rpm is None   # the file's limits won for the valid key
    # the default import keeps what is there, and never says it kept a revocation
    res = run("import", str(out))
    assert res.exit_code == 0 and "kept revoked" not in res.output
    assert apikeys.lookup(r, key) is None


def test_revoking_a_key_of_a_lost_store_says_how_to_end_the_kept_keys(run, redis_server) -> None:
    """Redis lost the key store (no marker): a key the edges still accept has no record
    to revoke; the refusal says why and how to restore, instead of "see keys list"."""
    r = redis_server.client()
    _, rec = apikeys.create_key(r, "acme")
    res = run("revoke", "nosuchid")
    assert res.exit_code == 1 and "see 'infergate keys list'" in res.output
    r.flushdb()                                       # Redis came back empty
    res = run("revoke", rec.id)
    assert res.exit_code == 1, res.output
    assert "key store is missing" in res.output and "keys import" in res.output


@pytest.mark.parametrize("what", ["keys", "nodes"])
def test_an_export_that_cannot_be_written_says_so_without_a_traceback(redis_server, tmp_path,
                                                                      what) -> None:
    runner = CliRunner()
    for out, why in ((tmp_path / "no-such-dir" / "x.json", "No such file or directory"),
                     ("/dev/full", "No space left on device")):
        res = runner.invoke(main, [what, "--redis-url", redis_server.url, "export",
                                   "--out", str(out)])
        assert res.exit_code == 1, res.output
        assert f"cannot write {out}: {why}" in res.output, res.output
        assert "Traceback" not in res.output
