"""``refpipe audit`` and ``refpipe sweep`` through typer's CliRunner: exit codes, JSON keys, what is deleted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from refpipe.cli.main import app
from refpipe.storage.backends import open_store
from refpipe.storage.errors import DoubleDeleteError
from refpipe.storage.layout import tombstone_key
from refpipe.storage.ledger import Ledger
from tests.pipeline.audit_helpers import chunks, keep, make_keeper, publish

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, list(args), catch_exceptions=False)


@pytest.fixture
def crashed(storage_config):
    """A run whose env worker (this process, its ledger session live while the test runs) kept 3 chunks; step 0
    ships one of them, untrained. Declaring the run stopped turns the other 2 into orphans.

    Yields (store, run URI, CLI options, the 2 orphans' URIs, the shipped chunk's URI).
    """
    store = open_store(storage_config)
    keeper = make_keeper(store, storage_config)
    refs = [keep(keeper, seed) for seed in range(3)]
    publish(store, 0, refs[:1], [0], dp_world_size=1)
    options = ["--s3-endpoint-url", storage_config.s3_endpoint_url] if storage_config.s3_endpoint_url else []
    yield store, store.prefix.uri, options, sorted(r.uri for r in refs[1:]), refs[0].uri
    del keeper  # the env worker (this process) held its session live until here


def test_audit_json_and_exit_codes(crashed):
    store, run_uri, options, orphans, shipped = crashed
    live = invoke("audit", run_uri, "--json", *options)
    assert live.exit_code == 0, live.output
    report = json.loads(live.stdout)
    assert {"kept", "deleted", "outstanding", "leaked", "double_deletes"} <= report.keys()
    assert (report["kept"], report["deleted"], report["outstanding"], report["leaked"], report["double_deletes"]) \
        == (3, 0, 3, 0, 0)
    assert report["outstanding_by_holder"] == {"trainer step 0": 1, "env_worker_0": 2} and report["clean"]

    stopped = invoke("audit", run_uri, "--json", "--stopped", "--force", *options)
    assert stopped.exit_code == 1
    report = json.loads(stopped.stdout)
    assert (report["leaked"], sorted(report["leaked_chunks"]), report["outstanding"]) == (2, orphans, 1)

    assert report["violations"] == ["2 leaked chunks (present, no live holder; `refpipe sweep --stopped` deletes them)"]

    table = invoke("audit", run_uri, "--stopped", "--force", *options)
    assert table.exit_code == 1
    assert "violation 2 leaked chunks" in table.stdout and orphans[0] in table.stdout


def test_sweep_dry_run_then_sweep_then_a_clean_audit(crashed):
    store, run_uri, options, orphans, shipped = crashed
    before = store.list_prefix("")
    dry = invoke("sweep", run_uri, "--dry-run", "--stopped", "--force", "--json", *options)
    assert dry.exit_code == 0
    assert sorted(json.loads(dry.stdout)["deleted"]) == orphans and store.list_prefix("") == before

    swept = invoke("sweep", run_uri, "--stopped", "--force", *options)  # the "dead" env worker is this process
    assert swept.exit_code == 0 and "deleted 2 chunks" in swept.stdout
    assert chunks(store) == {shipped}
    after = invoke("audit", run_uri, "--json", "--stopped", "--force", *options)
    assert after.exit_code == 0 and json.loads(after.stdout)["leaked"] == 0

    finished = invoke("audit", run_uri, "--json", "--finished", "--force", *options)  # step 0 was never trained
    assert finished.exit_code == 1
    assert json.loads(finished.stdout)["violations"] == ["1 chunks still outstanding at the declared end of the run"]

    abandoned = invoke("sweep", run_uri, "--abandon", "--force", *options)  # the run will never be resumed
    assert abandoned.exit_code == 0 and "deleted 1 chunks" in abandoned.stdout
    assert chunks(store) == set()
    assert invoke("audit", run_uri, "--finished", "--force", *options).exit_code == 0


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


OPEN_A_SESSION = """
import sys, time
from refpipe.storage.config import StorageConfig
from refpipe.storage.ledger import Ledger
from refpipe.storage.backends import open_store
Ledger(open_store(StorageConfig.model_validate_json(sys.argv[1])), sys.argv[2])  # never closed
print("open", flush=True)
time.sleep(float(sys.argv[3]))
"""


def process_state(pid: int) -> str:
    """The state letter of process ``pid`` in ``/proc/<pid>/stat`` (``Z``: a zombie)."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rpartition(")")[2].split()[0]


def open_session_in_child(config, actor: str, sleep_s: float) -> subprocess.Popen:
    """A process that opens a ledger session of ``actor``, says so, then sleeps ``sleep_s`` and exits without close."""
    proc = subprocess.Popen([sys.executable, "-c", OPEN_A_SESSION, config.model_dump_json(), actor, str(sleep_s)],
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    assert proc.stdout.readline() == "open\n"
    return proc


def test_audit_as_stopped_or_finished_refuses_while_a_session_of_the_run_is_alive(local_config):
    """Before: ``refpipe audit --stopped`` on a live run counted its live holders' chunks as leaked (exit 1)."""
    store = open_store(local_config)
    keeper = make_keeper(store, local_config)
    keep(keeper, 0)
    keeper.ledger.flush()
    for flag in ("--stopped", "--finished"):
        refused = invoke("audit", store.prefix.uri, flag)
        assert (refused.exit_code, refused.output) == (2, (
            f"error: refusing to audit {store.prefix.uri} as stopped: env_worker_0 (pid {os.getpid()} on this host) "
            "is still running (heartbeat live); audit it without --stopped/--finished while it runs\n"))
    assert invoke("audit", store.prefix.uri).exit_code == 0  # the live run, judged by its heartbeats: clean
    assert invoke("audit", store.prefix.uri, "--stopped", "--force").exit_code == 1  # its chunk then counts as leaked
    keeper.ledger.close()


def test_sweep_as_stopped_refuses_while_a_session_of_the_run_is_alive_on_this_host(local_config):
    """This test process opens the env worker's session and never closes it: the run is still going."""
    store = open_store(local_config)
    keeper = make_keeper(store, local_config)
    refs = [keep(keeper, seed) for seed in range(2)]
    keeper.ledger.flush()
    def contents():  # the live session's own heartbeat keeps changing: everything else must not
        return {k: store.get(k) for k in store.list_prefix("") if not k.startswith("ledger/heartbeats/")}
    before = contents()
    for flags in (["--stopped"], ["--abandon"], ["--stopped", "--dry-run"]):
        refused = invoke("sweep", store.prefix.uri, *flags)
        assert refused.exit_code == 2, (flags, refused.output)
        assert "error: refusing to sweep" in refused.output
        assert f"env_worker_0 (pid {os.getpid()} on this host) is still running (heartbeat live); stop the run " \
               "first, or pass --force if that process is not part of the run" in refused.output
        assert contents() == before

    forced = invoke("sweep", store.prefix.uri, "--stopped", "--force", "--json")
    assert forced.exit_code == 0 and sorted(json.loads(forced.stdout)["deleted"]) == sorted(r.uri for r in refs)
    assert chunks(store) == set()


def test_sessions_of_processes_that_exited_do_not_block_the_sweep(local_config):
    """One session's process exited (reaped), another's was SIGKILLed and is not reaped yet (a zombie)."""
    store = open_store(local_config)
    keeper = make_keeper(store, local_config)
    refs = [keep(keeper, seed) for seed in range(2)]
    keeper.ledger.close()
    open_session_in_child(local_config, "orchestrator", 0).wait()
    killed = open_session_in_child(local_config, "env_worker_0", 60)  # a restart of the worker, then a crash
    try:
        killed.send_signal(signal.SIGKILL)
        while process_state(killed.pid) != "Z":  # dead, not reaped yet
            time.sleep(0.01)
        report = json.loads(invoke("audit", store.prefix.uri, "--json").stdout)
        assert report["live_sessions"] == [] and report["leaked"] == 2  # both processes are gone: dead sessions
        swept = invoke("sweep", store.prefix.uri, "--stopped", "--json")
    finally:
        killed.wait()
    assert swept.exit_code == 0, swept.output
    assert sorted(json.loads(swept.stdout)["deleted"]) == sorted(r.uri for r in refs)
    assert chunks(store) == set()


def test_stray_and_misnamed_delete_records_are_shown_and_a_truncated_one_still_counts(local_config):
    store = open_store(local_config)
    keeper = make_keeper(store, local_config)
    refs = [keep(keeper, seed) for seed in range(2)]
    keeper.discard(refs[:1])
    keeper.ledger.close()
    truncated = tombstone_key(refs[1].branch_id)
    store.put(truncated, b'{"branch_id":"zz"')  # a claim with an unreadable body: still the claim
    store.delete_keys([f"{store.prefix.key_of(refs[1].uri)}/{name}" for name in ("zarr.json", "c.0")])
    misnamed = tombstone_key(refs[0].branch_id).replace(refs[0].branch_id, "other-id")  # not other-id's shard
    store.put(misnamed, b"{}")
    store.put("ledger/deletes/zz-garbage", b"x")

    report = json.loads(invoke("audit", store.prefix.uri, "--json").stdout)
    assert (report["kept"], report["deleted"], report["missing"], report["leaked"]) == (2, 2, [], 0)
    assert report["stray_keys"] == sorted([misnamed, "ledger/deletes/zz-garbage"])
    text = invoke("audit", store.prefix.uri)
    assert text.exit_code == 0
    assert "stray keys (no refpipe object belongs there) (2)" in text.stdout
    assert f"  {misnamed}\n" in text.stdout and "  ledger/deletes/zz-garbage\n" in text.stdout


def test_sweep_finishes_the_unfinished_deletes_a_dead_trainer_recorded(local_config):
    """A trainer rank trained step 0 and its release failed for both chunks (their directories refused the unlink
    of the commit marker, the claim on a filesystem), and so did its retry: one claim was never written (the delete
    records' directory refused it), the other chunk's objects could not be removed. While the rank lives it holds
    both; after it is gone the audit lists both as unfinished deletes (never as leaked, and step 0 no longer
    protects them), and ``refpipe sweep`` finishes them."""
    from tests.helpers.fault_os import refusing

    store = open_store(local_config)
    keeper = make_keeper(store, local_config)
    refs = [keep(keeper, seed) for seed in range(2)]
    keeper.ledger.close()
    publish(store, 0, refs, [0, 0], dp_world_size=1)
    unclaimed, claimed = refs
    records = os.path.dirname(store.path(tombstone_key(unclaimed.branch_id)))
    os.makedirs(records)
    trainer = Ledger(store, "trainer_dp0")
    with refusing(records), refusing(store.path(claimed.key)), refusing(store.path(unclaimed.key)):
        result = trainer.delete(refs, reason="trained step 0")
        assert [result.outcome(r.uri) for r in refs] == ["failed", "failed"]
        again = trainer.finish_unfinished()  # each claimed by its own delete record now: one written, one refused
        assert sorted(again.failed) == sorted(r.uri for r in refs)
        live = json.loads(invoke("audit", store.prefix.uri, "--json").stdout)
        assert live["outstanding_by_holder"] == {"trainer_dp0 (unfinished delete)": 1}
        assert (live["leaked"], live["unfinished_deletes"]) == (0, [claimed.uri])
        trainer.close()  # retries once, still refused: left to the sweep
    report = json.loads(invoke("audit", store.prefix.uri, "--json", "--finished").stdout)
    assert (report["leaked"], report["outstanding"]) == (0, 0)
    assert report["unfinished_deletes"] == sorted(r.uri for r in refs)
    assert report["violations"] == ["2 unfinished deletes (objects still present; `refpipe sweep` finishes them)"]

    swept = invoke("sweep", store.prefix.uri, "--json")
    assert swept.exit_code == 0, swept.output
    assert json.loads(swept.stdout)["finished_deletes"] == sorted(r.uri for r in refs)
    assert chunks(store) == set()
    assert json.loads(store.get(tombstone_key(unclaimed.branch_id)))["holder"] == "sweep"
    assert json.loads(store.get(tombstone_key(claimed.branch_id)))["holder"] == "trainer_dp0"
    clean = invoke("audit", store.prefix.uri, "--json", "--finished")
    assert clean.exit_code == 0 and (json.loads(clean.stdout)["kept"], json.loads(clean.stdout)["deleted"]) == (2, 2)



def test_the_audit_names_its_run_on_one_line(crashed):
    """The run URI heads the report whole, whatever the table's width (a table title wraps to the table)."""
    store, run_uri, options, orphans, shipped = crashed
    assert invoke("audit", run_uri, *options).stdout.splitlines()[0] == f"audit of {run_uri}"
