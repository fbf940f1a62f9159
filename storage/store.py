"""One store interface over fsspec: a local directory (here) or S3 (``storage.s3_store``).

Keys are relative to the run prefix (``storage.uri``). Verbs, one per operation:
``get`` (optionally a byte range), ``get_into`` (a whole object into caller buffers),
``put`` (``exclusive=True`` is atomic or raises ``KeyExistsError``),
``delete`` (known keys; S3 batches ``DeleteObjects``), ``exists``, ``list_prefix``.
Nothing on the hot path lists or stats.

Filesystems are created per process (s3fs is not fork-safe): a ``Store`` that
crosses a fork rebuilds its filesystem on first use in the child.
"""

from __future__ import annotations

import errno
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import fsspec
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import ChunkNotFoundError, KeyExistsError, StorageError, TransientStorageError
from refpipe.storage.uri import RunPrefix
from typing_extensions import Buffer

Data = Buffer | list[Buffer] | tuple[Buffer, ...]
"""What ``put`` writes: one bytes-like object (bytes, memoryview, a C-contiguous ndarray), or a list/tuple of them."""
T = TypeVar("T")
_RETRIES_LOCK = threading.Lock()


def open_store(config: StorageConfig) -> "Store":
    """Build the store for ``config``'s run prefix: the one place URIs become filesystems."""
    prefix = RunPrefix.from_root(config.root, config.run_id)
    if prefix.scheme == "s3":
        from refpipe.storage.s3_store import S3Store  # s3fs, aiobotocore: imported only by runs on S3

        return S3Store(prefix, config)
    return LocalStore(prefix, config)


def _buffers(data: Data) -> list | tuple:
    """``data`` as a list of buffers: a list or tuple is already one; anything else (bytes, an ndarray) is one
    buffer."""
    return data if isinstance(data, (list, tuple)) else [data]


class Store:
    """A run's store. Subclasses implement the verbs for one backend.

    Args:
        prefix: the run prefix; every key is checked against it.
        config: retries and backoff for transient errors.
    """

    def __init__(self, prefix: RunPrefix, config: StorageConfig):
        self.prefix = prefix
        self.config = config
        self._fs = None
        self._pid = -1
        self.retries = 0
        """Retries of transient errors by this store in this process (trainer metrics)."""

    @property
    def fs(self):
        """This process's fsspec filesystem (rebuilt after a fork)."""
        if self._fs is None or self._pid != os.getpid():
            self._fs = self._new_fs()
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self):
        return {"prefix": self.prefix, "config": self.config, "_fs": None, "_pid": -1, "retries": 0}

    def _new_fs(self):
        return fsspec.core.url_to_fs(self.prefix.uri)[0]

    def path(self, key: str) -> str:
        """Filesystem path of a key (checked to be a clean key under the run prefix)."""
        return f"{self.prefix.path}/{self.prefix.check_key(key)}"

    def uri(self, key: str) -> str:
        """URI of a key."""
        return self.prefix.uri_of(key)

    def retrying(self, what: str, op: Callable[[], T]) -> T:
        """Run ``op``, retrying ``TransientStorageError`` with exponential backoff and jitter.

        Raises:
            TransientStorageError: still failing after ``config.max_retries`` retries.
        """
        for attempt in range(self.config.max_retries + 1):
            try:
                return op()
            except TransientStorageError as e:
                if attempt == self.config.max_retries:
                    raise TransientStorageError(f"{what}: gave up after {attempt + 1} attempts: {e}") from e
                with _RETRIES_LOCK:
                    self.retries += 1
                slow = 8 if "SlowDown" in str(e) else 1
                time.sleep(self.config.retry_backoff_s * slow * 2**attempt * (0.5 + random.random()))
        raise AssertionError("unreachable")

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes of ``key``, or of ``[start, end)`` of it (a range past the end gives the bytes that exist).

        Raises:
            ChunkNotFoundError: no object at ``key``.
            StorageError: any other failure (``TransientStorageError`` once retries are spent).
        """
        raise NotImplementedError

    def get_into(self, key: str, buffers: Sequence[Buffer]) -> int:
        """Read ``key`` from its first byte into ``buffers`` (writable, C-contiguous; filled in order).

        Returns:
            The object's size in bytes. Larger than the buffers' total: the buffers hold its
            first bytes and the rest was not read. Smaller: only that many bytes were written
            (the buffers' tail is left as it was). Callers compare it with the size they expect.

        Raises:
            ChunkNotFoundError: no object at ``key``.
            StorageError: any other failure (``TransientStorageError`` once retries are spent).
        """
        raise NotImplementedError

    def put(self, key: str, data: Data, *, exclusive: bool = False) -> None:
        """Write ``data`` (one buffer, or a list/tuple of buffers written in order) at ``key``.

        Readers never see a partial object. With ``exclusive=True`` exactly one of any
        number of concurrent puts of ``key`` succeeds; the others raise ``KeyExistsError``.

        Raises:
            KeyExistsError: ``exclusive`` and ``key`` exists (the stored object is unchanged).
            StorageError: any other failure (``TransientStorageError`` once retries are spent).
        """
        raise NotImplementedError

    def delete(self, keys: Sequence[str]) -> None:
        """Delete known keys; keys already absent are not an error.

        Raises:
            StorageError: a key could not be deleted (names the key and the store's reason).
        """
        raise NotImplementedError

    def exists(self, key: str) -> bool:
        """Whether an object exists at ``key`` (off the hot path: audits, deletes of refs)."""
        raise NotImplementedError

    def list_prefix(self, key_prefix: str) -> list[str]:
        """Every key under ``key_prefix/`` (recursive, sorted; ``""`` = the whole run). Audits and inspection only."""
        raise NotImplementedError


class LocalStore(Store):
    """A run prefix on a POSIX directory (local disk, NFS, Lustre).

    ``put`` writes a temp file in the key's directory and renames it into place.
    ``exclusive`` puts write an unnamed ``O_TMPFILE`` file and ``linkat(2)`` it to the
    key, which fails atomically with ``EEXIST`` when the key exists: one new
    directory entry per object and no temp name (where the filesystem lacks
    ``O_TMPFILE``: a named temp file, ``link(2)``, ``unlink(2)``). ``get`` is
    ``open``, ``pread``, ``close`` (plus an ``fstat`` for whole reads); ``get_into`` is ``open``,
    ``fstat``, ``preadv`` (one call for all buffers, repeated only after a short read), ``close``. ``delete``
    unlinks in order per directory and removes branch directories it empties,
    directories in parallel.
    """

    def get(self, key, start=None, end=None):
        fd = self._open_read(key)
        try:
            start = start or 0
            size = (os.fstat(fd).st_size if end is None else end) - start
            return _read_all(fd, max(size, 0), start)
        except OSError as e:
            raise StorageError(f"cannot read {self.uri(key)}: {e.strerror}") from e
        finally:
            os.close(fd)

    def get_into(self, key, buffers):
        fd = self._open_read(key)
        try:
            size = os.fstat(fd).st_size
            views = [v for v in (memoryview(b).cast("B") for b in buffers) if v.nbytes]
            wanted = min(size, sum(v.nbytes for v in views))
            got = _readv_all(fd, views, wanted)
            return size if got == wanted else got  # a short read: the file shrank since fstat
        except OSError as e:
            raise StorageError(f"cannot read {self.uri(key)}: {e.strerror}") from e
        finally:
            os.close(fd)

    def _open_read(self, key: str) -> int:
        """A read-only fd of ``key`` (``ChunkNotFoundError`` when absent)."""
        path = self.path(key)
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise ChunkNotFoundError(f"{self.uri(key)} does not exist") from e
        except OSError as e:
            raise StorageError(f"cannot read {self.uri(key)}: {e.strerror}") from e

    def put(self, key, data, *, exclusive=False):
        path = self.path(key)
        buffers = _buffers(data)
        try:
            if exclusive and _HAVE_TMPFILE:
                self._put_unnamed(path, key, buffers)
            else:
                self._put_named(path, key, buffers, exclusive)
        except KeyExistsError:
            raise
        except OSError as e:
            raise StorageError(f"cannot write {self.uri(key)}: {e.strerror}") from e

    def _put_unnamed(self, path: str, key: str, buffers) -> None:
        directory = os.path.dirname(path)
        try:
            fd = _open_dir_file(directory, os.O_TMPFILE | os.O_WRONLY)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            return self._put_named(path, key, buffers, True)  # no O_TMPFILE on this filesystem
        try:
            _write_all(fd, buffers)
            os.link(f"/proc/self/fd/{fd}", path, src_dir_fd=fd)  # a dir fd makes CPython call linkat(AT_SYMLINK_FOLLOW)
        except FileExistsError as e:
            raise KeyExistsError(f"{self.uri(key)} already exists") from e
        finally:
            os.close(fd)

    def _put_named(self, path: str, key: str, buffers, exclusive: bool) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        fd = _open_dir_file(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
        try:
            _write_all(fd, buffers)
        except BaseException:
            os.unlink(tmp)
            raise
        finally:
            os.close(fd)
        if not exclusive:
            os.replace(tmp, path)
            return
        try:
            os.link(tmp, path)
        except FileExistsError as e:
            raise KeyExistsError(f"{self.uri(key)} already exists") from e
        finally:
            os.unlink(tmp)

    def delete(self, keys):
        by_directory: dict[str, list[tuple[str, str]]] = {}
        for key in keys:
            path = self.path(key)
            by_directory.setdefault(os.path.dirname(path), []).append((key, path))
        if len(by_directory) <= 1:
            for directory, items in by_directory.items():
                self._delete_in(directory, items)
            return
        # rmdir(2) waits on the filesystem (~2-5 ms each on ext4 with discard, a metadata round trip on
        # Lustre) while costing little CPU: empty the branch directories in parallel
        with ThreadPoolExecutor(min(_DELETE_THREADS, len(by_directory))) as pool:
            list(pool.map(lambda item: self._delete_in(*item), by_directory.items()))

    def _delete_in(self, directory: str, items: list[tuple[str, str]]) -> None:
        """Unlink ``items`` in order, then remove ``directory`` if this emptied a branch directory."""
        removed = False
        for key, path in items:
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise StorageError(f"cannot delete {self.uri(key)}: {e.strerror}") from e
            removed = True
        if removed:
            self._remove_empty_dir(directory)

    def _remove_empty_dir(self, directory: str) -> None:
        """Remove a branch directory once its last object is gone (shards stay)."""
        if directory.count("/") - self.prefix.path.count("/") < 3:
            return
        try:
            os.rmdir(directory)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise StorageError(f"cannot remove directory {directory}: {e.strerror}") from e

    def exists(self, key):
        return os.path.exists(self.path(key))

    def list_prefix(self, key_prefix):
        root = self.prefix.path
        base = self.path(key_prefix) if key_prefix else root
        keys = []
        for directory, _, files in os.walk(base):
            rel = os.path.relpath(directory, root)
            keys.extend(name if rel == "." else f"{rel}/{name}" for name in files)
        return sorted(keys)


_HAVE_TMPFILE = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")
_DELETE_THREADS = 8
_WRITE_PIECE_BYTES = 512 << 10
"""Bytes per ``write(2)``. On ext4 under Linux 6.18 one write of >= 2 MiB took ~3x as long as the same
bytes in <= 1 MiB writes (measured for bench/keep_fetch.py); smaller pieces cost nothing elsewhere."""


def _open_dir_file(path: str, flags: int) -> int:
    """``os.open(path, flags | O_CLOEXEC, 0o666)``, creating the parent directories once on ENOENT."""
    flags |= os.O_CLOEXEC
    try:
        return os.open(path, flags, 0o666)
    except FileNotFoundError:
        os.makedirs(path if (flags & os.O_TMPFILE) == os.O_TMPFILE else os.path.dirname(path), exist_ok=True)
        return os.open(path, flags, 0o666)


def _write_all(fd: int, buffers) -> None:
    """Write buffers in order, at most ``_WRITE_PIECE_BYTES`` per ``write(2)``, resuming after short writes."""
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        while view:
            view = view[os.write(fd, view[:_WRITE_PIECE_BYTES]):]


def _read_all(fd: int, size: int, offset: int) -> bytes:
    """Up to ``size`` bytes at ``offset`` (fewer only at end of file), resuming after short reads."""
    data = os.pread(fd, size, offset)
    while len(data) < size:
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def _readv_all(fd: int, views: list[memoryview], size: int) -> int:
    """Read up to ``size`` bytes from offset 0 into ``views`` in order (``preadv``, resumed after short reads).

    Returns bytes read: ``size``, or fewer at end of file. Without ``os.preadv``: one ``readinto`` per view.
    """
    done = 0
    while done < size and views:
        n = os.preadv(fd, views, done) if _HAVE_PREADV else _preadinto(fd, views[0], done)
        if n == 0:
            break
        done += n
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views = views[1:]
        if views and n:
            views = [views[0][n:], *views[1:]]
    return min(done, size)


def _preadinto(fd: int, view: memoryview, offset: int) -> int:
    """``pread`` into one view (platforms without ``preadv``)."""
    data = os.pread(fd, view.nbytes, offset)
    view[: len(data)] = data
    return len(data)


_HAVE_PREADV = hasattr(os, "preadv")

