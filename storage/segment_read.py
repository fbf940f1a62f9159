"""Reading a segmented branch (``PayloadRef.segments``) or one segment of a writer life's object (``offset``).

The segments of one writer life share one object (``pipeline.segment_write``), each at its ``offset``. A fetch
groups the consecutive segments of one object that it reads whole and straight into the destinations (uncompressed,
every array of the segment given a destination) into a run, and reads each run with one open and one ``preadv``
(``Store.get_into`` from the run's first offset, no per-piece call): each segment's arrays land in their rows of
the destinations, its alignment padding and crc32c bytes in scratch (one array each per run); then each segment's
crc32c is computed over the buffers it was read into and checked against the stored one and its ref's. Any other
segment of such an object (the one a cut goes through, a compressed one, one with an array that has no destination)
is read by its byte range and cut as a whole chunk is (``chunk_codec.decode_payload``: length and crc32c). A segment
that is an object of its own (no ``offset``: a shared prefix, any segment on S3) is read by ``fetch_into``. Errors
name the segment's object, and its bytes where it shares one; a missing object is ``ChunkNotFoundError`` as for any
chunk (``chunk_read.read_found``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import numpy as np

from refpipe.storage.checksum import crc32c
from refpipe.storage.chunk_codec import check_checksum, check_length, decode_payload, view_array
from refpipe.storage.chunk_read import (
    Fetched,
    _check_destination,
    _cut,
    _fresh_nbytes,
    _nbytes,
    fetch_into,
    read_found,
)
from refpipe.storage.chunk_ref import ALIGN_BYTES, PayloadRef, domain_rows
from refpipe.storage.errors import RefError
from refpipe.storage.layout import chunk_keys
from refpipe.storage.store import Store, byte_view


class _Part(NamedTuple):
    """One segment to read: its ref, the tokens read from it and its destinations (rows of the caller's arrays)."""

    seg: PayloadRef
    num_tokens: int
    dests: dict[str, np.ndarray]
    direct: bool
    """Read whole straight into the destinations (and fresh arrays, no larger, for the arrays without one), with the
    rest of its object's run."""

    def arrays(self) -> dict[str, np.ndarray]:
        """Where a direct read puts the segment's arrays: the destinations, fresh arrays for the others."""
        return {name: self.dests[name] if name in self.dests else np.empty(spec.shape, spec.dtype)
                for name, spec in self.seg.arrays.items()}


def fetch_segments(store: Store, ref: PayloadRef, n: int, out: Mapping[str, np.ndarray], step: int | None) -> Fetched:
    """``fetch_into`` of a segmented branch's first ``n`` tokens, or of one segment with an ``offset``: every segment
    they reach (a cut one too) read into its rows of the destinations (module doc); arrays without a destination
    (and ragged values) are joined from the pieces. Raises as ``fetch_into``."""
    for name, dest in out.items():
        _check_destination(ref, name, dest, (_cut_rows(ref, name, n, out), *ref.arrays[name].shape[1:]))
    pieces: dict[str, list[np.ndarray]] = {name: [] for name in ref.arrays}
    in_place = True
    for run in _runs(_parts(ref, n, out)):
        fetched = _read_run(store, run, step) if run[0].direct else [_read_part(store, run[0], step)]
        for part, got in zip(run, fetched):
            in_place &= got.in_place
            for name, a in got.arrays.items():
                if name not in part.dests:
                    pieces[name].append(a)
    return Fetched(_joined(ref, pieces, out), in_place)


def _parts(ref: PayloadRef, n: int, out: Mapping[str, np.ndarray]) -> list[_Part]:
    """The segments the first ``n`` tokens reach (at least one), each with its rows of the destinations.

    Raises:
        RefError: a segment's rows disagree with its token counts (``PayloadRef.rows_problem``: a step file's refs
            are validated without it), before any read.
    """
    parts, start = [], 0
    offsets = dict.fromkeys(out, 0)
    ragged = {name for name, spec in ref.arrays.items() if spec.domain.startswith("values:")}
    placed = [(name, dest) for name, dest in out.items() if name not in ragged]
    for seg in ref.segments or (ref,):
        if start >= n and start:
            break
        arrays, prompt, tokens = seg.arrays, seg.num_prompt_tokens, seg.num_tokens
        k = min(tokens, n - start)
        dests, agree = {}, k == tokens  # agree: each destination's rows are its array's
        for name, dest in placed:
            spec = arrays.get(name)
            if spec is not None:
                at, rows = offsets[name], domain_rows(spec.domain, prompt, k)
                dests[name], offsets[name] = dest[at : at + rows], at + rows
                agree = agree and rows == spec.shape[0]
        whole = agree and len(dests) == len(arrays)
        if seg is not ref and not whole and (problem := seg.rows_problem()):
            raise RefError(f"chunk {ref.uri}: segment {seg.branch_id}: {problem}: not read")
        direct = seg.offset is not None and k == tokens and seg.compression == "none" and (
            len(dests) == len(arrays) or 0 < _fresh_nbytes(seg, dests) <= _nbytes(dests))
        parts.append(_Part(seg, k, dests, direct))
        start += tokens
    return parts


def _runs(parts: list[_Part]) -> list[list[_Part]]:
    """``parts`` cut into runs: consecutive direct parts of one object together, every other part alone."""
    runs: list[list[_Part]] = []
    for part in parts:
        if runs and part.direct and runs[-1][-1].direct and runs[-1][-1].seg.branch_id == part.seg.branch_id:
            runs[-1].append(part)
        else:
            runs.append([part])
    return runs


def _read_run(store: Store, run: list[_Part], step: int | None) -> list[Fetched]:
    """Read a run of direct parts of one object with one ``Store.get_into`` from its first offset, then check each
    segment's length and crc32c (computed over the buffers it was read into, still in cache)."""
    first = run[0].seg
    buffers, ends, fetched, stored = _run_buffers(run)
    data_key = chunk_keys(first.key)[0]
    got = read_found(store, first, step, lambda: store.get_into(data_key, buffers, None, first.offset or 0))
    crcs, start = [], 0
    for end in ends:  # each segment's buffers, then its stored crc32c
        crc = 0
        for buffer in buffers[start:end]:
            crc = crc32c(buffer, crc)
        crcs.append(crc)
        start = end + 1
    if got < sum(part.seg.nbytes for part in run) or crcs != stored.tolist() \
            or crcs != [part.seg.checksum for part in run]:
        _check_run(store, run, got, crcs, stored)
    return [Fetched(arrays, True) for arrays in fetched]


def _run_buffers(run: list[_Part]) -> tuple[list[memoryview], list[int], list[dict[str, np.ndarray]], np.ndarray]:
    """The buffers a run is read into, in object order: each segment's arrays (its destinations, fresh arrays for the
    rest) with scratch for alignment padding (one array for the run), then its stored crc32c; where each segment's
    stored crc32c is among them; each segment's arrays; the stored crc32c (uint32, one per segment)."""
    stored = np.empty(len(run), "<u4")
    trailers = byte_view(stored)
    buffers: list[memoryview] = []
    ends, fetched, pads = [], [], []  # pads: (index in buffers, bytes)
    for j, part in enumerate(run):
        end, arrays = 0, part.dests if len(part.dests) == len(part.seg.arrays) else part.arrays()
        for name in part.seg.arrays:  # in payload order, placed as ``layout_arrays`` places them
            if end % ALIGN_BYTES:  # alignment padding
                pads.append((len(buffers), ALIGN_BYTES - end % ALIGN_BYTES))
                buffers.append(trailers)
                end += ALIGN_BYTES - end % ALIGN_BYTES
            buffers.append(byte_view(arrays[name]))
            end += buffers[-1].nbytes
        if part.seg.nbytes - 4 > end:  # the payload's trailing padding
            pads.append((len(buffers), part.seg.nbytes - 4 - end))
            buffers.append(trailers)
        ends.append(len(buffers))
        buffers.append(trailers[4 * j : 4 * j + 4])
        fetched.append(arrays)
    scratch, at = memoryview(bytearray(sum(n for _, n in pads))), 0
    for i, n in pads:
        buffers[i], at = scratch[at : at + n], at + n
    return buffers, ends, fetched, stored


def _check_run(store: Store, run: list[_Part], got: int, crcs: list[int], stored: np.ndarray) -> None:
    """Raise ``ChunkCorruptError`` for the first segment of a run read short or with another crc32c."""
    done = 0
    for part, crc, crc_stored in zip(run, crcs, stored.tolist()):
        seg, what = part.seg, _what(store, part.seg)
        check_length(seg, min(max(got - done, 0), seg.nbytes), what)
        check_checksum(seg, crc, crc_stored, what)
        done += seg.nbytes


def _read_part(store: Store, part: _Part, step: int | None) -> Fetched:
    """One part alone: a segment of its own object by ``fetch_into``; else its byte range, checked and cut."""
    seg = part.seg
    if seg.offset is None:
        return fetch_into(store, seg, part.num_tokens, part.dests, step)
    data_key = chunk_keys(seg.key)[0]
    data = read_found(store, seg, step, lambda: store.get(data_key, seg.offset, (seg.offset or 0) + seg.nbytes))
    seg = seg.model_copy(update={"uri": _what(store, seg)})  # errors name the bytes read
    payload = decode_payload(seg, data, seg.uri)
    got = _cut(seg, part.num_tokens, lambda lay, rows: view_array(payload, lay, rows))
    for name, dest in part.dests.items():
        _check_destination(seg, name, dest, got[name].shape)
        dest[...] = got[name]
    return Fetched({name: part.dests.get(name, a) for name, a in got.items()}, False)


def _what(store: Store, seg: PayloadRef) -> str:
    """A segment in errors: its object's URI, and its bytes there."""
    uri = store.uri(seg.key)
    return uri if seg.offset is None else f"{uri} bytes [{seg.offset}, {seg.offset + seg.nbytes})"


def _joined(ref: PayloadRef, pieces: dict[str, list[np.ndarray]], out: Mapping[str, np.ndarray]) -> dict[
        str, np.ndarray]:
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
            _check_destination(ref, name, out[name], arrays[name].shape)
            out[name][...] = arrays[name]
            arrays[name] = out[name]
    return arrays


def _cut_rows(ref: PayloadRef, name: str, n: int, out: Mapping[str, np.ndarray]) -> int:
    """Rows array ``name`` has in the first ``n`` tokens (a ragged one: its destination's, checked after)."""
    domain = ref.arrays[name].domain
    return len(out[name]) if domain.startswith("values:") else domain_rows(domain, ref.num_prompt_tokens, n)
