"""``trainer.background.BackgroundRelease`` on a real local store: which release a step's metrics count, and that the
step right after a release never waits for it; ``Prefetch``: one thread for every step, ended by ``close``."""

from __future__ import annotations

import json
import threading

import numpy as np

from refpipe.storage.backends import open_store
from refpipe.storage.errors import KeyNotFoundError
from refpipe.storage.layout import chunk_keys
from refpipe.storage.ledger import Ledger
from refpipe.trainer.background import BackgroundRelease, Prefetch, ReleaseCounts
from refpipe.trainer.fetch import FetchedStep
from tests.trainer.trainer_helpers import keep_all, make_branch


def test_a_release_is_collected_by_the_submit_after_next_and_the_last_two_by_wait(local_config):
    """Steps 0-2 of 2 chunks each: ``submit`` of step 1 leaves step 0's release pending (the main thread does not
    wait for it: nothing is counted yet), ``submit`` of step 2 collects step 0's, ``wait`` steps 1 and 2's; every
    chunk is deleted once and released in step order."""
    store = open_store(local_config)
    rng = np.random.default_rng(3)
    refs = keep_all(store, local_config, {f"b{i}": make_branch(rng, 2, 3, f"b{i}") for i in range(6)})
    steps = [[refs[f"b{2 * s}"], refs[f"b{2 * s + 1}"]] for s in range(3)]
    release = BackgroundRelease(Ledger(store, "trainer_dp0"), 0, 2)
    release.submit(0, steps[0])
    assert release.take_counts() == ReleaseCounts()
    release.submit(1, steps[1])
    assert release.take_counts() == ReleaseCounts()  # step 0's release may still run: not waited for, not counted
    release.submit(2, steps[2])
    assert release.take_counts() == ReleaseCounts(deletes=2)  # step 0's
    release.wait()
    assert release.take_counts() == ReleaseCounts(deletes=4)  # steps 1 and 2
    release.shutdown()
    release.ledger.close()
    assert not [k for r in refs.values() for k in chunk_keys(r.key) if store.exists(k)]
    events = [e for key in sorted(store.list_prefix("ledger/events/trainer_dp0"))
              for e in (json.loads(line) for line in store.get(key).decode().splitlines())
              if e["event"] == "release"]
    assert [e["step"] for e in events] == [0, 1, 2]


def test_prefetch_fetches_each_step_on_one_thread_and_close_ends_it():
    """Steps 0 and 1 are fetched on the same thread (started once, not per step); step 2's file never appears, so
    ``take(2)`` ends its polling and returns None; a raising fetch (a bug) is logged and the next step still
    prefetches; ``close`` ends the thread."""
    threads, loaded = set(), []

    def load(step: int) -> object:
        if step == 2:
            raise KeyNotFoundError(f"step {step}")
        loaded.append(step)
        return step

    def fetch(step_file: object) -> FetchedStep:
        threads.add(threading.current_thread())
        if step_file == 3:
            raise RuntimeError("a bug")
        return FetchedStep(chunks=int(step_file))  # type: ignore[call-overload]

    prefetch = Prefetch(load, fetch, poll_s=0.01)  # type: ignore[arg-type]
    got = []
    for step in (0, 1, 2, 3, 4):
        prefetch.start(step)
        prepared = prefetch.take(step)
        got.append(None if prepared is None else (prepared.step_file, prepared.fetched.chunks, prepared.prefetched))
    assert got == [(0, 0, True), (1, 1, True), None, None, (4, 4, True)]
    assert loaded == [0, 1, 3, 4]
    assert len(threads) == 1
    thread = threads.pop()
    assert thread.is_alive() and thread.name == "prefetch"
    prefetch.close()
    assert not thread.is_alive()
    assert prefetch.take(5) is None
