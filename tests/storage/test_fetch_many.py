"""fetch_many: results in request order, at most ``max_concurrency`` fetches in flight, typed errors per item."""

from __future__ import annotations

import socket
import threading

import pytest
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.backends import open_store
from refpipe.storage.chunk import PayloadRef
from refpipe.storage.errors import ChunkCorruptError, ChunkNotFoundError, TransientStorageError
from refpipe.storage.fetch import FetchStats, fetch_many
from refpipe.storage.layout import DATA_NAME, node_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.local_store import LocalStore
from storage_helpers import FIELDS_CFG, Backend, assert_same_bytes, make_backend, make_fields, stored_cut


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


def test_results_in_request_order(backend):
    refs, fields, prompts = keep_many(backend, 9)
    order = [4, 0, 8, 2, 2, 7, 1, 6, 3, 5]
    num_tokens = [refs[i].num_tokens - (k % 3) for k, i in enumerate(order)]
    stats = FetchStats()
    results = fetch_many(backend.store, [(refs[i], n) for i, n in zip(order, num_tokens)], max_concurrency=3,
                         stats=stats)
    assert len(results) == len(order)
    for result, i, n in zip(results, order, num_tokens):
        assert_same_bytes(result, stored_cut(fields[i], prompts[i], n))
    assert (stats.chunks, stats.failures) == (len(order), 0)
    assert stats.nbytes == sum(a.nbytes for r in results for a in r.values())


def test_errors_are_typed_per_item_and_the_rest_succeed(backend):
    refs, fields, prompts = keep_many(backend, 5)
    backend.raw.remove(f"{node_key('b1')}/{DATA_NAME}")
    corrupted = bytearray(backend.raw.get(f"{node_key('b3')}/{DATA_NAME}"))
    corrupted[10] ^= 0xFF
    backend.raw.put(f"{node_key('b3')}/{DATA_NAME}", bytes(corrupted))
    relocated = refs[4].model_copy(update={"uri": refs[4].uri.replace("/run_1/", "/run_10/")})  # provenance only
    requests = [(refs[0], refs[0].num_tokens), (refs[1], refs[1].num_tokens), (refs[2], refs[2].num_tokens),
                (refs[3], refs[3].num_tokens), (relocated, 3), (refs[4], 3)]
    stats = FetchStats()
    results = fetch_many(backend.store, requests, max_concurrency=4, stats=stats)
    assert [type(r) for r in results] == [dict, ChunkNotFoundError, dict, ChunkCorruptError, dict, dict]
    assert refs[1].uri in str(results[1]) and refs[3].uri in str(results[3])
    assert_same_bytes(results[0], stored_cut(fields[0], prompts[0], refs[0].num_tokens))
    assert_same_bytes(results[2], stored_cut(fields[2], prompts[2], refs[2].num_tokens))
    assert_same_bytes(results[4], stored_cut(fields[4], prompts[4], 3))
    assert_same_bytes(results[5], stored_cut(fields[4], prompts[4], 3))
    assert (stats.chunks, stats.failures) == (4, 2)


def test_empty_and_single_requests(backend):
    refs, fields, prompts = keep_many(backend, 1)
    assert fetch_many(backend.store, [], max_concurrency=4) == []
    [result] = fetch_many(backend.store, [(refs[0], 2)], max_concurrency=4)
    assert_same_bytes(result, stored_cut(fields[0], prompts[0], 2))


class InFlightStore(LocalStore):
    """A real LocalStore that records how many reads (``get``, ``get_into``) run at once and holds each at a barrier."""

    def __init__(self, prefix, config, parties: int):
        super().__init__(prefix, config)
        self.barrier = threading.Barrier(parties)
        self.lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0

    def get(self, key, start=None, end=None):
        return self._held(lambda: super(InFlightStore, self).get(key, start, end))

    def get_into(self, key, buffers):
        return self._held(lambda: super(InFlightStore, self).get_into(key, buffers))

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
    results = fetch_many(store, [(ref, ref.num_tokens) for ref in refs], max_concurrency=max_concurrency)
    assert store.peak == max_concurrency
    for result, f, p, ref in zip(results, fields, prompts, refs):
        assert_same_bytes(result, stored_cut(f, p, ref.num_tokens))


def test_unreachable_store_gives_a_transient_error_per_item(s3_config):
    backend = make_backend("s3", s3_config)
    refs, _, _ = keep_many(backend, 3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dead = open_store(s3_config.model_copy(update={"s3_endpoint_url": f"http://127.0.0.1:{port}",
                                                   "max_retries": 1, "retry_backoff_s": 0.001}))
    stats = FetchStats()
    results = fetch_many(dead, [(ref, ref.num_tokens) for ref in refs], max_concurrency=3, stats=stats)
    assert [type(r) for r in results] == [TransientStorageError] * 3
    assert all("gave up after 2 attempts" in str(r) for r in results)
    assert (stats.chunks, stats.failures, stats.nbytes) == (0, 3, 0)
    assert all(isinstance(r, OSError) for r in results)
