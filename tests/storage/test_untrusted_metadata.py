"""Untrusted metadata never sizes a read or an allocation unchecked, and has one reader (issue 14 residuals).

A forged ``block_rows`` is refused by its one rule (``storage.chunk_ref.check_block_rows``); a zstd frame
is decoded only into a buffer of the ref's declared size, so a small frame that declares or expands
to more is refused without allocating it (tracemalloc measures the Python and numpy allocations);
a malformed delete record is refused by its one reader (``storage.ledger_records.read_delete_record``).
Local backend only: these rules run on bytes already read, the same for every store.
"""

from __future__ import annotations

import tracemalloc

import google_crc32c
import numcodecs
import numpy as np
import pytest
from pydantic import ValidationError

from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.chunk_codec import encode_chunk
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.chunk_write import put_chunk
from refpipe.storage.errors import ChunkCorruptError, DoubleDeleteError
from refpipe.storage.layout import DATA_NAME, node_key, tombstone_key
from refpipe.storage.ledger import Ledger
from tests.storage.storage_helpers import FIELDS_CFG, Backend, make_backend, make_fields, stored_cut

P, C = 4, 6
PAYLOAD_NBYTES = 576
"""The payload of ``keep``'s branch: 4 fields, each 64-byte aligned."""
GIB = 2**30


@pytest.fixture
def backend(local_config) -> Backend:
    return make_backend("local", local_config)


def keep(backend: Backend, compression: str = "none") -> PayloadRef:
    config = backend.config.model_copy(update={"compression": compression})
    keeper = Keeper(backend.store, Ledger(backend.store, "env_worker_0"), FIELDS_CFG, config)
    return keeper.keep(Branch(P, C, make_fields(0, P, C), "b1"))


def zstd_bomb(expands_to: int, declares: int | None) -> bytes:
    """A valid zstd frame (RFC 8878) of RLE blocks: 4 bytes per 128 KiB of zeros, so 32 KiB expand to 1 GiB.
    ``declares``: the Frame_Content_Size its header states (8 bytes, single segment), or None (no size: a
    streaming frame with a 128 KiB window)."""
    block = 128 * 1024
    if declares is None:
        frame = bytearray(b"\x28\xb5\x2f\xfd\x00\x38")  # no content size; window 2**(10 + 7) bytes
    else:
        frame = bytearray(b"\x28\xb5\x2f\xfd\xe0" + declares.to_bytes(8, "little"))
    blocks = expands_to // block
    for i in range(blocks):
        last = i == blocks - 1
        frame += (last | 1 << 1 | block << 3).to_bytes(3, "little") + b"\x00"  # RLE block: one byte, repeated
    return bytes(frame)


def forge_chunk(backend: Backend, ref: PayloadRef, body: bytes) -> PayloadRef:
    """Store ``body`` + its crc32c as the ref's chunk; return the ref made to vouch for it (validated)."""
    crc = google_crc32c.value(body)
    backend.raw.put(f"{node_key(ref.branch_id)}/{DATA_NAME}", body + np.array([crc], "<u4").tobytes())
    return PayloadRef.model_validate({**ref.model_dump(), "nbytes": len(body) + 4, "checksum": crc})


def fetch_peak_nbytes(backend: Backend, ref: PayloadRef, message: str) -> int:
    """Fetch ``ref`` expecting ``ChunkCorruptError`` with exactly ``chunk <uri>: <message>``; return the peak bytes
    allocated meanwhile."""
    tracemalloc.start()
    try:
        with pytest.raises(ChunkCorruptError) as info:
            fetch_arrays(backend.store, ref)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert str(info.value) == f"chunk {ref.uri}: {message}"
    return peak


@pytest.mark.parametrize("declares", [None, 2**20])
def test_the_bomb_is_a_real_zstd_frame(declares):
    """What the bombs below expand to, decoded by zstd itself at 1 MiB (8 blocks: 38 or 45 bytes)."""
    frame = zstd_bomb(2**20, declares)
    assert numcodecs.Zstd().decode(frame) == bytes(2**20) and len(frame) == (38 if declares is None else 45)


@pytest.mark.parametrize("block_rows", [0, -1, 2**31, 256, "512", True])
def test_a_block_rows_other_than_the_formats_is_refused(backend, block_rows):
    """Before: 0 and -1 were pydantic's "greater than or equal to 1"; 2**31, 256, "512" and True validated (one crc
    per array of 10 rows fits any block_rows >= 10), and a cut read checked crcs of blocks nobody wrote."""
    raw = keep(backend).model_dump(mode="json") | {"block_rows": block_rows}
    with pytest.raises(ValidationError) as info:
        PayloadRef.model_validate(raw)
    assert f"ref: block_rows={block_rows!r}: expected 512 (rows per verified block of chunk format 2)" in str(
        info.value)


@pytest.mark.parametrize("crcs", [[], [0, 0]])
def test_a_block_crc_list_of_the_wrong_length_is_refused(backend, crcs):
    raw = keep(backend).model_dump(mode="json")
    raw["arrays"]["routed_experts"][3] = crcs
    with pytest.raises(ValidationError) as info:
        PayloadRef.model_validate(raw)
    assert (f"array 'routed_experts': {len(crcs)} block crcs: expected 1 uint32 (one per 512 rows of 10)"
            in str(info.value))


def test_a_zstd_bomb_declaring_1_gib_is_refused_before_allocating(backend):
    """Before: numcodecs allocated the 1 GiB the frame's header declares, decoded it, then the length check
    refused it."""
    ref = forge_chunk(backend, keep(backend, "zstd"), zstd_bomb(GIB, declares=GIB))
    assert ref.nbytes == 32_785  # 13 header bytes + 8,192 blocks of 4 + crc
    peak = fetch_peak_nbytes(backend, ref, f"zstd frame declares {GIB} bytes of content, expected "
                                           f"{PAYLOAD_NBYTES} (the ref's arrays)")
    assert peak < 256 * 1024, peak  # the 32 KiB object as read, twice at most, and small change; not 1 GiB


def test_a_zstd_frame_declaring_no_size_is_refused_before_decoding(backend):
    """Before: numcodecs streamed the frame into a growing buffer: 1 GiB allocated (2 GiB RSS while growing)."""
    ref = forge_chunk(backend, keep(backend, "zstd"), zstd_bomb(GIB, declares=None))
    peak = fetch_peak_nbytes(backend, ref, "zstd frame declares no content size (a streaming "
                                           "frame); refpipe writes one-shot frames that do")
    assert peak < 256 * 1024, peak


def test_a_zstd_frame_expanding_past_its_declared_size_stops_at_the_refs_size(backend):
    """The header agrees with the ref (576 bytes) but the blocks expand to 1 GiB: zstd stops at the buffer's end.
    Before: numcodecs allocated the 576 bytes the header declares and zstd refused the same way; refused now with
    the buffer the ref declares, never a size from the frame."""
    ref = forge_chunk(backend, keep(backend, "zstd"), zstd_bomb(GIB, declares=PAYLOAD_NBYTES))
    peak = fetch_peak_nbytes(backend, ref, f"zstd frame does not decode to its declared {PAYLOAD_NBYTES} bytes: "
                                           f"Zstd decompression error: b'Destination buffer is too small'")
    assert peak < 256 * 1024, peak


def test_a_zstd_ref_declaring_more_than_its_frame_can_hold_is_refused(backend):
    """A zstd ref of 580 stored bytes declaring 3.6e6 rows (21.6 MB of arrays): no 576-byte frame decodes to more than
    32768 * 576 = 18.9 MB (RFC 8878: >= 4 bytes per <= 128 KiB block). Before: validated; the fetch allocated
    the 21.6 MB the frame header could declare."""
    raw = keep(backend, "zstd").model_dump(mode="json")
    rows = 3_600_000
    raw["num_prompt_tokens"] = rows - C
    raw["nbytes"] = 580
    raw["arrays"]["routed_experts"][1:4:2] = [rows, 3, 2], [0] * -(-rows // 512)
    with pytest.raises(ValidationError) as info:
        PayloadRef.model_validate(raw)
    assert ("nbytes=580: a zstd frame of 576 bytes decodes to at most 18874368 bytes, the declared arrays take "
            "21600512" in str(info.value))


def test_bytes_that_are_not_a_zstd_frame_are_named_so(backend):
    """Before: ``zstd frame does not decode: Zstd decompression error: ...`` from whichever check numcodecs met."""
    ref = forge_chunk(backend, keep(backend, "zstd"), b"PK\x03\x04" + bytes(60))
    assert fetch_peak_nbytes(backend, ref, "not a zstd frame (starts 504b0304, expected 28b52ffd)") < 256 * 1024


@pytest.mark.parametrize("record,problem", [
    (b"[]", "Input should be an object"),
    (b"not json", "Invalid JSON: expected ident at line 1 column 2 (got b'not json')"),
    (b'{"holder": 3, "reason": "died"}', "branch_id: Field required; uri: Field required; holder: Input should be a "
                                        "valid string (got 3); t: Field required; session: Field required; claim: "
                                        "Field required"),
])
def test_a_malformed_delete_record_is_a_double_delete_naming_it(backend, record, problem):
    """The ledger's claim reads the record it lost to (``storage.ledger_records.read_delete_record``, the one reader;
    the CLI's ``deleted by`` uses it too). Before: ``[]`` raised AttributeError out of ``Ledger.delete``; ``not json``
    was "deleted by ? (unreadable delete record)"; ``holder: 3`` was "deleted by 3 (died)", trusted. On a filesystem
    a chunk's claim is the unlink of its commit marker, so the record is read once the marker is found gone (its
    deleter died after unlinking it)."""
    ref = keep(backend)
    tomb = tombstone_key(ref.branch_id)
    backend.raw.put(tomb, record)
    if backend.name == "local":
        marker = f"{backend.store.prefix.key_of(ref.uri)}/zarr.json"
        kept_marker = backend.raw.get(marker)
        backend.raw.remove(marker)
    with pytest.raises(DoubleDeleteError) as info:
        Ledger(backend.store, "trainer_dp0").delete([ref], reason="trained")
    assert str(info.value) == (
        f"1 double deletes, 0 deletes of unknown refs (0 other chunks deleted); first: chunk {ref.uri} was already "
        f"deleted by ? (delete record {backend.store.uri(tomb)} is unreadable: {problem}); second delete from "
        "trainer_dp0 (trained)")
    assert info.value.first_holder == "?" and backend.raw.get(tomb) == record
    if backend.name == "local":
        backend.raw.put(marker, kept_marker)
    assert fetch_arrays(backend.store, ref)["routed_experts"].shape == (P + C, 3, 2)  # nothing deleted


@pytest.mark.parametrize("num_tokens", [None, P + 2])
@pytest.mark.parametrize("counts", [[100] * C, [-1, 5, 0, 0, 0, 0]])
def test_ragged_counts_slicing_past_their_values_are_corrupt(backend, counts, num_tokens):
    """A ref and chunk that agree (crcs and all) but whose ragged counts slice past the values they count. Before:
    counts of 100 were numpy's untyped ``ValueError: buffer is smaller than requested size`` on both read paths
    (a smaller excess viewed the next array's bytes as values); a count of -1 was returned as data."""
    stored = stored_cut(make_fields(0, P, C), P, P + C)
    stored["sampling_mask.counts"] = np.array(counts, np.int32)
    chunk = encode_chunk("b2", stored, keep(backend).arrays, num_prompt_tokens=P, num_completion_tokens=C)
    ref = PayloadRef(uri=put_chunk(backend.store, "b2", chunk), branch_id="b2", num_prompt_tokens=P,
                     num_completion_tokens=C, arrays=chunk.arrays, nbytes=chunk.nbytes, checksum=chunk.checksum)
    values = len(stored["sampling_mask.ids"])
    completion = C if num_tokens is None else 2
    kept = counts[:completion]
    with pytest.raises(ChunkCorruptError) as info:
        fetch_arrays(backend.store, ref, num_tokens)
    assert str(info.value) == (
        f"chunk {ref.uri}: array sampling_mask.ids: counts of the first {completion} rows of sampling_mask.counts "
        f"(min {min(kept)}) sum to {sum(kept)} rows: expected non-negative counts summing to at most its {values} rows")
