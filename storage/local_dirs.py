"""Directory handles of a local run prefix, opened once and reused (``storage.local_confined``).

A key's directories are reached from the run prefix one ``openat(O_PATH | O_NOFOLLOW)`` at a time, so no
symlink below the prefix is followed (DESIGN.md, invariant 4). ``DirectoryHandles`` keeps the ``O_PATH`` fds
of the directories reached that way, keyed by their key (``""``: the run prefix), so the next operation in
that directory starts from its fd instead of walking again: one system call for a read, not one per level.
A handle names the directory it was opened on, whatever happens to the path afterwards, so before each
use its current path (``readlink`` of ``/proc/self/fd/<fd>``: the kernel's name of the open directory, no
filesystem call) is compared with the path it had when opened: a directory moved (say, out of the run, a
symlink put in its place) or removed on this host is dropped and walked to again, which refuses the symlink.
A handle of a directory removed by another host (NFS, Lustre) answers ``ENOENT`` or ``ESTALE``; the store
then forgets it and walks again (``ConfinedPrefix.at``). Without ``/proc/self/fd`` nothing is cached.

Bounded (``limit`` handles, least recently used dropped first); an fd in use by an operation on another
thread is closed only when that operation ends. Per process: after a fork the child starts empty.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable


class _Handle:
    __slots__ = ("fd", "path", "users", "dropped")

    def __init__(self, fd: int, path: str):
        self.fd, self.path, self.users, self.dropped = fd, path, 0, False


class DirectoryHandles:
    """Cached ``O_PATH`` fds of directories below (and at) one run prefix; thread-safe.

    Args:
        limit: handles kept open at most (each is one fd of this process).
    """

    def __init__(self, limit: int):
        self.limit = limit if _HAVE_PROC_FD else 0
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._handles: OrderedDict[str, _Handle] = OrderedDict()
        self._orphans: dict[int, _Handle] = {}
        """Dropped handles still leased, by fd (closed by their last ``release``)."""

    def _check_fork(self) -> None:
        if self._pid != os.getpid():  # a forked child: the parent's threads and leases do not exist here
            for handle in self._handles.values():
                os.close(handle.fd)
            self._pid, self._lock, self._handles, self._orphans = os.getpid(), threading.Lock(), OrderedDict(), {}

    def lease(self, keys: list[str], *, check_path: bool = True) -> tuple[str, int] | None:
        """The deepest of ``keys`` (directory keys, shallowest first) that has a handle, and its fd, which stays
        open until ``release``; None when none has. The path check runs outside the lock (a ``readlink``);
        ``check_path=False`` skips it for a caller that checks the path of what it opens below the handle instead
        (``ConfinedPrefix.open_read``: one ``readlink`` per read, not two)."""
        self._check_fork()
        for key in reversed(keys):
            with self._lock:
                handle = self._handles.get(key)
                if handle is None:
                    continue
                handle.users += 1
            if handle.path and (not check_path or path_of(handle.fd) == handle.path):
                with self._lock:
                    if self._handles.get(key) is handle:
                        self._handles.move_to_end(key)
                return key, handle.fd
            with self._lock:  # moved or removed since it was opened
                if self._handles.get(key) is handle:
                    self._drop(key, self._handles.pop(key))
            self.release(key, handle.fd)
        return None

    def add(self, key: str, fd: int) -> int:
        """Keep ``fd`` (just opened, owned by the caller until now) as the handle of ``key``, leased to the caller;
        returns the fd to use (another thread's handle of ``key`` if it won, and ``fd`` is closed)."""
        self._check_fork()
        path = path_of(fd) if self.limit else ""
        with self._lock:
            handle = self._handles.get(key)
            if handle is not None:
                os.close(fd)
            else:
                handle = self._handles[key] = _Handle(fd, path)
                while len(self._handles) > self.limit:
                    self._drop(*self._handles.popitem(last=False))
            handle.users += 1
            return handle.fd

    def path(self, key: str) -> str | None:
        """The path directory ``key``'s handle had when it was opened (None: no handle)."""
        with self._lock:
            handle = self._handles.get(key)
            return handle.path if handle is not None else None

    def release(self, key: str, fd: int) -> None:
        """End a lease of ``key``'s handle ``fd`` (from ``lease`` or ``add``)."""
        with self._lock:
            handle = self._handles.get(key)
            if handle is None or handle.fd != fd:
                handle = self._orphans.pop(fd)
            handle.users -= 1
            if handle.dropped and handle.users == 0:
                os.close(handle.fd)
            elif handle.dropped:
                self._orphans[fd] = handle

    def forget(self, key: str) -> None:
        """Drop the handles of ``key`` and of every directory below it (removed, or found stale)."""
        with self._lock:
            for k in [k for k in self._handles if k == key or k.startswith(f"{key}/") or not key]:
                self._drop(k, self._handles.pop(k))

    def __del__(self, _getpid: Callable[[], int] = os.getpid, _close: Callable[[int], None] = os.close) -> None:
        # bound at definition: at interpreter exit this module's globals (``os``) may already be cleared
        if self._pid == _getpid():  # the store is gone: its handles are not leased any more
            for handle in [*self._handles.values(), *self._orphans.values()]:
                _close(handle.fd)

    def _drop(self, key: str, handle: _Handle) -> None:
        handle.dropped = True
        if handle.users == 0:
            os.close(handle.fd)
        else:
            self._orphans[handle.fd] = handle


class HeldInodes:
    """``O_PATH`` fds of unlinked commit markers, by their directory's key; thread-safe, per process.

    An ``unlink(2)`` whose file an fd still references only removes the name: ext4 frees the inode at the last
    ``close`` (measured here: 7-11 us for the name against 95-120 us for an unlink that frees a small file's inode).
    So a claim (``LocalStore.claim_by_unlink``) holds its marker, and the removal of the chunk's other keys (on the
    ledger's reaper thread) closes it first. A forked child closes the fds it inherited at its first use.
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._fds: dict[str, list[int]] = {}

    def hold(self, directory: str, fd: int) -> None:
        self._check_fork()
        with self._lock:
            self._fds.setdefault(directory, []).append(fd)

    def take(self, directory: str) -> list[int]:
        """The fds held for ``directory``, now the caller's to close (their inodes freed then, with no name left)."""
        self._check_fork()
        with self._lock:
            return self._fds.pop(directory, [])

    def _check_fork(self) -> None:
        if self._pid != os.getpid():
            for fd in (fd for fds in self._fds.values() for fd in fds):
                os.close(fd)
            self._pid, self._lock, self._fds = os.getpid(), threading.Lock(), {}


def path_of(fd: int) -> str:
    """The kernel's current path of an open fd (``" (deleted)"`` appended once it is removed)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


_HAVE_PROC_FD = os.path.isdir("/proc/self/fd")
