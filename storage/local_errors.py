"""The one place an ``OSError`` of a POSIX directory (local disk, NFS, Lustre) becomes a refpipe error.

``LocalStore`` calls ``classify`` for every failed system call; ``Store.retrying`` retries the
transient kind. Kinds (docs/DESIGN.md, "Store errors"):

- **transient**: ``EIO``, ``ETIMEDOUT``, ``ESTALE``, ``EAGAIN``, ``ENOTCONN``, ``ECONNRESET``,
  ``EINTR``, ``EBUSY``: what a Lustre client raises while it reconnects or after an eviction, and an NFS
  soft mount when the server does not answer in time (nfs(5), ``soft``/``timeo``); ``EBUSY``: a name in use for a
  while (an NFS client refuses to unlink its ``.nfs<hex>`` placeholder of a file a reader still holds open).
  ``TransientStorageError``: retried with backoff, bounded. For a write the call may have been
  applied ("maybe applied": the server did it, the answer was lost); an exclusive put resolves
  that by its write token (``Store.put``), a delete by the absent key's ``ENOENT``.
- **not found**: ``ENOENT``, ``ENOTDIR`` -> ``KeyNotFoundError``.
- **exists**: ``EEXIST`` (``linkat(2)`` of an exclusive put) -> ``KeyExistsError``.
- **permanent**: everything else (``EACCES``, ``EPERM``, ``EROFS``, ``ENOSPC``, ``EDQUOT``,
  ``EISDIR``, ...) -> ``StorageError`` naming the key, the errno name and ``strerror``.
"""

from __future__ import annotations

import errno

from refpipe.storage.errors import KeyExistsError, KeyNotFoundError, StorageError, TransientStorageError

TRANSIENT_ERRNOS = frozenset({errno.EIO, errno.ETIMEDOUT, errno.ESTALE, errno.EAGAIN, errno.ENOTCONN,
                              errno.ECONNRESET, errno.EINTR, errno.EBUSY})
"""Errnos worth retrying: a network filesystem's client lost its server for a while, or a name is busy for a while
(``EBUSY``: an NFS client's placeholder of a file a reader still holds open)."""


def classify(what: str, uri: str, e: OSError) -> StorageError:
    """The refpipe error for ``e``, raised by a system call on ``uri`` (``what``: ``cannot read`` ...).

    Returns (never raises) one of ``TransientStorageError``, ``KeyNotFoundError``, ``KeyExistsError`` or
    ``StorageError``; the caller raises it ``from e``. A ``StorageError`` passes through unchanged.
    """
    if isinstance(e, StorageError):
        return e
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return KeyNotFoundError(f"{uri} does not exist")
    if e.errno == errno.EEXIST:
        return KeyExistsError(f"{uri} already exists")
    reason = f"{what} {uri}: {errno.errorcode.get(e.errno or 0, e.errno)} ({e.strerror})"
    return (TransientStorageError if e.errno in TRANSIENT_ERRNOS else StorageError)(reason)
