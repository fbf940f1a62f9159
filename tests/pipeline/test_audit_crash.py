"""Crash injection: real processes killed with SIGKILL between keep and ship, between ship
and fetch, and between fetch and delete, on both backends. The audit lists exactly the
orphans, the sweep removes them, the audit is then clean, and the chunks of untrained
step files keep every byte."""

from __future__ import annotations

import json
import signal

import pytest

from refpipe.pipeline.audit import audit
from refpipe.pipeline.sweep import sweep
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.config import StorageConfig
from refpipe.storage.ledger import Ledger
from refpipe.storage.store import Store
from tests.helpers.children import killed_at_first_line, module_argv
from tests.pipeline.audit_helpers import chunks, snapshot, train

SCRIPT = "tests.pipeline.audit_helpers"
HOLDERS_AFTER_CRASH = {
    "keep-ship": {},
    "ship-fetch": {"trainer step 1": 2},
    "fetch-delete": {"trainer step 1": 2, "trainer step 2": 2, "trainer step 3": 1},
}


def run_until_killed(config: StorageConfig, scenario: str) -> dict:
    """Run a scenario in its own process; once it reports ready, SIGKILL it. Returns its expectations."""
    args = module_argv(SCRIPT, scenario, config.root, config.run_id)
    args += [config.s3_endpoint_url] if config.s3_endpoint_url else []
    line, stderr, returncode = killed_at_first_line(args)
    assert line, f"scenario {scenario} died before its crash point:\n{stderr}"
    assert returncode == -signal.SIGKILL
    return json.loads(line)


def _sweep_and_check_clean(store: Store, orphans: list[str], protected: list[PayloadRef]) -> None:
    before = snapshot(store, protected)
    dry = sweep(store, stopped=True, dry_run=True)
    assert sorted(dry.deleted) == sorted(orphans) and chunks(store) >= set(orphans)
    result = sweep(store, stopped=True)
    assert sorted(result.deleted) == sorted(orphans)
    assert result.finished_deletes == [] and result.removed_incomplete == [] and result.conflicts == 0
    after = audit(store, stopped=True)
    assert after.clean and after.leaked == 0 and after.double_deletes == 0
    assert after.outstanding == len(protected)
    assert chunks(store) == {r.uri for r in protected}
    assert snapshot(store, protected) == before


@pytest.mark.timeout(180)
@pytest.mark.parametrize("scenario", ["keep-ship", "ship-fetch", "fetch-delete"])
def test_sigkill_orphans_are_listed_then_swept(storage_config, scenario):
    expected = run_until_killed(storage_config, scenario)
    store = open_store(storage_config)
    protected = [PayloadRef.model_validate(r) for r in expected["protected"]]

    unaware = audit(store)  # not declared stopped: the heartbeats tell the process died (its pid is gone)
    assert unaware.live_sessions == [] and sorted(unaware.leaked_chunks) == sorted(expected["orphans"])

    report = audit(store, stopped=True)
    assert sorted(report.leaked_chunks) == sorted(expected["orphans"])
    assert report.outstanding_by_holder == HOLDERS_AFTER_CRASH[scenario]
    assert report.violations == [f"{len(expected['orphans'])} leaked chunks (present, no live holder; "
                                 "`refpipe sweep --stopped` deletes them)"]
    assert report.bad_records == [] and report.missing == [] and report.double_deletes == 0
    _sweep_and_check_clean(store, expected["orphans"], protected)

    if scenario == "fetch-delete":
        # The trainer restarts from a checkpoint taken after step 1 and trains step 2: step 1
        # was trained, so its chunks (a3, b0) are orphans now; step 3 is still untrained.
        trainers = [Ledger(store, f"trainer_dp{rank}") for rank in range(2)]
        train(store, trainers, 2)
        for ledger in trainers:
            ledger.close()
        report = audit(store, stopped=True)
        assert sorted(report.leaked_chunks) == sorted(r.uri for r in protected[:2])
        assert report.outstanding_by_holder == {"trainer step 3": 1}
        _sweep_and_check_clean(store, [r.uri for r in protected[:2]], protected[4:])
