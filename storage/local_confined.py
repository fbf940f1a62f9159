"""Reaching a key below a local run prefix without following a symlink (DESIGN.md, invariant 4).

Confinement by resolution, not by string: the run prefix directory is opened by its path (symlinks above
it, such as a mount path, are fine), then the key's directories one ``openat(O_PATH | O_NOFOLLOW)`` at a
time, and the caller's operation acts on the last name relative to that directory fd (``openat``,
``linkat``, ``unlinkat``, ...); a symlink anywhere below the prefix is ``OutsideRunError``, and nothing is
read, written or deleted through it. The directory fds reached are cached and reused
(``storage.local_dirs``): an operation in a directory reached before is one system call, not one per path
component. ``storage.local_store.LocalStore`` does every operation through ``ConfinedPrefix``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import stat
from collections.abc import Callable
from typing import TypeVar

from refpipe.storage.errors import KeyNotFoundError, OutsideRunError, RunPathNotADirectoryError, StorageError
from refpipe.storage.local_dirs import DirectoryHandles, HeldInodes, path_of
from refpipe.storage.uri import RunPrefix

T = TypeVar("T")


class ConfinedPrefix:
    """Directory fds below (and at) one local run prefix, reached without following symlinks; thread-safe.

    One per store and process (its fds are not inherited meaningfully: ``DirectoryHandles`` starts empty in a
    forked child; a store drops it when pickled).

    Args:
        prefix: the run prefix (a local path).
    """

    def __init__(self, prefix: RunPrefix):
        self.prefix = prefix
        self.handles = DirectoryHandles(_CACHED_DIRECTORIES)
        self.held = HeldInodes()

    def open_read(self, key: str) -> int:
        """A read-only fd of ``key`` (``OutsideRunError`` through a symlink; other failures as raised).

        One ``openat`` of the rest of the key's path from the deepest cached directory handle, kept only when the
        file's kernel path (``/proc/self/fd``) is that handle's path plus the rest, so no symlink led there and the
        directory was not moved (that one ``readlink`` is the read's only check of the handle); otherwise (and on
        any error) the fd is closed unread and the key is walked to one component at a time.
        """
        fast = self._open_below_handle(key)
        if fast is not None:
            return fast

        def op(dir_fd: int, name: str) -> int:
            try:
                return os.open(name, READ_FLAGS, dir_fd=dir_fd)
            except OSError as e:
                self._refuse_symlink(e, key, key, dir_fd, name)
                raise

        return self.at(key, op)

    def _open_below_handle(self, key: str) -> int | None:
        """``open_read``'s one-call path: the fd, or None (no handle, a name missing or stale or a symlink, or the
        path was not the key's); other errors are raised as the walk would raise them."""
        parts = self.prefix.check_key(key).split("/")
        directories = ["/".join(parts[:i]) for i in range(len(parts))]
        handles = self.handles
        leased = handles.lease(directories, check_path=False)  # the file's own path is checked below
        if leased is None:
            return None
        rest = key[len(leased[0]) + 1:] if leased[0] else key
        try:
            expected = f"{handles.path(leased[0])}/{rest}"
            fd = os.open(rest, READ_FLAGS | os.O_NONBLOCK, dir_fd=leased[1])  # O_NONBLOCK: a FIFO never blocks
        except OSError as e:
            if e.errno == errno.ESTALE and removed(leased[1]):
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

    def at(self, key: str, op: Callable[[int, str], T], *, create: bool = False, is_dir: bool = False) -> T:
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
        handles = self.handles
        while True:
            leased = handles.lease(directories)
            try:
                return self._walk_from(leased, directories, key, create, lambda fd: op(fd, name))
            except (KeyNotFoundError, OSError) as e:
                if leased is None or not gone(e) or not removed(leased[1]):
                    raise
                handles.forget(leased[0])  # removed by another process: walk again from its parent
            finally:
                if leased is not None:
                    handles.release(*leased)

    def _walk_from(self, leased: tuple[str, int] | None, directories: list[str], key: str, create: bool,
                   op: Callable[[int], T]) -> T:
        """Open ``directories`` below the leased one (all of them when None), caching each, then ``op(fd)`` of the
        last; every fd this opens is a cached handle, released here."""
        handles = self.handles
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
                    raise KeyNotFoundError(f"{self.prefix.uri_of(key)} does not exist") from None
                os.makedirs(self.prefix.path, exist_ok=True)
                return os.open(self.prefix.path, flags)
        except (NotADirectoryError, FileExistsError) as e:  # a file at or above the run prefix
            raise self._file_in_the_way() from e

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
                    raise KeyNotFoundError(f"{self.prefix.uri_of(key)} does not exist") from None
                with contextlib.suppress(FileExistsError):  # made by a concurrent put
                    os.mkdir(part, dir_fd=dir_fd)
                return os.open(part, flags, dir_fd=dir_fd)
        except OSError as e:
            self._refuse_symlink(e, key, where, dir_fd, part)
            if e.errno == errno.ENOTDIR and not create:
                raise KeyNotFoundError(f"{self.prefix.uri_of(key)} does not exist ({self.prefix.uri_of(where)} is a "
                                       f"file)") from e
            raise

    def _refuse_symlink(self, e: OSError, key: str, where: str, dir_fd: int, name: str) -> None:
        """Raise ``OutsideRunError`` when ``e`` is what ``O_NOFOLLOW`` gave for a symlink (ELOOP, or ENOTDIR
        with ``O_DIRECTORY``): ``name`` in ``dir_fd`` is one."""
        if e.errno in (errno.ELOOP, errno.ENOTDIR) and _is_symlink(dir_fd, name):
            context = "" if where == key else f"{self.prefix.uri_of(key)}: "
            raise OutsideRunError(f"{context}{self.prefix.uri_of(where)} is a symlink: the local store never follows "
                                  "a symlink below the run prefix") from e


def _is_symlink(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def gone(e: Exception) -> bool:
    """Whether ``e`` says a name or a directory handle no longer exists (``ENOENT``, NFS's ``ESTALE``)."""
    return isinstance(e, KeyNotFoundError) or getattr(e, "errno", None) in (errno.ENOENT, errno.ESTALE)


def removed(dir_fd: int) -> bool:
    """Whether the directory of ``dir_fd`` was removed (no links left, or its handle is stale)."""
    try:
        return os.fstat(dir_fd).st_nlink == 0
    except OSError:
        return True


READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
"""Flags of every read-only open of an object (the last name: never through a symlink)."""
_CACHED_DIRECTORIES = min(1024, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 8)
"""Directory handles (fds) a store keeps open: enough for the run prefix, ``payloads`` and its 256 shards
to stay cached while recently used branch and delete-record directories come and go, and at most an eighth
of this process's fd limit."""
