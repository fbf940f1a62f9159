"""Writing one object into a directory of a confined run (``storage.local_store``): the three forms of a put, each
acting on a name relative to its directory's fd (``storage.local_confined``).

- ``put_in_place``: an exclusive put written under its own name (a branch's chunk): one create.
- ``put_unnamed``: an exclusive put that appears whole: an unnamed ``O_TMPFILE`` file linked to its name.
- ``put_named``: a plain put (a temp name renamed over the name), and an exclusive one where the filesystem has no
  ``O_TMPFILE``.

Exclusive puts carry their write token as the extended attribute ``local_io.TOKEN_XATTR``, so a retry finds its own
earlier attempt.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from collections.abc import Sequence

from refpipe.storage.local_io import TOKEN_XATTR, fill
from refpipe.storage.store import Bytes

WRITE_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC

HAVE_TMPFILE = hasattr(os, "O_TMPFILE") and os.path.isdir("/proc/self/fd")


def put_in_place(dir_fd: int, name: str, buffers: Sequence[Bytes], token: str, durable: bool) -> bool:
    """Create ``name`` (``O_EXCL``), claim it by setting the write token with ``XATTR_CREATE`` (atomic: one
    claimant wins), then write the bytes. An existing empty file is claimed the same way when it has no token
    yet (an earlier attempt's create whose answer was lost, or a create a concurrent put has not claimed yet:
    whichever claims first writes, the other gets ``EEXIST``), and a file of this call's token is written again
    from its start (an earlier attempt cut short); anything else is ``EEXIST``, unchanged. A failed write
    unlinks the file (best effort) before the error propagates. Returns whether the file was an earlier attempt's
    (``Store.found_own_attempt``)."""
    created = True
    try:
        fd = os.open(name, WRITE_FLAGS | os.O_CREAT | os.O_EXCL, 0o666, dir_fd=dir_fd)
    except FileExistsError:
        try:  # O_NONBLOCK: a FIFO there never blocks
            fd = os.open(name, WRITE_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError:
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), name) from None
        created = False
    try:
        if not _claim(fd, token, created):
            raise FileExistsError(errno.EEXIST, os.strerror(errno.EEXIST), name)
        if not created:
            os.ftruncate(fd, 0)
        fill(fd, buffers, None, durable)
    except FileExistsError:
        raise
    except BaseException:
        with contextlib.suppress(OSError):  # this call's file: nobody else writes it
            os.unlink(name, dir_fd=dir_fd)
        raise
    finally:
        os.close(fd)
    return not created


def put_unnamed(dir_fd: int, name: str, buffers: Sequence[Bytes], token: str, durable: bool) -> None:
    try:
        fd = os.open(".", os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
            raise
        return put_named(dir_fd, name, buffers, token, durable)  # no O_TMPFILE on this filesystem
    try:
        fill(fd, buffers, token, durable)
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=dir_fd)  # linkat(AT_SYMLINK_FOLLOW) of the unnamed file
    finally:
        os.close(fd)

def put_named(dir_fd: int, name: str, buffers: Sequence[Bytes], token: str | None, durable: bool) -> None:
    """``token`` None: write a temp name and rename it over ``name``; else set the token and link it exclusively."""
    tmp = f"{name}.tmp-{uuid.uuid4().hex[:12]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666, dir_fd=dir_fd)
    try:
        fill(fd, buffers, token, durable)
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


def _claim(fd: int, token: str, created: bool) -> bool:
    """Whether this put owns the open file: its write token is ``token``, set earlier, or set now (``XATTR_CREATE``:
    only where none is set) on a file this attempt ``created`` or an empty one. Without user xattrs: only a file
    this attempt created."""
    try:
        if not created and os.fstat(fd).st_size:
            return token_of(fd) == token
        os.setxattr(fd, TOKEN_XATTR, token.encode(), os.XATTR_CREATE)
        return True
    except OSError as e:
        if e.errno == errno.EEXIST:
            return token_of(fd) == token
        if e.errno == errno.ENOTSUP:
            return created
        raise


def token_of(fd: int) -> str | None:
    """The write token of an open file (``TOKEN_XATTR``), or None (none set, or no user xattrs here)."""
    try:
        return os.getxattr(fd, TOKEN_XATTR).decode()
    except OSError as e:
        if e.errno not in (errno.ENODATA, errno.ENOTSUP):
            raise
        return None


__all__ = ["HAVE_TMPFILE", "WRITE_FLAGS", "put_in_place", "put_named", "put_unnamed", "token_of"]
