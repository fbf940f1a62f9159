"""Helpers of the storage tests: raw access that bypasses the store, request and filesystem-op logs, branches.

Imported by the test modules next to it, as ``tests.storage.storage_helpers``.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import boto3
import numpy as np

from refpipe.pipeline.fields import FieldsConfig, Ragged
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.store import Store
from refpipe.storage.uri import RunPrefix


class RawLocal:
    """Direct file access under a local run root, bypassing the store."""

    def __init__(self, config: StorageConfig):
        self.prefix = RunPrefix.from_root(config.root, config.run_id)
        self.root = os.path.dirname(self.prefix.path)

    def _path(self, key: str) -> str:
        return os.path.join(self.prefix.path, key)

    def put(self, key: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(self._path(key)), exist_ok=True)
        with open(self._path(key), "wb") as f:
            f.write(data)

    def get(self, key: str) -> bytes:
        with open(self._path(key), "rb") as f:
            return f.read()

    def remove(self, key: str) -> None:
        os.remove(self._path(key))

    def objects(self) -> list[str]:
        """Every file under the run *root* (all runs), relative to the root; directories not listed."""
        out = []
        for directory, _, files in os.walk(self.root):
            out += [os.path.relpath(os.path.join(directory, f), self.root) for f in files]
        return sorted(out)

    def keys(self) -> list[str]:
        """Every file under the run prefix, as keys."""
        run = self.prefix.run_id + "/"
        return [o[len(run):] for o in self.objects() if o.startswith(run)]


class RawS3:
    """Direct object access under an S3 run root (a boto3 client of its own), bypassing the store.

    ``scope``: the test's part of the bucket: the whole bucket (moto: a bucket per test) or the
    prefix above the run root (SeaweedFS: ``<test prefix>/`` in the session's bucket).
    """

    def __init__(self, config: StorageConfig):
        self.prefix = RunPrefix.from_root(config.root, config.run_id)
        self.bucket, _, run_path = self.prefix.path.partition("/")
        self.root = run_path.rpartition("/")[0]
        scope = self.root.rpartition("/")[0]
        self.scope = scope + "/" if scope else ""
        self.client = boto3.client("s3", endpoint_url=config.s3_endpoint_url, region_name="us-east-1")

    def _key(self, key: str) -> str:
        return f"{self.root}/{self.prefix.run_id}/{key}"

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def get(self, key: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()

    def remove(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def objects(self) -> list[str]:
        """Every object in the test's scope of the bucket (all runs, all prefixes), as full object keys."""
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self.scope):
            out += [o["Key"] for o in page.get("Contents", [])]
        return sorted(out)

    def keys(self) -> list[str]:
        """Every object under the run prefix, as keys."""
        run = f"{self.root}/{self.prefix.run_id}/"
        return [o[len(run):] for o in self.objects() if o.startswith(run)]


@dataclass
class Backend:
    """A store and a raw view of the same run."""

    name: str
    config: StorageConfig
    store: Store
    raw: RawLocal | RawS3


def make_backend(name: str, config: StorageConfig) -> Backend:
    raw = RawS3(config) if name == "s3" else RawLocal(config)
    return Backend(name, config, open_store(config), raw)


def s3_kind(operation_name: str) -> str:
    """Request kind of an S3 operation: PUT, GET, HEAD, DELETE, LIST or the operation name."""
    kinds = {"PutObject": "PUT", "GetObject": "GET", "HeadObject": "HEAD", "DeleteObjects": "DELETE",
             "DeleteObject": "DELETE", "ListObjectsV2": "LIST", "ListObjects": "LIST"}
    return kinds.get(operation_name, operation_name)


class S3Requests:
    """Every HTTP request a store's s3fs client sends (botocore ``request-created`` events, one per attempt)."""

    def __init__(self, store: Store):
        self.log: list[tuple[str, str | None]] = []
        store.fs.s3.meta.events.register("request-created.s3", self._on_request)

    def _on_request(self, request, operation_name, **_):
        self.log.append((s3_kind(operation_name), request.headers.get("Range")))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.log]

    def clear(self) -> None:
        self.log.clear()


_FS_EVENTS = {"open", "os.mkdir", "os.link", "os.rename", "os.remove", "os.rmdir", "os.listdir", "os.scandir"}
_TWO_PATHS = {"os.link", "os.rename"}
_recorders: list["FsOps"] = []


def _audit(event: str, args: tuple) -> None:
    if _recorders and event in _FS_EVENTS:
        paths = [os.fsdecode(p) if isinstance(p, bytes) else str(p) for p in args[: 2 if event in _TWO_PATHS else 1]]
        for rec in _recorders:
            if any(p.startswith(rec.under) or not p.startswith("/") for p in paths):
                rec.ops.append((event, paths[-1]))


sys.addaudithook(_audit)


class FsOps:
    """Filesystem calls this process makes under a directory while the context is active (CPython audit events).

    Records ``open`` (builtins and ``os.open``), ``os.mkdir``, ``os.link``, ``os.rename``/``os.replace``,
    ``os.remove``, ``os.rmdir``, ``os.listdir`` and ``os.scandir``, in order, as ``(event, path)`` (the destination
    for links and renames): absolute paths under ``under``, and relative names as given (the local store works
    relative to directory fds from the run prefix down; the audit events do not carry the fd).
    """

    def __init__(self, under: str):
        self.under = under
        self.ops: list[tuple[str, str]] = []

    def __enter__(self) -> "FsOps":
        _recorders.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _recorders.remove(self)

    def events(self) -> list[str]:
        return [event for event, _ in self.ops]


FIELDS_CFG = FieldsConfig(num_layers=3, top_k=2, num_experts=8, logprobs_k=4, support_width=5, sampling_mask=True)
"""Small shapes for tests: routing [T, 3, 2] over 8 experts, top-4 head, support width 5, sampling mask."""


def make_fields(seed: int, num_prompt_tokens: int, num_completion_tokens: int, cfg: FieldsConfig = FIELDS_CFG,
                routing_dtype=np.uint8) -> dict[str, np.ndarray | Ragged]:
    """Random valid fields of one branch: -inf logprobs, -1 support padding, empty and non-empty mask rows."""
    rng = np.random.default_rng(seed)
    tokens, c = num_prompt_tokens + num_completion_tokens, num_completion_tokens
    base = rng.integers(0, cfg.num_experts, (tokens, cfg.num_layers, 1))
    routing = ((base + np.arange(cfg.top_k)) % cfg.num_experts).astype(routing_dtype)  # distinct per token
    logprobs = -rng.exponential(2.0, (c, cfg.logprobs_k)).astype(np.float32)
    logprobs[:, -1] = -np.inf
    support = rng.integers(0, 50_000, (c, cfg.support_width)).astype(np.int32)
    support[:, cfg.support_width // 2:] = -1
    counts = rng.integers(0, 4, c).astype(np.int32)
    return {
        "routed_experts": routing,
        "topk_ids": rng.integers(0, 150_000, (c, cfg.logprobs_k)).astype(np.int32),
        "topk_logprobs": logprobs,
        "sample_support": support,
        "sampling_mask": Ragged(rng.integers(0, 150_000, int(counts.sum())).astype(np.int32), counts),
    }


def stored_cut(fields: dict, num_prompt_tokens: int, num_tokens: int) -> dict[str, np.ndarray]:
    """The stored arrays of ``fields`` cut to the first ``num_tokens`` tokens (what a fetch must return)."""
    c = max(0, num_tokens - num_prompt_tokens)
    out = {}
    for name, value in fields.items():
        if isinstance(value, Ragged):
            out[f"{name}.counts"] = value.counts[:c]
            out[f"{name}.ids"] = value.ids[: int(value.counts[:c].sum())]
        else:
            out[name] = value[:num_tokens] if name == "routed_experts" else value[:c]
    return out


def assert_same_bytes(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> None:
    """Same names in the same order, and every array has the same dtype (little-endian), shape and bytes."""
    assert list(got) == list(expected)
    for name, exp in expected.items():
        a = got[name]
        assert a.dtype == exp.dtype.newbyteorder("<"), name
        assert a.shape == exp.shape, name
        assert a.tobytes() == exp.astype(exp.dtype.newbyteorder("<")).tobytes(), name

