"""The store fault matrix on a local directory (issue 13): the operations of ``test_store_faults.py`` x the faults
of a POSIX filesystem, with exact outcomes.

Transient faults (``EIO``, ``ESTALE``, ``ETIMEDOUT``, ``EAGAIN``: a Lustre or NFS client losing its server) are
injected into one system call (``tests/helpers/fault_os.py``: no real way to make them here), before it runs or after
it ran ("maybe applied": an exclusive put then meets ``EEXIST`` and its write token resolves it). Permanent
faults are real: an immutable directory, a read-only and a full tmpfs. The store's retries: 2, backoff 1 ms.
"""

from __future__ import annotations

import errno
import json
import os

import numpy as np
import pytest
import torch

from refpipe.job.weights import publish_weights
from refpipe.pipeline.audit import audit
from refpipe.pipeline.keep import Branch
from refpipe.pipeline.step_file import StepFile
from refpipe.storage import local_confined, local_put, local_store
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.errors import KeyExistsError, StorageError, TransientStorageError
from refpipe.storage.layout import (
    LATEST_WEIGHTS_KEY,
    batch_key,
    chunk_keys,
    node_key,
    segment_key,
    step_key,
    weights_key,
)
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_records import delete_record_of, read_segment
from tests.helpers.checkpoint import FILES, assert_loads_back, one_rank_world, save, trained
from tests.helpers.fault_os import OsFault, OsFaults, read_only, refusing, tmpfs
from tests.pipeline.audit_helpers import NUM_COMPLETION, NUM_PROMPT, keep, make_keeper, publish

WRITE_FAULTS = [("EIO", False), ("EIO", True), ("ESTALE", False), ("ETIMEDOUT", True), ("EAGAIN", False)]
"""(errno, after): after = the call was applied and its answer lost."""
READ_FAULTS = ["EIO", "ESTALE", "ETIMEDOUT", "EAGAIN"]
WRITE_IDS = [f"{code}_{'after' if after else 'before'}" for code, after in WRITE_FAULTS]


@pytest.fixture
def run(local_config, monkeypatch):
    """``(store, faults)``: a fresh local run whose system calls go through ``faults``."""
    faults = OsFaults()
    for module in (local_store, local_put, local_confined):
        monkeypatch.setattr(module, "os", faults)
    store = open_store(local_config.model_copy(update={"max_retries": 2, "retry_backoff_s": 0.001}))
    return store, faults


def _fault(faults: OsFaults, function: str, name: str, code: str, after: bool = False, times: int = 1) -> None:
    faults.add(OsFault(function, name.replace(".", r"\."), getattr(errno, code), after=after, times=times))


def _assert_write_recovered(store, faults, function: str, name: str, code: str, after: bool) -> None:
    assert faults.hits == [(function, name, code)]
    assert (store.retries, store.idempotent_puts) == (1, 1 if after else 0)


def _events(store, ledger: Ledger, event: str) -> list[dict]:
    """``ledger``'s events named ``event`` on record (flushed)."""
    keys = store.list_prefix(f"ledger/events/{ledger.actor}")
    return [e for k in keys for _, e in read_segment(store.get(k)) if e["event"] == event]


def _assert_audit_clean(store, *ledgers, deleted: int) -> None:
    for ledger in ledgers:
        ledger.close()
    report = audit(store, finished=True)
    assert report.violations == [] and (report.deleted, report.present, report.double_deletes) == (deleted, 0, 0)


@pytest.mark.parametrize("code,after", WRITE_FAULTS, ids=WRITE_IDS)
@pytest.mark.parametrize("function,target", [("open", "c.0"), ("link", "zarr.json")])  # the chunk is made in place
def test_keep(run, code, after, function, target):
    store, faults = run
    keeper = make_keeper(store, store.config)
    _fault(faults, function, target, code, after)
    ref = keep(keeper, seed=1)
    _assert_write_recovered(store, faults, function, target, code, after)
    assert store.list_prefix("payloads") == sorted(chunk_keys(ref.key))
    assert fetch_arrays(store, ref)["topk_ids"].shape == (NUM_COMPLETION, 2)
    assert keeper.discard([ref]).deleted == [ref.uri]
    _assert_audit_clean(store, keeper.ledger, deleted=1)


@pytest.mark.parametrize("code,after", WRITE_FAULTS, ids=WRITE_IDS)
def test_publish_step(run, code, after):
    store, faults = run
    keeper = make_keeper(store, store.config)
    refs = [keep(keeper, seed=s) for s in range(2)]
    _fault(faults, "link", "step_00000000.npz", code, after)
    header = publish(store, 0, refs, [0, 1])
    _assert_write_recovered(store, faults, "link", "step_00000000.npz", code, after)
    assert StepFile.read(store, 0).header.model_copy(update={"stream_crc32c": {}}) == header
    assert store.list_prefix("steps") == [step_key(0)]


def test_a_failed_publish_whose_put_was_applied_is_done_when_published_again(run):
    """The step file's first put applied and answered EIO, its two retries failing before ``linkat`` ran: the publish
    raises; publishing the same step again (the launcher's next round, another put call) finds its bytes there."""
    store, faults = run
    keeper = make_keeper(store, store.config)
    refs = [keep(keeper, seed=s) for s in range(2)]
    _fault(faults, "link", "step_00000000.npz", "EIO", after=True)
    _fault(faults, "link", "step_00000000.npz", "EIO", times=2)
    with pytest.raises(TransientStorageError, match="gave up after 3 attempts"):
        publish(store, 0, refs, [0, 1])
    header = publish(store, 0, refs, [0, 1])
    assert StepFile.read(store, 0).header.model_copy(update={"stream_crc32c": {}}) == header  # crcs: set by the publish
    assert store.list_prefix("steps") == [step_key(0)]
    with pytest.raises(KeyExistsError):  # other contents for the same step
        publish(store, 0, refs[:1], [0])


@pytest.mark.parametrize("code,after", WRITE_FAULTS, ids=WRITE_IDS)
def test_flush_ledger(run, code, after):
    store, faults = run
    ledger = Ledger(store, "env_worker_0")
    name = segment_key("env_worker_0", ledger.session, 1).rpartition("/")[2]
    _fault(faults, "link", name, code, after)
    ledger.record("receive", branch_ids=["a"])
    ledger.flush()
    ledger.close()
    _assert_write_recovered(store, faults, "link", name, code, after)
    segments = [[json.loads(line)["event"] for line in store.get(k).splitlines()]
                for k in store.list_prefix("ledger/events/env_worker_0")]
    assert segments == [["open"], ["receive"], ["close"]]


def test_a_failed_flush_that_was_applied_is_found_by_the_next_flush(run):
    """A flush whose first attempt was applied and answered EIO, its two retries failing before ``linkat`` ran: the
    flush raises; the next flush (another put call, so not the same write token) finds the segment holding
    its first events and puts only the later ones."""
    store, faults = run
    ledger = Ledger(store, "env_worker_0")
    name = segment_key("env_worker_0", ledger.session, 1).rpartition("/")[2]
    _fault(faults, "link", name, "EIO", after=True)
    _fault(faults, "link", name, "EIO", times=2)
    ledger.record("receive", branch_ids=["a"])
    with pytest.raises(TransientStorageError, match="gave up after 3 attempts"):
        ledger.flush()
    ledger.record("receive", branch_ids=["b"])
    ledger.close()
    keys = store.list_prefix("ledger/events/env_worker_0")
    segments = [[json.loads(line)["branch_ids"][0] if "branch_ids" in line else json.loads(line)["event"]
                 for line in store.get(k).decode().splitlines()] for k in keys]
    assert segments == [["open"], ["a"], ["b", "close"]]
    assert [hit[2] for hit in faults.hits] == ["EIO"] * 3


@pytest.mark.parametrize("code,after", WRITE_FAULTS, ids=WRITE_IDS)
def test_weights_put(run, code, after):
    store, faults = run
    name = weights_key(0).rpartition("/")[2]
    _fault(faults, "link", name, code, after)
    publish_weights(store, torch.nn.Linear(3, 2), 0)
    _assert_write_recovered(store, faults, "link", name, code, after)
    assert store.list_prefix("weights") == [LATEST_WEIGHTS_KEY, weights_key(0)]


@pytest.fixture(scope="module")
def world():
    with one_rank_world() as group:
        yield group


@pytest.mark.parametrize("code,after,name", [*((c, a, "__0_0.distcp") for c, a in WRITE_FAULTS),
                                             ("EIO", True, ".metadata")], ids=[*WRITE_IDS, "EIO_after-.metadata"])
def test_checkpoint_put(run, world, code, after, name):
    """A rank's share (a file DCP closes) and DCP's ``.metadata`` (a file DCP renames into place): one exclusive put
    each (``linkat``), with its write token."""
    store, faults = run
    model, optimizer = trained()
    _fault(faults, "link", name, code, after)
    save(store, world, model, optimizer)
    _assert_write_recovered(store, faults, "link", name, code, after)
    assert store.list_prefix("checkpoints") == FILES
    assert_loads_back(store, model, optimizer)


@pytest.mark.parametrize("code", READ_FAULTS)
def test_checkpoint_get(run, world, code):
    store, faults = run
    model, optimizer = trained()
    save(store, world, model, optimizer)
    _fault(faults, "open", "__0_0.distcp", code)
    assert_loads_back(store, model, optimizer)
    assert faults.hits == [("open", "__0_0.distcp", code)] and store.retries == 1


def test_a_plain_put_is_retried(run):
    store, faults = run
    _fault(faults, "replace", "latest.json", "EIO", after=True)  # rename applied, answer lost: renamed again
    store.put(LATEST_WEIGHTS_KEY, b"{}")
    assert faults.hits == [("replace", "latest.json", "EIO")] and store.retries == 1
    assert store.list_prefix("weights") == [LATEST_WEIGHTS_KEY] and store.get(LATEST_WEIGHTS_KEY) == b"{}"


@pytest.mark.parametrize("code", READ_FAULTS)
@pytest.mark.parametrize("num_tokens", [None, NUM_PROMPT + 1], ids=["whole", "truncated"])
def test_fetch(run, code, num_tokens):
    store, faults = run
    ref = keep(make_keeper(store, store.config), seed=2)
    expected = fetch_arrays(store, ref, num_tokens)
    _fault(faults, "open", "c.0", code)
    got = fetch_arrays(store, ref, num_tokens)
    assert list(got) == list(expected) and all(np.array_equal(got[k], expected[k]) for k in expected)
    assert faults.hits == [("open", "c.0", code)] and store.retries == 1


def _kept_pair(store):
    keeper = make_keeper(store, store.config)
    return [keep(keeper, seed=s) for s in (3, 4)], keeper


def _assert_deleted(store, refs, *ledgers) -> None:
    """Both chunks deleted once each, each named by the record that claimed it (the call's batch record, or its own
    delete record when its claim was retried), and the finished run audits clean."""
    for ledger in ledgers:
        ledger.wait_freed()
    assert store.list_prefix("payloads") == []
    assert [delete_record_of(store, r.branch_id).holder for r in refs] == ["trainer_dp0"] * len(refs)
    _assert_audit_clean(store, *ledgers, deleted=len(refs))


@pytest.mark.parametrize("code,after", WRITE_FAULTS, ids=WRITE_IDS)
def test_delete_claim_put(run, code, after):
    store, faults = run
    refs, keeper = _kept_pair(store)
    name = "00000000.json"  # the call's batch record (storage.ledger_batch)
    _fault(faults, "link", name, code, after)
    trainer = Ledger(store, "trainer_dp0")
    result = trainer.delete(refs, reason="trained")
    assert [result.outcome(r.uri) for r in refs] == ["deleted", "deleted"] and result.failed == {}
    trainer.wait_freed()
    _assert_write_recovered(store, faults, "link", name, code, after)
    _assert_deleted(store, refs, keeper.ledger)


@pytest.mark.parametrize("code,after", [("EIO", False), ("EIO", True), ("ESTALE", True)],
                         ids=["EIO_before", "EIO_after", "ESTALE_after"])
@pytest.mark.parametrize("function,name", [("unlink", "c.0"), ("unlink", "zarr.json")])
def test_delete_objects(run, code, after, function, name):
    """An unlink (applied or not; a retry of an applied one meets ENOENT: done), the chunk's or its commit marker's
    (the chunk's claim: a retry of an applied one that meets ENOENT is this call's claim)."""
    store, faults = run
    refs, keeper = _kept_pair(store)
    _fault(faults, function, name, code, after)
    trainer = Ledger(store, "trainer_dp0")
    result = trainer.delete(refs, reason="trained")
    assert result.deleted == [r.uri for r in refs] and result.failed == {}
    trainer.wait_freed()  # the chunks' c.0 are unlinked by the reaper thread
    assert faults.hits == [(function, name, code)] and store.retries == 1 and trainer.unfinished == []
    _assert_deleted(store, refs, keeper.ledger)


def test_an_applied_rmdir_answered_estale_is_done(run):
    """The rmdir of an emptied branch directory applied and answered ESTALE (NFS, Lustre after a server failover):
    the retry finds it gone, every ref of the call is deleted, no directory is left."""
    store, faults = run
    refs, keeper = _kept_pair(store)
    _fault(faults, "rmdir", refs[0].branch_id, "ESTALE", after=True)
    trainer = Ledger(store, "trainer_dp0")
    result = trainer.delete(refs, reason="trained")
    assert result.deleted == [r.uri for r in refs] and result.failed == {}
    trainer.wait_freed()
    assert faults.hits == [("rmdir", refs[0].branch_id, "ESTALE")] and store.retries == 1
    shards = {node_key(r.branch_id).rpartition("/")[0] for r in refs}
    assert {shard: os.listdir(store.path(shard)) for shard in shards} == {shard: [] for shard in shards}
    _assert_deleted(store, refs, keeper.ledger)


def test_a_refused_rmdir_makes_the_ref_of_that_directory_only_an_unfinished_delete(run, caplog):
    """A shard directory that refuses removing names: the rmdir of the branch directory emptied in it (by the reaper,
    after the call returned it deleted) fails for good, and only the ref of that directory is an unfinished delete,
    recorded and logged (its objects are gone; ``finish_unfinished`` finishes it)."""
    store, faults = run
    keeper = make_keeper(store, store.config)
    refs = [keep(keeper, seed=s) for s in (3, 4)]
    shard = node_key(refs[0].branch_id).rpartition("/")[0]
    same_shard = []  # kept in refs[0]'s shard: not deleted here
    while node_key(refs[1].branch_id).startswith(shard + "/"):  # a chunk in another shard
        same_shard.append(refs[1])
        refs[1] = keep(keeper, seed=len(refs) + 5)
    trainer = Ledger(store, "trainer_dp0")
    with refusing(store.path(shard)) as code:
        result = trainer.delete(refs, reason="trained")
        trainer.wait_freed()
    node = store.uri(node_key(refs[0].branch_id))
    assert [result.outcome(r.uri) for r in refs] == ["deleted", "deleted"] and trainer.unfinished == [refs[0].uri]
    reason = os.strerror(getattr(errno, code))
    error = f"cannot remove directory {node}: {code} ({reason})"
    assert [(r.name, r.getMessage()) for r in caplog.records if r.name == "refpipe.storage.ledger_reaper"] == [
        ("refpipe.storage.ledger_reaper", f"ledger trainer_dp0: chunk {refs[0].uri} is deleted (claimed) but its "
         f"bytes could not be removed: {error}; this ledger retries at finish_unfinished and close, else `refpipe "
         f"sweep` removes them")]
    assert [(e["branch_id"], e["error"]) for e in _events(store, trainer, "unfinished_delete")] == \
        [(refs[0].branch_id, error)]
    assert trainer.finish_unfinished().deleted == [refs[0].uri]
    assert store.list_prefix("payloads") == sorted(k for r in same_shard for k in chunk_keys(r.key))


def test_an_applied_unlink_answered_estale_removes_the_directory_it_emptied(run):
    """The one key left in a branch directory (an unfinished delete's chunk, its marker already gone), its unlink
    applied and answered ESTALE: the retry finds it gone, so this call emptied the directory and removes it."""
    store, faults = run
    store.put("payloads/ab/b1/c.0", b"chunk")
    _fault(faults, "unlink", "c.0", "ESTALE", after=True)
    store.delete_keys(["payloads/ab/b1/c.0"])
    assert faults.hits == [("unlink", "c.0", "ESTALE")] and store.retries == 1
    assert os.listdir(store.path("payloads/ab")) == []


def test_a_transient_error_that_outlasts_the_retries_is_an_unfinished_delete(run):
    store, faults = run
    refs, keeper = _kept_pair(store)
    _fault(faults, "unlink", "zarr.json", "ESTALE", times=3)  # the chunk's commit marker: 1 + 2 retries
    trainer = Ledger(store, "trainer_dp0")
    result = trainer.delete(refs[:1], reason="trained")
    assert result.outcome(refs[0].uri) == "failed" and store.retries == 2
    error = result.failed[refs[0].uri]
    assert isinstance(error, TransientStorageError)
    assert str(error).startswith(f"cannot delete {store.uri(chunk_keys(refs[0].key)[1])}: gave up after 3 attempts")
    assert "ESTALE (Stale file handle)" in str(error) and trainer.unfinished == [refs[0].uri]
    again = trainer.finish_unfinished()
    assert again.deleted == [refs[0].uri] and again.double_deletes == {} and trainer.unfinished == []
    assert trainer.delete(refs[1:], reason="trained").deleted == [refs[1].uri]
    _assert_deleted(store, refs, keeper.ledger, trainer)


def test_a_refused_unlink_fails_that_ref_only_and_is_finished_later(run):
    """A branch directory that refuses removing names (permanent: not retried): that ref's outcome is ``failed``
    (claimed, an unfinished delete), the other ref of the same call is deleted."""
    store, faults = run
    refs, keeper = _kept_pair(store)
    trainer = Ledger(store, "trainer_dp0")
    meta = chunk_keys(refs[1].key)[1]
    with refusing(store.path(node_key(refs[1].branch_id))) as code:
        result = trainer.delete(refs, reason="trained")
        trainer.wait_freed()  # refs[0]'s bytes removed: the stopped audit below sees only refs[1] unfinished
        assert [result.outcome(r.uri) for r in refs] == ["deleted", "failed"] and store.retries == 0
        reason = os.strerror(getattr(errno, code))
        assert str(result.failed[refs[1].uri]) == f"cannot delete {store.uri(meta)}: {code} ({reason})"
        assert trainer.unfinished == [refs[1].uri] and audit(store, stopped=True).unfinished_deletes == [refs[1].uri]
    again = trainer.finish_unfinished()  # the same holder, its own claim: never a double delete
    assert again.deleted == [refs[1].uri] and again.double_deletes == {} and trainer.unfinished == []
    _assert_deleted(store, refs, keeper.ledger, trainer)


def test_an_exclusive_put_over_another_writers_object_is_still_refused(run):
    store, faults = run
    store.put("d/k", b"theirs", exclusive=True)
    other = open_store(store.config)  # another writer (its own token)
    _fault(faults, "link", "k", "EIO", after=False)
    with pytest.raises(KeyExistsError, match="d/k already exists"):
        other.put("d/k", b"theirs", exclusive=True)  # the same bytes, another writer's token
    assert other.retries == 1 and other.idempotent_puts == 0 and store.get("d/k") == b"theirs"


@pytest.fixture
def small_fs(tmp_path):
    """A local config whose run root is a 256 KiB tmpfs (mounted for the test)."""
    from refpipe.storage.config import StorageConfig

    with tmpfs(str(tmp_path / "fs"), 256 << 10) as root:
        yield StorageConfig(root=root, run_id="run_0", max_retries=2, retry_backoff_s=0.001)


def test_a_full_filesystem_refuses_a_keep_naming_the_chunk(small_fs):
    store = open_store(small_fs)
    keeper = make_keeper(store, small_fs)
    rows = 32 << 10  # 16 bytes a row: 512 KiB, twice the filesystem
    fields = {"topk_ids": np.tile(np.arange(2, dtype=np.int32), (rows, 1)),
              "topk_logprobs": np.zeros((rows, 2), np.float32)}
    with pytest.raises(StorageError, match=r"cannot write .*/payloads/[0-9a-f]{2}/env_worker_0-[0-9a-f]{32}/c\.0: "
                                           r"ENOSPC \(No space left on device\)$") as info:
        keeper.keep(Branch(NUM_PROMPT, rows, fields))
    assert not isinstance(info.value, TransientStorageError) and store.retries == 0
    assert store.list_prefix("payloads") == []  # the unnamed file of the refused chunk is gone
    _assert_audit_clean(store, keeper.ledger, deleted=0)


def test_a_read_only_filesystem_refuses_writes_naming_the_key_and_still_reads(small_fs):
    store = open_store(small_fs)
    keeper = make_keeper(store, small_fs)
    ref = keep(keeper, seed=5)
    read_only(small_fs.root)
    try:
        for key, put in ((step_key(0), lambda: publish(store, 0, [ref], [0])),
                         ("config.json", lambda: store.put("config.json", b"{}", exclusive=True)),
                         (LATEST_WEIGHTS_KEY, lambda: store.put(LATEST_WEIGHTS_KEY, b"{}"))):
            with pytest.raises(StorageError) as info:
                put()
            assert str(info.value) == f"cannot write {store.uri(key)}: EROFS (Read-only file system)"
        assert store.retries == 0 and fetch_arrays(store, ref)["topk_ids"].shape == (NUM_COMPLETION, 2)
    finally:
        read_only(small_fs.root, False)
    assert keeper.discard([ref]).deleted == [ref.uri]
    _assert_audit_clean(store, keeper.ledger, deleted=1)


def test_a_delete_on_a_read_only_filesystem_returns_failed_refs_and_is_finished_later(small_fs):
    """Claims and the ledger's own segment are refused alike: the delete still returns one outcome per ref
    (never raises), its events stay buffered, and the same holder finishes both deletes once writable."""
    store = open_store(small_fs)
    keeper = make_keeper(store, small_fs)
    refs = [keep(keeper, seed=s) for s in (6, 7)]
    trainer = Ledger(store, "trainer_dp0")
    read_only(small_fs.root)
    try:
        result = trainer.delete(refs, reason="trained")
    finally:
        read_only(small_fs.root, False)
    assert [result.outcome(r.uri) for r in refs] == ["failed", "failed"] and store.retries == 0
    batch = batch_key("trainer_dp0", trainer.session, 0)
    assert str(result.failed[refs[0].uri]) == f"cannot write {store.uri(batch)}: EROFS (Read-only file system)"
    assert trainer.unfinished == [r.uri for r in refs] and store.list_prefix("ledger/deletes") == []
    again = trainer.finish_unfinished()
    assert sorted(again.deleted) == sorted(r.uri for r in refs) and trainer.unfinished == []
    _assert_deleted(store, refs, keeper.ledger, trainer)
    events = [json.loads(line)["event"] for k in store.list_prefix("ledger/events/trainer_dp0")
              for line in store.get(k).splitlines()]
    assert events == ["open", "unfinished_delete", "unfinished_delete", "close"]
