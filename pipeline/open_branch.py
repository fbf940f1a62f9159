"""Open branches: keep a multi-turn branch turn by turn, each append writing only the turn's new rows.

An env-server worker opens a branch (``Keeper.open_branch``), appends each turn's rows as they arrive
(``OpenBranch.append``: rows of tokens ``[start, end)`` of every field, checked against the declarations as
``Keeper.keep`` checks a whole branch) and closes it (``OpenBranch.close``), which returns one ``PayloadRef``
listing the branch's segments (``PayloadRef.segments``). Appended rows wait in a buffer until it holds
``COALESCE_BYTES``, then go out as one segment: an ordinary chunk's bytes (same codec, its own block crcs and
crc32c) with the id ``<branch_id>.<index>`` (written after resume number ``n``: ``<branch_id>.r<n>.<index>``). On a
filesystem the segments of one writer life (an open or a resume, up to its close or suspend) are appended to one
object, named by the life's first segment id and kept in the ledger once (``pipeline.segment_write``); on S3 each is
a chunk of its own. So a worker holds at most one turn plus the buffer per open branch, and writes each row once.

Routing rows as engines return them (``FieldsConfig.routing_rows = "all_but_last"``, or a field declared
``rows = "all_but_last"``): an append's rows of such a field are those of positions ``[start - 1, end - 1)``
(the first append: ``[0, end - 1)``), since the row of a turn's last token comes with the next turn's prefill.
The buffer keeps the last appended token's rows back until that row arrives; ``close`` fills the branch's last
row by the field's padding rule, as ``keep`` does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

from refpipe.pipeline.field_decl import padding_rows
from refpipe.pipeline.fields import FieldsConfig, validate_branch
from refpipe.pipeline.segment_write import LifeWriter
from refpipe.storage.chunk_ref import (
    ArraySpec,
    PayloadRef,
    domain_rows,
    object_refs,
    segment_tokens,
    segments_checksum,
)
from refpipe.storage.delete_result import DeleteResult
from refpipe.storage.errors import FieldError, OpenBranchError
from refpipe.storage.layout import check_id, node_key
from refpipe.storage.ledger_holds import released_holders
from refpipe.storage.ledger_open import SuspendedBranch, WaitingRows, claim_resume, open_key, why_no_record

if TYPE_CHECKING:
    from refpipe.pipeline.keep import Keeper

COALESCE_BYTES = 1 << 16
"""Bytes of appended rows a branch buffers before writing them as one segment (smaller turns are coalesced)."""
MAX_SEGMENTS = 100_000
"""Segments one branch may have (its segment ids ``<branch_id>.<index>``, once resumed
``<branch_id>.r<resume>.<index>``, must stay valid ids)."""


class OpenBranch:
    """A branch kept turn by turn by one env-server worker; made by ``Keeper.open_branch``, used in that process.

    Attributes:
        branch_id: the branch's id (its segments are ``<branch_id>.<index>``).
        num_prompt_tokens: the branch's prompt tokens (its first tokens; every later token is a completion token).
        num_tokens: tokens appended so far (the next append starts here).
        segments: refs of the segments written so far, in token order.
    """

    def __init__(self, keeper: "Keeper", branch_id: str, num_prompt_tokens: int, prefix: PayloadRef | None = None):
        check_id(f"{branch_id}.{MAX_SEGMENTS}", f"branch_id {branch_id!r} with a segment index")
        if isinstance(num_prompt_tokens, bool) or not isinstance(num_prompt_tokens, (int, np.integer)) \
                or num_prompt_tokens < 0:
            raise FieldError(f"open branch {branch_id}: num_prompt_tokens={num_prompt_tokens!r}: expected an "
                             f"integer >= 0")
        self.keeper, self.branch_id, self.num_prompt_tokens = keeper, branch_id, int(num_prompt_tokens)
        self.segments: list[PayloadRef] = [] if prefix is None else [_checked_prefix(keeper, prefix, branch_id,
                                                                                     self.num_prompt_tokens)]
        self.num_tokens = 0 if prefix is None else prefix.num_tokens
        self._ended = ""
        """How this object ended: ``"closed"``, ``"discarded"`` or ``"suspended"``; empty while it is open."""
        self._life = LifeWriter(keeper)
        self._closing = False
        """``close`` wrote the last rows (with an ``all_but_last`` field's padding) but not the life's end."""
        self._start = self.num_tokens
        """First token of the buffered rows."""
        self._short = True
        """The next append gives one row fewer of ``all_but_last`` fields (rows are complete up to its start)."""
        self._suspended = False
        """A record of this branch exists (``suspend``; ``resume``)."""
        self._resumes = 0
        """Resumes of this branch so far, this one included (``SuspendedBranch.resumes`` of its next record)."""
        self._pending: dict[str, list[np.ndarray]] = {}
        self._specs: dict[str, ArraySpec] = {}
        registry = keeper.fields.registry()
        self._lagging = {name for name, d in registry.items() if d.rows == "all_but_last"}
        self._all_rows = _all_rows_config(keeper.fields)

    @property
    def closed(self) -> bool:
        """Whether the branch was closed, discarded or suspended (no append, close or suspend follows)."""
        return bool(self._ended)

    def __repr__(self) -> str:
        state = self._ended or "open"
        return f"OpenBranch({self.branch_id!r}, {state}, {self.num_tokens} tokens, {len(self.segments)} segments)"

    def append(self, start: int, end: int, fields: Mapping[str, object]) -> None:
        """Append the rows of tokens ``[start, end)``: ``fields`` as ``Branch.fields`` takes them, with the rows of
        those tokens only (the module doc says which rows an ``all_but_last`` field gives). Writes a segment when
        the buffer holds ``COALESCE_BYTES``.

        Raises:
            OpenBranchError: the branch was closed, discarded or suspended (says which), or ``start`` is not
                ``num_tokens`` or ``end <= start``, or either is not an integer (``int`` or ``numpy.integer``)
                (nothing is buffered).
            LedgerClosedError: the keeper's ledger session is closed (nothing is buffered).
            FieldError: the rows break their declarations, or a field's stored arrays differ from the first
                append's (nothing is buffered; the branch stays open at ``num_tokens``).
            KeyExistsError: a segment id was already kept in this run.
        """
        what = f"branch {self.branch_id} (env worker {self.keeper.ledger.actor}) rows [{start}, {end})"
        self._check_open(f"append rows [{start}, {end})")
        start, end = _position(start, "start", what), _position(end, "end", what)
        if start != self.num_tokens or not end > start:
            raise OpenBranchError(f"{what}: expected rows [{self.num_tokens}, end > {self.num_tokens}) (appends "
                                  f"follow each other: {self.num_tokens} tokens appended so far)")
        prompt, completion = segment_tokens(self.num_prompt_tokens, start, end)
        cfg = self.keeper.fields if self._short else self._all_rows
        try:
            arrays, specs = validate_branch(fields, cfg, num_prompt_tokens=prompt, num_completion_tokens=completion,
                                            what=what)
        except FieldError as e:
            if self._short or not self._lagging:
                raise
            raise FieldError(f"{e}; in an open branch, an append after the first gives an all_but_last field's rows "
                             f"of positions [{start - 1}, {end - 1}): {end - start} rows") from None
        self._check_specs(specs, what)
        for name, a in arrays.items():
            self._pending.setdefault(name, []).append(a[:-1] if self._short and name in self._lagging else a)
        self.num_tokens, self._short = end, False
        if sum(a.nbytes for parts in self._pending.values() for a in parts) >= COALESCE_BYTES:
            self._flush(end - 1 if self._lagging & specs.keys() else end)

    def close(self) -> PayloadRef:
        """Fill an ``all_but_last`` field's last row by its padding rule, write the buffered rows and return the
        branch's ref (``PayloadRef.segments``), to hand on like ``Keeper.keep``'s.

        Raises:
            OpenBranchError: the branch is closed, or nothing was appended.
            KeyExistsError, StorageError: writing the last segment, or the commit marker of its writer life's
                object (``LifeWriter.end``), failed; the branch stays open (close again, or discard it).
        """
        self._check_open("close")
        if not self._closing:
            self._write_last()
        self._life.end()
        self._end("closed")
        ref = self._ref()
        self._unsuspend()
        return ref

    def _write_last(self) -> None:
        """``close``'s rows: the buffered ones and an ``all_but_last`` field's padding row."""
        if self._short:
            raise OpenBranchError(f"branch {self.branch_id}: close with no rows appended: expected at least one "
                                  f"append (keep an empty branch with Keeper.keep)")
        registry, dims = self.keeper.fields.registry(), self.keeper.fields.dims
        appended = {name: list(parts) for name, parts in self._pending.items()}
        for name in self._lagging & appended.keys():
            decl, dtype = registry[name], np.dtype(self._specs[name].dtype)
            last = padding_rows(decl, 1, self._specs[name].shape[1:], dims, dtype, first_row=self.num_tokens - 1)
            appended[name].append(np.asarray(last, dtype))
        pending, self._pending = self._pending, appended
        try:
            self._flush(self.num_tokens)
        except Exception:
            self._pending = pending  # without the padding rows: a close again adds them once
            raise
        self._closing = True

    def discard(self, *, reason: str = "open branch discarded by env server") -> DeleteResult:
        """Drop the buffered rows and delete the segments written so far (exactly once, via the ledger; a shared
        prefix is released by this branch); the branch is closed. Raises as ``Ledger.delete``, and StorageError
        when the life's object cannot be committed first (``LifeWriter.end``; the branch stays open); an
        OpenBranchError once the branch was closed, discarded or suspended (a suspended branch is discarded by the
        process that resumes it: ``Keeper.resume_branch``, then ``discard``)."""
        self._check_open("discard")
        self._life.end()  # only a committed object is claimed and deleted
        self._end("discarded")
        self._pending = {}
        result = self.keeper.ledger.release_chunks([(s, self.branch_id) for s in object_refs(self.segments)],
                                                   reason=reason)
        self._unsuspend()
        return result

    def suspend(self) -> SuspendedBranch:
        """Cut the branch at a step boundary: write its buffered rows, record its segments durably
        (``storage.ledger_open``: a record under the run and a flushed ``suspend`` event) and close this object.
        Any env-server process continues it with ``Keeper.resume_branch`` from ``SuspendedBranch.num_tokens`` (every
        appended token), as if it had not been cut. With ``all_but_last`` fields the last appended token's row has
        not arrived: its other rows are kept in the record (``SuspendedBranch.waiting``) and its row comes with the
        resumed branch's next append.

        Raises:
            OpenBranchError: the branch is closed.
            StorageError: a put failed (after the store's retries); the branch stays open.
        """
        self._check_open("suspend")
        if not self._short:
            self._flush(self.num_tokens - 1 if self._lagging & self._specs.keys() else self.num_tokens)
        waiting = WaitingRows.of(self.num_tokens - self._start, self._specs, self._pending) \
            if self._start < self.num_tokens else None
        self._life.end()
        record = SuspendedBranch(branch_id=self.branch_id, num_prompt_tokens=self.num_prompt_tokens,
                                 segments=tuple(self.segments), actor=self.keeper.ledger.actor,
                                 resumes=self._resumes, waiting=waiting)
        self.keeper.store.put(open_key(self.branch_id), record.model_dump_json().encode())
        self.keeper.ledger.record("suspend", branch_id=self.branch_id, num_tokens=record.num_tokens,
                                  segments=[s.branch_id for s in self.segments])
        self.keeper.ledger.flush()
        self._end("suspended")
        self._pending, self._suspended = {}, True
        return record

    @classmethod
    def resume(cls, keeper: "Keeper", branch_id: str) -> "OpenBranch":
        """``Keeper.resume_branch``: the suspended branch ``branch_id``, claimed by this ledger session
        (``storage.ledger_open.claim_resume``) and open again at its committed tokens."""
        keeper.ledger.check_open(f"resume branch {branch_id}")
        record = claim_resume(keeper.store, branch_id, keeper.ledger.actor, keeper.ledger.session)
        if record is None:
            raise OpenBranchError(f"branch {branch_id}: no suspended branch of that id in run "
                                  f"{keeper.store.prefix.uri} ({why_no_record(keeper.store, branch_id)})")
        branch = cls(keeper, branch_id, record.num_prompt_tokens)
        branch._resumes = record.resumes + 1
        check_id(branch._segment_id(MAX_SEGMENTS), f"branch_id {branch_id!r} with a resume and segment index")
        branch.segments = list(record.segments)
        branch.num_tokens = branch._start = record.num_tokens
        if record.waiting:  # the last token's rows; its all_but_last rows come with the next append
            branch._start -= record.waiting.num_tokens
            branch._specs, branch._short = dict(record.waiting.arrays), False
            branch._pending = {n: [a] for n, a in record.waiting.rows().items()}
        branch._suspended = True
        keeper.ledger.open_branches.add(branch_id)
        keeper.ledger.record("resume", branch_id=branch_id, num_tokens=record.num_tokens, suspended_by=record.actor)
        return branch

    def _end(self, how: str) -> None:
        """This object ended (``how``: closed, discarded or suspended): no longer an open branch of its ledger."""
        self._ended = how
        self.keeper.ledger.open_branches.discard(self.branch_id)

    def _unsuspend(self) -> None:
        """A suspended branch closed or discarded: remove its record (it is continued or discarded once)."""
        if self._suspended:
            self.keeper.store.delete_keys([open_key(self.branch_id)])

    def _check_open(self, doing: str) -> None:
        """Raise before ``doing`` unless this object is the branch's open writer and its ledger session is open."""
        if self._ended == "suspended":
            raise OpenBranchError(f"branch {self.branch_id}: {doing}: the branch was suspended after {self.num_tokens} "
                                  f"tokens: expected an open branch; resume it (Keeper.resume_branch"
                                  f"({self.branch_id!r})) and use the branch that returns")
        if self._ended:
            raise OpenBranchError(f"branch {self.branch_id}: {doing}: the branch was {self._ended} after "
                                  f"{self.num_tokens} tokens: expected an open branch; open a new branch")
        if self._closing and doing not in ("close", "discard"):
            raise OpenBranchError(f"branch {self.branch_id}: {doing}: a close wrote the branch's last rows and "
                                  f"failed after; close again (or discard it)")
        self.keeper.ledger.check_open(f"{doing} of open branch {self.branch_id}")

    def _check_specs(self, specs: Mapping[str, ArraySpec], what: str) -> None:
        """Every append stores the same arrays in the same dtypes as the first, and a shared prefix's among them."""
        got = {n: s.dtype for n, s in specs.items()}
        if not self._specs:  # a shared prefix's or a suspended branch's segments
            earlier = {n: s.dtype for seg in self.segments for n, s in seg.arrays.items()}
            if any(got.get(n) != dtype for n, dtype in earlier.items()):
                raise FieldError(f"{what}: stores arrays {got}: expected the arrays of the branch's earlier segments "
                                 f"{earlier} among them")
            self._specs = dict(specs)
        want = {n: s.dtype for n, s in self._specs.items()}
        if got != want:
            raise FieldError(f"{what}: stores arrays {got}: expected {want} (as the branch's first append)")

    def _flush(self, end: int) -> None:
        """Write the buffered rows of tokens ``[self._start, end)`` as the next segment; keep the rest buffered (all
        of them when the write fails: a later flush writes them)."""
        if end <= self._start:
            return
        p = self.num_prompt_tokens
        arrays: dict[str, np.ndarray] = {}
        rest: dict[str, list[np.ndarray]] = {}
        for name, spec in self._specs.items():
            parts = self._pending.get(name) or [np.empty((0, *spec.shape[1:]), spec.dtype)]
            a = np.concatenate(parts) if len(parts) > 1 else parts[0]
            domain = spec.domain
            if domain.startswith("values:"):
                rows = int(arrays[domain[7:]].sum(dtype=np.int64))
            else:
                rows = domain_rows(domain, p, end) - domain_rows(domain, p, self._start)
            arrays[name], rest[name] = a[:rows], [a[rows:].copy()] if len(a) > rows else []
        prompt, completion = segment_tokens(p, self._start, end)
        specs = {n: s._replace(shape=arrays[n].shape) for n, s in self._specs.items()}
        self.segments.append(self._life.write(self._segment_id(len(self.segments)), arrays, specs, prompt, completion))
        self._pending, self._start = rest, end

    def _segment_id(self, index: int) -> str:
        """``<branch_id>.<index>``; once resumed, ``<branch_id>.r<resume>.<index>`` (no resume reuses an id)."""
        return f"{self.branch_id}.r{self._resumes}.{index}" if self._resumes else f"{self.branch_id}.{index}"

    def _ref(self) -> PayloadRef:
        segments = tuple(self.segments)
        arrays = {n: ArraySpec(s.dtype, (sum(g.arrays[n].shape[0] for g in segments if n in g.arrays),
                                         *s.shape[1:]), s.domain)
                  for n, s in self._specs.items()}
        return PayloadRef(uri=self.keeper.store.uri(node_key(self.branch_id)), branch_id=self.branch_id,
                          num_prompt_tokens=min(self.num_prompt_tokens, self.num_tokens),
                          num_completion_tokens=max(0, self.num_tokens - self.num_prompt_tokens), arrays=arrays,
                          nbytes=sum(g.nbytes for g in segments), checksum=segments_checksum(segments),
                          compression=self.keeper.storage.compression, segments=segments)


def keep_prefix(keeper: "Keeper", num_tokens: int, fields: Mapping[str, object], holders: Sequence[str],
                prefix_id: str) -> PayloadRef:
    """``Keeper.keep_prefix``: validate a shared prompt's rows (every row), write them as one chunk with its holders,
    flush the keep event."""
    if not holders or len(set(holders)) != len(holders):
        raise OpenBranchError(f"shared prefix {prefix_id}: holders {list(holders)}: expected distinct branch ids, "
                              f"at least one")
    for holder in holders:
        check_id(holder, f"shared prefix {prefix_id}: holder")
    what = f"shared prefix {prefix_id} (env worker {keeper.ledger.actor})"
    arrays, specs = validate_branch(fields, _all_rows_config(keeper.fields), num_prompt_tokens=num_tokens,
                                    num_completion_tokens=0, what=what)
    ref = keeper.write(prefix_id, arrays, specs, num_tokens, 0, holders=holders)
    keeper.ledger.flush()
    return ref


def _position(value: object, name: str, what: str) -> int:
    """A token position given to ``append``, as ``int`` (a ``numpy.integer`` would reach the ref's JSON)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise OpenBranchError(f"{what}: {name}={value!r}: expected an integer token position")
    return int(value)


def _checked_prefix(keeper: "Keeper", prefix: PayloadRef, branch_id: str, num_prompt_tokens: int) -> PayloadRef:
    """``prefix`` if ``branch_id`` holds it, has not released it, and it is all prompt tokens of the branch."""
    if branch_id not in prefix.holders:
        raise OpenBranchError(f"branch {branch_id}: prefix {prefix.branch_id} is held by {list(prefix.holders)}: "
                              f"expected {branch_id!r} among them (declare every holder in keep_prefix)")
    if branch_id in released_holders(keeper.store, prefix.branch_id):
        raise OpenBranchError(f"branch {branch_id}: prefix {prefix.branch_id} was already released for holder "
                              f"{branch_id!r} (release_holders, or a discard): expected a holder that still holds it "
                              f"(open a branch of another id without the prefix)")
    if prefix.num_completion_tokens or prefix.num_tokens > num_prompt_tokens:
        raise OpenBranchError(f"branch {branch_id}: prefix {prefix.branch_id} has {prefix.num_prompt_tokens} + "
                              f"{prefix.num_completion_tokens} tokens: expected at most the branch's "
                              f"{num_prompt_tokens} prompt tokens, no completion tokens")
    return prefix


def _all_rows_config(cfg: FieldsConfig) -> FieldsConfig:
    """``cfg`` with every field taking all its rows: how an append after the first is checked (its ``all_but_last``
    rows are those of ``[start - 1, end - 1)``, as many as its tokens)."""
    declare = tuple(d.model_copy(update={"rows": "all"}) for d in cfg.declare)
    return cfg.model_copy(update={"routing_rows": "all_tokens", "declare": declare})
