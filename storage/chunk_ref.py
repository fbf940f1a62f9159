"""A branch's payload reference and its contract: ``PayloadRef``, the array specs and their layout.

A ``PayloadRef`` names one branch's chunk (run-relative, by branch id) and says how to cut it without
reading it: every array's dtype, shape, row domain and per-block crc32c, the chunk's length and checksum.
Validation makes every declared size agree before anything is allocated from an untrusted ref (step
files, episodes, the CLI). The bytes themselves: ``storage.chunk_codec``; writing and reading a chunk:
``storage.chunk_write``, ``storage.chunk_read``; its keys: ``storage.layout``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)

from refpipe.storage.checksum import crc32c
from refpipe.storage.errors import ConfigError, OutsideRunError
from refpipe.storage.layout import ID_RULE, is_id, node_key

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

REF_ROWS_CHECKED_PER_USE = {"ref_rows": "checked per use"}
"""pydantic validation context under which a ref's rows need not agree with its token counts: a step file's refs
(``pipeline.step_file.StepFile``), whose disagreement drops only the micro batches that use them
(``StepHeader.micro_batch_problem``; ``storage.chunk_read`` refuses to read them). Every other ref is refused."""

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
    __slots__ = ("_fetch_plans",)
    """``_fetch_plans``: ``storage.segment_read``'s plans of this ref object's fetches, made on its first fetch. A slot,
    not a field: never validated, serialised or compared, and not carried by ``model_copy`` (whose update may change
    what a plan derives from), ``copy`` or pickling."""

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
    holders: tuple[str, ...] = ()
    """A shared prefix (``Keeper.keep_prefix``): the branch ids holding it, declared when it was kept; it is deleted
    after each of them was released or discarded (``storage.ledger_holds``). Empty: the chunk of one branch."""
    offset: int | None = Field(default=None, ge=0)
    """Where the chunk's bytes start in the object its ``branch_id`` names: a segment appended to its writer life's
    object (``pipeline.open_branch``; the chunk is bytes ``[offset, offset + nbytes)`` of it). None: the object is
    the chunk."""
    segments: tuple["PayloadRef", ...] = ()
    """A segmented branch (``pipeline.open_branch``): the refs of its segments in token order, each an ordinary
    chunk covering tokens ``[start, end)`` of the branch (its own token counts are that range's prompt and
    completion tokens). The branch then has no chunk of its own: ``arrays`` holds the whole branch's shapes
    without block crcs, ``nbytes`` the segments' total and ``checksum`` ``segments_checksum``. Empty: one chunk."""

    @field_validator("block_rows", mode="before")
    @classmethod
    def _block_rows(cls, value: object) -> int:
        return check_block_rows(value, "ref")

    @model_validator(mode="after")
    def _consistent(self, info: ValidationInfo) -> "PayloadRef":
        """Untrusted refs (step files, episodes, the CLI): every declared size must agree before anything is
        allocated from it; ``storage.chunk_read`` then bounds every allocation by the object's real size. Rows that
        disagree with the token counts are refused too, except under ``REF_ROWS_CHECKED_PER_USE``."""
        names = set(self.arrays)
        for name, (dtype, shape, domain, crcs) in self.arrays.items():
            _check_spec(self, name, dtype, shape, domain, crcs, names)
        problem = None if info.context == REF_ROWS_CHECKED_PER_USE else self.rows_problem()
        if problem:
            raise ValueError(problem)
        bad = [h for h in self.holders if not is_id(h)]
        if self.offset is not None and (self.segments or self.holders):
            raise ValueError(f"offset={self.offset}: expected none on a ref with segments or holders")
        if bad or len(set(self.holders)) != len(self.holders) or (self.holders and self.segments):
            raise ValueError(f"holders {list(self.holders)}: expected distinct branch ids ({ID_RULE}), on a ref "
                             f"without segments")
        if self.segments:
            _check_segments(self)
            return self
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

    @model_serializer(mode="wrap")
    def _without_empty_segments(self, handler: SerializerFunctionWrapHandler) -> dict[str, object]:
        """A ref serialises without empty ``holders`` and ``segments`` and a None ``offset``."""
        out: dict[str, object] = handler(self)
        for name in ("holders", "segments", "offset"):
            if getattr(self, name) in ((), None):
                out.pop(name, None)
        return out

    @property
    def nodes(self) -> tuple[str, ...]:
        """Node keys of every object this ref names (``chunks``), each once.

        Raises:
            OutsideRunError: as ``key``.
        """
        return tuple(c.key for c in self.chunks)

    @property
    def chunks(self) -> tuple["PayloadRef", ...]:
        """One ref per object this ref names, in order: its ``segments`` (of segments sharing a writer life's object,
        the first), else itself. What a delete claims and removes."""
        return object_refs(self.segments) if self.segments else (self,)

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
        ``storage.chunk_read`` reads nothing from a ref with a problem."""
        for name, spec in self.arrays.items():
            expected = {"tokens": self.num_tokens, "completion": self.num_completion_tokens,
                        "prompt": self.num_prompt_tokens}.get(spec.domain)
            if expected is not None and spec.shape[0] != expected:
                return f"array {name!r}: {spec.shape[0]} rows: expected {expected} ({spec.domain} domain)"
        return None

    def layout(self) -> list[ArrayLayout]:
        """Offsets of every array in the payload (derived, never stored in the ref)."""
        return layout_arrays(self.arrays)[0]


def object_refs(segments: Sequence[PayloadRef]) -> tuple[PayloadRef, ...]:
    """The first ref of each object among ``segments`` (segments of one writer life share one: ``offset``)."""
    return tuple({s.branch_id: s for s in reversed(segments)}.values())[::-1]


def segments_checksum(segments: tuple[PayloadRef, ...]) -> int:
    """A segmented ref's ``checksum``: crc32c of its segments' checksums (uint32 little-endian, in order)."""
    return int(crc32c(np.array([s.checksum for s in segments], "<u4").tobytes()))


def segment_tokens(num_prompt_tokens: int, start: int, end: int) -> tuple[int, int]:
    """``(prompt, completion)`` tokens among tokens ``[start, end)`` of a branch of ``num_prompt_tokens``."""
    prompt = min(end, num_prompt_tokens) - min(start, num_prompt_tokens)
    return prompt, end - start - prompt


def _check_segments(ref: "PayloadRef") -> None:
    """Raise ``ValueError`` unless a segmented ref's segments tile its tokens and arrays exactly."""
    start, rows = 0, dict.fromkeys(ref.arrays, 0)
    objects: dict[str, int] = {}  # object id -> its bytes up to the segment before
    for i, seg in enumerate(ref.segments):
        what = f"segment {i} ({seg.branch_id})"
        at = objects.get(seg.branch_id, 0) if i and ref.segments[i - 1].branch_id == seg.branch_id else 0
        if seg.branch_id in objects and not at or (seg.offset is not None and seg.offset != at):
            raise ValueError(f"{what}: offset {seg.offset}: expected {at} (the segments of one object follow each "
                             f"other, each starting where the one before ends)")
        objects[seg.branch_id] = at + seg.nbytes if seg.offset is not None else 0
        counts = segment_tokens(ref.num_prompt_tokens, start, start + seg.num_tokens)
        if seg.segments or (seg.num_prompt_tokens, seg.num_completion_tokens) != counts \
                or seg.compression != ref.compression:
            raise ValueError(f"{what}: {seg.num_prompt_tokens} prompt + {seg.num_completion_tokens} completion "
                             f"tokens ({seg.compression}): expected {counts[0]} + {counts[1]} (tokens [{start}, "
                             f"{start + seg.num_tokens}) of the branch; {ref.compression}, no segments of its own)")
        absent = [n for n in ref.arrays.keys() - seg.arrays.keys() if _segment_rows(ref, seg, n)]
        if absent or seg.arrays.keys() - ref.arrays.keys():
            raise ValueError(f"{what}: arrays {list(seg.arrays)}: expected {list(ref.arrays)} (an array may be absent "
                             f"only where it has no rows: a shared prefix without completion arrays)")
        for name, spec in seg.arrays.items():
            whole = ref.arrays[name]
            if (spec.dtype, spec.domain, spec.shape[1:]) != (whole.dtype, whole.domain, whole.shape[1:]):
                raise ValueError(f"{what}: array {name!r} is {spec.dtype} {list(spec.shape)} ({spec.domain}): "
                                 f"expected {whole.dtype} [rows, {', '.join(map(str, whole.shape[1:]))}] "
                                 f"({whole.domain})")
            rows[name] += spec.shape[0]
        start += seg.num_tokens
    problems = [f"array {n!r}: {rows[n]} rows in segments, {s.shape[0]} declared" for n, s in ref.arrays.items()
                if rows[n] != s.shape[0]]
    if start != ref.num_tokens or problems:
        raise ValueError(f"segments cover {start} tokens: expected {ref.num_tokens}; {'; '.join(problems)}")
    if ref.nbytes != sum(s.nbytes for s in ref.segments) or ref.checksum != segments_checksum(ref.segments):
        raise ValueError(f"nbytes={ref.nbytes}, checksum={ref.checksum:#010x}: expected the segments' total "
                         f"{sum(s.nbytes for s in ref.segments)} and segments_checksum "
                         f"{segments_checksum(ref.segments):#010x}")


def _segment_rows(ref: "PayloadRef", seg: "PayloadRef", name: str) -> int:
    """Rows array ``name`` of ``ref`` would have in segment ``seg`` (ragged values: 1 unless its counts are absent)."""
    domain = ref.arrays[name].domain
    if domain.startswith("values:"):
        return int(domain[7:] in seg.arrays)
    return domain_rows(domain, seg.num_prompt_tokens, seg.num_tokens)


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
    expected = 0 if ref.segments else -(-shape[0] // ref.block_rows)
    if len(crcs) != expected or any(not 0 <= c < 2**32 for c in crcs):
        raise ValueError(f"{what}: {len(crcs)} block crcs: expected {expected} uint32 "
                         + ("(a segmented ref: its segments carry them)" if ref.segments
                            else f"(one per {ref.block_rows} rows of {shape[0]})"))


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

