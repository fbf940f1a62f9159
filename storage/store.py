"""The store interface: what refpipe asks of the storage under one run prefix.

Keys are relative to the run prefix (``storage.uri``; the layout of keys: ``storage.layout``).
Verbs, one per operation: ``get`` (optionally a byte range), ``get_array`` (a whole object into a fresh
array), ``get_into`` (a whole object into caller buffers), ``put`` (``exclusive=True`` is atomic or raises
``KeyExistsError``), ``delete_key`` / ``delete_keys`` (known keys), ``exists``, ``list_prefix`` and ``list_sizes``
(listings: audits and inspection only). Nothing on the hot path lists or stats. Every backend
classifies its errors in one place and retries transient ones through ``Store.retrying`` (the one
retry layer; docs/DESIGN.md, "Store errors").

Backends: ``storage.local_store.LocalStore`` (a POSIX directory) and ``storage.s3_store.S3Store``;
``storage.backends.open_store`` picks one for a run's URI. A store is picklable and may cross a
fork (each backend rebuilds per-process state on first use in the child).
"""

from __future__ import annotations

import abc
import os
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
from typing_extensions import Buffer

from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import DeleteKeysError, KeyExistsError, StorageError, TransientStorageError
from refpipe.storage.uri import RunPrefix

Bytes = Buffer | np.ndarray
"""One bytes-like object (bytes, memoryview, an ndarray). ``np.ndarray`` is named apart because numpy's stubs declare
its ``__buffer__`` only from Python 3.12; on 3.11 an ndarray is a buffer all the same."""
Data = Bytes | list[Bytes] | tuple[Bytes, ...]
"""What ``put`` writes: one bytes-like object (bytes, memoryview, a C-contiguous ndarray), or a list/tuple of them."""
T = TypeVar("T")
_RETRIES_LOCK = threading.Lock()
WRITE_TOKEN = "refpipe-write"
"""Name of the write token of every exclusive put, ``<writer>.<call>`` (``call``: random per ``put`` call, the same
for that call's retries): S3 user metadata (``x-amz-meta-refpipe-write``), an extended attribute on a filesystem
(``user.refpipe-write``)."""


def byte_view(buffer: Bytes) -> memoryview:
    """``buffer``'s bytes as a flat ``memoryview`` (format ``B``; no copy)."""
    return memoryview(buffer).cast("B")  # type: ignore[arg-type]  # numpy's stubs: ndarray is a Buffer only from 3.12


def buffers_of(data: Data) -> list[Bytes] | tuple[Bytes, ...]:
    """``data`` as a list of buffers: a list or tuple is already one; anything else (bytes, an ndarray) is one
    buffer."""
    return data if isinstance(data, (list, tuple)) else [data]


class Store(abc.ABC):
    """A run's store. Each backend implements the abstract verbs.

    Args:
        prefix: the run prefix; every key is checked against it (``OutsideRunError`` before any I/O).
        config: the run's storage config (retries, backoff, concurrency, endpoint).

    Attributes:
        retries: retries by ``retrying`` in this process (trainer metrics).
        idempotent_puts: exclusive puts that found their own earlier, applied attempt (its answer
            lost) and succeeded.
    """

    claims_per_release = False
    """Whether ``Ledger.release`` claims a DP rank's chunks of a step with one release record (a store whose
    exclusive put and existence check are network round trips: S3) instead of one delete record per chunk."""

    appends = False
    """Whether ``write_at`` adds bytes to an existing object (a filesystem: ``pwrite``); S3 objects are whole."""

    claims_by_unlink = False
    """Whether removing a chunk's commit marker is itself an exclusive claim (``claim_by_unlink``: of any number of
    deleters exactly one removes it, the others find it absent; a filesystem's ``unlink(2)``), so ``Ledger.delete``
    claims a call's chunks with one batch record instead of one delete record per chunk."""

    def __init__(self, prefix: RunPrefix, config: StorageConfig):
        self.prefix = prefix
        self.config = config
        self.retries = 0
        self.idempotent_puts = 0

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_writer", "_writer_pid"):  # an unpickled copy is another writer
            state.pop(name, None)
        return state

    @property
    def writer(self) -> str:
        """This process's writer id (random; new after a fork or in an unpickled copy)."""
        if getattr(self, "_writer_pid", None) != os.getpid():
            self._writer, self._writer_pid = uuid.uuid4().hex[:16], os.getpid()
        return self._writer

    def retrying(self, what: str, op: Callable[[], T], retry: type[StorageError] = TransientStorageError) -> T:
        """Run ``op``, retrying errors of type ``retry`` with exponential backoff and jitter: the one retry layer.

        ``retry``: ``TransientStorageError`` (every backend verb), or ``KeyNotFoundError`` for a key a reference
        says was kept (a stale cache or a lagging replica may not show it yet; ``storage.chunk_read``).

        Raises:
            TransientStorageError: still failing after ``config.max_retries`` retries (``retry`` itself for others).
        """
        for attempt in range(self.config.max_retries + 1):
            try:
                return op()
            except retry as e:
                if attempt == self.config.max_retries:
                    if retry is TransientStorageError:
                        raise TransientStorageError(f"{what}: gave up after {attempt + 1} attempts: {e}") from e
                    raise
                self.backoff(attempt, "SlowDown" in str(e))
        raise AssertionError("unreachable")

    def backoff(self, attempt: int, slow_down: bool = False) -> None:
        """Count one retry and sleep before it: ``retry_backoff_s * 2**attempt`` with jitter, 8x for SlowDown."""
        with _RETRIES_LOCK:
            self.retries += 1
        time.sleep(self.config.retry_backoff_s * (8 if slow_down else 1) * 2**attempt * (0.5 + random.random()))

    def path(self, key: str) -> str:
        """Backend path of a key (``<prefix.path>/<key>``; checked to be a clean key under the run prefix)."""
        return f"{self.prefix.path}/{self.prefix.check_key(key)}"

    def uri(self, key: str) -> str:
        """URI of a key."""
        return self.prefix.uri_of(key)

    @abc.abstractmethod
    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        """Bytes of ``key``, or of ``[start, end)`` of it (a range past the end gives the bytes that exist).

        Raises:
            KeyNotFoundError: no object at ``key`` (``ChunkNotFoundError``, its subclass, today).
            StorageError: any other failure (``TransientStorageError`` once retries are spent).
        """

    @abc.abstractmethod
    def get_into(self, key: str, buffers: Sequence[Bytes], offset: int = 0) -> int:
        """Read ``key`` from byte ``offset`` into ``buffers`` (writable, C-contiguous; filled in order).

        Returns:
            The object's size in bytes from ``offset``. Larger than the buffers' total: the buffers hold its
            first bytes and the rest was not read. Smaller: only that many bytes were written
            (the buffers' tail is left as it was). Callers compare it with the size they expect.

        Raises:
            KeyNotFoundError: no object at ``key``.
            StorageError: any other failure (``TransientStorageError`` once retries are spent).
        """

    def get_array(self, key: str) -> np.ndarray:
        """Bytes of ``key`` as a fresh read-only 1-D uint8 array of the object's size (``get`` of the whole object).

        A backend that reads into memory it allocates does so with numpy, which on Linux advises transparent huge
        pages for arrays of 4 MiB and more: a whole chunk then faults in 2 MiB pages, not 4 KiB ones (a fresh
        4.7 MiB read costs ~0.9 ms of CPU against ~2.2 ms into ``bytes``, measured on this project's machine). The
        default wraps ``get``'s bytes (no copy).

        Raises:
            As ``get``.
        """
        return np.frombuffer(self.get(key), np.uint8)

    def put(self, key: str, data: Data, *, exclusive: bool = False, durable: bool = False,
            in_place: bool = False) -> None:
        """Write ``data`` (one buffer, or a list/tuple of buffers written in order) at ``key``.

        Readers never see a partial object, unless ``in_place`` (only with ``exclusive``; for an object a commit
        marker written after it vouches for, such as a branch's chunk): a filesystem then creates the file under
        its name and writes it there, one metadata operation instead of a create and a link, its write token
        claimed before the first byte (S3: a PUT is always whole; nothing changes).

        ``durable``: on return the bytes survive a crash of the host, not only of the process (a filesystem
        ``fsync``s the file before it appears; an S3 PUT always is): checkpoints.
        With ``exclusive=True`` exactly one of any number of concurrent
        puts of ``key`` succeeds; the others raise ``KeyExistsError``. An exclusive put stores a write token
        (``WRITE_TOKEN``: this writer and this call) with the object, atomically; when it finds the key
        present, the object's token is read (one HEAD or ``getxattr``), and when it is this call's, an
        earlier attempt of this call was applied and its answer lost (a "maybe applied" error, retried):
        the put succeeds and counts in ``idempotent_puts``. A later call is never taken for a retry of an
        earlier one, whatever its bytes: it raises ``KeyExistsError``.

        Raises:
            KeyExistsError: ``exclusive`` and ``key`` holds an object this call did not write (it is unchanged).
            ValueError: ``in_place`` without ``exclusive``.
            StorageError: any other failure (``TransientStorageError`` once retries are spent).
        """
        buffers = buffers_of(data)
        what = f"PUT {self.uri(key)}"
        if not exclusive:
            if in_place:
                raise ValueError(f"put({self.uri(key)}, in_place=True): expected exclusive=True as well")
            self.retrying(what, lambda: self._put(key, buffers, None, durable, False))
            return
        token = f"{self.writer}.{uuid.uuid4().hex[:16]}"  # this call's: kept across its retries only
        try:
            self.retrying(what, lambda: self._put(key, buffers, token, durable, in_place))
        except KeyExistsError:
            if self._token(key) != token:
                raise
            self.found_own_attempt()

    def write_at(self, key: str, buffers: Sequence[Bytes], offset: int) -> None:
        """Write ``buffers`` in order at byte ``offset`` of the existing object ``key`` (only where ``appends``; a
        retry writes the same bytes again). Readers may see the bytes partly written: the writer's refs say which
        bytes are whole (``PayloadRef.offset``).

        Raises:
            KeyNotFoundError: no object at ``key``.
            StorageError: any other failure (``TransientStorageError`` once retries are spent).
            NotImplementedError: the store does not append.
        """
        raise NotImplementedError(f"{type(self).__name__} does not append to an object ({self.uri(key)})")

    def found_own_attempt(self) -> None:
        """Count an exclusive put that found its own earlier, applied attempt (``idempotent_puts``)."""
        with _RETRIES_LOCK:
            self.idempotent_puts += 1

    @abc.abstractmethod
    def _put(self, key: str, buffers: list[Bytes] | tuple[Bytes, ...], token: str | None, durable: bool,
             in_place: bool) -> None:
        """One attempt of ``put`` (errors classified, not retried); ``token``: exclusive, store it as the object's
        write token in the same atomic step (``in_place``: before the first byte); ``durable``, ``in_place``: as in
        ``put``."""

    @abc.abstractmethod
    def _token(self, key: str) -> str | None:
        """The write token stored with the object at ``key``, or None (absent, or stored without one)."""

    def delete_key(self, key: str) -> None:
        """Delete one key; an absent key is not an error.

        Raises:
            DeleteKeysError: the key could not be deleted (names it and the store's reason).
        """
        self.delete_keys([key])

    def delete_keys(self, keys: Sequence[str]) -> None:
        """Delete known keys (a list or tuple of them); keys already absent are not an error.

        Transient errors are retried per key (``retrying``'s budget).

        Raises:
            TypeError: ``keys`` is a ``str`` (whose characters are not keys: use ``delete_key``).
            OutsideRunError: a key is not a clean key under the run prefix (nothing deleted).
            DeleteKeysError: some keys could not be deleted (``.failed``: key -> its classified error, naming the
                key and the store's reason); every other key was deleted.
        """
        if isinstance(keys, (str, bytes)):
            raise TypeError(f"delete_keys({keys!r}): expected a sequence of keys, got a {type(keys).__name__} "
                            f"(use delete_key for one key)")
        keys = list(keys)
        for key in keys:
            self.prefix.check_key(key)
        failed = self._delete_keys(keys)
        if failed:
            key, error = next(iter(failed.items()))
            raise DeleteKeysError(f"delete under {self.prefix.uri}: {len(failed)} of {len(keys)} keys not deleted; "
                                  f"first: {self.uri(key)}: {error}", failed)

    def claim_by_unlink(self, keys: Sequence[str]) -> list[StorageError | None]:
        """Delete each key (a chunk's commit marker) as that chunk's claim; only on a store with ``claims_by_unlink``.
        The chunk's other keys are left to the caller (``storage.ledger_reaper``), deleted with ``delete_keys``.

        Returns:
            Per key: None (this call removed it: the chunk is claimed), ``KeyNotFoundError`` (it was absent: not
            claimed), or the store error that stopped it after the retries (claim unresolved).

        Raises:
            OutsideRunError: a key is not a clean key under the run prefix (nothing deleted).
            NotImplementedError: the store has no ``claims_by_unlink``.
        """
        raise NotImplementedError(f"{type(self).__name__}: removing a commit marker is no claim here")

    @abc.abstractmethod
    def _delete_keys(self, keys: list[str]) -> dict[str, StorageError]:
        """Delete checked keys (the backend's part of ``delete_keys``); return the keys not deleted, each with its
        classified error after the retries."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool:
        """Whether an object exists at ``key`` (off the hot path: audits, deletes of refs)."""

    def appears(self, key: str) -> bool:
        """Whether an object missing at a first look shows up when looked for again (``exists``, ``max_retries``
        times with backoff, counted: a stale cache or a lagging replica may hide it at first)."""
        for attempt in range(self.config.max_retries):
            self.backoff(attempt)
            if self.exists(key):
                return True
        return False

    @abc.abstractmethod
    def list_prefix(self, key_prefix: str) -> list[str]:
        """Every key under ``key_prefix/`` (recursive, sorted; ``""`` = the whole run). Audits and inspection only."""

    def remove_empty_directories(self) -> int:
        """Remove every empty directory below the run prefix (never the prefix itself, nothing outside it); return
        how many. The end-of-run cleanup of a stopped run only (a concurrent put may need a directory removed here).
        Object stores have no directories: 0.

        Raises:
            StorageError: a directory could not be read or removed for another reason than holding entries.
        """
        return 0

    @abc.abstractmethod
    def list_sizes(self, key_prefix: str) -> dict[str, int]:
        """Every key under ``key_prefix/`` (recursive, ``""`` = the whole run) with its size in bytes, sorted by key.

        Audits, inspection and the main job's progress view only. A missing prefix lists as ``{}``.

        Raises:
            OSError: the listing failed (``StorageError`` on S3; a ``PermissionError`` naming the directory
                on a local disk).
        """
