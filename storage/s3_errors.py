"""The one place an S3 error becomes a refpipe error (``S3Store`` calls ``classify`` for every failure).

Kinds (docs/DESIGN.md, "Store errors"):

- **transient**: the connection failed or timed out (botocore ``ConnectionError``/``HTTPClientError``,
  which include ``ReadTimeoutError``, ``ConnectTimeoutError``, ``ConnectionClosedError`` and a short
  body's ``ResponseStreamingError``; aiohttp errors; ``asyncio.TimeoutError``), a body arrived that does not match
  its transport checksum (``FlexibleChecksumError``: cut or damaged on the way; read again), the server throttled
  (``SlowDown``, 503), failed (5xx, ``InternalError``) or saw a conflicting conditional write (409).
  ``TransientStorageError``: retried by ``Store.retrying``. For a write the request may have been
  applied ("maybe applied"): an exclusive put resolves that by its write token (``S3Store.put``).
- **not found**: ``NoSuchKey`` / 404 -> ``KeyNotFoundError``;
  ``NoSuchBucket`` -> ``StorageError`` naming the bucket.
- **exists**: ``PreconditionFailed`` / 412 of ``If-None-Match: *`` -> ``KeyExistsError``.
- **permanent**: everything else (``AccessDenied``, ``InvalidArgument``, a refused ``DeleteObjects``
  such as 400 ``MissingContentMD5``) -> ``StorageError`` naming the key and the server's code.

The network errors are tested before ``OSError``: botocore's timeouts are ``OSError``s too
(``requests``' exceptions derive from ``IOError``).
"""

from __future__ import annotations

import asyncio

import aiohttp
import botocore.exceptions

from refpipe.storage.errors import KeyExistsError, KeyNotFoundError, StorageError, TransientStorageError

TRANSIENT_CODES = frozenset({
    "SlowDown", "InternalError", "ServiceUnavailable", "RequestTimeout", "Throttling", "ThrottlingException",
    "ConditionalRequestConflict", "OperationAborted", "RequestTimeTooSkewed"})
"""S3 error codes worth retrying (also: any HTTP status >= 500)."""
_NETWORK = (botocore.exceptions.ConnectionError, botocore.exceptions.HTTPClientError, aiohttp.ClientError,
            asyncio.TimeoutError, TimeoutError, ConnectionError)


def error_code(e: BaseException | None) -> tuple[str, int | None]:
    """``(S3 error code, HTTP status)`` of a botocore error or an s3fs error that translated one."""
    response = getattr(e, "response", None) or getattr(getattr(e, "__cause__", None), "response", None) or {}
    return str(response.get("Error", {}).get("Code", "")), response.get("ResponseMetadata", {}).get("HTTPStatusCode")


def is_transient_code(code: str, status: int | None) -> bool:
    """Whether an S3 error code (or its HTTP status) is worth retrying."""
    return code in TRANSIENT_CODES or (status or 0) >= 500


def classify(what: str, uri: str, e: BaseException) -> StorageError:
    """The refpipe error for ``e``, raised by an s3fs/botocore call on ``uri`` (``what``: the request, for messages).

    Returns (never raises) one of ``TransientStorageError``, ``KeyNotFoundError``, ``KeyExistsError``
    or ``StorageError``; the caller raises it ``from e``. A ``StorageError`` passes through unchanged.
    """
    if isinstance(e, StorageError):
        return e
    if isinstance(e, (*_NETWORK, botocore.exceptions.FlexibleChecksumError)):
        return TransientStorageError(f"{what}: {type(e).__name__}: {e}")
    code, status = error_code(e)
    if code == "NoSuchBucket":
        bucket = uri.removeprefix("s3://").partition("/")[0]
        return StorageError(f"{what}: bucket {bucket!r} does not exist (create it first)")
    if code in ("NoSuchKey", "404") or (isinstance(e, FileNotFoundError) and not code):
        return KeyNotFoundError(f"{uri} does not exist")
    if code == "PreconditionFailed" or isinstance(e, FileExistsError):
        return KeyExistsError(f"{uri} already exists")
    if is_transient_code(code, status):
        return TransientStorageError(f"{what}: {code or status}: {e}")
    return StorageError(f"{what}: {code or status or type(e).__name__}: {e}")
