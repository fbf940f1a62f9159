"""One branch's side-channel arrays as one Zarr v3 array: encoding, decoding and the checks of its bytes.

Layout (DESIGN.md, Storage layout, last row): every array of a branch is packed
into one uint8 Zarr v3 array with a single chunk. Each array starts at a 64-byte
aligned offset, little-endian, C order. The array's ``zarr.json`` attributes hold
the field table under ``"refpipe"``, so ``zarr.open(branch_uri, zarr_format=3)``
plus those attributes recover every typed array offline. Codecs: ``bytes``, then
optional ``zstd``, then ``crc32c`` (little-endian uint32 after the bytes; Zarr v3
spec, crc32c codec).

Verified partial reads: besides the whole-chunk crc32c (which zarr checks), every array
carries a crc32c per block of ``block_rows`` rows (``BLOCK_ROWS``), recorded in the
attributes and in the ``PayloadRef`` (``storage.chunk_ref``). A read of an array's first ``n``
rows reads its first ``ceil(n / block_rows)`` blocks and checks each, so no cut read returns
bytes nothing vouched for.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import numcodecs
import numpy as np
from zarr.abc.codec import Codec
from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.dtype import parse_dtype
from zarr.core.metadata.v3 import ArrayV3Metadata

from refpipe.storage.checksum import crc32c
from refpipe.storage.chunk_ref import (
    ALIGN_BYTES,
    BLOCK_ROWS,
    FORMAT_VERSION,
    ArrayLayout,
    ArraySpec,
    PayloadRef,
    layout_arrays,
)
from refpipe.storage.errors import ChunkCorruptError
from refpipe.storage.layout import META_NAME

_ZSTD_MAGIC = 0xFD2FB528
_ZEROS = np.zeros(ALIGN_BYTES, np.uint8)
_UINT8 = parse_dtype(np.dtype("uint8"), zarr_format=3)

def block_crcs(a: np.ndarray, block_rows: int) -> tuple[int, ...]:
    """crc32c of each block of ``block_rows`` rows of a C-contiguous array ``[rows, ...]`` (its stored bytes)."""
    flat = a.reshape(-1).view(np.uint8)
    step = block_rows * a.itemsize * math.prod(a.shape[1:])
    return tuple(crc32c(flat[i * step : (i + 1) * step])
                 for i in range(-(-a.shape[0] // block_rows)))



class EncodedChunk(NamedTuple):
    """A branch ready to write: chunk parts (written in order), ``zarr.json`` bytes and the ref fields."""

    parts: list[np.ndarray]
    """uint8 buffers, written in order."""
    metadata: bytes
    nbytes: int
    checksum: int
    arrays: dict[str, ArraySpec]
    """The ref's array table: ``specs`` with each array's ``block_crcs``."""


def encode_chunk(
    branch_id: str,
    arrays: Mapping[str, np.ndarray],
    specs: Mapping[str, ArraySpec],
    *,
    num_prompt_tokens: int,
    num_completion_tokens: int,
    compression: Literal["none", "zstd"] = "none",
    zstd_level: int = 1,
    writer: str = "",
) -> EncodedChunk:
    """Pack validated arrays into one chunk. ``arrays`` must match ``specs`` (validated by the caller).

    Non-contiguous or big-endian inputs are copied once; others are written zero-copy.
    """
    layouts, payload_nbytes = layout_arrays(specs)
    parts: list[np.ndarray] = []
    crcs: dict[str, ArraySpec] = {}
    for lay in layouts:
        a = np.ascontiguousarray(arrays[lay.name], dtype=lay.dtype)
        crcs[lay.name] = ArraySpec(lay.dtype.str, lay.shape, lay.domain, block_crcs(a, BLOCK_ROWS))
        if a.nbytes:
            parts.append(a.reshape(-1).view(np.uint8))
        pad = (-a.nbytes) % ALIGN_BYTES
        if pad:
            parts.append(_ZEROS[:pad])
    written = sum(len(p) for p in parts)
    if written < payload_nbytes:
        parts.append(np.zeros(payload_nbytes - written, np.uint8))
    if compression == "zstd":
        parts = [np.frombuffer(numcodecs.Zstd(level=zstd_level).encode(b"".join(parts)), np.uint8)]  # type: ignore[arg-type]  # numpy stubs: an ndarray is a Buffer only from Python 3.12
    crc = 0
    for p in parts:
        crc = crc32c(p, crc)
    parts.append(np.array([crc], "<u4").view(np.uint8))
    metadata = _metadata_json(branch_id, crcs, payload_nbytes, num_prompt_tokens, num_completion_tokens,
                              compression, zstd_level, writer)
    return EncodedChunk(parts, metadata, sum(len(p) for p in parts), crc, crcs)


def _metadata_json(branch_id: str, arrays: Mapping[str, ArraySpec], payload_nbytes: int, num_prompt_tokens: int,
                   num_completion_tokens: int, compression: str, zstd_level: int, writer: str) -> bytes:
    """``zarr.json`` of the branch array: zarr's own document for the codecs, with this branch's shape and attributes.

    Equal (as JSON) to ``ArrayV3Metadata(...).to_buffer_dict()``, which takes ~0.5 ms per call
    (zarr pretty-prints through the pure-Python JSON encoder); this takes ~30 us.
    """
    doc = json.loads(_metadata_template(compression, zstd_level))
    doc["shape"] = [payload_nbytes]
    doc["chunk_grid"]["configuration"]["chunk_shape"] = [payload_nbytes]
    doc["attributes"] = {
        "refpipe": {
            "format": "refpipe.packed_branch",
            "version": FORMAT_VERSION,
            "branch_id": branch_id,
            "writer": writer,
            "num_prompt_tokens": num_prompt_tokens,
            "num_completion_tokens": num_completion_tokens,
            "block_rows": BLOCK_ROWS,
            "arrays": {
                lay.name: {"dtype": lay.dtype.str, "shape": list(lay.shape), "domain": lay.domain, "offset": lay.offset,
                           "block_crcs": list(lay.block_crcs)}
                for lay in layout_arrays(arrays)[0]
            },
        }
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def segments_metadata(object_id: str, nbytes: int, num_prompt_tokens: int, num_completion_tokens: int,
                      writer: str) -> bytes:
    """``zarr.json`` of a writer life's object of an open branch (``pipeline.segment_write``): a 1-D uint8 array of
    the ``nbytes`` its segments take, ``bytes`` codec only (each segment carries its own crc32c, its ref its offset),
    attributes naming the object, its writer and the tokens its segments cover."""
    doc = json.loads(_metadata_template("none", 0))
    doc["shape"] = doc["chunk_grid"]["configuration"]["chunk_shape"] = [nbytes]
    doc["codecs"] = [c for c in doc["codecs"] if c["name"] == "bytes"]
    doc["attributes"] = {"refpipe": {"format": "refpipe.segments", "version": FORMAT_VERSION, "branch_id": object_id,
                                     "writer": writer, "nbytes": nbytes, "num_prompt_tokens": num_prompt_tokens,
                                     "num_completion_tokens": num_completion_tokens}}
    return json.dumps(doc, separators=(",", ":")).encode()


@functools.lru_cache(maxsize=4)
def _metadata_template(compression: str, zstd_level: int) -> str:
    """zarr's ``zarr.json`` of a one-chunk uint8 array with our codecs (one per compression setting)."""
    codecs: list[Codec] = [BytesCodec()]
    if compression == "zstd":
        codecs.append(ZstdCodec(level=zstd_level, checksum=False))
    codecs.append(Crc32cCodec())
    meta = ArrayV3Metadata(
        shape=(1,), data_type=_UINT8,
        chunk_grid={"name": "regular", "configuration": {"chunk_shape": [1]}},
        chunk_key_encoding={"name": "default", "configuration": {"separator": "."}},
        fill_value=0, codecs=codecs, attributes={}, dimension_names=None, storage_transformers=None,
    )
    return meta.to_buffer_dict(default_buffer_prototype())[META_NAME].to_bytes().decode()


def decode_payload(ref: PayloadRef, stored: bytes | np.ndarray, what: str) -> np.ndarray | bytes:
    """Check a whole stored chunk against its ref and return the payload bytes.

    A zstd frame is decoded into one buffer of the declared arrays' size (``layout_arrays``), and only
    after its header declared exactly that content size: a frame declaring or expanding to more is
    refused having allocated at most that buffer (bounded by ``ZSTD_MAX_RATIO`` times ``len(stored)``).

    Raises:
        ChunkCorruptError: wrong length, checksum mismatch, a zstd frame declaring no or another content
            size, or one that does not decode to exactly that size.
    """
    check_length(ref, len(stored), what)
    body = np.frombuffer(stored, np.uint8, len(stored) - 4)
    crc = crc32c(body)
    check_checksum(ref, crc, int(np.frombuffer(stored, "<u4", 1, len(stored) - 4)[0]), what)
    if ref.compression == "none":
        return body
    expected = layout_arrays(ref.arrays)[1]
    declared = _zstd_content_size(body, what)
    if declared != expected:
        raise ChunkCorruptError(f"chunk {what}: zstd frame declares {declared} bytes of content, expected {expected} "
                                f"(the ref's arrays)")
    payload = np.empty(expected, np.uint8)
    try:
        numcodecs.Zstd().decode(body, out=payload)  # refuses output beyond the buffer; zstd checks the declared size
    except Exception as e:  # numcodecs raises RuntimeError/ValueError variants for bad frames
        raise ChunkCorruptError(f"chunk {what}: zstd frame does not decode to its declared {expected} bytes: "
                                f"{e}") from e
    payload.flags.writeable = False  # every fetched array is read-only, as a view of the bytes read
    return payload


def _zstd_content_size(frame: np.ndarray, what: str) -> int:
    """The content size a zstd frame's header declares (RFC 8878, 3.1.1.1). refpipe's writer
    (``numcodecs.Zstd``, one shot) always declares it.

    Raises:
        ChunkCorruptError: not a zstd frame, or a frame declaring no content size (a streaming frame).
    """
    header = bytes(frame[:18])
    if len(header) < 6 or int.from_bytes(header[:4], "little") != _ZSTD_MAGIC:
        raise ChunkCorruptError(f"chunk {what}: not a zstd frame (starts {header[:4].hex()}, expected 28b52ffd)")
    descriptor = header[4]
    single_segment = descriptor >> 5 & 1
    size_bytes = (single_segment, 2, 4, 8)[descriptor >> 6]
    start = 5 + (1 - single_segment) + (0, 1, 2, 4)[descriptor & 3]  # window descriptor, dictionary id
    if not size_bytes or len(header) < start + size_bytes:
        raise ChunkCorruptError(f"chunk {what}: zstd frame declares no content size (a streaming frame); refpipe "
                                f"writes one-shot frames that do")
    return int.from_bytes(header[start : start + size_bytes], "little") + (256 if size_bytes == 2 else 0)


def check_length(ref: PayloadRef, nbytes: int, what: str) -> None:
    """Raise ``ChunkCorruptError`` unless a stored chunk of ``nbytes`` bytes has the ref's length."""
    if nbytes != ref.nbytes:
        raise ChunkCorruptError(f"chunk {what}: expected {ref.nbytes} bytes, got {nbytes} (truncated or replaced)")


def check_checksum(ref: PayloadRef, computed: int, stored: int, what: str) -> None:
    """Raise ``ChunkCorruptError`` unless the computed crc32c equals both the stored one and the ref's."""
    if computed != stored or computed != ref.checksum:
        raise ChunkCorruptError(f"chunk {what}: crc32c mismatch: reference {ref.checksum:#010x}, "
                                f"stored {stored:#010x}, computed {computed:#010x}")


def view_array(payload: np.ndarray | bytes, lay: ArrayLayout, rows: int | None = None) -> np.ndarray:
    """Typed read-only view of one array (its first ``rows`` rows) inside the payload."""
    shape = lay.shape if rows is None else (rows, *lay.shape[1:])
    count = int(np.prod(shape, dtype=np.int64))
    return np.frombuffer(payload, lay.dtype, count, lay.offset).reshape(shape)


def read_writer(metadata: bytes) -> str | None:
    """The ``writer`` attribute of a branch's ``zarr.json``, tolerantly: None when the document is not
    one (not JSON, no refpipe attributes, a writer that is not a string). The one reader of the
    writer, shared by the audit and ``refpipe ls``."""
    try:
        writer = read_attributes(metadata).get("writer")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    return writer if isinstance(writer, str) else None


def read_attributes(metadata: bytes) -> dict[str, Any]:
    """The ``refpipe`` attributes of a branch's ``zarr.json`` (offline readers and the audit)."""
    attributes: dict[str, Any] = json.loads(metadata)["attributes"]["refpipe"]
    return attributes
