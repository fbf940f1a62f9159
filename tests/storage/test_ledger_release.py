"""``Ledger.release`` on S3 (moto and SeaweedFS): one release record claims a DP rank's chunks of a step, batched
deletes; exactly once, with a chunk in two claims found by the audit and a crash mid-release finished by the sweep."""

from __future__ import annotations

import gc

import pytest

from refpipe.pipeline.audit import audit
from refpipe.pipeline.sweep import sweep
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_into
from refpipe.storage.errors import ChunkNotFoundError, DoubleDeleteError, LedgerRecordError, UnknownRefError
from refpipe.storage.layout import chunk_keys, parse_release_key, release_key, release_prefix, tombstone_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_records import delete_record_of, read_release_record
from tests.helpers.fault_proxy import Fault, FaultProxy
from tests.storage.test_ledger import kept

ACTOR = "trainer_dp0"


@pytest.fixture
def s3_store(s3_server_config):
    return open_store(s3_server_config)


def present(store, ref) -> bool:
    return any(store.exists(k) for k in chunk_keys(ref.key))


def test_a_release_claims_its_chunks_with_one_record_then_deletes_them(s3_store):
    store = s3_store
    refs = [kept(store, f"b{i}") for i in range(3)]
    ledger = Ledger(store, ACTOR)
    result = ledger.release(5, refs, reason="trained step 5")
    assert result.deleted == [store.uri(r.key) for r in refs]
    assert not any(present(store, r) for r in refs)
    assert store.list_prefix("ledger/deletes") == [release_key(5, ACTOR)]  # no per-chunk delete record
    record = read_release_record(store.get(release_key(5, ACTOR)), "r")
    assert (record.step, record.holder, record.branch_ids) == (5, ACTOR, ["b0", "b1", "b2"])
    found = delete_record_of(store, "b1", step=5)
    assert (found.holder, found.reason, found.uri) == (ACTOR, "trained step 5", store.uri(refs[1].key))
    assert delete_record_of(store, "b1") is None  # without the step, only the chunk's own delete record is read
    assert ledger.release(6, [], reason="retained step 6").deleted == [] and not store.list_prefix(release_prefix(6))
    assert parse_release_key(release_key(5, ACTOR)) == (5, ACTOR)
    with pytest.raises(ChunkNotFoundError, match=r"was deleted by trainer_dp0 at .* UTC \(trained step 5\)"):
        fetch_into(store, refs[2], None, {}, step=5)  # final at once: the release record names the deleter
    ledger.close()
    report = audit(store)
    assert (report.kept, report.deleted, report.double_deletes, report.clean) == (3, 3, 0, True)
    assert audit(store, incremental=True) == report  # a full read, then the summary
    assert audit(store, incremental=True) == report


def test_a_second_release_of_the_same_batch_is_a_double_delete_and_deletes_nothing(s3_store):
    store = s3_store
    refs = [kept(store, f"b{i}") for i in range(2)]
    other = kept(store, "other")
    ledger = Ledger(store, ACTOR)
    ledger.release(1, refs, reason="trained step 1")
    with pytest.raises(DoubleDeleteError) as e:
        ledger.release(1, refs, reason="trained step 1 again")
    assert sorted(e.value.result.double_deletes) == sorted(store.uri(r.key) for r in refs)
    assert e.value.result.deleted == [] and (e.value.first_holder, e.value.second_holder) == (ACTOR, ACTOR)
    assert present(store, other)
    ledger.close()
    assert audit(store).double_deletes == 2


def test_a_restarted_actor_finds_its_earlier_lifes_release_already_released(s3_store):
    store = s3_store
    refs = [kept(store, f"b{i}") for i in reversed(range(8))]  # outcomes keep the call's order
    first = Ledger(store, ACTOR)
    first.release(3, refs, reason="trained step 3")
    first.close()
    again = Ledger(store, ACTOR)
    result = again.release(3, refs, reason="trained step 3")
    assert result.already_released == [store.uri(r.key) for r in refs] and result.deleted == []
    again.close()
    assert audit(store).double_deletes == 0


def test_a_chunk_in_two_release_records_is_a_double_delete_the_audit_reports(s3_store):
    store = s3_store
    shared, own = kept(store, "shared"), kept(store, "own")
    dp0, dp1 = Ledger(store, "trainer_dp0"), Ledger(store, "trainer_dp1")
    dp0.release(1, [shared], reason="trained step 1")
    assert dp1.release(2, [shared, own], reason="trained step 2").deleted == [store.uri(shared.key),
                                                                             store.uri(own.key)]
    dp0.close()
    dp1.close()
    report = audit(store)
    assert report.double_deletes == 1 and report.deleted == 2
    assert report.delete_problems == [f"double_delete of {store.uri(shared.key)} by trainer_dp1 (trained step 2), "
                                      f"first deleted by trainer_dp0 (trained step 1)"]
    assert audit(store, incremental=True).double_deletes == 1


def test_a_release_and_a_delete_of_one_chunk_is_a_double_delete_the_audit_reports(s3_store):
    store = s3_store
    ref = kept(store, "b0")
    Ledger(store, "orchestrator").delete([ref], reason="discarded")
    trainer = Ledger(store, ACTOR)
    trainer.release(4, [ref], reason="trained step 4")  # no per-chunk round trip: not seen at delete time
    trainer.close()
    report = audit(store)
    assert report.double_deletes == 1
    assert report.delete_problems == [f"double_delete of {store.uri(ref.key)} by {ACTOR} (trained step 4), "
                                      f"first deleted by orchestrator (discarded)"]


def test_a_release_that_dies_mid_delete_is_finished_once_by_the_sweep(s3_server_config):
    store = open_store(s3_server_config)
    refs = [kept(store, f"b{i}") for i in range(3)]
    stuck = chunk_keys(refs[1].key)[0]  # its c.0: DeleteObjects reports it as an error, every time
    with FaultProxy(s3_server_config.s3_endpoint_url,
                    Fault("key_error", "POST", "/" + stuck.replace(".", r"\.") + "$", times=None,
                          code="AccessDenied")) as proxy:
        faulty = open_store(s3_server_config.model_copy(update={"s3_endpoint_url": proxy.url, "max_retries": 1,
                                                                "retry_backoff_s": 0.01}))
        crashed = Ledger(faulty, ACTOR)  # never closed: as after SIGKILL
        result = crashed.release(2, refs, reason="trained step 2")
        assert list(result.failed) == [store.uri(refs[1].key)]
        assert sorted(result.deleted) == sorted(store.uri(r.key) for r in (refs[0], refs[2]))
        assert crashed.unfinished == [store.uri(refs[1].key)]
        assert proxy.hits["key_error"] == 1  # a permanent per-key error: not sent again
    del crashed
    gc.collect()
    report = audit(store, stopped=True)
    assert report.unfinished_deletes == [store.uri(refs[1].key)] and report.leaked == 0
    swept = sweep(store, stopped=True)
    assert swept.finished_deletes == [store.uri(refs[1].key)] and swept.deleted == []
    assert not present(store, refs[1]) and not store.exists(tombstone_key("b1"))
    assert sweep(store, stopped=True).finished_deletes == []
    after = audit(store, stopped=True)
    assert (after.unfinished_deletes, after.deleted, after.double_deletes) == ([], 3, 0)


def test_a_release_whose_claim_put_fails_is_retried_with_the_same_claim(s3_server_config):
    store = open_store(s3_server_config)
    refs = [kept(store, f"b{i}") for i in range(2)]
    key = release_key(7, ACTOR)
    with FaultProxy(s3_server_config.s3_endpoint_url,
                    Fault("reset_before", "PUT", "/" + key.replace(".", r"\.") + "$", times=None)) as proxy:
        faulty = open_store(s3_server_config.model_copy(update={"s3_endpoint_url": proxy.url, "max_retries": 1,
                                                                "retry_backoff_s": 0.01}))
        ledger = Ledger(faulty, ACTOR)
        failed = ledger.release(7, refs, reason="trained step 7")
        assert sorted(failed.failed) == sorted(store.uri(r.key) for r in refs) and failed.deleted == []
        assert all(present(store, r) for r in refs) and not store.exists(key)
        claim = ledger._releases._pending[key].claim
        hits = proxy.hits["reset_before"]
        proxy.clear()
        retried = ledger.release(7, refs, reason="trained step 7")  # the background release's retry
        assert retried.deleted == [store.uri(r.key) for r in refs] and ledger.unfinished == []
        assert read_release_record(store.get(key), "r").claim == claim
        assert proxy.hits["reset_before"] == hits >= 2  # the retry sent its one put after the faults
        ledger.close()


def test_an_unreadable_release_record_is_a_bad_record_and_the_sweep_deletes_nothing(s3_store):
    store = s3_store
    leaked = kept(store, "leaked")
    store.put(release_key(1, ACTOR), b'{"step": 1}')
    report = audit(store, stopped=True)
    assert len(report.bad_records) == 1 and report.bad_records[0].startswith(
        f"{store.uri(release_key(1, ACTOR))}: DeleteRecordError: release record")
    with pytest.raises(LedgerRecordError):
        sweep(store, stopped=True)
    assert present(store, leaked)


def test_a_delete_after_a_release_of_its_chunk_is_refused_and_reported(s3_store):
    store = s3_store
    ref = kept(store, "b0")
    trainer = Ledger(store, ACTOR)
    trainer.release(4, [ref], reason="trained step 4")
    orchestrator = Ledger(store, "orchestrator")
    with pytest.raises(UnknownRefError) as e:  # no delete record of its own: the release record is the step's
        orchestrator.delete([ref], reason="discarded")
    assert list(e.value.result.unknown) == [store.uri(ref.key)] and e.value.result.deleted == []
    trainer.close()
    orchestrator.close()
    report = audit(store)
    assert (report.unknown_deletes, report.double_deletes, report.deleted) == (1, 0, 1)


def test_segmented_branches_and_their_shared_prefix_keep_per_chunk_claims_in_a_release(s3_store, s3_server_config,
                                                                                      monkeypatch):
    """A release holding segmented branches (and through them a group's shared prefix) claims those per chunk, so
    every segment is deleted once and the prefix once after its last holder; the plain chunk of the same call is
    claimed by the step's release record."""
    from refpipe.pipeline import open_branch
    from refpipe.pipeline.keep import Keeper
    from tests.pipeline.test_keep import CFG
    from tests.pipeline.test_shared_prefix import group

    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    store = s3_store
    keeper = Keeper(store, Ledger(store, "env_worker_0"), CFG, s3_server_config)
    prefix, refs, _ = group(keeper)
    plain = kept(store, "p0")
    ledger = Ledger(store, ACTOR)
    result = ledger.release(3, [plain, *refs.values()], reason="trained step 3")
    segments = [s for ref in refs.values() for s in ref.segments[1:]]
    assert sorted(result.deleted) == sorted([store.uri(plain.key), store.uri(prefix.key),
                                             *(store.uri(s.key) for s in segments)])
    assert not any(present(store, r) for r in [plain, prefix, *segments])
    assert read_release_record(store.get(release_key(3, ACTOR)), "r").branch_ids == ["p0"]
    keeper.ledger.close()
    ledger.close()
    report = audit(store, finished=True)
    assert (report.deleted, report.present, report.double_deletes, report.leaked, report.clean) == (10, 0, 0, 0, True)
