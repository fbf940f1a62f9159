"""One conformance suite for every store backend (zarr's ``StoreTests`` style).

``StoreConformance`` holds the tests; each backend subclasses it once and supplies the
``backend`` fixture: the store and a raw view (plain files, or a boto3 client of its own)
that bypasses it. S3 runs against the real moto server from ``tests/conftest.py``.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import pickle
import socket
import threading

import numpy as np
import pytest

from refpipe.storage import local_io
from refpipe.storage import local_store as store_module
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import (
    DeleteKeysError,
    KeyExistsError,
    KeyNotFoundError,
    OutsideRunError,
    StorageError,
    TransientStorageError,
)
from refpipe.storage.local_store import LocalStore
from refpipe.storage.s3_store import S3Store
from tests.storage.storage_helpers import Backend, FsOps, S3Requests, make_backend
from tests.storage.store_children import race_in_child, race_payload, use_in_child

DATA = bytes(range(256)) * 3
BAD_KEYS = ["../run_2/x", "a/../../x", "/etc/passwd", "a//b", "./a", "a/.", "a\\b", "", "a/\x00b"]


class StoreConformance:
    """Subclass once per backend: supply the ``backend`` fixture (``storage_helpers.Backend``)."""

    def test_put_get_round_trip(self, backend: Backend):
        store, raw = backend.store, backend.raw
        store.put("a/b/one", DATA)
        store.put("a/b/two", [b"head", bytearray(b"-mid-"), memoryview(b"tail"), np.arange(3, dtype=np.uint8)])
        store.put("a/empty", b"")
        store.put("a/array", np.arange(6, dtype="<i4").reshape(2, 3))  # one buffer, not a sequence of rows
        store.put("a/tuple", (b"x", np.zeros(2, np.uint8)))
        assert store.get("a/b/one") == DATA
        assert raw.get("a/b/one") == DATA
        assert store.get("a/b/two") == b"head-mid-tail\x00\x01\x02"
        assert store.get("a/empty") == b""
        assert store.get("a/array") == np.arange(6, dtype="<i4").tobytes()
        assert store.get("a/tuple") == b"x\x00\x00"
        assert raw.keys() == ["a/array", "a/b/one", "a/b/two", "a/empty", "a/tuple"]  # no temp objects left

    def test_large_objects_round_trip(self, backend: Backend):
        parts = [np.random.default_rng(0).integers(0, 256, 1_500_007, dtype=np.uint8), b"mid", bytes(700_001)]
        backend.store.put("big", parts, exclusive=True)
        backend.store.put("big2", parts)
        expected = b"".join(bytes(p) for p in parts)
        assert backend.store.get("big") == expected and backend.store.get("big2") == expected
        assert backend.store.get("big", 1_499_990, 1_500_020) == expected[1_499_990:1_500_020]

    def test_get_into_fills_buffers_in_order_and_returns_the_object_size(self, backend: Backend):
        backend.store.put("g", DATA)
        head, typed, tail = bytearray(5), np.zeros(64, "<u4"), np.zeros(512, np.uint8)
        buffers = [head, memoryview(bytearray(0)), typed, tail[:507]]  # 5 + 0 + 256 + 507 = 768 bytes
        assert backend.store.get_into("g", buffers) == len(DATA)
        assert bytes(head) + typed.tobytes() + tail[:507].tobytes() == DATA
        assert not tail[507:].any()

    def test_get_into_a_shorter_object_fills_only_its_bytes(self, backend: Backend):
        backend.store.put("g", DATA[:100])
        buffers = [np.full(64, 7, np.uint8), np.full(64, 7, np.uint8)]
        assert backend.store.get_into("g", buffers) == 100
        assert buffers[0].tobytes() + buffers[1][:36].tobytes() == DATA[:100]
        assert (buffers[1][36:] == 7).all()  # left as it was
        backend.store.put("empty", b"")
        assert backend.store.get_into("empty", [np.full(8, 7, np.uint8)]) == 0

    def test_get_into_a_longer_object_fills_the_buffers_and_reports_its_size(self, backend: Backend):
        backend.store.put("g", DATA)
        buffers = [bytearray(10), np.zeros(20, np.uint8)]
        assert backend.store.get_into("g", buffers) == len(DATA)
        assert bytes(buffers[0]) + buffers[1].tobytes() == DATA[:30]
        assert backend.store.get_into("g", []) == len(DATA)

    def test_get_into_more_buffers_than_one_preadv_takes(self, backend: Backend):
        data = np.random.default_rng(2).integers(0, 256, 3_000, dtype=np.uint8)  # 1,500 buffers: IOV_MAX is 1,024
        backend.store.put("many", data)
        buffers = [np.empty(2, np.uint8) for _ in range(1_500)]
        assert backend.store.get_into("many", buffers, offset=7) == 2_993
        assert b"".join(b.tobytes() for b in buffers)[:2_993] == data[7:].tobytes()

    def test_get_into_large_object(self, backend: Backend):
        data = np.random.default_rng(1).integers(0, 256, 2_900_017, dtype=np.uint8)
        backend.store.put("big", data)
        parts = [np.empty(1_500_000, np.uint8), np.empty((350_000, 2), "<u2"), np.empty(17, np.uint8)]
        assert backend.store.get_into("big", parts) == data.nbytes
        assert b"".join(p.tobytes() for p in parts) == data.tobytes()

    def test_get_array_is_the_whole_object_read_only(self, backend: Backend):
        data = np.random.default_rng(3).integers(0, 256, 2_900_017, dtype=np.uint8)
        backend.store.put("big", data)
        backend.store.put("empty", b"")
        got = backend.store.get_array("big")
        assert (got.dtype, got.shape, got.flags.writeable) == (np.uint8, (2_900_017,), False)
        assert got.tobytes() == data.tobytes()
        assert backend.store.get_array("empty").shape == (0,)
        for key in ("absent", "big/below_an_object"):
            with pytest.raises(KeyNotFoundError, match="does not exist"):
                backend.store.get_array(key)

    def test_get_into_missing_raises_key_not_found(self, backend: Backend):
        backend.store.put("present/x", b"x")
        for key in ("absent", "present/missing", "present/x/below_an_object"):
            with pytest.raises(KeyNotFoundError, match="does not exist"):
                backend.store.get_into(key, [bytearray(4)])

    def test_put_replaces(self, backend: Backend):
        backend.store.put("k", b"first")
        backend.store.put("k", b"second version")
        assert backend.store.get("k") == b"second version"
        assert backend.raw.keys() == ["k"]

    @pytest.mark.parametrize("start,end", [(0, 10), (10, 20), (760, 768), (700, None), (None, 7), (0, 5000),
                                           (768, 800), (900, 950), (5, 5), (9, 3), (0, 0)])
    def test_byte_ranges(self, backend: Backend, start, end):
        backend.store.put("ranged", DATA)
        assert backend.store.get("ranged", start, end) == DATA[start:end]

    @pytest.mark.parametrize("start,end", [(None, None), (0, 4), (3, None), (2, 2)])
    def test_get_missing_raises_key_not_found(self, backend: Backend, start, end):
        backend.store.put("present/x", b"x")
        for key in ("absent", "present/missing", "present/x/below_an_object"):
            with pytest.raises(KeyNotFoundError, match="does not exist") as info:
                backend.store.get(key, start, end)
            assert backend.store.uri(key) in str(info.value)
            assert isinstance(info.value, FileNotFoundError)

    def test_exclusive_put_of_existing_key_raises_and_keeps_first(self, backend: Backend):
        backend.store.put("k", b"first", exclusive=True)
        with pytest.raises(KeyExistsError, match="already exists") as info:
            backend.store.put("k", [b"sec", b"ond"], exclusive=True)
        assert backend.store.uri("k") in str(info.value)
        assert isinstance(info.value, FileExistsError)
        assert backend.store.get("k") == b"first"
        assert backend.raw.keys() == ["k"]

    def test_in_place_put_is_exclusive_and_whole(self, backend: Backend):
        backend.store.put("n/c.0", [b"fir", b"st"], exclusive=True, in_place=True)
        with pytest.raises(KeyExistsError, match="already exists"):
            backend.store.put("n/c.0", b"second", exclusive=True, in_place=True)
        with pytest.raises(KeyExistsError, match="already exists"):
            backend.store.put("n/c.0", b"second", exclusive=True)
        assert backend.store.get("n/c.0") == b"first" and backend.raw.keys() == ["n/c.0"]
        assert (backend.store.retries, backend.store.idempotent_puts) == (0, 0)
        with pytest.raises(ValueError, match=r"in_place=True\): expected exclusive=True as well"):
            backend.store.put("n/other", b"x", in_place=True)
        assert backend.raw.keys() == ["n/c.0"]

    def test_in_place_put_16_threads_one_winner(self, backend: Backend):
        n, barrier, outcome = 16, threading.Barrier(16), [""] * 16

        def attempt(i: int) -> None:
            barrier.wait(timeout=30)
            try:
                backend.store.put("race/c.0", race_payload(i), exclusive=True, in_place=True)
                outcome[i] = "won"
            except KeyExistsError:
                outcome[i] = "lost"

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcome) == ["lost"] * (n - 1) + ["won"]
        assert backend.store.get("race/c.0") == race_payload(outcome.index("won"))

    def test_exclusive_put_16_threads_one_winner(self, backend: Backend):
        n = 16
        barrier = threading.Barrier(n)
        outcome: list[str | None] = [None] * n

        def attempt(i: int) -> None:
            barrier.wait(timeout=30)
            try:
                backend.store.put("race/key", race_payload(i), exclusive=True)
                outcome[i] = "won"
            except KeyExistsError:
                outcome[i] = "lost"

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        winners = [i for i, o in enumerate(outcome) if o == "won"]
        assert len(winners) == 1 and outcome.count("lost") == n - 1, outcome
        assert backend.store.get("race/key") == race_payload(winners[0])
        assert backend.raw.keys() == ["race/key"]

    def test_delete_known_keys_absent_keys_are_not_errors(self, backend: Backend):
        for key in ("a/1", "a/2", "b/3"):
            backend.store.put(key, key.encode())
        backend.store.delete_keys(["a/1", "b/3", "a/never", "zz/never/x"])
        backend.store.delete_keys([])
        backend.store.delete_keys(["a/1"])
        assert backend.raw.keys() == ["a/2"]
        assert backend.store.get("a/2") == b"a/2"

    def test_delete_more_than_1000_keys(self, backend: Backend):
        keys = [f"many/{i:05d}" for i in range(1001)]
        present = [keys[0], keys[500], keys[999], keys[1000]]  # both sides of S3's 1,000-key batch limit
        for key in present + ["keep/me"]:
            backend.store.put(key, b".")
        backend.store.delete_keys(keys)
        assert backend.raw.keys() == ["keep/me"]

    def test_exists(self, backend: Backend):
        backend.store.put("e/x", b"")
        assert backend.store.exists("e/x") is True
        assert backend.store.exists("e/y") is False
        assert backend.store.exists("e/x/z") is False

    def test_list_prefix(self, backend: Backend):
        for key in ("x/b1/k", "x/b10/k", "x/b1/sub/k2", "y/k"):
            backend.store.put(key, b"v")
        assert backend.store.list_prefix("x/b1") == ["x/b1/k", "x/b1/sub/k2"]
        assert backend.store.list_prefix("x") == ["x/b1/k", "x/b1/sub/k2", "x/b10/k"]
        assert backend.store.list_prefix("") == ["x/b1/k", "x/b1/sub/k2", "x/b10/k", "y/k"]
        assert backend.store.list_prefix("nope") == []
        assert backend.store.list_prefix("y/k") == []  # an object is not a prefix

    @pytest.mark.parametrize("key", BAD_KEYS)
    def test_keys_outside_the_run_are_refused_before_io(self, backend: Backend, key):
        store = backend.store
        for verb in (lambda: store.get(key), lambda: store.put(key, b"x"), lambda: store.put(key, b"x", exclusive=True),
                     lambda: store.delete_keys([key]), lambda: store.exists(key), lambda: store.uri(key),
                     lambda: store.list_prefix(key) if key else store.path(key)):
            with pytest.raises(OutsideRunError):
                verb()
        assert backend.raw.objects() == []

    def test_pickled_into_spawned_child(self, backend: Backend):
        self._run_child(backend, "spawn")

    def test_forked_child(self, backend: Backend):
        self._run_child(backend, "fork")

    @staticmethod
    def _run_child(backend: Backend, method: str) -> bool | None:
        """Use the store in a child; return whether the child rebuilt its filesystem (None: the store has none)."""
        backend.store.put("parent/obj", b"from parent")
        ctx = multiprocessing.get_context(method)
        queue = ctx.Queue()
        child = ctx.Process(target=use_in_child, args=(backend.store, queue))
        child.start()
        got, rebuilt = queue.get(timeout=120)
        child.join(60)
        assert child.exitcode == 0
        assert got == b"from parent"
        assert backend.raw.get("child/obj") == b"from child " + str(child.pid).encode()
        return rebuilt

    def test_pickle_round_trip(self, backend: Backend):
        backend.store.put("p", b"1")
        clone = pickle.loads(pickle.dumps(backend.store))
        assert type(clone) is type(backend.store)
        assert clone.prefix == backend.store.prefix and clone.config == backend.store.config
        assert clone.get("p") == b"1"

    def test_delete_keys_refuses_a_string(self, backend: Backend):
        backend.store.put("steps/x", b"1")
        backend.store.put("s", b"1")
        with pytest.raises(TypeError, match=r"delete_keys\('steps/x'\): expected a sequence of keys, got a str"):
            backend.store.delete_keys("steps/x")
        assert backend.raw.keys() == ["s", "steps/x"]
        backend.store.delete_key("steps/x")
        assert backend.raw.keys() == ["s"]

    def test_list_sizes(self, backend: Backend):
        for key, size in (("x/b1/k", 3), ("x/b1/sub/k2", 0), ("x/b10/k", 7), ("y/k", 1)):
            backend.store.put(key, bytes(size))
        assert backend.store.list_sizes("x") == {"x/b1/k": 3, "x/b1/sub/k2": 0, "x/b10/k": 7}
        assert backend.store.list_sizes("x/b1") == {"x/b1/k": 3, "x/b1/sub/k2": 0}
        assert backend.store.list_sizes("") == {"x/b1/k": 3, "x/b1/sub/k2": 0, "x/b10/k": 7, "y/k": 1}
        assert backend.store.list_sizes("nope") == {}


class TestLocalStore(StoreConformance):
    @pytest.fixture
    def backend(self, local_config) -> Backend:
        backend = make_backend("local", local_config)
        assert isinstance(backend.store, LocalStore)
        return backend

    def test_exclusive_put_16_processes_one_winner(self, backend: Backend):
        ctx = multiprocessing.get_context("fork")
        barrier = ctx.Barrier(16)
        children = [ctx.Process(target=race_in_child, args=(backend.store, "race/key", i, barrier))
                    for i in range(16)]
        for child in children:
            child.start()
        for child in children:
            child.join(60)
        codes = [child.exitcode for child in children]
        assert sorted(codes) == [0] + [17] * 15, codes
        assert backend.store.get("race/key") == race_payload(codes.index(0))
        assert backend.raw.keys() == ["race/key"]

    def test_exclusive_put_creates_one_entry_and_no_temp_name(self, backend: Backend):
        backend.store.put("d/first", b"1")
        with FsOps(backend.store.prefix.path) as ops:
            backend.store.put("d/second", [b"2", b"2"], exclusive=True)
        assert ops.ops == [("open", "."), ("os.link", "second")]  # directory d's handle is cached since "first"
        assert backend.store.get("d/second") == b"22"

    def test_in_place_put_is_one_create_and_claims_with_its_token(self, backend: Backend):
        backend.store.put("d/first", b"1")
        with FsOps(backend.store.prefix.path) as ops:
            backend.store.put("d/second", [b"2", b"2"], exclusive=True, in_place=True)
        assert ops.ops == [("open", "second")]  # no temp file, no link
        assert backend.store.get("d/second") == b"22"
        path = backend.store.path("d/second")
        assert os.getxattr(path, local_io.TOKEN_XATTR).decode().startswith(f"{backend.store.writer}.")

    def test_in_place_put_claims_an_empty_file_without_token_and_never_another(self, backend: Backend):
        """An empty file without a write token: a create whose answer was lost (or one not claimed yet), claimed by
        ``XATTR_CREATE`` and written; a file with bytes or with another put's token stays, ``KeyExistsError``."""
        store, raw = backend.store, backend.raw
        raw.put("d/lost", b"")
        store.put("d/lost", b"mine", exclusive=True, in_place=True)
        assert store.get("d/lost") == b"mine" and store.idempotent_puts == 1
        raw.put("d/bytes", b"theirs")
        store.put("d/claimed", b"")
        os.setxattr(store.path("d/claimed"), local_io.TOKEN_XATTR, b"other.writer")
        for key, held in (("d/bytes", b"theirs"), ("d/claimed", b""), ("d/lost", b"mine")):
            with pytest.raises(KeyExistsError, match="already exists"):
                store.put(key, b"new", exclusive=True, in_place=True)
            assert store.get(key) == held
        os.mkfifo(store.path("d/fifo"))
        with pytest.raises(KeyExistsError):  # never blocks on a FIFO, never writes through it
            store.put("d/fifo", b"new", exclusive=True, in_place=True)
        assert store.idempotent_puts == 1

    def test_in_place_put_that_fails_writing_leaves_no_file(self, backend: Backend, monkeypatch):
        def full(fd, data):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(local_io.os, "write", full)
        with pytest.raises(StorageError, match="ENOSPC"):
            backend.store.put("d/c.0", b"x" * 10, exclusive=True, in_place=True)
        monkeypatch.undo()
        assert backend.raw.keys() == []
        backend.store.put("d/c.0", b"x" * 10, exclusive=True, in_place=True)
        assert backend.store.get("d/c.0") == b"x" * 10

    def test_get_is_open_and_nothing_else(self, backend: Backend):
        backend.store.put("d/x", DATA)
        with FsOps(backend.store.prefix.path) as ops:
            assert backend.store.get("d/x", 3, 9) == DATA[3:9]
            assert backend.store.get("d/x") == DATA
            assert backend.store.get_into("d/x", [bytearray(len(DATA))]) == len(DATA)
            assert backend.store.get_array("d/x").tobytes() == DATA
        assert ops.ops == [("open", "x")] * 4  # directory d's handle is cached since the put

    def test_get_array_is_a_fresh_numpy_array_read_with_short_reads_resumed(self, backend: Backend, monkeypatch):
        data = np.random.default_rng(5).integers(0, 256, 10_000, dtype=np.uint8)
        backend.store.put("d/x", data)
        real = os.preadv
        monkeypatch.setattr(os, "preadv", lambda fd, views, offset: real(fd, [views[0][:999]], offset))
        got = backend.store.get_array("d/x")
        assert got.tobytes() == data.tobytes()
        assert isinstance(got.base, np.ndarray) and got.base.flags.owndata  # numpy's allocator, not bytes

    def test_get_into_resumes_after_short_reads_and_without_preadv(self, backend: Backend, monkeypatch):
        data = np.random.default_rng(2).integers(0, 256, 10_000, dtype=np.uint8)
        backend.store.put("d/x", data)
        real = os.preadv
        monkeypatch.setattr(os, "preadv", lambda fd, views, offset: real(fd, [views[0][:999]], offset))
        parts = [np.empty(3000, np.uint8), np.empty(7000, np.uint8)]
        assert backend.store.get_into("d/x", parts) == 10_000
        assert parts[0].tobytes() + parts[1].tobytes() == data.tobytes()
        monkeypatch.setattr(local_io, "_HAVE_PREADV", False)
        parts = [np.empty(3000, np.uint8), np.empty(7100, np.uint8)]
        assert backend.store.get_into("d/x", parts) == 10_000
        assert parts[0].tobytes() + parts[1][:7000].tobytes() == data.tobytes()

    def test_get_into_a_directory_is_a_storage_error(self, backend: Backend):
        backend.store.put("d/x", b"1")
        with pytest.raises(StorageError, match="cannot read") as info:
            backend.store.get_into("d", [bytearray(4)])
        assert not isinstance(info.value, KeyNotFoundError)

    def test_delete_removes_empty_branch_directory_keeps_shard(self, backend: Backend):
        backend.store.put("payloads/ab/b1/c.0", b"c")
        backend.store.put("payloads/ab/b1/zarr.json", b"{}")
        backend.store.put("payloads/ab/b2/c.0", b"c")
        backend.store.delete_keys(["payloads/ab/b1/c.0"])
        assert os.path.isdir(backend.store.path("payloads/ab/b1"))
        backend.store.delete_keys(["payloads/ab/b1/zarr.json"])
        assert not os.path.exists(backend.store.path("payloads/ab/b1"))
        assert os.listdir(backend.store.path("payloads/ab")) == ["b2"]

    def test_unreadable_key_is_a_storage_error(self, backend: Backend):
        backend.store.put("d/x", b"1")
        with pytest.raises(StorageError, match="cannot read") as info:
            backend.store.get("d")  # a directory
        assert not isinstance(info.value, KeyNotFoundError)

class TestLocalStoreWithoutTmpfile(TestLocalStore):
    """The same suite where the filesystem has no ``O_TMPFILE`` (NFS, some Lustre): exclusive puts use a named
    temp file, ``link(2)`` and ``unlink(2)``."""

    @pytest.fixture
    def backend(self, local_config, monkeypatch) -> Backend:
        monkeypatch.setattr(store_module, "HAVE_TMPFILE", False)
        return make_backend("local", local_config)

    def test_exclusive_put_creates_one_entry_and_no_temp_name(self, backend: Backend):
        backend.store.put("d/first", b"1")
        with FsOps(backend.store.prefix.path) as ops:
            backend.store.put("d/second", [b"2", b"2"], exclusive=True)
        tmp = ops.ops[0][1]
        assert tmp.startswith("second.tmp-")
        assert ops.ops == [("open", tmp), ("os.link", "second"), ("os.remove", tmp)]
        assert backend.store.get("d/second") == b"22"
        assert backend.raw.keys() == ["d/first", "d/second"]


class TestS3Store(StoreConformance):
    """On each S3 server: moto, then SeaweedFS (a real S3-compatible server)."""

    @pytest.fixture
    def backend(self, s3_server_config) -> Backend:
        backend = make_backend("s3", s3_server_config)
        assert isinstance(backend.store, S3Store)
        return backend

    def test_requests_per_verb(self, backend: Backend):
        store = backend.store
        requests = S3Requests(store)
        store.put("k", DATA)
        store.put("x", DATA, exclusive=True)
        assert requests.log == [("PUT", None), ("PUT", None)]
        requests.clear()
        store.get("k")
        store.get("k", 2, 5)
        store.get("k", 700)
        store.get_into("k", [bytearray(10)])
        assert requests.log == [("GET", None), ("GET", "bytes=2-4"), ("GET", "bytes=700-"), ("GET", None)]
        requests.clear()
        store.delete_keys(["k", "x", "never"])
        assert requests.kinds() == ["DELETE"]

    def test_a_put_above_the_part_size_is_one_multipart_upload_of_the_buffers_in_order(self, backend: Backend):
        part = 5 * 2**20  # the smallest part S3 allows
        store = open_store(backend.config.model_copy(update={"s3_part_size_bytes": part}))
        body = [np.arange(3 * 2**20, dtype=np.uint8), np.full(8 * 2**20, 7, np.uint8), b"!"]  # 11 MiB + 1: 3 parts
        requests = S3Requests(store)
        store.put("ckpt/share", body, exclusive=True)
        assert requests.kinds() == ["CreateMultipartUpload", "UploadPart", "UploadPart", "UploadPart",
                                    "CompleteMultipartUpload"]
        assert store.get("ckpt/share") == b"".join(bytes(b) for b in body)
        with pytest.raises(KeyExistsError):
            open_store(store.config).put("ckpt/share", b"other" * 2**21, exclusive=True)  # 10 MiB: multipart
        requests.clear()
        with pytest.raises(KeyExistsError):  # this writer's body again, a later call: 412, not its token
            store.put("ckpt/share", body, exclusive=True)
        assert store.idempotent_puts == 0
        assert requests.kinds()[-3:] == ["CompleteMultipartUpload", "AbortMultipartUpload", "HEAD"]
        store.put("small", b"x" * part)  # at the part size: one PUT
        assert requests.kinds()[-1] == "PUT"
        # the test's own scope: on SeaweedFS the bucket is shared with other tests, some leaving an upload on purpose
        uploads = store.fs.call_s3("list_multipart_uploads", Bucket=backend.raw.bucket, Prefix=backend.raw.scope)
        assert uploads.get("Uploads", []) == []
        assert backend.raw.keys() == ["ckpt/share", "small"]

    def test_put_into_a_missing_bucket_names_the_bucket(self, backend: Backend):
        store = open_store(StorageConfig(root="s3://no-such-bucket-here/p", run_id="r",
                                         s3_endpoint_url=backend.config.s3_endpoint_url))
        with pytest.raises(StorageError, match="bucket 'no-such-bucket-here' does not exist"):
            store.put("config.json", b"{}")

    def test_delete_batches_1000_keys_per_request(self, backend: Backend):
        keys = [f"many/{i:05d}" for i in range(2001)]
        backend.store.put(keys[1000], b".")
        backend.store.put(keys[2000], b".")
        batches = []
        backend.store.fs.s3.meta.events.register(
            "request-created.s3.DeleteObjects", lambda request, **_: batches.append(request.body.count(b"<Key>")))
        backend.store.delete_keys(keys)
        assert batches == [1000, 1000, 1]
        assert backend.raw.keys() == []

    def test_requests_outside_the_run_are_never_sent(self, backend: Backend):
        requests = S3Requests(backend.store)
        for key in BAD_KEYS:
            with pytest.raises(OutsideRunError):
                backend.store.get(key)
            with pytest.raises(OutsideRunError):
                backend.store.delete_keys(["ok/key", key])
        assert requests.log == []

    def test_unreachable_endpoint_is_a_transient_error_after_retries(self, backend: Backend):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # closed once the block ends: nothing listens there
        config = backend.config.model_copy(update={"s3_endpoint_url": f"http://127.0.0.1:{port}", "max_retries": 1,
                                              "retry_backoff_s": 0.001})
        store = open_store(config)
        for verb in (lambda: store.get("k"), lambda: store.put("k", b"x", exclusive=True)):
            with pytest.raises(TransientStorageError, match="gave up after 2 attempts.*EndpointConnectionError"):
                verb()
        with pytest.raises(DeleteKeysError, match="1 of 1 keys not deleted") as info:
            store.delete_key("k")
        assert list(info.value.failed) == ["k"] and isinstance(info.value.failed["k"], TransientStorageError)
        assert "gave up after 2 attempts" in str(info.value.failed["k"])

    def test_retrying_retries_transient_errors_only(self, backend: Backend):
        store = open_store(backend.config.model_copy(update={"retry_backoff_s": 0.001, "max_retries": 3}))
        calls = []

        def flaky():
            calls.append(1)
            if len(calls) < 3:
                raise TransientStorageError("busy")
            return "ok"

        assert store.retrying("flaky op", flaky) == "ok" and len(calls) == 3
        calls.clear()
        with pytest.raises(TransientStorageError, match="flaky op: gave up after 4 attempts"):
            store.retrying("flaky op", lambda: calls.append(1) or (_ for _ in ()).throw(TransientStorageError("x")))
        assert len(calls) == 4
        calls.clear()
        with pytest.raises(StorageError, match="broken"):
            store.retrying("op", lambda: calls.append(1) or (_ for _ in ()).throw(StorageError("broken")))
        assert len(calls) == 1

    def test_forked_child_rebuilds_filesystem(self, backend: Backend):
        assert backend.store.fs is not None  # the parent's filesystem exists before the fork
        assert self._run_child(backend, "fork") is True

    def test_pickle_drops_the_filesystem(self, backend: Backend):
        assert backend.store.fs is not None
        assert pickle.loads(pickle.dumps(backend.store))._fs is None
