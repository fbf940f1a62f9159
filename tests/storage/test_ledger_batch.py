"""Deletes on a filesystem (``storage.ledger_batch``): one batch record per call, each chunk claimed by the unlink of
its commit marker; the filesystem operations each costs, and exactly once across batches, processes and crashes."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

import pytest

from refpipe.pipeline.audit import audit
from refpipe.pipeline.sweep import sweep
from refpipe.storage.backends import open_store
from refpipe.storage.errors import DoubleDeleteError, UnknownRefError
from refpipe.storage.layout import BATCHES_PREFIX, batch_key, node_key, parse_release_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_records import delete_record_of, read_release_record
from refpipe.storage.local_store import LocalStore
from tests.storage.storage_helpers import FsOps
from tests.storage.store_children import claim_then_hang, free_then_hang
from tests.storage.test_ledger import kept


def _open(config) -> LocalStore:
    store = open_store(config)
    assert isinstance(store, LocalStore)
    return store


@pytest.fixture
def local(local_config) -> LocalStore:
    return _open(local_config)


def listed(store: LocalStore, key: str) -> list[str]:
    return read_release_record(store.get(key), key).branch_ids


def test_a_delete_of_n_chunks_is_one_record_and_five_operations_per_chunk(local, local_config):
    refs = [kept(local, f"b{i:02d}") for i in range(17)]
    more = [kept(local, f"m{i}") for i in range(4)]
    deleter = _open(local_config)  # another process's store: no directory handle of the branches
    ledger = Ledger(deleter, "orchestrator")
    ledger.delete(refs[:1], reason="warm")  # the session's batch directories, made once
    ledger.wait_freed()
    with FsOps(local.prefix.path) as ops:
        result = ledger.delete(refs[1:], reason="filtered")
        ledger.wait_freed()  # c.0 and the directories are removed by the reaper thread
    assert result.deleted == [r.uri for r in refs[1:]]
    counts = {e: ops.events().count(e) for e in set(ops.events())}
    shards = {local.prefix.key_of(r.uri).rpartition("/")[0] for r in refs[1:]} - \
        {local.prefix.key_of(refs[0].uri).rpartition("/")[0]}  # payload shards this store has not opened yet
    # the record: O_TMPFILE + linkat; per chunk: the O_PATH open of its directory, the O_PATH open of zarr.json
    # (holding its inode) and its unlink (the claim), unlink c.0, rmdir (and the first O_PATH open of each shard)
    assert counts == {"open": 1 + 2 * 16 + len(shards), "os.link": 1, "os.remove": 2 * 16, "os.rmdir": 16}
    assert len(ops.ops) == 2 + 5 * 16 + len(shards)
    keeper = Ledger(local, "env_worker_0")  # the process that kept them: their directory handles are open
    keeper.delete(more[:1], reason="warm")
    keeper.wait_freed()
    with FsOps(local.prefix.path) as ops:
        keeper.delete(more[1:], reason="discarded")
        keeper.wait_freed()
    events = ops.events()  # the chunks' removals run on max_concurrent_deletes threads: their order varies
    assert events[:2] == ["open", "os.link"] and sorted(events[2:]) == ["open"] * 3 + ["os.remove"] * 6 + \
        ["os.rmdir"] * 3
    assert local.list_prefix("ledger/deletes") == [batch_key("env_worker_0", keeper.session, n) for n in (0, 1)] + \
        [batch_key("orchestrator", ledger.session, n) for n in (0, 1)]
    assert listed(local, batch_key("orchestrator", ledger.session, 1)) == [f"b{i:02d}" for i in range(1, 17)]
    assert local.list_prefix("payloads") == []
    first = delete_record_of(local, "b05")
    assert (first.holder, first.reason, first.uri) == ("orchestrator", "filtered", refs[5].uri)


def test_a_chunk_deleted_in_an_earlier_batch_is_a_double_delete_naming_its_deleter(local):
    refs = [kept(local, f"c{i}") for i in range(3)]
    first, second = Ledger(local, "trainer_dp0"), Ledger(local, "orchestrator")
    first.delete(refs[:2], reason="trained step 4")
    with pytest.raises(DoubleDeleteError, match="chunk .*/c1 was already deleted by trainer_dp0 \\(trained step 4\\); "
                                                "second delete from orchestrator \\(filtered\\)") as info:
        second.delete(refs[1:], reason="filtered")
    result = info.value.result
    assert (result.deleted, list(result.double_deletes)) == ([refs[2].uri], [refs[1].uri])
    # each record lists exactly the chunks whose marker it removed
    assert listed(local, batch_key("trainer_dp0", first.session, 0)) == ["c0", "c1"]
    assert listed(local, batch_key("orchestrator", second.session, 0)) == ["c2"]
    with pytest.raises(DoubleDeleteError, match="second delete from trainer_dp0 \\(again\\)"):
        first.delete(refs[:1], reason="again")  # the same session, another batch
    for ledger in (first, second):
        ledger.close()
    report = audit(local, finished=True)
    assert (report.kept, report.deleted, report.double_deletes, report.unknown_deletes) == (3, 3, 2, 0)


def test_the_same_chunk_twice_in_one_call_and_a_chunk_never_kept(local):
    ref = kept(local, "d0")
    ghost = ref.model_copy(update={"uri": local.uri(node_key("ghost")), "branch_id": "ghost"})
    ledger = Ledger(local, "a")
    with pytest.raises(DoubleDeleteError, match="already deleted by a \\(twice, earlier in this call\\)") as info:
        ledger.delete([ref, ghost, ref], reason="twice")
    result = info.value.result
    assert (result.deleted, list(result.double_deletes), list(result.unknown)) == ([ref.uri], [ref.uri], [ghost.uri])
    assert listed(local, batch_key("a", ledger.session, 0)) == ["d0"]
    with pytest.raises(UnknownRefError, match="ghost: delete by a \\(x\\) refused: it was never kept"):
        ledger.delete([ghost], reason="x")


def test_two_processes_racing_on_the_same_chunks_delete_each_once(local, local_config):
    refs = [kept(local, f"e{i:02d}") for i in range(40)]
    ledgers = [Ledger(_open(local_config), f"trainer_dp{r}") for r in range(2)]
    barrier, results = threading.Barrier(2), {}

    def run(r: int) -> None:
        barrier.wait()
        try:
            results[r] = ledgers[r].delete(refs[::1 if r == 0 else -1], reason=f"rank {r}")
        except DoubleDeleteError as e:
            results[r] = e.result

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deleted = [set(results[r].deleted) for r in range(2)]
    assert deleted[0] | deleted[1] == {r.uri for r in refs} and not deleted[0] & deleted[1]
    for r in range(2):
        assert set(results[r].double_deletes) == deleted[1 - r]
        assert set(listed(local, batch_key(f"trainer_dp{r}", ledgers[r].session, 0))) == \
            {ref.branch_id for ref in refs if ref.uri in deleted[r]}
        ledgers[r].close()
    report = audit(local, finished=True)
    assert (report.kept, report.deleted, report.double_deletes, report.leaked) == (40, 40, 40, 0)


def _killed_after_claim(store: LocalStore, refs, child_body=claim_then_hang) -> None:
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    child = ctx.Process(target=child_body, args=(store, refs, ready))
    child.start()
    assert ready.wait(60)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL


def _finished_once_by_the_sweep(local: LocalStore, refs) -> None:
    """The audit lists ``refs`` (3 chunks) as unfinished deletes, the sweep finishes each once, the audit is clean."""
    report = audit(local, stopped=True)
    assert sorted(report.unfinished_deletes) == sorted(r.uri for r in refs) and report.leaked == 0
    result = sweep(local, stopped=True)
    assert (sorted(result.finished_deletes), result.deleted) == (sorted(r.uri for r in refs), [])
    report = audit(local, stopped=True)
    assert (report.deleted, report.double_deletes, report.unfinished_deletes) == (3, 0, []) and report.clean
    assert local.list_prefix("payloads") == []


def test_a_claim_killed_before_its_unlinks_is_finished_once_by_the_sweep(local):
    refs = [kept(local, f"f{i}") for i in range(3)]
    _killed_after_claim(local, refs)
    [key] = local.list_prefix(BATCHES_PREFIX)
    assert parse_release_key(key) == (None, "trainer_dp0") and listed(local, key) == ["f0", "f1", "f2"]
    _finished_once_by_the_sweep(local, refs)


def test_a_claim_killed_before_its_unlinks_is_finished_once_by_the_actors_next_life(local):
    refs = [kept(local, f"g{i}") for i in range(3)]
    _killed_after_claim(local, refs)
    resumed = Ledger(local, "trainer_dp0")
    assert resumed.delete(refs, reason="trained step 3, resumed").deleted == [r.uri for r in refs]
    with pytest.raises(DoubleDeleteError):
        resumed.delete(refs[:1], reason="again")
    resumed.close()
    report = audit(local, stopped=True)
    # two lives of one actor claim the chunks: already released, not a double delete; the refused one is
    assert (report.deleted, report.double_deletes, report.unfinished_deletes) == (3, 1, [])
    assert local.list_prefix("payloads") == []


def _killed_with_removals_queued(store: LocalStore, refs) -> None:
    """A real process whose ``Ledger.delete`` returned (markers unlinked) is SIGKILLed before its reaper removed any
    chunk: each chunk is left without ``zarr.json`` and with its ``c.0``, claimed by the batch record."""
    _killed_after_claim(store, refs, free_then_hang)
    [key] = store.list_prefix(BATCHES_PREFIX)
    assert listed(store, key) == [r.branch_id for r in refs]
    assert store.list_prefix("payloads") == sorted(f"{store.prefix.key_of(r.uri)}/c.0" for r in refs)


def test_removals_queued_when_the_deleter_is_killed_are_finished_once_by_the_sweep(local):
    refs = [kept(local, f"q{i}") for i in range(3)]
    _killed_with_removals_queued(local, refs)
    _finished_once_by_the_sweep(local, refs)


def test_removals_queued_when_the_deleter_is_killed_are_finished_once_by_the_actors_next_life(local):
    refs = [kept(local, f"r{i}") for i in range(3)]
    _killed_with_removals_queued(local, refs)
    resumed = Ledger(local, "trainer_dp0")
    result = resumed.delete(refs, reason="trained step 3, resumed")
    assert (result.deleted, result.already_released) == ([], [r.uri for r in refs])
    resumed.close()
    report = audit(local, stopped=True)
    assert (report.deleted, report.double_deletes, report.unfinished_deletes) == (3, 0, []) and report.clean
    assert local.list_prefix("payloads") == []


def test_a_refusal_names_this_session_then_another_actor_then_an_earlier_life_whatever_the_listing_order(local):
    from refpipe.storage.ledger_batch import _named_first
    from refpipe.storage.ledger_records import ReleaseRecord

    ledger = Ledger(local, "trainer_dp0")

    def record(holder: str, session: str) -> ReleaseRecord:
        return ReleaseRecord(step=None, holder=holder, reason=f"{holder} {session}", t=0.0, session=session,
                             claim="c", branch_ids=["g0"])

    earlier, other, own = record("trainer_dp0", "1-1"), record("trainer_dp1", "2-2"), record("trainer_dp0",
                                                                                             ledger.session)
    # a killed earlier life's record still lists the chunk; it sorted first when its pid did, and the refusal of
    # this session's second delete became a quiet "already released"
    assert _named_first(ledger, [earlier, own]) is own and _named_first(ledger, [own, earlier]) is own
    assert _named_first(ledger, [earlier, other]) is other and _named_first(ledger, [other, earlier]) is other
    assert _named_first(ledger, [earlier]) is earlier
    ledger.close()


def test_a_refusal_names_the_first_deleter_while_another_batch_record_is_being_rewritten(local):
    """A batch record's rewrite (a plain put: a temp file, then a rename) in flight in another process: its temp file,
    created but not yet written, is no record; the refusal reads the records and names the first deleter."""
    refs = [kept(local, f"c{i}") for i in range(2)]
    first, second = Ledger(local, "deleter_1"), Ledger(local, "deleter_2")
    first.delete(refs[:1], reason="race 1")
    in_flight = f"{local.prefix.path}/{batch_key('deleter_0', 'p1-1', 0)}.tmp-0123456789ab"
    os.makedirs(os.path.dirname(in_flight), exist_ok=True)
    open(in_flight, "wb").close()
    with pytest.raises(DoubleDeleteError) as info:
        second.delete(refs, reason="race 2")
    assert [(e.first_holder, e.first_reason, e.second_holder) for e in info.value.result.double_deletes.values()] == [
        ("deleter_1", "race 1", "deleter_2")]
    assert delete_record_of(local, refs[0].branch_id).holder == "deleter_1"
    for ledger in (first, second):
        ledger.close()
