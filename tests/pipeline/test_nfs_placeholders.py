"""A chunk deleted on NFS while a reader holds it open, and a sweep that meets a key it cannot delete.

The NFS client's silly rename is simulated (``tests/helpers/fault_os.py`` ``NfsClient``), because no NFS server can be
mounted here. The local store unlinks relative to directory fds (``unlinkat``), so a stand-in that intercepts
path-based calls would never see its unlinks: ``NfsClient`` replaces ``os`` as ``refpipe.storage.local_store``
sees it (only ``unlink`` is changed) and does what the client does, for real, on the real directory: the open
``c.0`` is renamed to ``.nfs<hex>`` in the chunk's directory (asserted: the placeholder is there and the reader
still reads the chunk's bytes through its fd), unlinking the placeholder while the reader holds it is ``EBUSY``
from the same stand-in, and the reader's close removes it.
"""

from __future__ import annotations

import errno
import json
import os

import pytest

from refpipe.pipeline.audit import audit
from refpipe.pipeline.sweep import SweepResult, sweep
from refpipe.storage import local_confined, local_put, local_store
from refpipe.storage.backends import open_store
from refpipe.storage.layout import chunk_keys, node_key
from refpipe.storage.ledger import Ledger
from tests.helpers.fault_os import NfsClient, refusing
from tests.pipeline.audit_helpers import keep, make_keeper


def _events(store, actor: str) -> list[str]:
    return [json.loads(line)["event"] for k in store.list_prefix(f"ledger/events/{actor}")
            for line in store.get(k).splitlines()]


def test_a_silly_renamed_chunk_is_no_object_of_the_run(local_config, monkeypatch):
    nfs = NfsClient()
    for module in (local_store, local_put, local_confined):
        monkeypatch.setattr(module, "os", nfs)
    store = open_store(local_config.model_copy(update={"max_retries": 2, "retry_backoff_s": 0.001}))
    keeper = make_keeper(store, store.config)
    refs = [keep(keeper, seed=s) for s in (1, 2)]
    data_key = chunk_keys(refs[0].key)[0]
    chunk = store.get(data_key)
    reader = os.open(store.path(data_key), os.O_RDONLY)
    try:
        assert keeper.discard(refs).deleted == [r.uri for r in refs]
        keeper.ledger.wait_freed()
        placeholder = nfs.renames[0][1]
        node_dir = os.open(store.path(node_key(refs[0].branch_id)), os.O_RDONLY | os.O_DIRECTORY)
        assert nfs.renames == [("c.0", placeholder)] and os.listdir(node_dir) == [placeholder]
        assert os.pread(reader, len(chunk) + 1, 0) == chunk
        with pytest.raises(OSError) as busy:
            nfs.unlink(placeholder, dir_fd=node_dir)
        assert busy.value.errno == errno.EBUSY
        keeper.ledger.close()
        report = audit(store, finished=True)
        assert report.violations == [] and (report.kept, report.deleted, report.present) == (2, 2, 0)
        assert report.stray_keys == [] and store.list_prefix("payloads") == []
        swept = sweep(store, stopped=True, force=True)
        shards = {node_key(r.branch_id).rpartition("/")[0] for r in refs}
        assert swept == SweepResult(dry_run=False, deleted=[], finished_deletes=[], removed_incomplete=[],
                                    removed_directories=len(shards) - 1)  # the placeholder's shard stays
        assert _events(store, "sweep") == ["open", "close"]
    finally:
        nfs.close(reader)
    assert os.listdir(node_dir) == []
    os.close(node_dir)
    assert store.remove_empty_directories() == 3  # the chunk's directory, its shard and payloads/
    assert audit(store, finished=True).violations == [] and not os.path.exists(store.path("payloads"))


def test_a_sweep_that_cannot_delete_one_chunk_finishes_the_others_and_closes_its_ledger(local_config):
    """Two unfinished deletes (claimed, objects left: their directories refused removing names); at the sweep one
    directory still refuses. The sweep finishes the other, names the failed one, closes its session; the next
    sweep finishes it."""
    store = open_store(local_config.model_copy(update={"max_retries": 2, "retry_backoff_s": 0.001}))
    keeper = make_keeper(store, store.config)
    refs = [keep(keeper, seed=s) for s in (3, 4)]
    trainer = Ledger(store, "trainer_dp0")
    data = chunk_keys(refs[0].key)[0]  # listed first: the sweep deletes a node's keys in sorted order
    with refusing(store.path(node_key(refs[0].branch_id))) as code:
        with refusing(store.path(node_key(refs[1].branch_id))):
            result = trainer.delete(refs, reason="trained")
            trainer.close()  # retries once more: still refused
        assert sorted(result.failed) == sorted(r.uri for r in refs)
        keeper.ledger.close()
        swept = sweep(store)
    reason = os.strerror(getattr(errno, code))
    assert swept.finished_deletes == [refs[1].uri]
    assert swept.failed == [f"{refs[0].uri}: cannot delete {store.uri(data)}: {code} ({reason})"]
    assert _events(store, "sweep") == ["open", "finish_delete", "finish_delete", "close"]
    again = sweep(store)
    assert (again.finished_deletes, again.failed) == ([refs[0].uri], [])
    report = audit(store, finished=True)
    assert report.violations == [] and (report.deleted, report.present) == (2, 0)
