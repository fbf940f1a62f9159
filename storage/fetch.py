"""Write, fetch and inspect branch chunks by reference.

Fetches read exactly the keys the reference names: no listing, no metadata
read. A whole-chunk fetch checks length and crc32c; a fetch of the first ``n``
tokens of an uncompressed chunk reads only the needed byte range of each array
(length-checked; the crc32c covers the whole chunk, so a partial read cannot
check it). Compressed chunks are always read whole.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from storage.chunk import DATA_KEY, META_KEY, ArrayLayout, EncodedChunk, PayloadRef, decode_payload, node_key, view_array
from storage.errors import ChunkCorruptError, RefpipeError
from storage.store import Store


def put_chunk(store: Store, branch_id: str, chunk: EncodedChunk) -> str:
    """Write a chunk, then its ``zarr.json`` (the commit marker); return the node URI.

    Both puts are exclusive, so a branch id is never written twice.

    Raises:
        KeyExistsError: a branch with this id was already kept in this run.
    """
    key = node_key(branch_id)
    store.put(f"{key}/{DATA_KEY}", chunk.parts, exclusive=True)
    store.put(f"{key}/{META_KEY}", chunk.metadata, exclusive=True)
    return store.uri(key)


def chunk_keys(store: Store, ref: PayloadRef) -> tuple[str, str]:
    """``(data_key, meta_key)`` of a ref, confined to the store's run prefix.

    Raises:
        OutsideRunError: the ref's URI is not under the run prefix.
    """
    key = store.prefix.key_of(ref.uri)
    return f"{key}/{DATA_KEY}", f"{key}/{META_KEY}"


def rows_for(lay: ArrayLayout, ref: PayloadRef, num_tokens: int, counts: np.ndarray | None) -> int:
    """Rows of ``lay`` that belong to the first ``num_tokens`` tokens of the branch."""
    if lay.domain == "tokens":
        return num_tokens
    num_completion = max(0, num_tokens - ref.num_prompt_tokens)
    if lay.domain == "completion":
        return num_completion
    if counts is None:
        raise ChunkCorruptError(f"chunk {ref.uri}: array {lay.name} is ragged but its counts were not read first")
    return int(counts[:num_completion].sum())


def fetch_arrays(store: Store, ref: PayloadRef, num_tokens: int | None = None) -> dict[str, np.ndarray]:
    """Read a branch's arrays, cut to its first ``num_tokens`` tokens (default: all).

    Returns:
        name -> read-only array; token-domain arrays have ``num_tokens`` rows,
        completion-domain arrays ``max(0, num_tokens - num_prompt_tokens)`` rows,
        ragged values the rows their kept counts cover.

    Raises:
        OutsideRunError: the ref points outside the run prefix (before any I/O).
        ChunkNotFoundError: the chunk does not exist (never zeros).
        ChunkCorruptError: length or checksum mismatch.
        ValueError: ``num_tokens`` outside ``[0, ref.num_tokens]``.
    """
    n = ref.num_tokens if num_tokens is None else num_tokens
    if not 0 <= n <= ref.num_tokens:
        raise ValueError(f"num_tokens={n} for chunk {ref.uri}: expected 0..{ref.num_tokens}")
    data_key, _ = chunk_keys(store, ref)
    if n == ref.num_tokens or ref.compression != "none":
        payload = decode_payload(ref, store.get(data_key), ref.uri)
        return _cut(ref, n, lambda lay, rows: view_array(payload, lay, rows))
    return _cut(ref, n, lambda lay, rows: _read_rows(store, data_key, ref, lay, rows))


def _cut(ref: PayloadRef, n: int, read) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {}
    layouts = ref.layout()
    by_name = {lay.name: lay for lay in layouts}
    for lay in sorted(layouts, key=lambda lay: lay.domain.startswith("values:")):
        counts = None
        if lay.domain.startswith("values:"):
            counts_name = lay.domain.partition(":")[2]
            counts = out.get(counts_name)
            if counts is None or counts_name not in by_name:
                raise ChunkCorruptError(f"chunk {ref.uri}: ragged array {lay.name} names missing counts {counts_name!r}")
        out[lay.name] = read(lay, rows_for(lay, ref, n, counts))
    return {name: out[name] for name in ref.arrays}


def _read_rows(store: Store, data_key: str, ref: PayloadRef, lay: ArrayLayout, rows: int) -> np.ndarray:
    row_nbytes = lay.dtype.itemsize * int(np.prod(lay.shape[1:], dtype=np.int64))
    end = lay.offset + rows * row_nbytes
    if rows == 0:
        return np.frombuffer(b"", lay.dtype).reshape(0, *lay.shape[1:])  # read-only, like every fetched array
    data = store.get(data_key, lay.offset, end)
    if len(data) != end - lay.offset:
        raise ChunkCorruptError(
            f"chunk {ref.uri}: array {lay.name} bytes [{lay.offset}, {end}) read {len(data)} bytes (truncated chunk)"
        )
    return np.frombuffer(data, lay.dtype).reshape(rows, *lay.shape[1:])


class FetchStats:
    """Thread-safe counters of one process's fetches: chunks, bytes, failures."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.chunks = 0
        self.nbytes = 0
        self.failures = 0

    def add(self, arrays: dict[str, np.ndarray] | None) -> None:
        with self._lock:
            if arrays is None:
                self.failures += 1
            else:
                self.chunks += 1
                self.nbytes += sum(a.nbytes for a in arrays.values())


def fetch_many(
    store: Store,
    requests: Sequence[tuple[PayloadRef, int]],
    *,
    max_concurrency: int,
    stats: FetchStats | None = None,
) -> list[dict[str, np.ndarray] | RefpipeError]:
    """Fetch many ``(ref, num_tokens)`` in parallel with at most ``max_concurrency`` threads.

    Transient store errors are retried inside the store (``StorageConfig.max_retries``).

    Returns:
        One entry per request, in order: the arrays (as ``fetch_arrays``) or the typed
        ``RefpipeError`` that ended that fetch. Errors that are not ``RefpipeError``
        (bugs) propagate.
    """

    def one(req: tuple[PayloadRef, int]):
        try:
            arrays = fetch_arrays(store, req[0], req[1])
        except RefpipeError as e:
            if stats:
                stats.add(None)
            return e
        if stats:
            stats.add(arrays)
        return arrays

    if len(requests) <= 1:
        return [one(r) for r in requests]
    with ThreadPoolExecutor(max_workers=min(max_concurrency, len(requests))) as pool:
        return list(pool.map(one, requests))
