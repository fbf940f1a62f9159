"""Suspended open branches: the record that lets a branch cut at a step boundary be continued by a later process.

``OpenBranch.suspend`` writes the committed segments of an open branch as ``ledger/open/<aa>/<bb>/<branch_id>.json``
(a ``SuspendedBranch``) and a flushed ``suspend`` event naming it; ``Keeper.resume_branch`` (any env-server
process, after a restart too) reads it back, claims it (``claim_resume``) and continues appending. Closing or
discarding the branch removes the record. Each resume of a record takes the claim ``<branch_id>.claim.<n>`` next to it
(``n``: ``SuspendedBranch.resumes``) by an exclusive put, so of any number of processes resuming one record exactly
one continues it; the others get an ``OpenBranchError`` naming who resumed it, before writing or deleting anything.
A claim of a dead session (a resumer that crashed) is passed over to the next number; resume number ``n`` names its
segments ``<branch_id>.r<n>.<index>``, so no resume reuses an id a crashed one may have written (its segments are
leaked: the audit reports them, the sweep deletes them once).
Claims stay (a few bytes each) so a process holding a stale record is refused too. While the record exists the
audit counts its segments as held by ``open branch <id> (suspended)``; in a finished or abandoned run they are leaked
and the sweep deletes them.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Mapping, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from refpipe.storage.chunk_ref import ArraySpec, PayloadRef
from refpipe.storage.errors import KeyExistsError, KeyNotFoundError, OpenBranchError, validation_problems
from refpipe.storage.layout import check_id
from refpipe.storage.liveness import live_sessions
from refpipe.storage.store import Store

OPEN_PREFIX = "ledger/open"


class WaitingRows(BaseModel):
    """The rows of a suspended branch's last appended token, which wait for the row of an ``all_but_last`` field
    (it comes with the next turn's prefill): every other field's rows of that token, kept in the record."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_tokens: int
    """Tokens after the segments whose rows are here (the last appended token: 1)."""
    arrays: dict[str, ArraySpec]
    """Every stored array of the branch (dtype, shape of its rows here, domain), in payload order."""
    data: dict[str, str]
    """Base64 of each array's rows here (C order, little-endian)."""

    @classmethod
    def of(cls, num_tokens: int, specs: Mapping[str, ArraySpec], rows: Mapping[str, Sequence[np.ndarray]]) \
            -> "WaitingRows":
        """The rows ``rows`` (name -> parts, in token order) of the last ``num_tokens`` appended tokens."""
        whole = {n: np.concatenate([np.empty((0, *s.shape[1:]), s.dtype), *rows.get(n, ())]) for n, s in specs.items()}
        return cls(num_tokens=num_tokens, arrays={n: s._replace(shape=whole[n].shape) for n, s in specs.items()},
                   data={n: base64.b64encode(a.tobytes()).decode() for n, a in whole.items()})

    def rows(self) -> dict[str, np.ndarray]:
        """Each array's rows (``arrays`` gives dtype and shape)."""
        return {n: np.frombuffer(base64.b64decode(self.data[n]), s.dtype).reshape(s.shape)
                for n, s in self.arrays.items()}

    @model_validator(mode="after")
    def _sizes(self) -> "WaitingRows":
        for n, s in self.arrays.items():
            nbytes = np.dtype(s.dtype).itemsize * int(np.prod(s.shape))
            if n not in self.data or len(base64.b64decode(self.data[n])) != nbytes:
                raise ValueError(f"waiting rows of {n}: expected {nbytes} bytes of {s.dtype} {list(s.shape)}")
        return self


class SuspendedBranch(BaseModel):
    """An open branch's state: its id, prompt tokens, the refs of its segments so far (token order) and the rows of
    its last appended token that wait for an ``all_but_last`` field's row (``waiting``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    branch_id: str
    num_prompt_tokens: int
    segments: tuple[PayloadRef, ...]
    actor: str
    """The env-server worker that suspended it."""
    resumes: int = 0
    """Resumes of the branch before this record (the next resumer takes claim number ``resumes``)."""
    waiting: WaitingRows | None = None
    """The last appended token's rows when an ``all_but_last`` field's row of it had not arrived; None: none."""

    @property
    def num_tokens(self) -> int:
        """Tokens appended: those the segments cover and the waiting ones (the next append starts here)."""
        return sum(s.num_tokens for s in self.segments) + (self.waiting.num_tokens if self.waiting else 0)


def open_key(branch_id: str) -> str:
    """Key of a suspended branch's record: ``ledger/open/<aa>/<bb>/<branch_id>.json``."""
    check_id(branch_id, "branch_id")
    digest = hashlib.blake2b(branch_id.encode(), digest_size=2).hexdigest()
    return f"{OPEN_PREFIX}/{digest[:2]}/{digest[2:]}/{branch_id}.json"


def claim_key(branch_id: str, resume: int) -> str:
    """Key of the claim of resume number ``resume`` of a suspended branch: next to its record, not ending ``.json``."""
    return f"{open_key(branch_id).removesuffix('.json')}.claim.{resume}"


def opened_key(branch_id: str) -> str:
    """Key of the claim of an open branch's id, taken when it is opened: ``<record key without .json>.opened``."""
    return f"{open_key(branch_id).removesuffix('.json')}.opened"


def claim_branch_id(store: Store, branch_id: str, actor: str, session: str) -> None:
    """Claim ``branch_id`` for a branch opened by the ledger session ``session`` of ``actor``: one exclusive put of
    ``opened_key`` per opened branch (none per append), kept for the run, so no later open reuses the id.

    Raises:
        OpenBranchError: the id was opened before in this run (names the env worker and ledger session that did).
        StorageError: the put failed (after the store's retries).
    """
    key = opened_key(branch_id)
    try:
        store.put(key, json.dumps({"actor": actor, "session": session}).encode(), exclusive=True)
    except KeyExistsError:
        raise OpenBranchError(f"branch {branch_id}: already opened in run {store.prefix.uri} by {_who(store, key)} "
                              f"(claim {store.uri(key)}): branch ids are unique per run; open the branch under a new "
                              f"id") from None


def why_no_record(store: Store, branch_id: str) -> str:
    """Why a branch has no suspended record, for an error: its last resumer closed or discarded it (the holder of its
    highest resume claim), else who opened it and never suspended it; a sweep may have removed the record too.
    Reads the claims one by one (an error path: one read per resume)."""
    last, resume = None, 0
    while store.exists(claim_key(branch_id, resume)):
        last, resume = claim_key(branch_id, resume), resume + 1
    if last is not None:
        return f"already closed or discarded by {_who(store, last)}, its last resumer (claim {store.uri(last)}), or " \
               f"its record removed by a sweep"
    if store.exists(opened_key(branch_id)):
        return f"opened by {_who(store, opened_key(branch_id))} and never suspended, or its record removed by a sweep"
    return "never opened in this run"


def _who(store: Store, key: str) -> str:
    """``env worker <actor> (ledger session <session>)`` of the claim at ``key``."""
    winner = _claimer(store, key)
    return "another process (its claim is unreadable)" if winner is None else \
        f"env worker {winner[0]} (ledger session {winner[1]})"


def claim_resume(store: Store, branch_id: str, actor: str, session: str) -> SuspendedBranch | None:
    """Claim the next resume of the suspended branch ``branch_id`` for the ledger session ``session`` of ``actor``:
    the record as it stands once claimed, its ``resumes`` set to the claim's number, or None when there is none
    (never suspended, closed or discarded). A claim whose session is dead (``storage.liveness``: a resumer that
    crashed) is passed over: the next number is claimed, so a resumer's segment ids never repeat an earlier one's.

    Raises:
        OpenBranchError: a live session (or an unreadable claim) holds the resume (names the branch, the actor and
            session that resumed it), or the record is unreadable.
    """
    record = read_suspended(store, branch_id)
    if record is None:
        return None
    resume, body = record.resumes, json.dumps({"actor": actor, "session": session}).encode()
    while True:
        key = claim_key(branch_id, resume)
        try:
            store.put(key, body, exclusive=True)
            break
        except KeyExistsError:
            winner = _claimer(store, key)
            if winner is None or winner in live_sessions(store, [winner]):
                raise OpenBranchError(f"branch {branch_id}: already resumed by {_who(store, key)} (claim "
                                      f"{store.uri(key)}): a suspended branch is continued or discarded once") from None
            resume += 1
    record = read_suspended(store, branch_id)  # as a dead claimer left it (suspended again, or closed)
    return None if record is None else record.model_copy(update={"resumes": resume})


def _claimer(store: Store, key: str) -> tuple[str, str] | None:
    """``(actor, session)`` of the claim at ``key``; None when it is unreadable."""
    try:
        winner = json.loads(store.get(key))
        return str(winner["actor"]), str(winner["session"])
    except (KeyNotFoundError, ValueError, KeyError, TypeError):
        return None


def read_suspended(store: Store, branch_id: str) -> SuspendedBranch | None:
    """The record of a suspended branch, or None when there is none (never suspended, closed or discarded).

    Raises:
        OpenBranchError: the record is not a ``SuspendedBranch`` of ``branch_id`` (names the key and what is wrong).
    """
    key = open_key(branch_id)
    try:
        data = store.get(key)
    except KeyNotFoundError:
        return None
    try:
        record = SuspendedBranch.model_validate_json(data)
    except ValidationError as e:
        raise OpenBranchError(f"suspended branch record {store.uri(key)} is unreadable: {validation_problems(e)}") \
            from None
    if record.branch_id != branch_id:
        raise OpenBranchError(f"suspended branch record {store.uri(key)} names branch {record.branch_id!r}: "
                              f"expected {branch_id!r}")
    return record


__all__ = ["OPEN_PREFIX", "SuspendedBranch", "WaitingRows", "claim_branch_id", "claim_key", "claim_resume",
           "open_key", "opened_key", "read_suspended", "why_no_record"]
