"""The incremental audit (``audit(incremental=True)``): what a second audit reads, exact reports, stale summaries."""

from __future__ import annotations

import pytest

from refpipe.pipeline.audit import audit
from refpipe.storage.backends import open_store
from refpipe.storage.layout import AUDIT_SUMMARY_KEY, BATCHES_PREFIX, EVENTS_PREFIX, meta_key, step_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.local_store import LocalStore
from tests.pipeline.audit_helpers import keep, make_keeper, publish, train


class CountingStore(LocalStore):
    """The local store, recording each ``get``, ``exists`` and listing as ``(verb, key)``."""

    def __init__(self, *args):
        super().__init__(*args)
        self.ops: list[tuple[str, str]] = []

    def get(self, key, start=None, end=None):
        self.ops.append(("get", key))
        return super().get(key, start, end)

    def exists(self, key):
        self.ops.append(("exists", key))
        return super().exists(key)

    def list_prefix(self, key_prefix):
        self.ops.append(("list", key_prefix))
        return super().list_prefix(key_prefix)

    def reads(self, verb: str, prefix: str = "") -> list[str]:
        return [key for v, key in self.ops if v == verb and key.startswith(prefix)]


@pytest.fixture
def run(local_config, monkeypatch):
    """(counting store, env worker keeper, [trainer_dp0, trainer_dp1] ledgers, 8 kept refs)."""
    monkeypatch.setattr("refpipe.storage.ledger_session.SEGMENT_MAX_AGE_S", 3600.0)  # segments counted exactly below
    store = open_store(local_config)
    keeper = make_keeper(store, local_config)
    trainers = [Ledger(store, f"trainer_dp{r}") for r in range(2)]
    refs = [keep(keeper, seed) for seed in range(8)]
    keeper.ledger.flush()
    return CountingStore(store.prefix, store.config), keeper, trainers, refs


def test_a_second_audit_reads_only_what_is_new_and_reports_what_a_full_audit_reports(run):
    store, keeper, trainers, refs = run
    publish(store, 0, refs[:4], [0, 1, 0, 1], borrow=(1, 0))
    train(store, trainers, 0)
    # stopped: no waiting for the live sessions' heartbeats; the 4 unshipped chunks then count as leaked
    assert audit(store, stopped=True, incremental=True) == audit(store, stopped=True)  # a full read, then the summary
    store.ops.clear()
    second = audit(store, stopped=True, incremental=True)
    reads = {verb: store.reads(verb) for verb in ("get", "exists", "list")}
    assert second == audit(store, stopped=True) and second.leaked == 4
    assert (second.kept, second.deleted, second.shipped, second.borrowed) == (8, 4, 4, 1)
    assert reads["get"] == [AUDIT_SUMMARY_KEY]  # no step file (settled), no segment (folded)
    # ledger/deletes/ is not listed, only its release records (one per DP rank and step)
    assert reads["list"] == ["steps", "ledger/events", "ledger/deletes/releases", "payloads"]
    assert len(reads["exists"]) == 4  # the delete records of the 4 unsettled chunks only

    covered = set(store.list_prefix(EVENTS_PREFIX))  # the segments the summary covers
    batches = set(store.list_prefix(BATCHES_PREFIX))  # the delete batch records of step 0, settled
    publish(store, 1, refs[4:], [0, 1, 0, 1])
    train(store, trainers, 1)
    for ledger in [keeper.ledger, *trainers]:
        ledger.close()
    store.ops.clear()
    third = audit(store, incremental=True, finished=True)
    reads = {verb: store.reads(verb) for verb in ("get", "exists")}
    new_segments = sorted(set(store.list_prefix(EVENTS_PREFIX)) - covered)
    assert third == audit(store, finished=True) and third.clean
    assert (third.kept, third.deleted, third.shipped, third.borrowed, third.present) == (8, 8, 8, 1, 0)
    assert len(new_segments) == 5  # env worker: close; each trainer: step 1's release, then close
    new_batches = sorted(set(store.list_prefix(BATCHES_PREFIX)) - batches)  # step 1's release, one per DP rank
    assert len(new_batches) == 2 and len(reads["exists"]) == 4
    assert sorted(reads["get"]) == sorted([AUDIT_SUMMARY_KEY, step_key(1), *new_segments, *new_batches])

def test_a_stale_or_broken_summary_is_ignored_and_a_reappearing_settled_chunk_is_an_unfinished_delete(run):
    store, keeper, trainers, refs = run
    publish(store, 0, refs[:4], [0, 1, 0, 1])
    train(store, trainers, 0)
    for ledger in [keeper.ledger, *trainers]:
        ledger.close()
    audit(store, incremental=True)
    store.put(AUDIT_SUMMARY_KEY, b'{"version": 2}')
    store.ops.clear()
    assert audit(store, incremental=True) == audit(store)
    assert store.reads("list", "ledger/deletes") == ["ledger/deletes", "ledger/deletes"]  # read in full, twice

    store.put(meta_key(refs[0].key), b"{}")  # a settled chunk's commit marker is back
    report = audit(store, incremental=True)
    assert report.unfinished_deletes == audit(store).unfinished_deletes == [refs[0].uri]
    assert report.violations == ["4 leaked chunks (present, no live holder; `refpipe sweep` deletes them)",
                                 "1 unfinished deletes (objects still present; `refpipe sweep` finishes them)"]
