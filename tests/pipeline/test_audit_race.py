"""Exactly once across processes: 8 real processes (spawned, each with its own store and
ledger) race to delete the same 100 chunks, on both backends.

Every spawned child imports this module: its top level imports only ``storage`` (the
test body imports the rest), so each child starts in about a second.
"""

from __future__ import annotations

import multiprocessing
from collections import Counter

import pytest

from refpipe.storage.backends import open_store
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import DoubleDeleteError
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_records import delete_record_of

NUM_PROCESSES, NUM_CHUNKS = 8, 100


def _deleter(config: StorageConfig, index: int, refs_json: list[str], barrier, results) -> None:
    """One racing process: its own store and ledger, then delete every chunk at once."""
    store = open_store(config)
    ledger = Ledger(store, f"deleter_{index}")
    refs = [PayloadRef.model_validate_json(r) for r in refs_json]
    barrier.wait()
    try:
        result = ledger.delete(refs, reason=f"race {index}")
    except DoubleDeleteError as e:
        result = e.result
    ledger.close()
    holders = {(err.first_holder, err.second_holder) for err in result.double_deletes.values()}
    results.put((index, len(result.deleted), len(result.double_deletes), len(result.unknown), sorted(holders)))


@pytest.mark.timeout(300)
def test_eight_processes_delete_each_chunk_exactly_once(storage_config):
    from refpipe.pipeline.audit import audit
    from tests.pipeline.audit_helpers import chunks, keep, make_keeper

    store = open_store(storage_config)
    keeper = make_keeper(store, storage_config)
    refs = [keep(keeper, seed) for seed in range(NUM_CHUNKS)]
    keeper.ledger.close()

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(NUM_PROCESSES), ctx.Queue()
    refs_json = [r.model_dump_json() for r in refs]
    procs = [ctx.Process(target=_deleter, args=(storage_config, i, refs_json, barrier, results))
             for i in range(NUM_PROCESSES)]
    for p in procs:
        p.start()
    outcome = {}
    for _ in procs:
        index, deleted, doubles, unknown, holders = results.get(timeout=240)
        outcome[index] = (deleted, doubles, unknown)
        assert all(second == f"deleter_{index}" and first.startswith("deleter_") for first, second in holders)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert sum(d for d, _, _ in outcome.values()) == NUM_CHUNKS
    assert sum(dd for _, dd, _ in outcome.values()) == (NUM_PROCESSES - 1) * NUM_CHUNKS
    assert all(d + dd == NUM_CHUNKS and u == 0 for d, dd, u in outcome.values())
    assert chunks(store) == set()

    winners = Counter(delete_record_of(store, r.branch_id).holder for r in refs)
    assert sum(winners.values()) == NUM_CHUNKS
    assert dict(winners) == {f"deleter_{i}": d for i, (d, _, _) in outcome.items() if d}

    report = audit(store)
    assert report.double_deletes == 700 and report.unknown_deletes == 0
    assert report.kept == report.deleted == NUM_CHUNKS
    assert report.leaked == report.outstanding == report.present == 0
    assert report.violations == ["700 double deletes"]
    per_chunk = Counter(line.split(" of ")[1].split(" by ")[0] for line in report.delete_problems)
    assert per_chunk == {r.uri: NUM_PROCESSES - 1 for r in refs}
