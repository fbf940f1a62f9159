"""The store on S3 (or an S3-compatible endpoint: MinIO, Ceph RGW, SeaweedFS, moto) through s3fs.

Every failure is classified by ``storage.s3_errors.classify`` (the one place for S3);
``Store.retrying`` is the one retry layer (s3fs's and botocore's own retries are off).

The s3fs filesystem is created per process (s3fs is not fork-safe): a store that crosses
a fork rebuilds it on first use in the child, and pickling drops it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import fsspec

from refpipe.storage.concurrency import bounded_map
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import KeyNotFoundError, StorageError, TransientStorageError
from refpipe.storage.s3_errors import classify, error_code, is_transient_code
from refpipe.storage.store import WRITE_TOKEN, Bytes, Store, byte_view
from refpipe.storage.uri import RunPrefix

T = TypeVar("T")
_S3_DELETE_BATCH = 1000  # DeleteObjects takes at most 1,000 keys (AWS S3 API reference)
_S3_MAX_PARTS = 10_000  # parts of one multipart upload (AWS S3 API reference, "Multipart upload limits")
log = logging.getLogger(__name__)


def _parts(views: list[memoryview], part_size: int) -> list[list[memoryview]]:
    """The body ``views`` (in order) cut into parts of ``part_size`` bytes (the last shorter), grown so that at most
    ``_S3_MAX_PARTS`` parts; each part is the views of its pieces (copied only when it is sent)."""
    part_size = max(part_size, -(-sum(v.nbytes for v in views) // _S3_MAX_PARTS))
    parts: list[list[memoryview]] = [[]]
    room = part_size
    for view in views:
        while view.nbytes:
            piece, view = view[:room], view[room:]
            parts[-1].append(piece)
            room -= piece.nbytes
            if room == 0:
                parts.append([])
                room = part_size
    return [p for p in parts if p]


class S3Store(Store):
    """A run prefix on S3 (or an S3-compatible endpoint) through s3fs.

    ``get_into`` is one GET copied into the buffers. ``put`` is one PUT up to ``s3_part_size_bytes``
    (default 64 MiB) and one multipart upload above it (a single PUT stops at 5 GiB, a checkpoint share
    can exceed it); ``exclusive`` adds ``If-None-Match: *`` (to the PUT or the completion) and the write
    token as user metadata (``x-amz-meta-refpipe-write``): a 412 is followed by one HEAD for it (``Store.put``).
    ``delete`` sends ``DeleteObjects`` in batches of 1,000, checks every key's result (s3fs's bulk ``rm`` drops
    them), re-sends keys with transient errors and falls back to one ``DELETE`` per key when the batch request is
    refused.
    """

    claims_per_release = True

    def __init__(self, prefix: RunPrefix, config: StorageConfig):
        super().__init__(prefix, config)
        self._fs: Any = None
        self._pid = -1

    @property
    def fs(self) -> Any:
        """This process's s3fs filesystem (rebuilt after a fork)."""
        if self._fs is None or self._pid != os.getpid():
            self._fs = self._new_fs()
            self._pid = os.getpid()
        return self._fs

    def __getstate__(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "config": self.config, "_fs": None, "_pid": -1, "retries": 0,
                "idempotent_puts": 0}

    def _new_fs(self) -> Any:
        # One retry layer, ``Store.retrying`` (config.max_retries): s3fs and botocore each retry up to 5x
        # by default, which multiplies into minutes against a dead endpoint and resends writes below us.
        timeout = self.config.s3_timeout_s
        client_kwargs: dict[str, str] = {}
        if self.config.s3_endpoint_url:
            client_kwargs["endpoint_url"] = self.config.s3_endpoint_url
        if self.config.s3_region:
            client_kwargs["region_name"] = self.config.s3_region
        fs = fsspec.core.url_to_fs(self.prefix.uri, skip_instance_cache=True, use_listings_cache=False,
                                   client_kwargs=client_kwargs,
                                   config_kwargs={"retries": {"total_max_attempts": 1, "mode": "standard"},
                                                  "connect_timeout": timeout, "read_timeout": timeout})[0]
        fs.retries = 1
        fs.connect_timeout = fs.read_timeout = timeout
        return fs

    def _split(self, key: str) -> tuple[str, str]:
        bucket, _, object_key = self.path(key).partition("/")
        return bucket, object_key

    def _once(self, what: str, uri: str, op: Callable[[], T]) -> T:
        """Run one s3fs call; raise its failure classified (``s3_errors.classify``)."""
        try:
            return op()
        except Exception as e:
            raise classify(what, uri, e) from e

    def _call(self, what: str, uri: str, method: str, **kwargs: Any) -> Any:
        """One S3 request through ``call_s3``, classified and retried."""
        return self.retrying(what, lambda: self._once(what, uri, lambda: self.fs.call_s3(method, **kwargs)))

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        path, uri = self.path(key), self.uri(key)
        if start is not None and end is not None and end <= start:
            if not self.exists(key):  # an empty range needs no GET, but a missing key is still an error
                raise KeyNotFoundError(f"{uri} does not exist")
            return b""
        what = f"GET {uri}"

        def op() -> bytes:
            try:
                # max_concurrency=1: one GET; s3fs otherwise sends a HEAD first to split large objects
                data: bytes = self._once(what, uri, lambda: self.fs.cat_file(path, start=start, end=end,
                                                                             max_concurrency=1))
                return data
            except StorageError as e:
                if error_code(e.__cause__)[0] == "InvalidRange":
                    return b""  # the range starts at or past the end: no bytes, as a file read returns
                raise

        return self.retrying(what, op)

    def get_into(self, key: str, buffers: Sequence[Bytes], offset: int = 0) -> int:
        data = memoryview(self.get(key, offset or None))  # one GET, then copied: S3 reads are network-bound
        done = 0
        for i, buffer in enumerate(buffers):
            view = byte_view(buffer)
            n = min(view.nbytes, len(data) - done)
            view[:n] = data[done : done + n]
            done += n
        return len(data)

    def _put(self, key: str, buffers: list[Bytes] | tuple[Bytes, ...], token: str | None, durable: bool,
             in_place: bool) -> None:  # a PUT's 200 means stored durably, and a PUT is whole: nothing more to do
        bucket, object_key = self._split(key)
        uri = self.uri(key)
        exclusive: dict[str, str] = {} if token is None else {"IfNoneMatch": "*"}
        metadata: dict[str, dict[str, str]] = {} if token is None else {"Metadata": {WRITE_TOKEN: token}}
        views = [byte_view(b) for b in buffers]
        if sum(v.nbytes for v in views) > self.config.s3_part_size_bytes:
            self._put_multipart(bucket, object_key, uri, views, exclusive, metadata)
            return
        body = b"".join(views)
        self._once(f"PUT {uri}", uri, lambda: self.fs.call_s3("put_object", Bucket=bucket, Key=object_key, Body=body,
                                                              **exclusive, **metadata))

    def _put_multipart(self, bucket: str, object_key: str, uri: str, views: list[memoryview], exclusive: dict[str, str],
                       metadata: dict[str, dict[str, str]]) -> None:
        """One multipart upload of ``views`` (the body in order): parts of ``s3_part_size_bytes`` sent in parallel
        (``max_concurrent_upload_parts``; each copied when sent, so at most that many parts are held besides the body),
        each retried by itself; the object appears whole at the completion, which
        carries the ``If-None-Match`` of an exclusive put. On any failure the upload is aborted (best effort: a
        bucket lifecycle rule ``AbortIncompleteMultipartUpload`` reclaims what an abort could not), and the error
        is raised for ``Store.put`` to retry the whole put; a completion whose answer was lost then meets its own
        object (412) and the write token. Parts leave no object under the run prefix before the completion.
        """
        what = f"PUT {uri} (multipart)"
        upload = self._call(what, uri, "create_multipart_upload", Bucket=bucket, Key=object_key,
                            **metadata)["UploadId"]
        ids = {"Bucket": bucket, "Key": object_key, "UploadId": upload}

        def send(numbered: tuple[int, list[memoryview]]) -> dict[str, Any]:
            number, pieces = numbered
            body = b"".join(pieces)  # botocore takes bytes, not views: one part per thread in memory at a time
            etag = self._call(f"{what} part {number}", uri, "upload_part", PartNumber=number, Body=body, **ids)["ETag"]
            return {"PartNumber": number, "ETag": etag}

        try:
            parts = enumerate(_parts(views, self.config.s3_part_size_bytes), start=1)
            done = bounded_map(send, parts, self.config.max_concurrent_upload_parts)
            self._once(what, uri, lambda: self.fs.call_s3("complete_multipart_upload", MultipartUpload={"Parts": done},
                                                          **ids, **exclusive))
        except BaseException:
            try:
                self._once(f"abort {what}", uri, lambda: self.fs.call_s3("abort_multipart_upload", **ids))
            except Exception as e:  # noqa: BLE001 - the put's own error is the one to raise
                log.warning("%s: upload %s not aborted (%s); a lifecycle rule reclaims its parts", what, upload, e)
            raise

    def _token(self, key: str) -> str | None:
        bucket, object_key = self._split(key)
        uri = self.uri(key)
        try:
            head = self._call(f"HEAD {uri}", uri, "head_object", Bucket=bucket, Key=object_key)
        except FileNotFoundError:
            return None
        token: str | None = (head.get("Metadata") or {}).get(WRITE_TOKEN)
        return token

    def _delete_keys(self, keys: list[str]) -> dict[str, StorageError]:
        failed: dict[str, StorageError] = {}
        for i in range(0, len(keys), _S3_DELETE_BATCH):
            failed.update(self._delete_batch(keys[i : i + _S3_DELETE_BATCH]))
        return failed

    def _delete_batch(self, batch: list[str]) -> dict[str, StorageError]:
        """``DeleteObjects`` of up to 1,000 keys; keys with transient per-key errors are sent again (bounded).

        Returns the keys not deleted with their errors. A refused request (a permanent error for the
        whole batch, e.g. 400 ``MissingContentMD5``) falls back to one ``DELETE`` per key.
        """
        bucket = self._split(batch[0])[0]
        by_object = {self._split(k)[1]: k for k in batch}
        pending, failed = list(batch), dict[str, StorageError]()
        for attempt in range(self.config.max_retries + 1):
            objects = [{"Key": self._split(k)[1]} for k in pending]
            try:
                resp = self._call(f"DeleteObjects under {self.prefix.uri}", self.prefix.uri, "delete_objects",
                                  Bucket=bucket, Delete={"Objects": objects, "Quiet": True})
            except TransientStorageError as e:
                return {**failed, **{k: e for k in pending}}
            except StorageError:
                return {**failed, **self._delete_one_by_one(pending)}
            pending = []
            for error in resp.get("Errors") or []:
                key = by_object.get(error.get("Key"), error.get("Key"))
                code, message = str(error.get("Code")), error.get("Message")
                what = f"DELETE {self.uri(key)}: {code} {message}"
                if is_transient_code(code, None) and attempt < self.config.max_retries:
                    pending.append(key)
                else:
                    failed[key] = (TransientStorageError if is_transient_code(code, None) else StorageError)(what)
            if not pending:
                return failed
            self.backoff(attempt, "SlowDown" in str(resp.get("Errors")))
        return failed

    def _delete_one_by_one(self, keys: list[str]) -> dict[str, StorageError]:
        """One ``DELETE`` per key (classified and retried each); the keys that failed, with their errors."""
        failed: dict[str, StorageError] = {}
        for key in keys:
            bucket, object_key = self._split(key)
            try:
                self._call(f"DELETE {self.uri(key)}", self.uri(key), "delete_object", Bucket=bucket, Key=object_key)
            except FileNotFoundError:
                continue  # already absent
            except StorageError as e:
                failed[key] = e
        return failed

    def exists(self, key: str) -> bool:
        bucket, object_key = self._split(key)
        try:
            self._call(f"HEAD {self.uri(key)}", self.uri(key), "head_object", Bucket=bucket, Key=object_key)
        except FileNotFoundError:
            return False
        return True

    def list_prefix(self, key_prefix: str) -> list[str]:
        key_prefix = key_prefix.rstrip("/")
        base = self.path(key_prefix) if key_prefix else self.prefix.path
        root = self.prefix.path + "/"
        try:
            paths = self._listing(key_prefix, lambda: self.fs.find(base))
        except FileNotFoundError:
            return []
        return sorted(p[len(root):] for p in paths if p.startswith(base + "/"))

    def list_sizes(self, key_prefix: str) -> dict[str, int]:
        key_prefix = key_prefix.rstrip("/")
        base = self.path(key_prefix) if key_prefix else self.prefix.path
        try:
            entries = self._listing(key_prefix, lambda: self.fs.ls(base, detail=True))
        except FileNotFoundError:
            return {}
        sizes = {e["name"]: e["size"] for e in entries if e["type"] == "file"}
        directories = [e["name"] for e in entries if e["type"] == "directory"]

        def find(directory: str) -> dict[str, Any]:
            return self._listing(key_prefix, lambda: self.fs.find(directory, detail=True))

        # one listing per sub-directory (a shard of payloads/), in parallel: a LIST page holds 1,000 keys
        for found in bounded_map(find, directories, self.config.max_concurrent_scan_ops):
            sizes.update((name, info["size"]) for name, info in found.items())
        root = self.prefix.path + "/"
        return dict(sorted((name[len(root):], size) for name, size in sizes.items()
                           if name.startswith(base + "/")))

    def _listing(self, key_prefix: str, op: Callable[[], T]) -> T:
        """One s3fs listing under ``key_prefix``, classified and retried (a missing prefix: ``KeyNotFoundError``)."""
        uri = self.uri(key_prefix) if key_prefix else self.prefix.uri
        return self.retrying(f"LIST {uri}", lambda: self._once(f"LIST {uri}", uri, op))
