"""``refpipe audit`` and ``refpipe sweep`` through typer's CliRunner: exit codes, JSON keys, what is deleted."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).parents[1] / "pipeline"))
from audit_helpers import chunks, keep, make_keeper, publish  # noqa: E402
from cli.main import app  # noqa: E402
from storage.errors import DoubleDeleteError  # noqa: E402
from storage.ledger import Ledger  # noqa: E402
from storage.store import open_store  # noqa: E402

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture
def crashed(storage_config):
    """A run whose env worker kept 3 chunks and died; step 0 ships one of them, untrained.

    Returns (store, run URI, CLI options, the 2 orphans' URIs, the shipped chunk's URI).
    """
    store = open_store(storage_config)
    keeper = make_keeper(store, storage_config)
    refs = [keep(keeper, seed) for seed in range(3)]
    publish(store, 0, refs[:1], [0], dp_world_size=1)
    options = ["--s3-endpoint-url", storage_config.s3_endpoint_url] if storage_config.s3_endpoint_url else []
    return store, store.prefix.uri, options, sorted(r.uri for r in refs[1:]), refs[0].uri


def test_audit_json_and_exit_codes(crashed):
    store, run_uri, options, orphans, shipped = crashed
    live = invoke("audit", run_uri, "--json", *options)
    assert live.exit_code == 0, live.output
    report = json.loads(live.stdout)
    assert {"kept", "deleted", "outstanding", "leaked", "double_deletes"} <= report.keys()
    assert (report["kept"], report["deleted"], report["outstanding"], report["leaked"], report["double_deletes"]) \
        == (3, 0, 3, 0, 0)
    assert report["outstanding_by_holder"] == {"trainer step 0": 1, "env_worker_0": 2} and report["clean"]

    stopped = invoke("audit", run_uri, "--json", "--stopped", *options)
    assert stopped.exit_code == 1
    report = json.loads(stopped.stdout)
    assert (report["leaked"], sorted(report["leaked_chunks"]), report["outstanding"]) == (2, orphans, 1)

    table = invoke("audit", run_uri, "--stopped", *options)
    assert table.exit_code == 1
    assert "violation 2 leaked chunks" in table.stdout and orphans[0] in table.stdout


def test_sweep_dry_run_then_sweep_then_a_clean_audit(crashed):
    store, run_uri, options, orphans, shipped = crashed
    before = store.list_prefix("")
    dry = invoke("sweep", run_uri, "--dry-run", "--stopped", "--json", *options)
    assert dry.exit_code == 0
    assert sorted(json.loads(dry.stdout)["deleted"]) == orphans and store.list_prefix("") == before

    swept = invoke("sweep", run_uri, "--stopped", *options)
    assert swept.exit_code == 0 and "deleted 2 chunks" in swept.stdout
    assert chunks(store) == {shipped}
    after = invoke("audit", run_uri, "--json", "--stopped", *options)
    assert after.exit_code == 0 and json.loads(after.stdout)["leaked"] == 0

    finished = invoke("audit", run_uri, "--json", "--finished", *options)  # step 0 was never trained
    assert finished.exit_code == 1
    assert json.loads(finished.stdout)["violations"] == ["1 chunks still outstanding at the declared end of the run"]

    abandoned = invoke("sweep", run_uri, "--abandon", *options)  # the run will never be resumed
    assert abandoned.exit_code == 0 and "deleted 1 chunks" in abandoned.stdout
    assert chunks(store) == set()
    assert invoke("audit", run_uri, "--finished", *options).exit_code == 0


def test_double_deletes_fail_the_audit(local_config):
    store = open_store(local_config)
    keeper = make_keeper(store, local_config)
    ref = keep(keeper, 0)
    keeper.discard([ref])
    with pytest.raises(DoubleDeleteError):
        Ledger(store, "orchestrator").delete([ref], reason="shutdown")
    result = invoke("audit", store.prefix.uri, "--json")
    assert result.exit_code == 1 and json.loads(result.stdout)["double_deletes"] == 1


@pytest.mark.parametrize("command", ["audit", "sweep"])
def test_a_bad_run_uri_exits_2(command):
    result = runner.invoke(app, [command, "ftp://host/run_0"])
    assert result.exit_code == 2 and "error:" in result.output and "scheme" in result.output


def test_audit_and_sweep_of_an_empty_run_prefix_fail_and_write_nothing(storage_config):
    """A mistyped run URI is an error (exit 2), never a clean audit; sweep creates no ledger there."""
    store = open_store(storage_config)
    options = ["--s3-endpoint-url", storage_config.s3_endpoint_url] if storage_config.s3_endpoint_url else []
    for command in (["audit", "--finished"], ["sweep", "--stopped"]):
        result = invoke(*command, store.prefix.uri, *options)
        assert result.exit_code == 2
        assert "nothing under the run prefix" in result.output
    assert store.list_prefix("") == []
