"""Whether an episode's refs still name kept chunks: the orchestrator's look at the store when it takes an episode.

A ref whose chunk was discarded, released or swept cannot train (its micro batch would fail on every rank), and
deleting it again would be a double delete; ``Orchestrator.submit`` refuses such an episode (``gone_refs``). The
look is one ``Store.exists`` of a commit marker per chunk, never a chunk's bytes, off the data path (the env
server's submit, not the trainer's fetch).
"""

from __future__ import annotations

from refpipe.pipeline.samples import Episode
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import DeleteRecordError
from refpipe.storage.layout import meta_key
from refpipe.storage.ledger_records import delete_record_of
from refpipe.storage.store import Store


def gone_refs(store: Store, episode: Episode) -> dict[str, str]:
    """Branch id -> why its chunk is gone, for each ref of ``episode`` that no longer names a kept chunk.

    Cost per submitted episode: one ``Store.exists`` of the commit marker (``zarr.json``) of each chunk of each ref
    (one per ref; one per segment of a segmented ref). Only for a chunk found without one: ``max_retries`` more
    looks with backoff when it has no delete record either (a lagging replica or cache), and its delete record
    (``storage.ledger_records.delete_record_of``: one ``get``; on a filesystem also one listing of the delete batch
    records and one ``get`` each until one lists it).

    Args:
        store: the run's store; every ref of ``episode`` was checked to lie in its run (``check_episode``).
        episode: the episode submitted.

    Returns:
        ``{branch_id: "<episode> branch <i>: ref <uri> was deleted by <holder> (<reason>): ..."}``, empty when
        every chunk is kept.
    """
    what = f"episode {episode.episode_id!r} (group {episode.group_id!r}, env {episode.env_name!r})"
    gone: dict[str, str] = {}
    for i, ref in enumerate(branch.ref for branch in episode.branches):
        why = None if ref is None or ref.branch_id in gone else why_gone(store, ref)
        if ref is not None and why is not None:
            gone[ref.branch_id] = (f"{what} branch {i}: ref {ref.uri} {why}: expected a kept chunk (a discarded or "
                                   f"deleted ref cannot train: keep the branch again)")
    return gone


def why_gone(store: Store, ref: PayloadRef) -> str | None:
    """None when every chunk of ``ref`` is kept, else why not (``was deleted by <holder> (<reason>)``, naming the
    segment when it is not the ref's own chunk): one ``Store.exists`` per chunk, more only for a missing one (as
    ``gone_refs``)."""
    for chunk in ref.chunks:
        why = _why_gone(store, chunk)
        if why is not None:
            return why if chunk is ref else f"(its segment {chunk.uri}) {why}"
    return None


def _why_gone(store: Store, chunk: PayloadRef) -> str | None:
    """None when ``chunk``'s commit marker exists, else who deleted it (its delete record) or that it has none."""
    marker = meta_key(chunk.key)
    if store.exists(marker):
        return None
    record = delete_record_of(store, chunk.branch_id)
    if isinstance(record, DeleteRecordError):
        return f"was deleted (its delete record is unreadable: {record})"
    if record is not None:
        return f"was deleted by {record.holder} ({record.reason})"
    if store.appears(marker):
        return None
    return "has no commit marker and no delete record of its own (never kept, or released by a trainer)"
