"""Faults of a POSIX directory for the local store: real ones where this machine can make them, injected otherwise.

Real (``tmpfs``, ``read_only``, ``refusing``): a tiny tmpfs mount fills up (``ENOSPC``), a tmpfs remounted
read-only refuses writes (``EROFS``), an immutable directory (``FS_IMMUTABLE_FL``; ``chmod 0555`` when not root)
refuses creating and removing names in it (``EPERM``, or ``EACCES``). Mounting needs ``CAP_SYS_ADMIN``: the tests
that need it skip with a message where it is missing.

Injected (``OsFaults``): ``EIO``, ``ESTALE``, ``ETIMEDOUT``, ``EAGAIN`` are what a Lustre or NFS client raises while
its server is unreachable; no real way to make them exists on one machine without a network filesystem server (a
FUSE filesystem would need libfuse bindings the test environment does not have). ``OsFaults`` stands in for the
``os`` module as ``refpipe.storage.local_store``, ``local_put`` and ``local_confined`` see it and fails one system
call whose name argument matches:
``before`` it runs (the request never reached the server) or ``after`` it ran (the server applied it; its answer
was lost, which a client's retransmission after a timeout turns into ``EEXIST`` or ``ENOENT``).

Simulated (``NfsClient``): an NFS client's silly rename of a file unlinked while it is open, done for real on the
directory (rename to ``.nfs<hex>``, ``EBUSY`` for unlinking it while open, removed at the last close).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import os
import re
import stat
from dataclasses import dataclass

import pytest

_NAME_ARG = {"open": 0, "stat": 0, "unlink": 0, "rmdir": 0, "link": 1, "replace": 1}
"""Position of the name (relative to a directory fd) each wrapped function acts on."""


@dataclass
class OsFault:
    function: str
    """``os`` function: ``open``, ``stat``, ``unlink``, ``rmdir``, ``link`` (exclusive puts) or ``replace`` (plain
    puts)."""
    name: str
    """Regular expression the whole name must match (``re.fullmatch``)."""
    error: int
    """errno raised."""
    after: bool = False
    """Raise after the call ran (applied, answer lost); else before it."""
    times: int = 1


class OsFaults:
    """A stand-in for the ``os`` module that fails chosen calls (install with ``monkeypatch.setattr(module, "os",
    faults)`` for ``local_store``, ``local_put`` and ``local_confined``). ``hits``: ``(function, name, errno name)``
    of every fault raised, in order."""

    def __init__(self):
        self.faults: list[OsFault] = []
        self.hits: list[tuple[str, str, str]] = []

    def add(self, fault: OsFault) -> None:
        self.faults.append(fault)

    def __getattr__(self, attr: str):
        real = getattr(os, attr)
        if attr not in _NAME_ARG:
            return real

        def call(*args, **kwargs):
            name = os.fsdecode(args[_NAME_ARG[attr]])
            fault = next((f for f in self.faults if f.function == attr and f.times and re.fullmatch(f.name, name)),
                         None)
            if fault is None:
                return real(*args, **kwargs)
            fault.times -= 1
            self.hits.append((attr, name, errno.errorcode[fault.error]))
            if fault.after:
                real(*args, **kwargs)
            raise OSError(fault.error, os.strerror(fault.error), name)

        return call


_libc = ctypes.CDLL(None, use_errno=True)
_MS_RDONLY, _MS_REMOUNT, _MNT_DETACH = 1, 32, 2
_FS_IOC_GETFLAGS, _FS_IOC_SETFLAGS, _FS_IMMUTABLE_FL = 0x80086601, 0x40086602, 0x10


def _mount(source: bytes | None, target: str, fstype: bytes | None, flags: int, options: bytes | None) -> None:
    if _libc.mount(source, os.fsencode(target), fstype, ctypes.c_ulong(flags), options) != 0:
        code = ctypes.get_errno()
        pytest.skip(f"cannot mount a tmpfs at {target} ({errno.errorcode[code]}: needs CAP_SYS_ADMIN, e.g. root)")


@contextlib.contextmanager
def tmpfs(path: str, size_bytes: int):
    """A tmpfs of ``size_bytes`` mounted at ``path`` (made if missing), unmounted at the end (lazily)."""
    os.makedirs(path, exist_ok=True)
    _mount(b"tmpfs", path, b"tmpfs", 0, f"size={size_bytes},mode=0755".encode())
    try:
        yield path
    finally:
        _libc.umount2(os.fsencode(path), _MNT_DETACH)


def read_only(path: str, read_only: bool = True) -> None:
    """Remount the tmpfs at ``path`` read-only (or read-write again)."""
    _mount(None, path, None, _MS_REMOUNT | (_MS_RDONLY if read_only else 0), None)


@contextlib.contextmanager
def refusing(directory: str):
    """Make ``directory`` refuse new and removed names until the end; yields the errno name that refusal raises:
    ``EPERM`` (immutable, as root: permissions do not bind root) or ``EACCES`` (``chmod 0555``)."""
    if os.geteuid() != 0:
        mode = os.stat(directory).st_mode
        os.chmod(directory, 0o555)
        try:
            yield "EACCES"
        finally:
            os.chmod(directory, mode)
        return
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        flags = bytearray(8)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, flags)
        before = int.from_bytes(flags[:4], "little")
        fcntl.ioctl(fd, _FS_IOC_SETFLAGS, bytearray((before | _FS_IMMUTABLE_FL).to_bytes(8, "little")))
        try:
            yield "EPERM"
        finally:
            fcntl.ioctl(fd, _FS_IOC_SETFLAGS, bytearray(before.to_bytes(8, "little")))
    finally:
        os.close(fd)


class NfsClient:
    """A stand-in for the ``os`` module as ``refpipe.storage.local_store`` sees it that unlinks as an NFS client does
    (the "silly rename" of nfs(5) and the Linux client's ``nfs_unlink``): unlinking a regular file that a process
    still holds open renames it to ``.nfs<inode:016x><n:08x>`` in the same directory instead (its data stays
    readable through the open fd); unlinking such a placeholder while the file is still open is ``EBUSY``;
    ``close(fd)`` closes the reader and, once no fd holds the file, removes the placeholder, as the client does
    at the last close. Whether a file is open is read from ``/proc/self/fd`` (the readers are this process's).

    ``renames``: ``(name, placeholder)`` of every silly rename, in order. Every other call is the real one.
    """

    def __init__(self):
        self.renames: list[tuple[str, str]] = []
        self._placeholders: list[tuple[int, str]] = []  # (placeholder's directory fd, placeholder name)

    def __getattr__(self, attr: str):
        return getattr(os, attr)

    def unlink(self, name, *, dir_fd=None):
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not (stat.S_ISREG(st.st_mode) and _held_open(st)):
            return os.unlink(name, dir_fd=dir_fd)
        if os.fsdecode(name).startswith(".nfs"):
            raise OSError(errno.EBUSY, os.strerror(errno.EBUSY), name)
        placeholder = f".nfs{st.st_ino:016x}{len(self.renames):08x}"
        os.rename(name, placeholder, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        self.renames.append((os.fsdecode(name), placeholder))
        self._placeholders.append((os.open(".", os.O_PATH | os.O_DIRECTORY, dir_fd=dir_fd), placeholder))

    def close(self, fd: int) -> None:
        """Close a reader's ``fd``; remove the placeholders no fd holds any more (the client's last-close unlink)."""
        os.close(fd)
        for dir_fd, placeholder in list(self._placeholders):
            if not _held_open(os.stat(placeholder, dir_fd=dir_fd)):
                os.unlink(placeholder, dir_fd=dir_fd)
                os.close(dir_fd)
                self._placeholders.remove((dir_fd, placeholder))


def _held_open(st: os.stat_result) -> bool:
    """Whether an fd of this process (not an ``O_PATH`` handle) refers to the file ``st`` describes."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            other = os.stat(f"/proc/self/fd/{fd}")
            flags = fcntl.fcntl(int(fd), fcntl.F_GETFL)
        except OSError:
            continue
        if (other.st_dev, other.st_ino) == (st.st_dev, st.st_ino) and not flags & os.O_PATH:
            return True
    return False
