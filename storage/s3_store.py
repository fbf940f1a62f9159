"""The store on S3 (or an S3-compatible endpoint: MinIO, Ceph RGW, moto) through s3fs.

Errors are typed here: s3fs's translated ``OSError``s and the botocore/aiohttp errors it
re-raises become ``StorageError`` / ``TransientStorageError`` (``S3Store.retrying`` is the
one retry layer), ``FileNotFoundError`` becomes ``KeyNotFoundError`` and a failed
``If-None-Match`` becomes ``KeyExistsError``.

The s3fs filesystem is created per process (s3fs is not fork-safe): a store that crosses
a fork rebuilds it on first use in the child, and pickling drops it.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import aiohttp
import botocore.exceptions
import fsspec
from refpipe.storage.errors import KeyExistsError, KeyNotFoundError, StorageError, TransientStorageError
from refpipe.storage.store import Store, buffers_of

T = TypeVar("T")
_RETRIES_LOCK = threading.Lock()
_S3_DELETE_BATCH = 1000  # DeleteObjects takes at most 1,000 keys (AWS S3 API reference)


class S3Store(Store):
    """A run prefix on S3 (or an S3-compatible endpoint) through s3fs.

    ``get_into`` is one GET copied into the buffers. ``put`` is one PUT; ``exclusive`` adds
    ``If-None-Match: *`` (a 412 means the key exists; a 409 from a concurrent conditional PUT is
    retried). ``delete`` sends ``DeleteObjects`` in batches of 1,000 and checks every key's
    result, since s3fs's bulk ``rm`` drops per-key errors.
    """

    def __init__(self, prefix, config):
        super().__init__(prefix, config)
        self._fs = None
        self._pid = -1

    @property
    def fs(self):
        """This process's s3fs filesystem (rebuilt after a fork)."""
        if self._fs is None or self._pid != os.getpid():
            self._fs = self._new_fs()
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self):
        return {"prefix": self.prefix, "config": self.config, "_fs": None, "_pid": -1, "retries": 0}

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

    @property
    def fsspec_options(self) -> dict:
        """Options ``fsspec.core.url_to_fs`` needs to reach this run's URIs from another library (DCP's fsspec
        writer): the run's endpoint and region, no instance or listings cache."""
        client_kwargs = {}
        if self.config.s3_endpoint_url:
            client_kwargs["endpoint_url"] = self.config.s3_endpoint_url
        if self.config.s3_region:
            client_kwargs["region_name"] = self.config.s3_region
        return {"skip_instance_cache": True, "use_listings_cache": False, "client_kwargs": client_kwargs}

    def _new_fs(self):
        # One retry layer, ``retrying`` (config.max_retries): s3fs and botocore each retry up to 5x
        # by default, which multiplies into minutes against a dead endpoint.
        fs = fsspec.core.url_to_fs(self.prefix.uri, **self.fsspec_options,
                                   config_kwargs={"retries": {"total_max_attempts": 1, "mode": "standard"}})[0]
        fs.retries = 1
        return fs

    def _split(self, key: str) -> tuple[str, str]:
        bucket, _, object_key = self.path(key).partition("/")
        return bucket, object_key

    def _call(self, what: str, method: str, **kwargs):
        """``call_s3`` with typed errors and retries; ``FileNotFoundError``/``FileExistsError`` pass through."""
        return self.retrying(what, lambda: _typed(what, lambda: self.fs.call_s3(method, **kwargs)))

    def get(self, key, start=None, end=None):
        path = self.path(key)
        if start is not None and end is not None and end <= start:
            if not self.exists(key):  # an empty range needs no GET, but a missing key is still an error
                raise KeyNotFoundError(f"{self.uri(key)} does not exist")
            return b""
        what = f"GET {self.uri(key)}"

        def op():
            try:
                # max_concurrency=1: one GET; s3fs otherwise sends a HEAD first to split large objects
                return _typed(what, lambda: self.fs.cat_file(path, start=start, end=end, max_concurrency=1))
            except FileNotFoundError as e:
                raise KeyNotFoundError(f"{self.uri(key)} does not exist") from e
            except StorageError as e:
                if _error_code(e.__cause__)[0] == "InvalidRange":
                    return b""  # the range starts at or past the end: no bytes, as a file read returns
                raise

        return self.retrying(what, op)

    def get_into(self, key, buffers):
        data = memoryview(self.get(key))  # one GET, then copied: S3 reads are network-bound, not copy-bound
        done = 0
        for buffer in buffers:
            view = memoryview(buffer).cast("B")
            n = min(view.nbytes, len(data) - done)
            view[:n] = data[done : done + n]
            done += n
        return len(data)

    def put(self, key, data, *, exclusive=False):
        bucket, object_key = self._split(key)
        match = {"IfNoneMatch": "*"} if exclusive else {}
        try:
            self._call(f"PUT {self.uri(key)}", "put_object", Bucket=bucket, Key=object_key,
                       Body=b"".join(buffers_of(data)), **match)
        except FileExistsError as e:
            raise KeyExistsError(f"{self.uri(key)} already exists") from e
        except FileNotFoundError as e:  # a PUT only misses when the bucket does
            raise StorageError(f"PUT {self.uri(key)}: bucket {bucket!r} does not exist (create it first)") from e
        except StorageError as e:
            if _error_code(e.__cause__)[0] == "PreconditionFailed":  # a 412 s3fs did not recognise as If-None-Match
                raise KeyExistsError(f"{self.uri(key)} already exists") from e
            raise

    def _delete_keys(self, keys):
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
        key_prefix = key_prefix.rstrip("/")
        base = self.path(key_prefix) if key_prefix else self.prefix.path
        root = self.prefix.path + "/"
        try:
            paths = _typed(f"LIST {self.uri(key_prefix) if key_prefix else self.prefix.uri}",
                           lambda: self.fs.find(base))
        except FileNotFoundError:
            return []
        return sorted(p[len(root):] for p in paths if p.startswith(base + "/"))

    def list_sizes(self, key_prefix):
        key_prefix = key_prefix.rstrip("/")
        base = self.path(key_prefix) if key_prefix else self.prefix.path
        what = f"LIST {self.uri(key_prefix) if key_prefix else self.prefix.uri}"
        try:
            entries = _typed(what, lambda: self.fs.ls(base, detail=True))
        except FileNotFoundError:
            return {}
        sizes = {e["name"]: e["size"] for e in entries if e["type"] == "file"}
        directories = [e["name"] for e in entries if e["type"] == "directory"]

        def find(directory: str) -> dict:
            return _typed(what, lambda: self.fs.find(directory, detail=True))

        # one listing per sub-directory (a shard of payloads/), in parallel: a LIST page holds 1,000 keys
        with ThreadPoolExecutor(max(1, min(self.config.max_concurrent_fetches, len(directories)))) as pool:
            for found in pool.map(find, directories):
                sizes.update((name, info["size"]) for name, info in found.items())
        root = self.prefix.path + "/"
        return dict(sorted((name[len(root):], size) for name, size in sizes.items()
                           if name.startswith(base + "/")))


_TRANSIENT_CODES = {"SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling",
                    "ThrottlingException", "ConditionalRequestConflict", "OperationAborted"}


def _error_code(e: BaseException | None) -> tuple[str, int | None]:
    """``(S3 error code, HTTP status)`` of an s3fs error, read from the botocore error it translated."""
    response = getattr(getattr(e, "__cause__", None), "response", None) or getattr(e, "response", None) or {}
    return str(response.get("Error", {}).get("Code", "")), response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def _typed(what: str, op: Callable[[], T]) -> T:
    """Run an s3fs call; turn its errors into ``StorageError``/``TransientStorageError``.

    ``FileNotFoundError`` and ``FileExistsError`` pass through for the caller to name.
    Connection failures and timeouts (botocore/aiohttp errors that s3fs re-raises
    after its own retries) are transient; so are throttling, 5xx and 409 conflicts.
    """
    try:
        return op()
    except (FileNotFoundError, FileExistsError):
        raise
    except OSError as e:
        code, status = _error_code(e)
        if code in _TRANSIENT_CODES or (status or 0) >= 500:
            raise TransientStorageError(f"{what}: {code or status}: {e}") from e
        raise StorageError(f"{what}: {code or status or type(e).__name__}: {e}") from e
    except (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError, aiohttp.ClientError,
            asyncio.TimeoutError) as e:
        raise TransientStorageError(f"{what}: {type(e).__name__}: {e}") from e
    except botocore.exceptions.BotoCoreError as e:
        raise StorageError(f"{what}: {type(e).__name__}: {e}") from e
