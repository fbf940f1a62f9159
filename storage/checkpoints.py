"""Which trainer checkpoint of a run is complete (read-only, no torch): the one answer shared by the trainer's
resume (``trainer.resume``), the launcher's (``job.resume``) and the audit and sweep (``pipeline.audit``: the steps
after it are replayed by a resume, so their chunks are never swept).

A checkpoint covering step ``N`` (written by ``trainer.checkpoint.save_checkpoint``) counts only once it has
both DCP's ``.metadata`` and refpipe's commit marker ``commit.json`` (``storage.layout``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from refpipe.storage.layout import (
    CHECKPOINT_MARKER_NAME,
    CHECKPOINTS_PREFIX,
    DCP_METADATA_NAME,
    checkpoint_key,
    parse_checkpoint_key,
)
from refpipe.storage.store import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointInfo:
    """A complete checkpoint: the step it covers and the policy version its weights are."""

    step: int
    policy_version: int
    uri: str


def newest_checkpoint(store: Store) -> CheckpointInfo | None:
    """The newest complete checkpoint (DCP's ``.metadata`` and refpipe's marker), or None.

    One listing of ``checkpoints/`` and one GET of the chosen marker. A newer checkpoint without
    both files (its writer died mid-write) is skipped with a warning.
    """
    files: dict[int, set[str]] = {}
    for key in store.list_prefix(CHECKPOINTS_PREFIX):
        if parsed := parse_checkpoint_key(key):
            files.setdefault(parsed[0], set()).add(parsed[1])
    for step in sorted(files, reverse=True):
        uri = store.uri(checkpoint_key(step))
        if not {DCP_METADATA_NAME, CHECKPOINT_MARKER_NAME} <= files[step]:
            log.warning("checkpoint %s is incomplete (no %s): skipped", uri,
                        " and no ".join(sorted({DCP_METADATA_NAME, CHECKPOINT_MARKER_NAME} - files[step])))
        elif (version := _marker_version(store, step)) is not None:
            return CheckpointInfo(step, version, uri)
    return None


def _marker_version(store: Store, step: int) -> int | None:
    """The policy version in checkpoint ``step``'s commit marker; None (with a warning) for a marker that is
    not ``{"step": <step>, "policy_version": <int >= 0>, ...}``."""
    key = f"{checkpoint_key(step)}/{CHECKPOINT_MARKER_NAME}"
    try:
        marker = json.loads(store.get(key))
        version = marker["policy_version"] if marker["step"] == step else None
        if type(version) is int and version >= 0:
            return version
    except (ValueError, TypeError, KeyError):
        pass
    log.warning("checkpoint %s: its %s is not {\"step\": %d, \"policy_version\": <int >= 0>, ...}: skipped",
                store.uri(checkpoint_key(step)), CHECKPOINT_MARKER_NAME, step)
    return None


__all__ = ["CheckpointInfo", "newest_checkpoint"]
