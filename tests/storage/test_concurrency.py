"""bounded_map: results in item order, at most ``max_concurrency`` calls in flight (real store reads), the first
error in item order raised once every call returned."""

from __future__ import annotations

import threading

import pytest

from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.concurrency import bounded_map
from refpipe.storage.errors import ChunkNotFoundError
from refpipe.storage.layout import DATA_NAME, node_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.local_store import LocalStore
from tests.storage.storage_helpers import FIELDS_CFG, Backend, assert_same_bytes, make_backend, make_fields, stored_cut


@pytest.fixture(params=["local", "s3"])
def backend(request) -> Backend:
    return make_backend(request.param, request.getfixturevalue(f"{request.param}_config"))


def keep_many(backend: Backend, count: int) -> tuple[list[PayloadRef], list[dict], list[int]]:
    keeper = Keeper(backend.store, Ledger(backend.store, "env_worker_0"), FIELDS_CFG, backend.config)
    refs, fields, prompts = [], [], []
    for i in range(count):
        p, c = 2 + i % 3, 3 + i
        fields.append(make_fields(i, p, c))
        prompts.append(p)
        refs.append(keeper.keep(Branch(p, c, fields[-1], f"b{i}")))
    return refs, fields, prompts


def test_results_in_item_order(backend):
    refs, fields, prompts = keep_many(backend, 9)
    order = [4, 0, 8, 2, 2, 7, 1, 6, 3, 5]
    num_tokens = [refs[i].num_tokens - (k % 3) for k, i in enumerate(order)]
    seen = []
    results = bounded_map(lambda item: fetch_arrays(backend.store, refs[item[0]], item[1]),
                          list(zip(order, num_tokens)), 3, on_result=seen.append)
    assert len(results) == len(order) and seen == results
    for result, i, n in zip(results, order, num_tokens):
        assert_same_bytes(result, stored_cut(fields[i], prompts[i], n))


def test_the_first_error_in_item_order_is_raised_once_every_call_returned(backend):
    refs, _, _ = keep_many(backend, 5)
    backend.raw.remove(f"{node_key('b1')}/{DATA_NAME}")
    backend.raw.remove(f"{node_key('b3')}/{DATA_NAME}")
    started, returned = [], []

    def fetch(ref: PayloadRef) -> dict:
        started.append(ref.branch_id)
        try:
            return fetch_arrays(backend.store, ref)
        finally:
            returned.append(ref.branch_id)

    with pytest.raises(ChunkNotFoundError, match=f"{refs[1].uri}/c.0 does not exist"):
        bounded_map(fetch, refs, 2)
    assert sorted(started) == sorted(returned) == [r.branch_id for r in refs]


def test_empty_and_single_items_run_inline(backend):
    refs, fields, prompts = keep_many(backend, 1)
    assert bounded_map(fetch_arrays, [], 4) == []
    caller = threading.get_ident()
    [(result, thread)] = bounded_map(lambda r: (fetch_arrays(backend.store, r, 2), threading.get_ident()), refs, 4)
    assert thread == caller
    assert_same_bytes(result, stored_cut(fields[0], prompts[0], 2))
    with pytest.raises(ValueError, match="max_concurrency=0: expected at least 1"):
        bounded_map(fetch_arrays, refs, 0)


class InFlightStore(LocalStore):
    """A real LocalStore that records how many reads (``get``, ``get_array``, ``get_into``) run at once and holds each
    at a barrier."""

    def __init__(self, prefix, config, parties: int):
        super().__init__(prefix, config)
        self.barrier = threading.Barrier(parties)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0

    def get(self, key, start=None, end=None):
        return self._held(lambda: super(InFlightStore, self).get(key, start, end))

    def get_array(self, key):
        return self._held(lambda: super(InFlightStore, self).get_array(key))

    def get_into(self, key, buffers, offset=0):
        return self._held(lambda: super(InFlightStore, self).get_into(key, buffers, offset))

    def _held(self, read):
        with self.lock:
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        try:
            self.barrier.wait(timeout=20)  # only passes when `parties` reads are in flight together
            return read()
        finally:
            with self.lock:
                self.in_flight -= 1


@pytest.mark.parametrize("max_concurrency", [1, 3])
def test_concurrency_is_bounded(local_config, max_concurrency):
    backend = make_backend("local", local_config)
    refs, fields, prompts = keep_many(backend, 6)
    store = InFlightStore(backend.store.prefix, local_config, parties=max_concurrency)
    results = bounded_map(lambda ref: fetch_arrays(store, ref), refs, max_concurrency)
    assert store.peak == max_concurrency
    for result, f, p, ref in zip(results, fields, prompts, refs):
        assert_same_bytes(result, stored_cut(f, p, ref.num_tokens))
