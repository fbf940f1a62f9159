"""One branch's side-channel arrays as one Zarr v3 array (the chunk codec).

Layout (DESIGN.md, Storage layout, last row): every array of a branch is packed
into one uint8 Zarr v3 array with a single chunk. Each array starts at a 64-byte
aligned offset, little-endian, C order. The array's ``zarr.json`` attributes hold
the field table under ``"refpipe"``, so ``zarr.open(branch_uri, zarr_format=3)``
plus those attributes recover every typed array offline. Codecs: ``bytes``, then
optional ``zstd``, then ``crc32c`` (little-endian uint32 after the bytes; Zarr v3
spec, crc32c codec).

Verified partial reads: besides the whole-chunk crc32c (which zarr checks), every array
carries a crc32c per block of ``block_rows`` rows (``BLOCK_ROWS``), recorded in the
attributes and in the ``PayloadRef``. A read of an array's first ``n`` rows reads its
first ``ceil(n / block_rows)`` blocks and checks each, so no cut read returns bytes
nothing vouched for.

Keys under the run prefix: ``storage.layout`` (``payloads/<shard>/<branch_id>/c.0`` and its
``zarr.json``, the commit marker, written last).
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import crc32c  # CRC-32C like zarr's codec (google-crc32c); releases the GIL and ran ~2x faster here
import numcodecs
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from zarr.abc.codec import Codec
from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.dtype import parse_dtype
from zarr.core.metadata.v3 import ArrayV3Metadata

from refpipe.storage.errors import ChunkCorruptError, ConfigError, OutsideRunError
from refpipe.storage.layout import META_NAME, node_key

FORMAT_VERSION = 2
"""2: per-array block crc32c (``block_rows``, ``block_crcs``)."""
ALIGN_BYTES = 64
BLOCK_ROWS = 512
"""Rows per verified block of an array. A cut read reads up to ``BLOCK_ROWS - 1`` rows past its cut; a
ref of 4,096 tokens and four fields carries ~30 block crcs (~300 bytes of JSON)."""
ZSTD_MAX_RATIO = 32768
"""Most bytes one byte of a zstd frame can decode to: every block takes at least 4 bytes (3-byte header + 1
content byte of an RLE block) and regenerates at most 128 KiB (RFC 8878, 3.1.1.2). A ref whose arrays take
more than this times its compressed ``nbytes`` is refused at validation, so decoding allocates at most
``ZSTD_MAX_RATIO`` times the object's real size (``check_length`` runs first)."""
_ZSTD_MAGIC = 0xFD2FB528
_ZEROS = np.zeros(ALIGN_BYTES, np.uint8)
_UINT8 = parse_dtype(np.dtype("uint8"), zarr_format=3)

REF_ROWS_CHECKED_PER_USE = {"ref_rows": "checked per use"}
"""pydantic validation context under which a ref's rows need not agree with its token counts: a step file's refs
(``pipeline.step_file.StepFile``), whose disagreement drops only the micro batches that use them
(``StepHeader.micro_batch_problem``; ``storage.fetch`` refuses to read them). Every other ref is refused."""

Domain = str
"""Which rows an array has: ``"tokens"`` (one per token), ``"completion"`` (one per
completion token), ``"prompt"`` (one per prompt token) or ``"values:<name>"`` (ragged values; counts in
array ``<name>``)."""


def domain_rows(domain: Domain, num_prompt_tokens: int, num_tokens: int) -> int:
    """Rows of a ``tokens``/``completion``/``prompt`` array for the first ``num_tokens`` tokens of a branch."""
    if domain == "tokens":
        return num_tokens
    if domain == "prompt":
        return min(num_tokens, num_prompt_tokens)
    return max(0, num_tokens - num_prompt_tokens)


class ArraySpec(NamedTuple):
    """dtype (numpy ``dtype.str``, little-endian), shape, row domain and block crc32c of one stored array."""

    dtype: str
    shape: tuple[int, ...]
    domain: Domain
    block_crcs: tuple[int, ...] = ()
    """crc32c of each block of ``PayloadRef.block_rows`` rows (the last block may be shorter);
    ``ceil(rows / block_rows)`` of them. Filled by ``encode_chunk``."""


class ArrayLayout(NamedTuple):
    """Where one array lives inside the chunk's payload."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    domain: Domain
    offset: int
    nbytes: int
    block_crcs: tuple[int, ...]


class PayloadRef(BaseModel):
    """What keep returns: which branch's chunk to read and how to cut it, without reading it.

    Run-relative: the chunk's identity is ``branch_id``; its key under the run prefix is
    ``node_key(branch_id)`` (``key``), and every reader resolves it against the run as *it*
    opened it (any mount path, a copy of the run, a copied S3 prefix). ``uri`` records where
    the writer saw the chunk (provenance only); it must end in ``/<key>``, so the two can never
    name different chunks. Serialised as JSON it is a few hundred bytes for four fields.

    Raises:
        ValueError (pydantic ``ValidationError``): ``uri`` does not end in ``/<node_key(branch_id)>``
            or has ``.``/``..`` segments, or ``branch_id`` is not a valid id.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    uri: str
    """Provenance: URI of the branch's Zarr array node as its writer saw it (``<run>/payloads/<shard>/<branch_id>``)."""
    branch_id: str
    """Unique id of the branch within the run; names the chunk (``key``)."""
    num_prompt_tokens: int = Field(ge=0)
    """Prompt tokens of the branch."""
    num_completion_tokens: int = Field(ge=0)
    """Completion tokens of the branch."""
    arrays: dict[str, ArraySpec]
    """Stored arrays in payload order: name -> (dtype, shape, domain)."""
    nbytes: int = Field(ge=4)
    """Bytes of the stored chunk object, checksum included."""
    checksum: int = Field(ge=0, lt=2**32)
    """crc32c of the stored chunk bytes before the checksum (the value the crc32c codec appends)."""
    compression: Literal["none", "zstd"] = "none"
    """Bytes-to-bytes codec between ``bytes`` and ``crc32c``."""
    block_rows: int = BLOCK_ROWS
    """Rows per block of each array's ``block_crcs``: always ``BLOCK_ROWS`` (``check_block_rows``)."""

    @field_validator("block_rows", mode="before")
    @classmethod
    def _block_rows(cls, value: object) -> int:
        return check_block_rows(value, "ref")

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "PayloadRef":
        """Untrusted refs (step files, episodes, the CLI): every declared size must agree before anything is
        allocated from it; ``storage.fetch`` then bounds every allocation by the object's real size. Rows that
        disagree with the token counts are refused too, except under ``REF_ROWS_CHECKED_PER_USE``."""
        names = set(self.arrays)
        for name, (dtype, shape, domain, crcs) in self.arrays.items():
            _check_spec(self, name, dtype, shape, domain, crcs, names)
        problem = None if info.context == REF_ROWS_CHECKED_PER_USE else self.rows_problem()
        if problem:
            raise ValueError(problem)
        payload_nbytes = layout_arrays(self.arrays)[1]
        if self.compression == "none" and self.nbytes != payload_nbytes + 4:
            raise ValueError(f"nbytes={self.nbytes}: expected {payload_nbytes + 4} for the "
                             f"declared arrays (payload, 64-byte aligned, + 4 crc bytes)")
        if self.compression == "zstd" and payload_nbytes > ZSTD_MAX_RATIO * (self.nbytes - 4):
            raise ValueError(f"nbytes={self.nbytes}: a zstd frame of {self.nbytes - 4} bytes decodes to at most "
                             f"{ZSTD_MAX_RATIO * (self.nbytes - 4)} bytes, the declared arrays take {payload_nbytes}")
        return self

    @model_validator(mode="after")
    def _uri_names_the_branch(self) -> "PayloadRef":
        check_ref_uri(self.uri, self.branch_id)
        return self

    @property
    def key(self) -> str:
        """The chunk's node key under the run prefix, derived from ``branch_id``.

        Raises:
            OutsideRunError: ``uri`` names another chunk (a ref built without validation,
                e.g. by ``model_copy``); nothing is read or deleted.
        """
        try:
            return check_ref_uri(self.uri, self.branch_id)
        except (ConfigError, ValueError) as e:
            raise OutsideRunError(f"ref {self.branch_id!r}: {e}") from None

    @property
    def num_tokens(self) -> int:
        """Prompt + completion tokens."""
        return self.num_prompt_tokens + self.num_completion_tokens

    def rows_problem(self) -> str | None:
        """Which array's rows disagree with the token counts (a ``tokens`` array has ``num_tokens`` rows, a
        ``completion`` array ``num_completion_tokens``, a ``prompt`` array ``num_prompt_tokens``), e.g.
        ``array 'routed_experts': 9 rows: expected 10 (tokens domain)``; None when every array agrees.
        ``storage.fetch`` reads nothing from a ref with a problem."""
        for name, spec in self.arrays.items():
            expected = {"tokens": self.num_tokens, "completion": self.num_completion_tokens,
                        "prompt": self.num_prompt_tokens}.get(spec.domain)
            if expected is not None and spec.shape[0] != expected:
                return f"array {name!r}: {spec.shape[0]} rows: expected {expected} ({spec.domain} domain)"
        return None

    def layout(self) -> list[ArrayLayout]:
        """Offsets of every array in the payload (derived, never stored in the ref)."""
        return layout_arrays(self.arrays)[0]


def layout_arrays(arrays: Mapping[str, ArraySpec]) -> tuple[list[ArrayLayout], int]:
    """Place arrays at 64-byte aligned offsets; return the layouts and the payload size (>= 64)."""
    out, offset = [], 0
    for name, (dtype, shape, domain, crcs) in arrays.items():
        dt = np.dtype(dtype)
        nbytes = math.prod(shape) * dt.itemsize
        out.append(ArrayLayout(name, dt, tuple(shape), domain, offset, nbytes, tuple(crcs)))
        offset += -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES
    return out, max(offset, ALIGN_BYTES)


STORED_DTYPES = {"|u1", "<u2", "<i4", "<f4", "|b1", "<i8", "<u4", "<f8", "<i2", "|i1", "<f2", "<u8"}
"""Stored dtypes a ref may declare: little-endian fixed-size numbers (no objects, strings or structs)."""


def _check_spec(ref: "PayloadRef", name: str, dtype: str, shape: tuple[int, ...], domain: str, crcs: tuple[int, ...],
                names: set[str]) -> None:
    """Raise ``ValueError`` (pydantic turns it into a ``ValidationError``) unless one declared array is sane."""
    what = f"array {name!r}"
    if dtype not in STORED_DTYPES:
        raise ValueError(f"{what}: dtype {dtype!r}: expected one of {sorted(STORED_DTYPES)}")
    if not shape or any(d < 0 for d in shape):
        raise ValueError(f"{what}: shape {list(shape)}: expected at least one dimension, none negative")
    if domain not in ("tokens", "completion", "prompt") and not (domain.startswith("values:") and domain[7:] in names):
        raise ValueError(f"{what}: domain {domain!r}: expected 'tokens', 'completion', 'prompt' or 'values:<array>'")
    if len(crcs) != -(-shape[0] // ref.block_rows) or any(not 0 <= c < 2**32 for c in crcs):
        raise ValueError(f"{what}: {len(crcs)} block crcs: expected {-(-shape[0] // ref.block_rows)} uint32 "
                         f"(one per {ref.block_rows} rows of {shape[0]})")


def check_block_rows(value: object, what: str) -> int:
    """The one rule for ``block_rows``, from a ref or a chunk's ``zarr.json``: exactly ``BLOCK_ROWS``.

    Every chunk of format version 2 is written with ``BLOCK_ROWS`` rows per verified block; any other
    value (0, negative, huge, not an integer) is a forged or foreign ref, refused before it sizes a read.

    Raises:
        ValueError: naming ``what`` (``ref`` or the ``zarr.json``), the value and the expected one.
    """
    if type(value) is not int or value != BLOCK_ROWS:
        raise ValueError(f"{what}: block_rows={value!r}: expected {BLOCK_ROWS} (rows per verified block "
                         f"of chunk format {FORMAT_VERSION})")
    return value


def block_crcs(a: np.ndarray, block_rows: int) -> tuple[int, ...]:
    """crc32c of each block of ``block_rows`` rows of a C-contiguous array ``[rows, ...]`` (its stored bytes)."""
    flat = a.reshape(-1).view(np.uint8)
    step = block_rows * a.itemsize * math.prod(a.shape[1:])
    return tuple(crc32c.crc32c(flat[i * step : (i + 1) * step])  # type: ignore[arg-type]  # numpy stubs: an ndarray is a Buffer only from Python 3.12
                 for i in range(-(-a.shape[0] // block_rows)))


def check_ref_uri(uri: str, branch_id: str) -> str:
    """Return ``node_key(branch_id)`` if ``uri`` ends in ``/<that key>`` and has no ``.``/``..`` segments.

    The rest of the URI (scheme, root, run id) is the writer's view of the run and is not checked:
    a run may be read through another mount path or as a copy.

    Raises:
        ValueError: ``uri`` names another chunk than ``branch_id`` (DESIGN.md, run-relative refs).
        ConfigError: ``branch_id`` is not a valid id.
    """
    key = node_key(branch_id)
    if not uri.endswith("/" + key) or any(seg in (".", "..") for seg in uri.split("/")):
        raise ValueError(f"ref uri {uri!r} does not name branch {branch_id!r}: expected a URI ending in /{key} "
                         f"(the key is derived from the branch id), without . or .. segments")
    return key


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
        crc = crc32c.crc32c(p, crc)  # type: ignore[arg-type]  # numpy stubs: an ndarray is a Buffer only from Python 3.12
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


def decode_payload(ref: PayloadRef, stored: bytes, what: str) -> np.ndarray | bytes:
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
    crc = crc32c.crc32c(body)  # type: ignore[arg-type]  # numpy stubs: an ndarray is a Buffer only from Python 3.12
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
