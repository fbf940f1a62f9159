"""The local store's cached directory handles (``storage.local_dirs``): one system call per operation in a
directory reached before, and a handle whose directory went away (removed, moved, replaced by a symlink) is
never used again."""

from __future__ import annotations

import os
import pickle
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from refpipe.storage.backends import open_store
from refpipe.storage.errors import OutsideRunError
from tests.storage.storage_helpers import FsOps


def calls(store, op) -> list[tuple[str, str]]:
    """The filesystem calls ``op()`` makes under the run (CPython audit events: open, mkdir, link, remove, ...)."""
    with FsOps(store.prefix.path) as ops:
        op()
    return ops.ops


def test_operations_in_a_directory_reached_before_are_one_call_each(local_config):
    store = open_store(local_config)
    store.put("payloads/ab/b1/c.0", b"chunk", exclusive=True)  # walks and caches the run prefix .. b1
    assert calls(store, lambda: store.put("payloads/ab/b1/zarr.json", b"{}", exclusive=True)) == \
        [("open", "."), ("os.link", "zarr.json")]  # the O_TMPFILE open in b1, then its name
    assert calls(store, lambda: store.get("payloads/ab/b1/c.0")) == [("open", "c.0")]
    assert calls(store, lambda: store.get("payloads/ab/b1/c.0", 1, 3)) == [("open", "c.0")]
    assert calls(store, lambda: store.put("payloads/ab/b2/c.0", b"x", exclusive=True)) == \
        [("os.mkdir", "b2"), ("open", "b2"), ("open", "."), ("os.link", "c.0")]  # a new branch directory
    assert calls(store, lambda: store.delete_keys(["payloads/ab/b1/zarr.json", "payloads/ab/b1/c.0"])) == \
        [("os.remove", "zarr.json"), ("os.remove", "c.0"), ("os.rmdir", "b1")]
    assert store.get("payloads/ab/b2/c.0") == b"x"


def test_a_directory_removed_by_another_process_is_walked_to_again(local_config):
    store, other = open_store(local_config), open_store(local_config)
    store.put("payloads/ab/b1/c.0", b"first")
    other.delete_keys(["payloads/ab/b1/c.0"])  # removes b1, which `store` holds a handle of
    shutil.rmtree(f"{store.prefix.path}/payloads/ab")
    store.put("payloads/ab/b1/c.0", b"second")  # a new directory b1 (and ab), not the removed one
    assert other.get("payloads/ab/b1/c.0") == b"second"
    assert sorted(os.listdir(f"{store.prefix.path}/payloads/ab/b1")) == ["c.0"]
    assert store.exists("payloads/ab/b1/c.0") and not store.exists("payloads/ab/b1/zarr.json")


def test_a_cached_directory_moved_out_and_replaced_by_a_symlink_is_refused(local_config, tmp_path):
    store = open_store(local_config)
    store.put("payloads/ab/b1/c.0", b"chunk")
    elsewhere = tmp_path / "elsewhere"
    shutil.move(f"{store.prefix.path}/payloads/ab", elsewhere)
    os.symlink(elsewhere, f"{store.prefix.path}/payloads/ab")
    expected = (f"{store.uri('payloads/ab/b1/c.0')}: {store.uri('payloads/ab')} is a symlink: the local store never "
                "follows a symlink below the run prefix")
    with FsOps(store.prefix.path) as ops, pytest.raises(OutsideRunError) as info:
        store.get("payloads/ab/b1/c.0")
    assert str(info.value) == expected
    # the read opens c.0 through the moved directory's handle (not path-checked first), finds the file elsewhere,
    # closes it unread and walks: the stale handles are dropped there and the symlink refused
    assert ops.ops == [("open", "c.0"), ("open", "ab")]
    with pytest.raises(OutsideRunError):
        store.put("payloads/ab/b1/zarr.json", b"{}", exclusive=True)
    with pytest.raises(OutsideRunError):
        store.delete_keys(["payloads/ab/b1/c.0"])
    assert sorted(os.listdir(elsewhere / "b1")) == ["c.0"] and (elsewhere / "b1" / "c.0").read_bytes() == b"chunk"


def test_a_pickled_store_carries_no_handles(local_config):
    store = open_store(local_config)
    store.put("payloads/ab/b1/c.0", b"chunk")
    copy = pickle.loads(pickle.dumps(store))
    assert "_confined_prefix" not in copy.__dict__
    assert calls(copy, lambda: copy.get("payloads/ab/b1/c.0")) == [
        ("open", store.prefix.path), ("open", "payloads"), ("open", "ab"), ("open", "b1"), ("open", "c.0")]


def test_a_key_below_a_cached_directory_is_one_open_and_a_symlink_on_its_way_is_refused(local_config, tmp_path):
    writer = open_store(local_config)
    for branch in ("b1", "b2"):
        writer.put(f"payloads/ab/{branch}/c.0", branch.encode())
    reader = open_store(local_config)  # another process: no handles yet
    assert reader.get("payloads/ab/b1/c.0") == b"b1"  # walks, caching the run prefix, payloads, ab and b1
    assert calls(reader, lambda: reader.get("payloads/ab/b2/c.0")) == [("open", "b2/c.0")]
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "c.0").write_bytes(b"secret")
    os.symlink(tmp_path / "elsewhere", f"{reader.prefix.path}/payloads/ab/b3")
    with FsOps(reader.prefix.path) as ops, pytest.raises(OutsideRunError) as info:
        reader.get("payloads/ab/b3/c.0")
    assert str(info.value) == (f"{reader.uri('payloads/ab/b3/c.0')}: {reader.uri('payloads/ab/b3')} is a symlink: "
                               "the local store never follows a symlink below the run prefix")
    assert ops.ops == [("open", "b3/c.0"), ("open", "b3")]  # opened, found elsewhere, closed unread; then walked


def test_handles_evicted_while_other_threads_use_them_stay_open_until_released(local_config):
    """Eight threads put, read and delete in 4 shards through a store that keeps 3 handles: every handle is evicted
    while other threads hold it. Every read sees its own bytes, every delete removes its directory, and every fd is
    closed once its handle is dropped."""
    store = open_store(local_config)
    store._confined().handles.limit = 3

    def worker(t: int) -> list[bytes]:
        got = []
        for i in range(20):
            key = f"payloads/s{i % 4}/t{t}-{i}/c.0"
            store.put(key, f"{t}-{i}".encode(), exclusive=True)
            got.append(store.get(key))
            store.delete_keys([key])
        return got

    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(worker, range(8)))
    assert results == [[f"{t}-{i}".encode() for i in range(20)] for t in range(8)]
    assert sorted(os.listdir(f"{store.prefix.path}/payloads")) == ["s0", "s1", "s2", "s3"]
    assert all(os.listdir(f"{store.prefix.path}/payloads/s{s}") == [] for s in range(4))
    assert store._confined().handles._orphans == {}  # every lease was released, so every dropped handle is closed
    store._confined().handles.forget("")
    assert _fds_below(store.prefix.path) == []  # counted by target: other threads of the process open fds too


def _fds_below(path: str) -> list[str]:
    """The open fds of this process on ``path`` or below it."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile (or the listing's own fd)
            continue
        if target == path or target.startswith(f"{path}/"):
            out.append(target)
    return out


def test_handles_close_at_interpreter_exit_after_the_module_globals_are_cleared(tmp_path, monkeypatch):
    """Finalization can clear ``storage.local_dirs``' globals before a store's handles are collected (an adopter's
    script printed ``Exception ignored in: DirectoryHandles.__del__ ... 'NoneType' object has no attribute 'getpid'``
    at exit): ``__del__`` still closes every fd."""
    from refpipe.storage import local_dirs

    handles = local_dirs.DirectoryHandles(limit=8)
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    handles.release("", handles.add("", fd))
    monkeypatch.setattr(local_dirs, "os", None)
    handles.__del__()
    monkeypatch.undo()
    with pytest.raises(OSError):
        os.fstat(fd)  # closed
    handles._handles.clear()  # nothing left for the collector's own __del__ to close again
