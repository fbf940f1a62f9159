"""One store interface over fsspec: a local directory or S3 (s3fs).

Keys are relative to the run prefix (``storage.uri``). Verbs, one per operation:
``get`` (optionally a byte range), ``put`` (``exclusive=True`` is atomic or raises
``KeyExistsError``), ``delete`` (known keys; S3 batches ``DeleteObjects``),
``exists``, ``list_prefix``. Nothing on the hot path lists or stats.

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
from typing import TypeVar

import fsspec

from storage.config import StorageConfig
from storage.errors import ChunkNotFoundError, KeyExistsError, StorageError, TransientStorageError
from storage.uri import RunPrefix

Data = bytes | bytearray | memoryview | Sequence[bytes | bytearray | memoryview]
T = TypeVar("T")
_RETRIES_LOCK = threading.Lock()
_S3_DELETE_BATCH = 1000  # DeleteObjects takes at most 1,000 keys (AWS S3 API reference)


def open_store(config: StorageConfig) -> "Store":
    """Build the store for ``config``'s run prefix: the one place URIs become filesystems."""
    prefix = RunPrefix.from_root(config.root, config.run_id)
    cls = S3Store if prefix.scheme == "s3" else LocalStore
    return cls(prefix, config)


def _join(data: Data) -> bytes | bytearray | memoryview:
    return data if isinstance(data, (bytes, bytearray, memoryview)) else b"".join(data)


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
            self._fs, _ = fsspec.core.url_to_fs(self.prefix.uri, **self._fs_options())
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self):
        return {"prefix": self.prefix, "config": self.config, "_fs": None, "_pid": -1, "retries": 0}

    def _fs_options(self) -> dict:
        return {}

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
        """Bytes of ``key``, or of ``[start, end)`` of it.

        Raises:
            ChunkNotFoundError: no object at ``key``.
        """
        raise NotImplementedError

    def put(self, key: str, data: Data, *, exclusive: bool = False) -> None:
        """Write ``data`` (bytes or a sequence of buffers, written in order) at ``key``.

        Readers never see a partial object. With ``exclusive=True`` exactly one of any
        number of concurrent puts of ``key`` succeeds; the others raise ``KeyExistsError``.
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
        """Every key under ``key_prefix`` (recursive, sorted). Audits and inspection only."""
        raise NotImplementedError


class LocalStore(Store):
    """A run prefix on a POSIX directory (local disk, NFS, Lustre).

    ``put`` writes a temp file in the key's directory and renames it into place;
    ``exclusive`` puts hard-link the temp file to the key, which fails atomically
    with ``EEXIST`` when the key exists (POSIX ``link(2)``; Lustre honours it).
    """

    def get(self, key, start=None, end=None):
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                if start:
                    f.seek(start)
                return f.read() if end is None else f.read(end - (start or 0))
        except (FileNotFoundError, NotADirectoryError) as e:
            raise ChunkNotFoundError(f"{self.uri(key)} does not exist") from e

    def put(self, key, data, *, exclusive=False):
        path = self.path(key)
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:12]}"
        self._write_new(tmp, data)
        try:
            if exclusive:
                self._link_exclusive(tmp, path, key)
            else:
                os.replace(tmp, path)
        finally:
            if exclusive:
                os.unlink(tmp)

    def _link_exclusive(self, tmp: str, path: str, key: str) -> None:
        try:
            os.link(tmp, path)
        except FileExistsError as e:
            raise KeyExistsError(f"{self.uri(key)} already exists") from e

    @staticmethod
    def _write_new(path: str, data: Data) -> None:
        try:
            f = open(path, "xb", buffering=0)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            f = open(path, "xb", buffering=0)
        with f:
            if isinstance(data, (bytes, bytearray, memoryview)):
                f.write(data)
            else:
                f.writelines(data)

    def delete(self, keys):
        for key in keys:
            try:
                os.unlink(self.path(key))
            except FileNotFoundError:
                continue
            except OSError as e:
                raise StorageError(f"cannot delete {self.uri(key)}: {e.strerror}") from e
            self._remove_empty_dir(os.path.dirname(self.path(key)))

    def _remove_empty_dir(self, directory: str) -> None:
        """Remove a branch directory once its last object is gone (shards stay)."""
        if directory.count("/") - self.prefix.path.count("/") < 3:
            return
        try:
            os.rmdir(directory)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT):
                raise

    def exists(self, key):
        return os.path.exists(self.path(key))

    def list_prefix(self, key_prefix):
        root = self.prefix.path
        base = os.path.join(root, key_prefix) if key_prefix else root
        keys = []
        for directory, _, files in os.walk(base):
            rel = os.path.relpath(directory, root)
            keys.extend(name if rel == "." else f"{rel}/{name}" for name in files)
        return sorted(keys)


class S3Store(Store):
    """A run prefix on S3 (or an S3-compatible endpoint) through s3fs.

    ``put`` is one PUT; ``exclusive`` adds ``If-None-Match: *`` (a 412 means the key
    exists; a 409 from a concurrent conditional PUT is retried). ``delete`` sends
    ``DeleteObjects`` in batches of 1,000 and checks every key's result, since
    s3fs's bulk ``rm`` drops per-key errors.
    """

    def _fs_options(self):
        client_kwargs = {}
        if self.config.s3_endpoint_url:
            client_kwargs["endpoint_url"] = self.config.s3_endpoint_url
        if self.config.s3_region:
            client_kwargs["region_name"] = self.config.s3_region
        return {"skip_instance_cache": True, "use_listings_cache": False, "client_kwargs": client_kwargs}

    def _split(self, key: str) -> tuple[str, str]:
        bucket, _, object_key = self.path(key).partition("/")
        return bucket, object_key

    def _call(self, what: str, method: str, **kwargs):
        def op():
            try:
                return self.fs.call_s3(method, **kwargs)
            except (FileNotFoundError, FileExistsError, PermissionError):
                raise
            except OSError as e:
                if _is_transient(e):
                    raise TransientStorageError(f"{what}: {e}") from e
                raise StorageError(f"{what}: {e}") from e

        return self.retrying(what, op)

    def get(self, key, start=None, end=None):
        path = self.path(key)

        def op():
            try:
                return self.fs.cat_file(path, start=start, end=end)
            except FileNotFoundError as e:
                raise ChunkNotFoundError(f"{self.uri(key)} does not exist") from e
            except OSError as e:
                if _is_transient(e):
                    raise TransientStorageError(f"GET {self.uri(key)}: {e}") from e
                raise StorageError(f"GET {self.uri(key)}: {e}") from e

        return self.retrying(f"GET {self.uri(key)}", op)

    def put(self, key, data, *, exclusive=False):
        bucket, object_key = self._split(key)
        match = {"IfNoneMatch": "*"} if exclusive else {}
        try:
            self._call(f"PUT {self.uri(key)}", "put_object", Bucket=bucket, Key=object_key, Body=bytes(_join(data)), **match)
        except FileExistsError as e:
            raise KeyExistsError(f"{self.uri(key)} already exists") from e

    def delete(self, keys):
        keys = list(keys)
        for i in range(0, len(keys), _S3_DELETE_BATCH):
            batch = keys[i : i + _S3_DELETE_BATCH]
            bucket = self._split(batch[0])[0]
            objects = [{"Key": self._split(k)[1]} for k in batch]
            resp = self._call(
                f"DeleteObjects under {self.prefix.uri}", "delete_objects",
                Bucket=bucket, Delete={"Objects": objects, "Quiet": True},
            )
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    f"DeleteObjects under {self.prefix.uri}: {len(errors)} of {len(batch)} keys not deleted; "
                    f"first: s3://{bucket}/{first.get('Key')}: {first.get('Code')} {first.get('Message')}"
                )

    def exists(self, key):
        bucket, object_key = self._split(key)
        try:
            self._call(f"HEAD {self.uri(key)}", "head_object", Bucket=bucket, Key=object_key)
        except FileNotFoundError:
            return False
        return True

    def list_prefix(self, key_prefix):
        base = self.path(key_prefix) if key_prefix else self.prefix.path
        root = self.prefix.path + "/"
        try:
            paths = self.fs.find(base)
        except FileNotFoundError:
            return []
        return sorted(p[len(root):] for p in paths if p.startswith(root))


def _is_transient(e: OSError) -> bool:
    text = str(e)
    return any(s in text for s in ("SlowDown", "503", "500", "InternalError", "RequestTimeout", "409", "ConditionalRequestConflict", "Throttl"))
