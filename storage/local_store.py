"""The store on a POSIX directory (local disk, NFS, Lustre): ``storage.store.Store`` with ``os`` calls.

Confinement by resolution, not by string (DESIGN.md, invariant 4): below the run prefix no
symlink is ever followed. The run prefix directory is opened by its path (symlinks above
it, such as a mount path, are fine), then the key's directories one ``openat`` at a
time with ``O_NOFOLLOW``, and the operation acts on the last name relative to that directory fd
(``openat``, ``linkat``, ``renameat``, ``unlinkat``); a symlink anywhere below the prefix is
``OutsideRunError``, and nothing is read, written or deleted through it. The directory fds
reached are cached and reused (``storage.local_dirs``): an operation in a directory reached
before is one system call, not one per path component.

Every failed system call is classified by ``storage.local_errors.classify`` (the one place for a
directory) and retried through ``Store.retrying`` when transient (a Lustre or NFS client's
``EIO``/``ESTALE``/``ETIMEDOUT``/``EAGAIN``).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import re
import resource
import stat
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from refpipe.storage.concurrency import bounded_map
from refpipe.storage.errors import KeyNotFoundError, OutsideRunError, RunPathNotADirectoryError, StorageError
from refpipe.storage.local_dirs import DirectoryHandles, path_of
from refpipe.storage.local_errors import classify
from refpipe.storage.store import WRITE_TOKEN, Bytes, Store, byte_view

T = TypeVar("T")


class LocalStore(Store):
    """A run prefix on a POSIX directory (local disk, NFS, Lustre).

    ``put`` writes a temp file in the key's directory and renames it into place.
    ``exclusive`` puts write an unnamed ``O_TMPFILE`` file, set its write token as the extended
    attribute ``user.refpipe-write`` (``fsetxattr``; skipped where the filesystem has no user
    xattrs: then an applied put whose answer was lost stays ``KeyExistsError``) and ``linkat(2)``
    it to the key, which fails atomically with ``EEXIST`` when the key exists: one new
    directory entry per object and no temp name (where the filesystem lacks
    ``O_TMPFILE``: a named temp file, ``link(2)``, ``unlink(2)``). A ``durable`` put ``fsync``s the file
    before it gets its name (the directory entry itself is not synced). ``get`` is
    ``open``, ``pread``, ``close`` (plus an ``fstat`` for whole reads); ``get_into`` is ``open``,
    ``fstat``, ``preadv`` (one call for all buffers, repeated only after a short read), ``close``. ``delete_keys``
    unlinks in order per directory and removes branch directories it empties,
    directories in parallel.
    """

    def _attempt(self, what: str, key: str, op: Callable[[], T]) -> T:
        """Run ``op`` (system calls on ``key``); classify its ``OSError`` (``local_errors.classify``) and retry the
        transient ones (``Store.retrying``). ``what``: ``cannot read`` ..., for messages."""
        uri = self.uri(key)

        def once() -> T:
            try:
                return op()
            except OSError as e:
                raise classify(what, uri, e) from e

        return self.retrying(f"{what} {uri}", once)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self._attempt("cannot read", key, lambda: self._read(key, start, end))

    def _read(self, key: str, start: int | None, end: int | None) -> bytes:
        fd = self._open_read(key)
        try:
            start, object_nbytes = start or 0, os.fstat(fd).st_size
            size = (object_nbytes if end is None else min(end, object_nbytes)) - start  # never more than it holds
            return _read_all(fd, max(size, 0), start)
        finally:
            os.close(fd)

    def get_into(self, key: str, buffers: Sequence[Bytes]) -> int:
        return self._attempt("cannot read", key, lambda: self._read_into(key, buffers))

    def _read_into(self, key: str, buffers: Sequence[Bytes]) -> int:
        fd = self._open_read(key)
        try:
            size = os.fstat(fd).st_size
            views = [v for v in (byte_view(b) for b in buffers) if v.nbytes]
            wanted = min(size, sum(v.nbytes for v in views))
            got = _readv_all(fd, views, wanted)
            return size if got == wanted else got  # a short read: the file shrank since fstat
        finally:
            os.close(fd)

    def _open_read(self, key: str) -> int:
        """A read-only fd of ``key`` (``OutsideRunError`` through a symlink; other failures as raised).

        One ``openat`` of the rest of the key's path from the deepest cached directory handle, kept only when the
        file's kernel path (``/proc/self/fd``) is that handle's path plus the rest, so no symlink led there;
        otherwise (and on any error) the fd is closed unread and the key is walked to one component at a time.
        """
        fast = self._open_below_handle(key)
        if fast is not None:
            return fast

        def op(dir_fd: int, name: str) -> int:
            try:
                return os.open(name, _READ_FLAGS, dir_fd=dir_fd)
            except OSError as e:
                self._refuse_symlink(e, key, key, dir_fd, name)
                raise

        return self._at(key, op)

    def _open_below_handle(self, key: str) -> int | None:
        """``_open_read``'s one-call path: the fd, or None (no handle, a name missing or stale or a symlink, or the
        path was not the key's); other errors are raised as the walk would raise them."""
        parts = self.prefix.check_key(key).split("/")
        directories = ["/".join(parts[:i]) for i in range(len(parts))]
        handles = self._handles()
        leased = handles.lease(directories)
        if leased is None:
            return None
        rest = key[len(leased[0]) + 1:] if leased[0] else key
        try:
            expected = f"{handles.path(leased[0])}/{rest}"
            fd = os.open(rest, _READ_FLAGS | os.O_NONBLOCK, dir_fd=leased[1])  # O_NONBLOCK: a FIFO never blocks
        except OSError as e:
            if e.errno == errno.ESTALE and _removed(leased[1]):
                handles.forget(leased[0])
            elif e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
                raise
            return None  # the walk tells which name is missing or a symlink
        finally:
            handles.release(*leased)
        if path_of(fd) != expected:
            os.close(fd)
            return None
        return fd

    def _at(self, key: str, op: Callable[[int, str], T], *, create: bool = False, is_dir: bool = False) -> T:
        """``op(dir_fd, name)`` with an ``O_PATH`` fd of ``key``'s directory and the key's last name (``is_dir``: the
        fd of directory ``key`` itself, and ``""``). The directory is reached from the deepest one with a cached
        handle (``storage.local_dirs``), the rest one component at a time without following symlinks
        (``create``: making missing ones); the directories opened are cached. When ``op`` or the walk finds a
        name missing (or stale) and the cached directory it started from was removed meanwhile, that handle is
        forgotten and the walk starts again from a shallower one.

        Raises:
            KeyNotFoundError: a directory is missing (and not ``create``).
            OutsideRunError: a component below the run prefix is a symlink (or not a directory).
        """
        parts = self.prefix.check_key(key).split("/")
        parents, name = (parts, "") if is_dir else (parts[:-1], parts[-1])
        directories = ["/".join(parents[:i]) for i in range(len(parents) + 1)]  # "" (the run prefix) first
        handles = self._handles()
        while True:
            leased = handles.lease(directories)
            try:
                return self._walk_from(leased, directories, key, create, lambda fd: op(fd, name))
            except (KeyNotFoundError, OSError) as e:
                if leased is None or not _gone(e) or not _removed(leased[1]):
                    raise
                handles.forget(leased[0])  # removed by another process: walk again from its parent
            finally:
                if leased is not None:
                    handles.release(*leased)

    def _walk_from(self, leased: tuple[str, int] | None, directories: list[str], key: str, create: bool,
                   op: Callable[[int], T]) -> T:
        """Open ``directories`` below the leased one (all of them when None), caching each, then ``op(fd)`` of the
        last; every fd this opens is a cached handle, released here."""
        handles = self._handles()
        fd: int | None
        if leased is None:
            key_here, fd = "", handles.add("", self._open_prefix(key, create))
            dir_fd = fd
        else:
            (key_here, dir_fd), fd = leased, None
        try:
            for where in directories[directories.index(key_here) + 1:]:
                child = self._step(dir_fd, where.rpartition("/")[2], key, where, create,
                                   mkdir_first=create and where == directories[-1])
                if fd is not None:
                    handles.release(key_here, fd)
                key_here, fd = where, handles.add(where, child)
                dir_fd = fd
            return op(dir_fd)
        finally:
            if fd is not None:
                handles.release(key_here, fd)

    def _open_prefix(self, key: str, create: bool) -> int:
        """An ``O_PATH`` fd of the run prefix (``create``: made if missing)."""
        flags = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC
        try:
            try:
                return os.open(self.prefix.path, flags)
            except FileNotFoundError:
                if not create:
                    raise KeyNotFoundError(f"{self.uri(key)} does not exist") from None
                os.makedirs(self.prefix.path, exist_ok=True)
                return os.open(self.prefix.path, flags)
        except (NotADirectoryError, FileExistsError) as e:  # a file at or above the run prefix
            raise self._file_in_the_way() from e

    def _handles(self) -> DirectoryHandles:
        """This store's cached directory handles (made on first use; not pickled)."""
        handles: DirectoryHandles | None = self.__dict__.get("_directory_handles")
        if handles is None:
            handles = self.__dict__.setdefault("_directory_handles", DirectoryHandles(_CACHED_DIRECTORIES))
        return handles

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_directory_handles", None)
        return state

    def _file_in_the_way(self) -> StorageError:
        """The error for a run prefix that is, or lies under, a regular file (``RunPathNotADirectoryError`` naming
        it; another ``StorageError`` if the file went away meanwhile)."""
        parts = self.prefix.path.split("/")
        for end in range(2, len(parts) + 1):
            path = "/".join(parts[:end])
            if os.path.lexists(path) and not os.path.isdir(path):
                what = "the run directory" if path == self.prefix.path else "the run root" \
                    if path == os.path.dirname(self.prefix.path) else "a directory above the run root"
                return RunPathNotADirectoryError(
                    f"run {self.prefix.uri}: {path} is a file, not a directory ({what}): pass the run's real location, "
                    "or set storage.root to a directory (or a path that can become one)")
        return StorageError(f"run {self.prefix.uri}: cannot open {self.prefix.path} as a directory")

    def _step(self, dir_fd: int, part: str, key: str, where: str, create: bool, mkdir_first: bool = False) -> int:
        """An ``O_PATH`` fd of directory ``part`` inside ``dir_fd``, never through a symlink (``mkdir_first``: a
        directory that is most likely new, such as a branch's, is made before it is opened)."""
        flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        if mkdir_first:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=dir_fd)
        try:
            try:
                return os.open(part, flags, dir_fd=dir_fd)
            except FileNotFoundError:
                if not create:
                    raise KeyNotFoundError(f"{self.uri(key)} does not exist") from None
                with contextlib.suppress(FileExistsError):  # made by a concurrent put
                    os.mkdir(part, dir_fd=dir_fd)
                return os.open(part, flags, dir_fd=dir_fd)
        except OSError as e:
            self._refuse_symlink(e, key, where, dir_fd, part)
            if e.errno == errno.ENOTDIR and not create:
                raise KeyNotFoundError(f"{self.uri(key)} does not exist ({self.uri(where)} is a file)") from e
            raise

    def _refuse_symlink(self, e: OSError, key: str, where: str, dir_fd: int, name: str) -> None:
        """Raise ``OutsideRunError`` when ``e`` is what ``O_NOFOLLOW`` gave for a symlink (ELOOP, or ENOTDIR
        with ``O_DIRECTORY``): ``name`` in ``dir_fd`` is one."""
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_symlink(dir_fd, name):
            context = "" if where == key else f"{self.uri(key)}: "
            raise OutsideRunError(f"{context}{self.uri(where)} is a symlink: the local store never follows "
                                  "a symlink below the run prefix") from e

    def _put(self, key: str, buffers: list[Bytes] | tuple[Bytes, ...], token: str | None, durable: bool) -> None:
        def op(dir_fd: int, name: str) -> None:
            if token is not None and _HAVE_TMPFILE:
                self._put_unnamed(dir_fd, name, buffers, token, durable)
            else:
                self._put_named(dir_fd, name, buffers, token, durable)

        try:
            self._at(key, op, create=True)
        except OSError as e:
            raise classify("cannot write", self.uri(key), e) from e

    def _put_unnamed(self, dir_fd: int, name: str, buffers: Sequence[Bytes], token: str, durable: bool) -> None:
        try:
            fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise
            return self._put_named(dir_fd, name, buffers, token, durable)  # no O_TMPFILE on this filesystem
        try:
            _fill(fd, buffers, token, durable)
            os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd)  # linkat(AT_SYMLINK_FOLLOW) of the unnamed file
        finally:
            os.close(fd)

    def _put_named(self, dir_fd: int, name: str, buffers: Sequence[Bytes], token: str | None, durable: bool) -> None:
        """``token`` None: write a temp name and rename it over ``name``; else set the token and link it exclusively."""
        tmp = f"{name}.tmp-{uuid.uuid4().hex[:12]}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
        try:
            _fill(fd, buffers, token, durable)
        except BaseException:
            os.unlink(tmp, dir_fd=dir_fd)
            raise
        finally:
            os.close(fd)
        if token is None:
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            return
        try:
            os.link(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd, follow_symlinks=False)
        finally:
            os.unlink(tmp, dir_fd=dir_fd)

    def _token(self, key: str) -> str | None:
        def read() -> str | None:
            fd = self._open_read(key)
            try:
                return os.getxattr(fd, _TOKEN_XATTR).decode()
            except OSError as e:
                if e.errno not in (errno.ENODATA, errno.ENOTSUP):
                    raise
                return None
            finally:
                os.close(fd)

        try:
            return self._attempt("cannot read the write token of", key, read)
        except KeyNotFoundError:
            return None

    def _delete_keys(self, keys: list[str]) -> dict[str, StorageError]:
        by_directory: dict[str, list[str]] = {}
        for key in keys:
            by_directory.setdefault(self.prefix.check_key(key).rpartition("/")[0], []).append(key)
        # rmdir(2) waits on the filesystem (~2-5 ms each on ext4 with discard, a metadata round trip on
        # Lustre) while costing little CPU: empty the branch directories in parallel
        parts = bounded_map(lambda item: self._delete_in(*item), list(by_directory.items()), _DELETE_THREADS)
        return {key: error for part in parts for key, error in part.items()}

    def _delete_in(self, directory: str, keys: list[str]) -> dict[str, StorageError]:
        """Unlink ``keys`` (all in ``directory``) in order, then remove ``directory`` if this emptied a branch
        directory (``payloads/<shard>/<branch_id>``; shards stay). Names are unlinked relative to the
        directory's fd: a symlink is removed itself, never followed. Returns the keys not deleted."""
        removed, failed = False, dict[str, StorageError]()
        for key in keys:
            attempts: list[str] = []
            try:
                self._attempt("cannot delete", key, functools.partial(self._unlink, key, attempts))
            except KeyNotFoundError:
                removed = removed or len(attempts) > 1  # absent, or removed by an attempt whose answer was lost
                continue
            except OutsideRunError:
                raise
            except StorageError as e:
                failed[key] = e
                continue
            removed = True
        if removed and directory.count("/") >= 2:
            try:
                self._remove_empty_dir(directory)
            except StorageError as e:  # this directory's trouble, not the batch's
                failed.update({key: e for key in keys if key not in failed})
        return failed

    def _unlink(self, key: str, attempts: list[str]) -> None:
        attempts.append(key)
        self._at(key, lambda dir_fd, name: os.unlink(name, dir_fd=dir_fd))

    def _remove_empty_dir(self, directory: str) -> None:
        """``rmdir`` an emptied directory; one that holds entries again stays. A transient error is retried, and an
        attempt applied whose answer was lost (``ESTALE``) is done: the retry finds no directory."""
        def rmdir(dir_fd: int, name: str) -> None:
            try:
                os.rmdir(name, dir_fd=dir_fd)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise

        try:
            self._attempt("cannot remove directory", directory, lambda: self._at(directory, rmdir))
        except KeyNotFoundError:
            return
        finally:
            self._handles().forget(directory)

    def remove_empty_directories(self) -> int:
        """Bottom-up ``os.fwalk`` of the run prefix (symlinks never followed: ``rmdir(2)`` of one is ``ENOTDIR``,
        and ``fwalk`` does not descend into them); ``rmdir`` relative to the parent's fd, a non-empty one stays."""
        try:
            top = os.open(self.prefix.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
        removed = 0
        try:
            for directory, dirs, _, dir_fd in os.fwalk(".", dir_fd=top, topdown=False, onerror=_raise_unless_gone):
                removed += sum(self._rmdir_if_empty(dir_fd, os.path.normpath(f"{directory}/{name}"), name)
                               for name in dirs)
        except StorageError:
            raise
        except OSError as e:
            raise StorageError(f"cannot list {self.prefix.uri} for empty directories: {e.strerror}") from e
        finally:
            os.close(top)
        return removed

    def _rmdir_if_empty(self, dir_fd: int, key: str, name: str) -> bool:
        try:
            os.rmdir(name, dir_fd=dir_fd)
            return True
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
                return False
            raise StorageError(f"cannot remove directory {self.uri(key)}: {e.strerror}") from e

    def exists(self, key: str) -> bool:
        def stat() -> None:
            self._at(key, lambda dir_fd, name: os.stat(name, dir_fd=dir_fd, follow_symlinks=False))

        try:
            self._attempt("cannot stat", key, stat)
        except KeyNotFoundError:
            return False
        return True

    def list_prefix(self, key_prefix: str) -> list[str]:
        return sorted(key for key, _ in self._walk(key_prefix))

    def list_sizes(self, key_prefix: str) -> dict[str, int]:
        sizes = {}
        for key, path in self._walk(key_prefix, strict=True):
            try:
                sizes[key] = os.stat(path, follow_symlinks=False).st_size
            except FileNotFoundError:
                continue  # deleted while listing
        return dict(sorted(sizes.items()))

    def _walk(self, key_prefix: str, strict: bool = False) -> Iterator[tuple[str, str]]:
        """``(key, path)`` of every file under ``key_prefix/`` (``""``: the whole run), unordered; a symlinked
        directory below the prefix is not descended into (``os.fwalk``), a symlink to a file is listed
        (every access to it is refused); an NFS client's placeholder (``_NFS_PLACEHOLDER``) is not. ``strict``: a
        directory that cannot be read raises its ``OSError`` (a vanished one is skipped)."""
        base = f"{self.prefix.path}/{self.prefix.check_key(key_prefix)}" if key_prefix else self.prefix.path
        try:
            self._at(key_prefix or "x", lambda dir_fd, name: None, is_dir=bool(key_prefix))  # refuses a symlink
            # on the way to the listed directory
            top = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (KeyNotFoundError, FileNotFoundError):
            return
        except RunPathNotADirectoryError:
            raise
        except OSError:
            if strict:
                raise
            return
        try:
            for directory, _, files, _ in os.fwalk(".", dir_fd=top, onerror=_raise_unless_gone if strict else None):
                rel = os.path.normpath(os.path.join(key_prefix, directory))
                for name in files:
                    if not _NFS_PLACEHOLDER.fullmatch(name):
                        yield (name if rel == "." else f"{rel}/{name}"), f"{base}/{directory}/{name}"
        finally:
            os.close(top)


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _gone(e: Exception) -> bool:
    """Whether ``e`` says a name or a directory handle no longer exists (``ENOENT``, NFS's ``ESTALE``)."""
    return isinstance(e, KeyNotFoundError) or getattr(e, "errno", None) in (errno.ENOENT, errno.ESTALE)


def _removed(dir_fd: int) -> bool:
    """Whether the directory of ``dir_fd`` was removed (no links left, or its handle is stale)."""
    try:
        return os.fstat(dir_fd).st_nlink == 0
    except OSError:
        return True


def _raise_unless_gone(e: OSError) -> None:
    if not isinstance(e, FileNotFoundError):
        raise e


_NFS_PLACEHOLDER = re.compile(r"\.nfs[0-9A-Fa-f]+")
"""What an NFS client renames a file to when it is unlinked while a process holds it open (the "silly rename",
``.nfs<hex>`` in the same directory; unlinking it is ``EBUSY`` until the last close, when the client removes it
itself): no object of the run, never listed, so no audit counts it and no sweep unlinks it."""
_HAVE_TMPFILE = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")
_TOKEN_XATTR = f"user.{WRITE_TOKEN}"
_DELETE_THREADS = 8
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
_CACHED_DIRECTORIES = min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 8)
"""Directory handles (fds) a store keeps open: enough for the run prefix, ``payloads`` and its 256 shards
to stay cached while recently used branch and delete-record directories come and go, and at most an eighth
of this process's fd limit."""
_WRITE_PIECE_BYTES = 512 << 10
"""Bytes per ``write(2)``. On ext4 under Linux 6.18 one write of >= 2 MiB took ~3x as long as the same
bytes in <= 1 MiB writes (measured for bench/keep_fetch.py); smaller pieces cost nothing elsewhere."""


def _fill(fd: int, buffers: Sequence[Bytes], token: str | None, durable: bool) -> None:
    """Write the new file's bytes, set its write token (if any), and ``fsync`` it when ``durable`` (before a name
    makes it visible)."""
    _write_all(fd, buffers)
    if token is not None:
        _set_token(fd, token)
    if durable:
        os.fsync(fd)


def _set_token(fd: int, token: str) -> None:
    """Store the write token as the file's ``user.refpipe-write`` xattr; a filesystem without user xattrs gets none."""
    try:
        os.setxattr(fd, _TOKEN_XATTR, token.encode())
    except OSError as e:
        if e.errno != errno.ENOTSUP:
            raise


def _write_all(fd: int, buffers: Sequence[Bytes]) -> None:
    """Write buffers in order, at most ``_WRITE_PIECE_BYTES`` per ``write(2)``, resuming after short writes."""
    for buffer in buffers:
        view = byte_view(buffer)
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

