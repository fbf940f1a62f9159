"""The ledger's reaper (``storage.ledger_reaper``): a delete returns once its chunks are claimed, their bytes are
removed in the background, and a full backlog makes the next delete wait."""

from __future__ import annotations

import os
import threading

import pytest

from refpipe.pipeline.audit import audit
from refpipe.storage import ledger_reaper
from refpipe.storage.backends import open_store
from refpipe.storage.layout import chunk_keys
from refpipe.storage.ledger import Ledger
from tests.storage.test_ledger import kept


@pytest.fixture
def local(local_config):
    return open_store(local_config)


def _gated_removal(store, monkeypatch) -> threading.Event:
    """Hold ``store``'s removals (the reaper's ``delete_keys``) until the returned event is set."""
    gate = threading.Event()
    delete_keys = store.delete_keys
    monkeypatch.setattr(store, "delete_keys", lambda keys: (keys and gate.wait(60), delete_keys(keys)))
    return gate


def test_a_full_backlog_makes_a_delete_wait_for_room(local, monkeypatch):
    monkeypatch.setattr(ledger_reaper, "BACKLOG_CHUNKS", 2)
    refs = [kept(local, f"w{i}") for i in range(6)]
    ledger = Ledger(local, "trainer_dp0")
    removing, gate = threading.Event(), threading.Event()
    delete_keys = local.delete_keys

    def gated(keys):  # the reaper's removals (the caller's delete_keys of no keys passes)
        if keys:
            removing.set()
            assert gate.wait(60)
        delete_keys(keys)

    monkeypatch.setattr(local, "delete_keys", gated)
    results = []
    deleter = threading.Thread(target=lambda: results.append(ledger.delete(refs, reason="trained step 1")))
    deleter.start()
    assert removing.wait(60)
    # every chunk is claimed (its commit marker gone) before any is queued; the reaper holds its first batch (one or
    # two chunks) and two more fit in the backlog: the delete of six waits for room
    deleter.join(0.5)
    assert deleter.is_alive() and results == []
    assert local.list_prefix("payloads") == sorted(chunk_keys(r.key)[0] for r in refs)
    gate.set()
    deleter.join(60)
    assert [r.deleted for r in results] == [[r.uri for r in refs]]
    ledger.wait_freed()
    assert local.list_prefix("payloads") == [] and ledger.unfinished == []
    ledger.close()


def test_a_delete_returns_before_the_bytes_are_removed_and_wait_freed_waits_for_them(local, monkeypatch):
    refs = [kept(local, f"v{i}") for i in range(3)]
    ledger = Ledger(local, "trainer_dp0")
    gate = _gated_removal(local, monkeypatch)
    assert ledger.delete(refs, reason="trained step 1").deleted == [r.uri for r in refs]
    assert local.list_prefix("payloads") == sorted(chunk_keys(r.key)[0] for r in refs)  # claimed, c.0 still there
    waiter = threading.Thread(target=ledger.wait_freed)
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()
    gate.set()
    waiter.join(60)
    assert not waiter.is_alive() and local.list_prefix("payloads") == []
    ledger.close()


def test_a_claim_holds_its_marker_open_until_the_reaper_removes_the_chunk(local, monkeypatch):
    """The claim's unlink only removes the marker's name (its inode held by an O_PATH fd: ext4 frees it at the close);
    the reaper closes the fds before it unlinks the chunks, and none stays open."""
    refs = [kept(local, f"h{i}") for i in range(3)]
    ledger = Ledger(local, "trainer_dp0")
    gate = _gated_removal(local, monkeypatch)
    ledger.delete(refs, reason="trained step 1")
    held = local._confined().held._fds
    nodes = sorted(r.key for r in refs)
    assert sorted(held) == nodes and [os.readlink(f"/proc/self/fd/{fd}") for n in nodes for fd in held[n]] == \
        [f"{local.prefix.path}/{n}/zarr.json (deleted)" for n in nodes]
    gate.set()
    ledger.wait_freed()
    assert held == {} and local.list_prefix("payloads") == []
    ledger.close()


def test_a_live_audit_counts_chunks_the_reaper_is_removing_as_the_deleters_not_unfinished(local, monkeypatch):
    """While the deleter's session is live its claimed chunks are its reaper's to remove: no violation, no sweep's
    business; once the session counts as dead (``stopped``) they are unfinished deletes the sweep finishes."""
    refs = [kept(local, f"u{i}") for i in range(3)]
    ledger = Ledger(local, "trainer_dp0")
    gate = _gated_removal(local, monkeypatch)
    ledger.delete(refs, reason="trained step 1")
    live = audit(local)
    assert (live.unfinished_deletes, live.outstanding_by_holder, live.clean) == (
        [], {"trainer_dp0 (deleted, bytes being removed)": 3}, True)
    assert sorted(audit(local, stopped=True).unfinished_deletes) == sorted(r.uri for r in refs)
    gate.set()
    ledger.wait_freed()
    assert (audit(local).outstanding_by_holder, local.list_prefix("payloads")) == ({}, [])
    ledger.close()
