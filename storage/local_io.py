"""Reads and writes of one open file of the local store (``storage.local_store``): whole buffers, short
reads and writes resumed, the exclusive put's write token as an extended attribute.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Sequence

from refpipe.storage.store import WRITE_TOKEN, Bytes, byte_view

TOKEN_XATTR = f"user.{WRITE_TOKEN}"
"""Extended attribute holding an exclusive put's write token (``Store.put``)."""
_WRITE_PIECE_BYTES = 512 << 10
"""Bytes per ``write(2)``. On ext4 under Linux 6.18 one write of >= 2 MiB took ~3x as long as the same
bytes in <= 1 MiB writes (measured for bench/keep_fetch.py); smaller pieces cost nothing elsewhere."""
_HAVE_PREADV = hasattr(os, "preadv")
_IOV_MAX = os.sysconf("SC_IOV_MAX") if _HAVE_PREADV else 1
"""Most buffers one ``preadv`` takes (Linux: 1,024; more is ``EINVAL``)."""


def fill(fd: int, buffers: Sequence[Bytes], token: str | None, durable: bool) -> None:
    """Write the new file's bytes, set its write token (if any), and ``fsync`` it when ``durable`` (before a name
    makes it visible)."""
    write_all(fd, buffers)
    if token is not None:
        set_token(fd, token)
    if durable:
        os.fsync(fd)


def set_token(fd: int, token: str) -> None:
    """Store the write token as the file's ``user.refpipe-write`` xattr; a filesystem without user xattrs gets none."""
    try:
        os.setxattr(fd, TOKEN_XATTR, token.encode())
    except OSError as e:
        if e.errno != errno.ENOTSUP:
            raise


def write_all(fd: int, buffers: Sequence[Bytes]) -> None:
    """Write buffers in order, at most ``_WRITE_PIECE_BYTES`` per ``write(2)``, resuming after short writes."""
    for buffer in buffers:
        view = byte_view(buffer)
        while view:
            view = view[os.write(fd, view[:_WRITE_PIECE_BYTES]):]


def pwrite_all(fd: int, buffers: Sequence[Bytes], offset: int) -> None:
    """Write buffers in order from byte ``offset``, at most ``_WRITE_PIECE_BYTES`` per ``pwrite(2)``, resuming after
    short writes."""
    for buffer in buffers:
        view = byte_view(buffer)
        while view:
            n = os.pwrite(fd, view[:_WRITE_PIECE_BYTES], offset)
            view, offset = view[n:], offset + n


def read_all(fd: int, size: int, offset: int) -> bytes:
    """Up to ``size`` bytes at ``offset`` (fewer only at end of file), resuming after short reads."""
    data = os.pread(fd, size, offset)
    while len(data) < size:
        more = os.pread(fd, size - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def readv_all(fd: int, views: list[memoryview], size: int, offset: int = 0) -> int:
    """Read up to ``size`` bytes from ``offset`` into ``views`` in order (``preadv`` of at most ``IOV_MAX`` views,
    resumed after short reads).

    Returns bytes read: ``size``, or fewer at end of file. Without ``os.preadv``: one ``readinto`` per view.
    """
    views = list(views)  # its first unfilled view is replaced by its unfilled rest after a short read
    done, first = 0, 0
    while done < size and first < len(views):
        at = offset + done
        n = os.preadv(fd, views[first : first + _IOV_MAX], at) if _HAVE_PREADV else _preadinto(fd, views[first], at)
        done += n
        if n == 0 or done >= size:  # end of file, or all read: no view to advance past
            break
        while first < len(views) and n >= views[first].nbytes:
            n -= views[first].nbytes
            first += 1
        if n:
            views[first] = views[first][n:]
    return min(done, size)


def _preadinto(fd: int, view: memoryview, offset: int) -> int:
    """``pread`` into one view (platforms without ``preadv``)."""
    data = os.pread(fd, view.nbytes, offset)
    view[: len(data)] = data
    return len(data)
