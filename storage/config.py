"""Storage config: where the run lives and how chunks are written and fetched."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from refpipe.storage.errors import ConfigError
from refpipe.storage.uri import RunPrefix

CONFIG = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False, use_attribute_docstrings=True)
"""The ``model_config`` of every config model (this one, the field registry's, the orchestrator's, the trainer's
and the main job's sections): immutable, unknown keys refused, and values taken only as their own type, finite.
Lax mode took ``num_steps = true`` as 1, ``step_timeout_s = "300"`` as 300.0, and ``inf`` for a timeout, which
``config.json`` then held as ``null``: every role refused that run, and its resume too. A tuple field (given
as a TOML or JSON array) says ``Field(strict=False)``; its elements stay strict. Each field's docstring is its
``description`` (docs/configuration.md is generated from them: ``refpipe.cli.config_docs``)."""


class StorageConfig(BaseModel):
    """Where a run stores its chunks, step files and ledger, and how it talks to the store."""

    model_config = CONFIG

    root: str = "runs"
    """Run root: a local directory (default ``runs``), ``file:///abs/dir`` or ``s3://bucket/prefix``."""
    run_id: str = "run_0"
    """Run id; the run prefix is ``<root>/<run_id>``."""
    s3_endpoint_url: str | None = None
    """S3 endpoint (MinIO, Ceph RGW, a moto server); None uses AWS or ``AWS_ENDPOINT_URL``."""
    s3_region: str | None = None
    """S3 region; None uses ``AWS_DEFAULT_REGION``/``AWS_REGION`` or the SDK default."""
    compression: Literal["none", "zstd"] = "none"
    """Chunk compression codec (Zarr ``zstd``); ``none`` allows ranged reads of truncated slices."""
    zstd_level: int = Field(default=1, ge=1, le=22)
    """zstd level when ``compression == "zstd"``."""
    max_retries: int = Field(default=4, ge=0, le=20)
    """Retries of a transient store error before giving up."""
    retry_backoff_s: float = Field(default=0.05, gt=0, le=60)
    """First retry backoff in seconds; doubles per retry (S3 SlowDown waits 8x longer)."""
    s3_timeout_s: float = Field(default=15.0, gt=0, le=600)
    """Seconds an S3 connect or read may wait before the request counts as lost (then retried: ``max_retries``)."""
    s3_part_size_bytes: int = Field(default=64 * 2**20, ge=5 * 2**20, le=5 * 2**30)
    """An S3 object above this many bytes (a checkpoint share) is put as a multipart upload of parts this size
    (AWS limits: parts of 5 MiB to 5 GiB; a single PUT stops at 5 GiB)."""
    max_concurrent_fetches: int | None = Field(default=None, ge=1, le=256)
    """Chunks one process (a trainer rank's prefetch) fetches at once, each on its own thread (``fetch_threads``).
    None: on S3 8, which wait on the network; on a directory one per CPU the process may run on, as a read from the
    page cache is CPU work and threads beyond the CPUs only hand the GIL around (docs/benchmarks.md,
    ``trainer_fetch``). Set it on a network filesystem (Lustre, NFS), whose reads wait on its servers."""
    max_concurrent_upload_parts: int = Field(default=8, ge=1, le=256)
    """Parts of one S3 multipart upload (``s3_part_size_bytes`` each) sent at once; each is held in memory
    while it is sent."""
    max_concurrent_deletes: int = Field(default=8, ge=1, le=256)
    """Chunks a trainer rank's release (``trainer.background.BackgroundRelease``) claims and deletes at once."""
    max_concurrent_scan_ops: int = Field(default=8, ge=1, le=256)
    """Reads and listings one process runs at once when it walks the run rather than trains from it: the audit's
    and sweep's scans, the CLI's ``inspect`` commands, and an S3 listing's one LIST per shard directory."""
    heartbeat_interval_s: float = Field(default=5.0, gt=0, le=600)
    """Seconds between rewrites of a ledger session's heartbeat (``storage.liveness``)."""
    heartbeat_timeout_s: float = Field(default=15.0, gt=0, le=3600)
    """A session whose heartbeat did not change for this long (by the reader's clock) is dead; >= 2 intervals."""

    def fetch_threads(self) -> int:
        """Threads a process's fetches run on: ``max_concurrent_fetches``, or its default for this root (S3: 8; a
        directory: the CPUs ``os.sched_getaffinity`` allows this process)."""
        if self.max_concurrent_fetches is not None:
            return self.max_concurrent_fetches
        if RunPrefix.from_root(self.root, self.run_id).scheme == "s3":
            return _S3_FETCH_THREADS
        return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

    @model_validator(mode="after")
    def _timeout_spans_beats(self) -> "StorageConfig":
        if self.heartbeat_timeout_s < 2 * self.heartbeat_interval_s:
            raise ValueError(f"heartbeat_timeout_s={self.heartbeat_timeout_s}: expected >= 2 x heartbeat_interval_s "
                             f"({self.heartbeat_interval_s}), or one late beat reads as death")
        return self

    @model_validator(mode="after")
    def _run_prefix(self) -> "StorageConfig":
        """Refuse at configuration a root or run id that has no run prefix (``RunPrefix.from_root``)."""
        RunPrefix.from_root(self.root, self.run_id)
        return self


_S3_FETCH_THREADS = 8
"""Default fetch threads on S3 (``StorageConfig.fetch_threads``): each waits on a GET's round trip."""


def run_storage(run_uri: str, s3_endpoint_url: str | None = None) -> StorageConfig:
    """Storage config of the run at ``run_uri`` (a local path, ``file://`` or ``s3://`` URI).

    Raises:
        ConfigError: not ``<root>/<run_id>``, an unknown scheme, or a root or run id ``RunPrefix`` refuses.
    """
    uri = run_uri if "://" in run_uri else os.path.abspath(os.path.expanduser(run_uri))
    root, _, run_id = uri.rstrip("/").rpartition("/")
    if not root or root.endswith(":/"):
        raise ConfigError(f"run URI {run_uri!r}: expected <root>/<run_id>")
    RunPrefix.from_root(root, run_id)  # a ConfigError naming the root or run id, before StorageConfig validates
    return StorageConfig(root=root, run_id=run_id, s3_endpoint_url=s3_endpoint_url)
