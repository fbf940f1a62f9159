"""Reading a segmented branch (``PayloadRef.segments``) or one segment of a writer life's object (``offset``).

The segments of one writer life share one object (``pipeline.segment_write``), each at its ``offset``. A fetch
groups the consecutive segments of one object that it reads whole and straight into the destinations (uncompressed,
every array of the segment given a destination, or fresh arrays no larger than the destinations for the others) into
a run, and reads each run with one open and one ``preadv`` (``Store.get_into`` from the run's first offset, no
per-piece call): each segment's arrays land in their rows of the destinations, its alignment padding and crc32c bytes
in scratch (one array per run); then each segment's crc32c is computed over the buffers it was read into and checked
against the stored one and its ref's. A segment that is an object of its own (no ``offset``: a shared prefix, any
segment on S3) read whole is a run of one, whose object must be exactly its ``nbytes``. Any other segment (the one a
cut goes through, a compressed one, one with an array that has no destination) is read by its byte range and cut as a
whole chunk is (``chunk_codec.decode_payload``: length and crc32c), or by ``fetch_into`` when it is an object of its
own. Errors name the segment's object, and its bytes where it shares one; a missing object is ``ChunkNotFoundError``
as for any chunk (``chunk_read.read_found``).

What a fetch reads depends only on the ref (immutable), the tokens fetched and the destinations' names, so it is
planned once per such pair (``Step``: runs with the byte ranges of their buffers, parts read alone) and the plan kept
with the ref object (its ``_fetch_plans`` slot); a fetch then only slices its destinations, reads and checks.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from itertools import groupby
from typing import NamedTuple, TypeAlias, cast

import numpy as np

from refpipe.storage.checksum import crc32c
from refpipe.storage.chunk_codec import check_checksum, check_length, decode_payload, view_array
from refpipe.storage.chunk_read import Fetched, _check_destination, _cut, fetch_into, read_found
from refpipe.storage.chunk_ref import ALIGN_BYTES, PayloadRef, domain_rows
from refpipe.storage.errors import RefError
from refpipe.storage.layout import chunk_keys
from refpipe.storage.store import Store, byte_view


class _Part(NamedTuple):
    """One segment to read: its ref, the tokens read from it and its rows ``[start, end)`` of each destination."""

    seg: PayloadRef
    num_tokens: int
    rows: dict[str, tuple[int, int]]
    direct: bool
    """Read whole straight into the destinations (and fresh arrays, no larger, for the arrays without one), with the
    rest of its object's run."""


class _Run(NamedTuple):
    """Consecutive direct parts of one object, read with one ``Store.get_into`` from ``offset``."""

    segs: tuple[PayloadRef, ...]
    data_key: str
    offset: int
    nbytes: int
    """The segments' bytes; an object of its own (``segs[0].offset`` None) has exactly these."""
    pieces: tuple[tuple[int, int, int], ...]
    """The buffers in object order, each ``(target, start, end)``: bytes of target ``target`` (the destinations'
    byte views in the order the fetch names them, then ``fresh``'s arrays, then scratch: -1). Scratch holds each
    segment's stored crc32c at ``4 * j``, then the alignment padding."""
    trailers: tuple[int, ...]
    """Index in ``pieces`` of each segment's stored crc32c (its other pieces come before it, after the one before)."""
    scratch_nbytes: int
    fresh: tuple[tuple[str, tuple[int, ...], np.dtype], ...]
    """Arrays without a destination, read into fresh arrays: (name, shape, dtype), in object order."""
    checksums: list[int]
    """Each segment's ref's crc32c."""


Step: TypeAlias = "_Run | _Part"


def fetch_segments(store: Store, ref: PayloadRef, num_tokens: int | None, out: Mapping[str, np.ndarray],
                   step: int | None) -> Fetched:
    """``fetch_into`` of a segmented branch's first ``num_tokens`` tokens (None: all), or of one segment with an
    ``offset``: every segment they reach (a cut one too) read into its rows of the destinations (module doc); arrays
    without a destination (and ragged values) are joined from the pieces. Raises as ``fetch_into``."""
    n = ref.num_tokens if num_tokens is None else num_tokens
    names, plans = tuple(out), _plans(ref)
    plan = plans.get((n, names))
    if plan is None:
        _check_ref(store, ref, n)
    for name, dest in out.items():
        _check_named(store, ref, name, dest, (_cut_rows(ref, name, n, out), *ref.arrays[name].shape[1:]))
    if plan is None:
        plan = plans.setdefault((n, names), _plan(store, ref, n, names))
    views = [byte_view(out[name]) if out[name].size else memoryview(bytearray()) for name in names]
    pieces: dict[str, list[np.ndarray]] = {name: [] for name in ref.arrays}
    in_place = True
    for todo in plan:
        if isinstance(todo, _Run):
            for name, a in _read_run(store, todo, views, step):
                pieces[name].append(a)
            continue
        got = _read_part(store, todo, out, step)
        in_place &= got.in_place
        for name, a in got.arrays.items():
            if name not in todo.rows:
                pieces[name].append(a)
    return Fetched(_joined(store, ref, pieces, out), in_place)


def _plans(ref: PayloadRef) -> dict[tuple[int, tuple[str, ...]], tuple[Step, ...]]:
    """The plans of ``ref``'s fetches by (tokens, destination names), kept in its ``_fetch_plans`` slot."""
    plans = getattr(ref, "_fetch_plans", None)
    if plans is None:
        plans = {}
        object.__setattr__(ref, "_fetch_plans", plans)  # a slot, not a field (``PayloadRef.__slots__``)
    return cast(dict[tuple[int, tuple[str, ...]], tuple[Step, ...]], plans)


def _check_ref(store: Store, ref: PayloadRef, n: int) -> None:
    """Raise before any read: ``OutsideRunError`` (``PayloadRef.key``), ``RefError`` for ``n`` outside
    ``[0, ref.num_tokens]`` or rows that disagree with the token counts (``PayloadRef.rows_problem``: a step file's
    refs are validated without it)."""
    uri = store.uri(ref.key)
    if not 0 <= n <= ref.num_tokens:
        raise RefError(f"num_tokens={n} for chunk {uri}: expected 0..{ref.num_tokens}")
    problem = ref.rows_problem()
    if problem:
        raise RefError(f"chunk {uri}: {problem}: not read")


def _plan(store: Store, ref: PayloadRef, n: int, names: tuple[str, ...]) -> tuple[Step, ...]:
    """What a fetch of the first ``n`` tokens into destinations ``names`` reads: ``_parts`` cut into runs
    (consecutive direct parts of one object together) and parts read alone."""
    row_nbytes = {name: np.dtype(spec.dtype).itemsize * math.prod(spec.shape[1:]) for name, spec in ref.arrays.items()}
    plan: list[Step] = []
    parts = _parts(store, ref, n, names, row_nbytes)
    for (_, joined), group in groupby(parts, lambda p: (p.seg.branch_id, p.direct and p.seg.offset is not None)):
        if joined:  # segments of one object
            plan.append(_run(list(group), names, row_nbytes))
        else:
            plan += [_run([part], names, row_nbytes) if part.direct else part for part in group]
    return tuple(plan)


def _parts(store: Store, ref: PayloadRef, n: int, names: tuple[str, ...], row_nbytes: dict[str, int]) -> list[_Part]:
    """The segments the first ``n`` tokens reach (at least one), each with its rows of the destinations
    (``row_nbytes``: bytes per row of each array, the same in every segment).

    Raises:
        RefError: a segment's rows disagree with its token counts (``PayloadRef.rows_problem``: a step file's refs
            are validated without it), before any read.
    """
    parts, start = [], 0
    offsets = dict.fromkeys(names, 0)
    rowed = [name for name in names if not ref.arrays[name].domain.startswith("values:")]
    for seg in ref.segments or (ref,):
        if start >= n and start:
            break
        arrays, prompt, tokens = seg.arrays, seg.num_prompt_tokens, seg.num_tokens
        k = min(tokens, n - start)
        rows, agree = {}, k == tokens  # agree: each destination's rows are its array's
        for name in rowed:
            spec = arrays.get(name)
            if spec is not None:
                at, count = offsets[name], domain_rows(spec.domain, prompt, k)
                rows[name], offsets[name] = (at, at + count), at + count
                agree = agree and count == spec.shape[0]
        whole = len(rows) == len(arrays)
        if seg is not ref and not (agree and whole) and (problem := seg.rows_problem()):
            raise RefError(f"chunk {store.uri(ref.key)}: segment {seg.branch_id}: {problem}: not read")
        direct = k == tokens and seg.compression == "none" and (whole or 0 < sum(
            spec.shape[0] * row_nbytes[name] for name, spec in arrays.items() if name not in rows) <= sum(
            (end - at) * row_nbytes[name] for name, (at, end) in rows.items()))
        parts.append(_Part(seg, k, rows, direct))
        start += tokens
    return parts


def _run(parts: list[_Part], names: tuple[str, ...], row_nbytes: dict[str, int]) -> _Run:
    """The plan of reading ``parts`` (direct, consecutive in one object) with one ``Store.get_into``: each
    segment's arrays (in payload order, each at an ``ALIGN_BYTES`` offset as ``layout_arrays`` places them) into its
    rows of the destinations or fresh arrays, its alignment padding into scratch, then its stored crc32c."""
    target = {name: i for i, name in enumerate(names)}
    pieces: list[tuple[int, int, int]] = []
    trailers, fresh = [], []
    scratch = 4 * len(parts)  # the stored crc32c first, then the padding
    for j, (seg, _, rows, _) in enumerate(parts):
        end = 0
        for name, spec in seg.arrays.items():
            if end % ALIGN_BYTES:  # alignment padding
                pad = ALIGN_BYTES - end % ALIGN_BYTES
                pieces.append((-1, scratch, scratch + pad))
                scratch, end = scratch + pad, end + pad
            nbytes = spec.shape[0] * row_nbytes[name]
            if name in rows:
                first = rows[name][0] * row_nbytes[name]
                pieces.append((target[name], first, first + nbytes))
            else:
                fresh.append((name, spec.shape, np.dtype(spec.dtype)))
                pieces.append((len(names) + len(fresh) - 1, 0, nbytes))
            end += nbytes
        if seg.nbytes - 4 > end:  # the payload's trailing padding
            pieces.append((-1, scratch, scratch + seg.nbytes - 4 - end))
            scratch += seg.nbytes - 4 - end
        trailers.append(len(pieces))
        pieces.append((-1, 4 * j, 4 * j + 4))
    segs = tuple(part.seg for part in parts)
    return _Run(segs, chunk_keys(segs[0].key)[0], segs[0].offset or 0, sum(s.nbytes for s in segs), tuple(pieces),
                tuple(trailers), scratch, tuple(fresh), [s.checksum for s in segs])


def _read_run(store: Store, run: _Run, views: list[memoryview], step: int | None) -> list[tuple[str, np.ndarray]]:
    """Read a run into the destinations' ``views`` (and fresh arrays, returned with their names) with one
    ``Store.get_into``, then check each segment's length and crc32c (computed over the buffers it was read into)."""
    fresh = [(name, np.empty(shape, dtype)) for name, shape, dtype in run.fresh]
    scratch = np.empty(run.scratch_nbytes, np.uint8)
    targets = [*views, *(byte_view(a) if a.size else memoryview(bytearray()) for _, a in fresh), byte_view(scratch)]
    buffers = [targets[t][start:end] for t, start, end in run.pieces]
    got = read_found(store, run.segs[0], step, lambda: store.get_into(run.data_key, buffers, run.offset))
    crcs, start = [], 0
    for end in run.trailers:  # each segment's buffers, then its stored crc32c
        crc = 0
        for buffer in buffers[start:end]:
            crc = crc32c(buffer, crc)
        crcs.append(crc)
        start = end + 1
    stored = scratch[: 4 * len(run.segs)].view("<u4").tolist()
    if (got != run.nbytes if run.segs[0].offset is None else got < run.nbytes) or crcs != stored \
            or crcs != run.checksums:
        _check_run(store, run, got, crcs, stored)
    return fresh


def _check_run(store: Store, run: _Run, got: int, crcs: list[int], stored: list[int]) -> None:
    """Raise ``ChunkCorruptError`` for the first segment of a run read short (an object of its own: of another
    length) or with another crc32c."""
    done = 0
    for seg, crc, crc_stored in zip(run.segs, crcs, stored):
        what = _what(store, seg)
        check_length(seg, got if seg.offset is None else min(max(got - done, 0), seg.nbytes), what)
        check_checksum(seg, crc, crc_stored, what)
        done += seg.nbytes


def _read_part(store: Store, part: _Part, out: Mapping[str, np.ndarray], step: int | None) -> Fetched:
    """One part alone: a segment of its own object by ``fetch_into``; else its byte range, checked and cut."""
    seg = part.seg
    dests = {name: out[name][start:end] for name, (start, end) in part.rows.items()}
    if seg.offset is None:
        return fetch_into(store, seg, part.num_tokens, dests, step)
    data_key = chunk_keys(seg.key)[0]
    data = read_found(store, seg, step, lambda: store.get(data_key, seg.offset, (seg.offset or 0) + seg.nbytes))
    seg = seg.model_copy(update={"uri": _what(store, seg)})  # errors name the bytes read
    payload = decode_payload(seg, data, seg.uri)
    got = _cut(seg, part.num_tokens, lambda lay, rows: view_array(payload, lay, rows))
    for name, dest in dests.items():
        _check_destination(seg, name, dest, got[name].shape)
        dest[...] = got[name]
    return Fetched({name: dests.get(name, a) for name, a in got.items()}, False)


def _what(store: Store, seg: PayloadRef) -> str:
    """A segment in errors: its object's URI, and its bytes there."""
    uri = store.uri(seg.key)
    return uri if seg.offset is None else f"{uri} bytes [{seg.offset}, {seg.offset + seg.nbytes})"


def _joined(store: Store, ref: PayloadRef, pieces: dict[str, list[np.ndarray]], out: Mapping[str, np.ndarray]) -> \
        dict[str, np.ndarray]:
    """The fetched arrays: ``out``'s own where its rows were read into it, else the pieces joined (and copied into
    ``out`` where it names them: ragged values)."""
    arrays = {}
    for name, parts in pieces.items():
        if name in out and not parts and not ref.arrays[name].domain.startswith("values:"):
            arrays[name] = out[name]
            continue
        spec = ref.arrays[name]
        parts = parts or [np.empty((0, *spec.shape[1:]), spec.dtype)]  # no rows in the segments read
        arrays[name] = np.concatenate(parts) if len(parts) > 1 else parts[0]
        arrays[name].flags.writeable = False
        if name in out:
            _check_named(store, ref, name, out[name], arrays[name].shape)
            out[name][...] = arrays[name]
            arrays[name] = out[name]
    return arrays


def _check_named(store: Store, ref: PayloadRef, name: str, dest: np.ndarray, shape: tuple[int, ...]) -> None:
    """``chunk_read._check_destination``, its error naming the chunk as this store reads it (``store.uri``)."""
    try:
        _check_destination(ref, name, dest, shape)
    except ValueError:
        _check_destination(ref.model_copy(update={"uri": store.uri(ref.key)}), name, dest, shape)
        raise


def _cut_rows(ref: PayloadRef, name: str, n: int, out: Mapping[str, np.ndarray]) -> int:
    """Rows array ``name`` has in the first ``n`` tokens (a ragged one: its destination's, checked after)."""
    domain = ref.arrays[name].domain
    return len(out[name]) if domain.startswith("values:") else domain_rows(domain, ref.num_prompt_tokens, n)
