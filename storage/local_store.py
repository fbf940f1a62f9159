"""The store on a POSIX directory (local disk, NFS, Lustre): ``storage.store.Store`` with ``os`` calls."""

from __future__ import annotations

import errno
import os
import uuid
from concurrent.futures import ThreadPoolExecutor

from refpipe.storage.errors import KeyExistsError, KeyNotFoundError, StorageError
from refpipe.storage.store import Store, buffers_of


class LocalStore(Store):
    """A run prefix on a POSIX directory (local disk, NFS, Lustre).

    ``put`` writes a temp file in the key's directory and renames it into place.
    ``exclusive`` puts write an unnamed ``O_TMPFILE`` file and ``linkat(2)`` it to the
    key, which fails atomically with ``EEXIST`` when the key exists: one new
    directory entry per object and no temp name (where the filesystem lacks
    ``O_TMPFILE``: a named temp file, ``link(2)``, ``unlink(2)``). ``get`` is
    ``open``, ``pread``, ``close`` (plus an ``fstat`` for whole reads); ``get_into`` is ``open``,
    ``fstat``, ``preadv`` (one call for all buffers, repeated only after a short read), ``close``. ``delete_keys``
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
        """A read-only fd of ``key`` (``KeyNotFoundError`` when absent)."""
        path = self.path(key)
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError) as e:
            raise KeyNotFoundError(f"{self.uri(key)} does not exist") from e
        except OSError as e:
            raise StorageError(f"cannot read {self.uri(key)}: {e.strerror}") from e

    def put(self, key, data, *, exclusive=False):
        path = self.path(key)
        buffers = buffers_of(data)
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

    def _delete_keys(self, keys):
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
        return sorted(key for key, _ in self._walk(key_prefix))

    def list_sizes(self, key_prefix):
        sizes = {}
        for key, path in self._walk(key_prefix, strict=True):
            try:
                sizes[key] = os.stat(path, follow_symlinks=False).st_size
            except FileNotFoundError:
                continue  # deleted while listing
        return dict(sorted(sizes.items()))

    def _walk(self, key_prefix: str, strict: bool = False):
        """``(key, path)`` of every file under ``key_prefix/`` (``""``: the whole run), unordered.
        ``strict``: a directory that cannot be read raises its ``OSError`` (a vanished one is skipped)."""
        root = self.prefix.path
        base = self.path(key_prefix) if key_prefix else root
        for directory, _, files in os.walk(base, onerror=_raise_unless_gone if strict else None):
            rel = os.path.relpath(directory, root)
            for name in files:
                yield (name if rel == "." else f"{rel}/{name}"), f"{directory}/{name}"


def _raise_unless_gone(e: OSError) -> None:
    if not isinstance(e, FileNotFoundError):
        raise e


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

