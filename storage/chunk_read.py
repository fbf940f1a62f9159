"""Reading a branch's chunk by reference: ``fetch_arrays`` and ``fetch_into``.

Fetches read exactly the keys the reference names: no listing, no metadata
read. A whole-chunk fetch is one read, then its length and crc32c checked: ``fetch_arrays`` reads
it into one fresh array of the object's size (``Store.get_array``) and returns views of it;
``fetch_into`` reads an uncompressed one straight into the caller's arrays (one ``Store.get_into``);
a fetch of the first ``n`` tokens of an uncompressed chunk reads each array's first
``ceil(rows / block_rows)`` blocks and checks their crc32c against the ref's ``block_crcs``
(length-checked too), so every read is verified. Compressed chunks are always read whole.

Untrusted refs: ``PayloadRef`` validation makes shapes, dtypes, ``block_rows`` and ``nbytes`` agree;
every buffer allocated here is bounded by the bytes the store returned (the object's real size)
or by the destinations the caller allocated, never by a size the ref merely declares. A zstd
chunk decodes into one buffer of its arrays' declared size, which validation bounds by
``ZSTD_MAX_RATIO`` times ``nbytes`` (checked against the bytes returned first); a frame
declaring or expanding to more is refused without allocating it (``chunk_codec.decode_payload``).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from typing import NamedTuple, TypeVar

import numpy as np

from refpipe.storage.checksum import crc32c
from refpipe.storage.chunk_codec import check_checksum, check_length, decode_payload, view_array
from refpipe.storage.chunk_ref import ArrayLayout, PayloadRef, domain_rows
from refpipe.storage.errors import (
    ChunkCorruptError,
    ChunkNotFoundError,
    DeleteRecordError,
    KeyNotFoundError,
    RefError,
    TruncatedChunkError,
    expect_type,
)
from refpipe.storage.layout import DATA_NAME, chunk_keys
from refpipe.storage.ledger_records import delete_record_of
from refpipe.storage.store import Store

T = TypeVar("T")


class Fetched(NamedTuple):
    """What ``fetch_into`` read."""

    arrays: dict[str, np.ndarray]
    """Stored array name -> array (as ``fetch_arrays`` returns), ``out``'s own arrays for the names it gives."""
    in_place: bool
    """True: the whole chunk was read straight into the destinations (one ``Store.get_into``, the crc32c
    computed over them). False: it was read in ranges or decompressed, then copied into them."""


def rows_for(lay: ArrayLayout, ref: PayloadRef, num_tokens: int, counts: np.ndarray | None) -> int:
    """Rows of ``lay`` that belong to the first ``num_tokens`` tokens of the branch.

    Raises:
        ChunkCorruptError: a ragged array's counts (read from the chunk) are negative or sum to more rows than
            the ref declares for it: they would slice past the array (into the next one, or past its blocks).
    """
    if not lay.domain.startswith("values:"):
        return domain_rows(lay.domain, ref.num_prompt_tokens, num_tokens)
    if counts is None:
        raise ChunkCorruptError(f"chunk {ref.uri}: array {lay.name} is ragged but its counts were not read first")
    counts_name = lay.domain.partition(":")[2]
    num_counted = domain_rows(ref.arrays[counts_name].domain, ref.num_prompt_tokens, num_tokens)
    kept = counts[:num_counted].astype(np.int64)
    rows = int(kept.sum())
    if (kept < 0).any() or rows > lay.shape[0]:
        raise ChunkCorruptError(f"chunk {ref.uri}: array {lay.name}: counts of the first {num_counted} rows of "
                                f"{counts_name} (min {kept.min()}) sum to {rows} rows: expected non-negative counts "
                                f"summing to at most its {lay.shape[0]} rows")
    return rows


def fetch_arrays(store: Store, ref: PayloadRef, num_tokens: int | None = None) -> dict[str, np.ndarray]:
    """Read a branch's arrays, cut to its first ``num_tokens`` tokens (default: all), into fresh arrays.

    Returns:
        name -> read-only array; token-domain arrays have ``num_tokens`` rows, completion-domain
        arrays ``max(0, num_tokens - num_prompt_tokens)`` rows, ragged values the rows their kept
        counts cover.

    Raises:
        ArgumentTypeError: ``ref`` is not a ``PayloadRef``.
        OutsideRunError: the ref's URI names another chunk than its branch id (before any I/O).
        ChunkNotFoundError: the chunk does not exist (never zeros, even for 0 tokens): at once when its delete
            record exists (the message names the deleter, when and why), else still missing after ``max_retries``
            re-reads with backoff (each counted in ``store.retries``).
        ChunkCorruptError: length, whole-chunk crc32c or (cut reads) a block crc32c mismatch.
        RefError: ``num_tokens`` outside ``[0, ref.num_tokens]``, or the ref's rows disagree with its token counts
            (``PayloadRef.rows_problem``; before any I/O).
    """
    return fetch_into(store, expect_type(ref, PayloadRef, "fetch_arrays(ref)"), num_tokens, {}).arrays


def fetch_into(store: Store, ref: PayloadRef, num_tokens: int | None, out: Mapping[str, np.ndarray],
               step: int | None = None) -> Fetched:
    """``fetch_arrays`` into the caller's arrays: on success every destination in ``out`` holds its rows.

    A whole uncompressed chunk is read straight into the destinations (one ``Store.get_into``, the
    crc32c computed over them; ``Fetched.in_place``) when the arrays ``out`` leaves out (allocated
    here from the ref's shapes) take no more bytes than the destinations the caller already
    allocated: an untrusted ref cannot make this allocate more than the caller committed. Any other
    chunk is read as ``fetch_arrays`` reads it (allocation bounded by the bytes the store returns)
    and copied into ``out``. Called by a trainer rank for its DP rank's chunks (``trainer.fetch``).

    Args:
        out: stored array name -> destination: a writable C-contiguous ndarray of that array's
            dtype and its cut shape (as ``fetch_arrays`` returns it). After an error a
            destination may hold part of the chunk: the caller discards it.
        step: the step file naming the ref: a chunk not found is also looked up in its release records.

    Raises:
        As ``fetch_arrays``; ValueError also for a destination of another dtype or shape,
        read-only or not C-contiguous.
    """
    if ref.segments or ref.offset is not None:  # checked there as below, its fetch plan kept with the ref
        from refpipe.storage.segment_read import fetch_segments  # it reads its single segments with fetch_into

        return fetch_segments(store, ref, num_tokens, out, step)
    key = ref.key
    uri = store.uri(key)
    if ref.uri != uri:
        ref = ref.model_copy(update={"uri": uri})  # errors name the chunk read, not where it was kept
    total = ref.num_tokens
    n = total if num_tokens is None else num_tokens
    if not 0 <= n <= total:
        raise RefError(f"num_tokens={n} for chunk {ref.uri}: expected 0..{total}")
    problem = ref.rows_problem()  # a step file's refs are validated without it (``REF_ROWS_CHECKED_PER_USE``)
    if problem:
        raise RefError(f"chunk {ref.uri}: {problem}: not read")
    data_key = chunk_keys(key)[0]
    return read_found(store, ref, step, lambda: _fetch(store, data_key, ref, n, dict(out)))


def read_found(store: Store, ref: PayloadRef, step: int | None, read: Callable[[], T]) -> T:
    """``read()`` of the chunk ``ref`` names, a ``KeyNotFoundError`` read again (``max_retries`` times with backoff:
    the ref says the chunk was kept, so a 404 may be a stale cache or a lagging replica) unless its delete record
    exists (``step``: the step file naming the ref, whose release records are looked up too).

    Raises:
        ChunkNotFoundError: naming the deleter, when and why; or still missing after the re-reads.
    """
    def attempt() -> T | _Deleted:
        try:
            return read()
        except KeyNotFoundError:
            deleted = _deleted(store, ref, step)
            if deleted is None:
                raise
            return _Deleted(deleted)

    node_uri = store.uri(ref.key)
    try:
        fetched = store.retrying(f"read {node_uri}", attempt, retry=KeyNotFoundError)
    except KeyNotFoundError as e:
        raise ChunkNotFoundError(f"{node_uri}/{DATA_NAME} does not exist (read {store.config.max_retries + 1} "
                                 f"times; no delete record)") from e
    if isinstance(fetched, _Deleted):  # final: a deleted chunk never comes back, so it is not read again
        raise ChunkNotFoundError(f"{node_uri}/{DATA_NAME} does not exist: {fetched.why}")
    return fetched


class _Deleted(NamedTuple):
    why: str


def _deleted(store: Store, ref: PayloadRef, step: int | None) -> str | None:
    """``chunk <uri> was deleted by <holder> at <time> UTC (<reason>)`` from the chunk's delete record
    (``storage.ledger_records.delete_record_of``), or None without one; read only after the chunk was not found."""
    record = delete_record_of(store, ref.branch_id, step)
    if record is None:
        return None
    if isinstance(record, DeleteRecordError):
        return f"chunk {ref.uri} was deleted ({record})"
    when = datetime.datetime.fromtimestamp(record.t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    return f"chunk {ref.uri} was deleted by {record.holder} at {when} UTC ({record.reason})"


def _fetch(store: Store, data_key: str, ref: PayloadRef, n: int, out: dict[str, np.ndarray]) -> Fetched:
    whole = n == ref.num_tokens
    if whole and ref.compression == "none" and out and _fresh_nbytes(ref, out) <= _nbytes(out):
        return Fetched(_read_whole_into(store, data_key, ref, out), True)
    if whole or ref.compression != "none":
        payload = decode_payload(ref, store.get_array(data_key), ref.uri)
        got = _cut(ref, n, lambda lay, rows: view_array(payload, lay, rows))
    else:
        got = _cut(ref, n, lambda lay, rows: _read_rows(store, data_key, ref, lay, rows))
        if not any(a.shape[0] for a in got.values()):
            _check_stored_checksum(store, data_key, ref)  # nothing was read: the chunk must still be there
    for name, dest in out.items():
        _check_destination(ref, name, dest, got[name].shape)
        dest[...] = got[name]
    return Fetched({name: out.get(name, a) for name, a in got.items()}, False)


def _read_whole_into(store: Store, data_key: str, ref: PayloadRef, out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Read a whole uncompressed chunk into ``out`` (fresh arrays for the rest) with one ``Store.get_into``; check
    length and crc32c (computed over the buffers after the read: measured as cheap as a checksum of each 256 KiB
    piece right after its read, without a Python call per piece)."""
    layouts = ref.layout()
    padding = ref.nbytes - sum(lay.nbytes for lay in layouts)  # >= 4: PayloadRef validation, nbytes = layout + 4
    scratch = np.empty(padding, np.uint8)  # alignment padding, then the tail and the stored checksum
    buffers, arrays, end, used = [], {}, 0, 0
    for lay in layouts:
        if lay.offset > end:
            buffers.append(scratch[used : used + lay.offset - end])
            used += lay.offset - end
        dest = out.get(lay.name)
        if dest is None:
            dest = np.empty(lay.shape, lay.dtype)
        else:
            _check_destination(ref, lay.name, dest, lay.shape)
        arrays[lay.name] = dest
        if lay.nbytes:
            buffers.append(dest.reshape(-1).view(np.uint8))
        end = lay.offset + lay.nbytes
    buffers.append(scratch[used:])
    check_length(ref, store.get_into(data_key, buffers), ref.uri)
    crc = 0
    for buffer in buffers[:-1]:
        crc = crc32c(buffer, crc)
    crc = crc32c(scratch[used:-4], crc)
    check_checksum(ref, crc, int(scratch[-4:].view("<u4")[0]), ref.uri)
    for name, a in arrays.items():
        if name not in out:
            a.flags.writeable = False
    return arrays


def _check_stored_checksum(store: Store, data_key: str, ref: PayloadRef) -> None:
    """Read the chunk's last 4 bytes, its crc32c, and compare them with the ref's: a cut read of no rows.

    Raises:
        KeyNotFoundError: the chunk does not exist.
        ChunkCorruptError: fewer than 4 bytes there, or another crc32c than the ref's.
    """
    stored = store.get(data_key, ref.nbytes - 4, ref.nbytes)
    if len(stored) != 4:
        raise ChunkCorruptError(f"chunk {ref.uri}: bytes [{ref.nbytes - 4}, {ref.nbytes}) read {len(stored)} bytes "
                                f"(truncated chunk)")
    crc = int.from_bytes(stored, "little")
    if crc != ref.checksum:
        raise ChunkCorruptError(f"chunk {ref.uri}: stored crc32c {crc:#010x}, reference {ref.checksum:#010x} "
                                f"(another or a corrupted chunk)")


def _nbytes(out: Mapping[str, np.ndarray]) -> int:
    return sum(a.nbytes for a in out.values() if isinstance(a, np.ndarray))


def _fresh_nbytes(ref: PayloadRef, out: Mapping[str, np.ndarray]) -> int:
    """Bytes a direct read would allocate for the arrays ``out`` gives no destination for."""
    return sum(lay.nbytes for lay in ref.layout() if lay.name not in out)


def _check_destination(ref: PayloadRef, name: str, dest: np.ndarray, shape: tuple[int, ...]) -> None:
    dtype = np.dtype(ref.arrays[name].dtype)
    if (not isinstance(dest, np.ndarray) or dest.dtype != dtype or dest.shape != tuple(shape)
            or not dest.flags.c_contiguous or not dest.flags.writeable):
        what = type(dest).__name__ if not isinstance(dest, np.ndarray) else f"{dest.dtype.str} {list(dest.shape)}"
        raise ValueError(f"chunk {ref.uri}: destination of {name} is {what}: expected a writable C-contiguous "
                         f"{dtype.str} {list(shape)}")


def _cut(ref: PayloadRef, n: int, read: Callable[[ArrayLayout, int], np.ndarray]) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    layouts = ref.layout()
    by_name = {lay.name: lay for lay in layouts}
    for lay in sorted(layouts, key=lambda lay: lay.domain.startswith("values:")):
        counts = None
        if lay.domain.startswith("values:"):
            counts_name = lay.domain.partition(":")[2]
            counts = out.get(counts_name)
            if counts is None or counts_name not in by_name:
                raise ChunkCorruptError(f"chunk {ref.uri}: ragged array {lay.name} "
                                        f"names missing counts {counts_name!r}")
        out[lay.name] = read(lay, rows_for(lay, ref, n, counts))
    return {name: out[name] for name in ref.arrays}


def _read_rows(store: Store, data_key: str, ref: PayloadRef, lay: ArrayLayout, rows: int) -> np.ndarray:
    """The first ``rows`` rows of one array: read its first ``ceil(rows / block_rows)`` blocks, check each crc32c.

    A short read is read again (``max_retries`` times with backoff, counted): a body cut on the way arrives
    with a matching length (no transport checksum covers a range), and only a re-read tells it from a short chunk.

    Raises:
        TruncatedChunkError: fewer bytes than the blocks span on every read (truncated chunk).
        ChunkCorruptError: a block's crc32c differs from the ref's (names the array and the block's rows).
    """
    if rows == 0:
        return np.frombuffer(b"", lay.dtype).reshape(0, *lay.shape[1:])  # read-only, like every fetched array
    row_nbytes = lay.dtype.itemsize * int(np.prod(lay.shape[1:], dtype=np.int64))
    blocks = -(-rows // ref.block_rows)
    end = lay.offset + min(blocks * ref.block_rows, lay.shape[0]) * row_nbytes

    def read() -> bytes:
        data = store.get(data_key, lay.offset, end)
        if len(data) != end - lay.offset:
            raise TruncatedChunkError(f"chunk {ref.uri}: array {lay.name} bytes [{lay.offset}, {end}) read "
                                      f"{len(data)} bytes (truncated chunk; read {store.config.max_retries + 1} times)")
        return data

    data = store.retrying(f"read {ref.uri}", read, retry=TruncatedChunkError)
    block_nbytes = ref.block_rows * row_nbytes
    for b in range(blocks):
        computed = crc32c(memoryview(data)[b * block_nbytes : (b + 1) * block_nbytes])
        if computed != lay.block_crcs[b]:
            first = b * ref.block_rows
            raise ChunkCorruptError(
                f"chunk {ref.uri}: array {lay.name} rows [{first}, {min(first + ref.block_rows, lay.shape[0])}): "
                f"crc32c {computed:#010x}, reference {lay.block_crcs[b]:#010x} (corrupted chunk)")
    return np.frombuffer(data, lay.dtype, rows * row_nbytes // lay.dtype.itemsize).reshape(rows, *lay.shape[1:])
