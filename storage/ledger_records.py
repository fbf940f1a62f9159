"""The ledger's on-disk records: event lines of ledger segments and delete records, each with its one reader.

A segment (``ledger/events/<actor>/<session>/<bucket>/<seq>.jsonl``) holds one JSON object per line, each
ending in its ``crc``: crc32c of the rest of the line as compact JSON with sorted keys (``encode_record``;
read back by ``read_segment``). A delete record (``ledger/deletes/<aa>/<bb>/<branch_id>.json``) is one
``DeleteRecord`` document, the exactly-once claim of its chunk (written by ``storage.ledger.Ledger``; read
by ``read_delete_record`` and ``delete_record_of``). A release record
(``ledger/deletes/releases/step_<N:08d>/<actor>.json``) is one ``ReleaseRecord``: one DP rank's claim of its
chunks of one step, written once for the whole batch (``Ledger.release`` on S3; read by ``read_release_record``,
the audit, ``delete_record_of`` given the step). Keys are built by ``storage.layout``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from refpipe.storage.checksum import crc32c
from refpipe.storage.errors import DeleteRecordError, KeyNotFoundError, validation_problems
from refpipe.storage.layout import BATCHES_PREFIX, node_key, parse_release_key, release_prefix, tombstone_key
from refpipe.storage.store import Store

CRC_FIELD = "crc"
"""The field each ledger line ends with: crc32c (8 hex digits) of ``canonical_record`` of the rest of the line."""


def canonical_record(event: Mapping[str, Any]) -> bytes:
    """The bytes a ledger line's crc covers: the event without its crc, as compact JSON with sorted keys."""
    return json.dumps(event, separators=(",", ":"), sort_keys=True).encode()


def encode_record(event: Mapping[str, Any]) -> bytes:
    """One ledger line: ``event`` as compact JSON with its ``crc`` appended, then a line end (the one encoder;
    ``read_segment`` checks it).

    Raises:
        ValueError: ``event`` already holds a ``crc`` field.
    """
    if CRC_FIELD in event:
        raise ValueError(f"ledger event {event.get('event')!r}: the field name {CRC_FIELD!r} is the line's own")
    crc = crc32c(canonical_record(event))
    return json.dumps({**event, CRC_FIELD: f"{crc:08x}"}, separators=(",", ":")).encode() + b"\n"


def _decode_record(line: bytes) -> dict[str, Any]:
    """The event of one complete ledger line, its crc checked and removed.

    Raises:
        ValueError: not JSON (``json.JSONDecodeError``), not an object with an ``event`` name, no crc, or a crc
            that does not match the line's content (the line was changed after the ledger wrote it).
    """
    event = json.loads(line)
    if not isinstance(event, dict) or not isinstance(event.get("event"), str):
        raise ValueError(f"{line[:40]!r}: expected a JSON object with an 'event' name")
    stored = event.pop(CRC_FIELD, None)
    computed = f"{crc32c(canonical_record(event)):08x}"
    if stored != computed:
        raise ValueError(f"crc32c {computed} of the record, the line says {stored!r} (changed after it was "
                         f"written)" if stored is not None else f"{line[:40]!r}: no {CRC_FIELD!r} field")
    return event


def read_segment(data: bytes) -> list[tuple[int, dict[str, Any] | ValueError]]:
    """Every record of a ledger segment, tolerantly: ``(line number, event)`` per non-empty line, or
    ``(line number, ValueError)`` for a line that is not a JSON object with an ``event`` name, whose
    crc32c is missing or does not match (``encode_record``), or a last line without its line end. Never
    raises: the one reader of segments, shared by the audit and sweep, ``refpipe ls`` and the trainer's
    resume. Callers decide what a bad record means (the audit: a violation that blocks the sweep)."""
    lines = data.split(b"\n")
    out: list[tuple[int, dict[str, Any] | ValueError]] = []
    for number, line in enumerate(lines, 1):
        if not line:
            continue
        try:
            if number == len(lines):
                raise ValueError("truncated record (no line end)")
            out.append((number, _decode_record(line)))
        except ValueError as e:  # json.JSONDecodeError included
            out.append((number, e))
    return out


class DeleteRecord(BaseModel):
    """A chunk's delete record (``ledger/deletes/<aa>/<bb>/<branch_id>.json``): the exactly-once claim, written
    once by ``Ledger`` (exclusive put) and read only through ``read_delete_record``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    branch_id: str
    uri: str
    """The deleted chunk's URI as its deleter saw it."""
    holder: str
    """The actor that deleted it."""
    reason: str
    """Why (the deletion path)."""
    t: float
    """Unix time of the claim, seconds."""
    session: str
    """The deleter's ledger session."""
    claim: str
    """Random per claim: a deleter whose put's answer was lost recognises its own record."""


def read_delete_record(data: bytes, uri: str) -> DeleteRecord:
    """The one reader of delete records: the ledger's claims (every holder's delete, the sweep) and the CLI's
    ``deleted by`` lines (``show``, ``verify``, ``inspect``).

    Raises:
        DeleteRecordError: ``data`` is not a ``DeleteRecord`` (names ``uri`` and each field that is wrong).
    """
    try:
        return DeleteRecord.model_validate_json(data)
    except ValidationError as e:
        raise DeleteRecordError(f"delete record {uri} is unreadable: {validation_problems(e)}") from None


class ReleaseRecord(BaseModel):
    """One claim of many chunks, written once (exclusive put) before any of them is deleted and read only through
    ``read_release_record``: a DP rank's release of its chunks of one step on S3
    (``ledger/deletes/releases/step_<N:08d>/<actor>.json``, ``Ledger.release``), or one ``Ledger.delete`` call's
    batch on a filesystem (``storage.layout.batch_key``, ``storage.ledger_batch``; ``step`` None), which lists only
    the chunks whose commit marker it removed once the call is done."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    step: int | None
    holder: str
    """The actor that released the chunks (``trainer_dp<r>``)."""
    reason: str
    t: float
    """Unix time of the claim, seconds."""
    session: str
    claim: str
    """Random per claim: a releaser whose put's answer was lost recognises its own record."""
    branch_ids: list[str]
    """The chunks it claims, sorted."""

    def delete_record(self, store: Store, branch_id: str) -> DeleteRecord:
        """The ``DeleteRecord`` this release is for one of its chunks (the chunk's URI in the run as opened)."""
        return DeleteRecord(branch_id=branch_id, uri=store.uri(node_key(branch_id)), holder=self.holder,
                            reason=self.reason, t=self.t, session=self.session, claim=self.claim)


def read_release_record(data: bytes, uri: str) -> ReleaseRecord:
    """The one reader of release records: ``Ledger.release``, the audit, ``delete_record_of``.

    Raises:
        DeleteRecordError: ``data`` is not a ``ReleaseRecord`` (names ``uri`` and each field that is wrong).
    """
    try:
        return ReleaseRecord.model_validate_json(data)
    except ValidationError as e:
        raise DeleteRecordError(f"release record {uri} is unreadable: {validation_problems(e)}") from None


def delete_record_of(store: Store, branch_id: str,
                     step: int | None = None) -> DeleteRecord | DeleteRecordError | None:
    """The delete record of ``branch_id``'s chunk, the error that makes it unreadable, or None when there is none:
    how a missing chunk is explained (``storage.chunk_read`` after a not-found; the CLI's ``show``, ``verify``,
    ``inspect``). One ``Store.get``; given ``step`` (a step file naming the chunk), also the release records of
    that step (one listing, one ``get`` each: at most one per DP rank); then the delete batch records of a
    filesystem (``storage.ledger_batch``: one listing, one ``get`` each until one lists the chunk).
    """
    key = tombstone_key(branch_id)
    try:
        return read_delete_record(store.get(key), store.uri(key))
    except KeyNotFoundError:
        pass
    except DeleteRecordError as e:
        return e
    releases = [] if step is None else release_record_keys(store, release_prefix(step))
    for release in releases + release_record_keys(store, BATCHES_PREFIX):
        try:
            record = read_release_record(store.get(release), store.uri(release))
        except KeyNotFoundError:
            continue
        except DeleteRecordError as e:
            return e
        if branch_id in record.branch_ids:
            return record.delete_record(store, branch_id)
    return None


def release_record_keys(store: Store, prefix: str) -> list[str]:
    """The keys of the release and delete batch records listed under ``prefix`` (``layout.parse_release_key``), sorted.
    Another key there is none: on a filesystem, the temp file of a record being rewritten (``Store.put``: a temp
    name renamed over the record once written), whose bytes may still be partial; the audit lists it as a stray
    key."""
    return [key for key in store.list_prefix(prefix) if parse_release_key(key)]


def delete_holder(store: Store, branch_id: str) -> tuple[str, str]:
    """``(holder, reason)`` of the delete record of ``branch_id``'s chunk (``delete_record_of``: how a double claim
    names its first deleter); ``("?", why)`` when it is gone or unreadable."""
    record = delete_record_of(store, branch_id)
    if record is None or isinstance(record, DeleteRecordError):
        return "?", f"its delete record is gone or unreadable: {record}"
    return record.holder, record.reason


def batch_claimed(store: Store, branch_ids: set[str]) -> set[str]:
    """The chunks of ``branch_ids`` that a filesystem's delete batch record lists (``storage.ledger_batch``): one
    listing and one ``get`` per batch record of the run, off the hot path (a resume's check of its replayed steps).
    An unreadable record is skipped (the audit reports it)."""
    claimed: set[str] = set()
    for key in release_record_keys(store, BATCHES_PREFIX):
        try:
            claimed.update(branch_ids.intersection(read_release_record(store.get(key), store.uri(key)).branch_ids))
        except (KeyNotFoundError, DeleteRecordError):
            continue
    return claimed


__all__ = ["CRC_FIELD", "DeleteRecord", "ReleaseRecord", "batch_claimed", "canonical_record", "delete_holder",
           "delete_record_of", "encode_record", "read_delete_record", "read_release_record", "read_segment",
           "release_record_keys"]
