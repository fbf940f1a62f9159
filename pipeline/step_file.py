"""Step files: one per trainer step, token streams inline, side channels by reference (docs/step-files.md).

A step file is an uncompressed ``.npz`` (a zip of ``.npy`` arrays, readable with numpy alone:
``np.load(path)``) under ``<run>/steps/step_<N:08d>.npz`` with ``header.json`` (the ``StepHeader``:
schema version, run, step, ``seq_len``, the run's field shapes, every micro batch's sequences and
the refs they use, each stream member's crc32c) and ``dp<r>.mb<i>.<stream>.npy`` for every micro
batch ``i`` of DP rank ``r`` and every token stream in ``STREAMS`` and ``header.extra_streams``
(``[T]``, ``T`` = the micro batch's real tokens; padding to ``seq_len`` is the trainer's job).

Reading validates: a truncated or foreign file, an unknown schema version, a ref outside the run
prefix, a ref whose arrays disagree with the header's field shapes, a ``seq_len`` above
``MAX_SEQ_LEN`` or unequal to a micro batch's tokens plus padding, or a stream member whose crc32c,
dtype or shape disagrees with the header is a ``StepFileError`` naming the file, raised before
anything is sized from the header. A ref that disagrees with itself or its use (a slice longer than
its chunk, rows against its token counts) makes only its micro batches unusable
(``StepHeader.micro_batch_problem``). Published with one exclusive put (temp + link on a
filesystem, one conditional PUT on S3), after every chunk it references was kept.
"""

from __future__ import annotations

import io
import json
import os
import re
import zipfile
from collections.abc import Mapping
from typing import Annotated

import crc32c
import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.step_zip import npy_header_bytes, stream_member
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_ref import REF_ROWS_CHECKED_PER_USE, PayloadRef
from refpipe.storage.config import run_storage
from refpipe.storage.errors import ConfigError, KeyExistsError, StepFileError, validation_problems
from refpipe.storage.layout import STEPS_PREFIX, parse_step_key, step_key
from refpipe.storage.store import Store

SCHEMA_VERSION = 3
"""3: the header carries ``stream_crc32c`` (2: no stream checksums; 1: no field shapes)."""
HEADER_MEMBER = "header.json"
STREAMS: dict[str, str] = {
    "input_ids": "<i4",
    "loss_mask": "|b1",
    "advantages": "<f4",
    "inference_logprobs": "<f4",
    "position_ids": "<i4",
    "temperatures": "<f4",
}
"""Token streams of a micro batch: name -> dtype (numpy ``dtype.str``); each is [T]."""
_STREAM_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")
EXTRA_STREAM_DTYPES = ("|b1", "|i1", "|u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8")
"""dtypes an extra per-token stream may have (numpy ``dtype.str``, little-endian)."""
MAX_SEQ_LEN = 2**20
"""The largest ``seq_len`` (tokens per micro batch) a step file may declare, and ``OrchestratorConfig.seq_len``
may configure. A reader pads every micro batch to ``seq_len`` from the header alone (``trainer.assemble``: 6
streams, row ids, ``[seq_len, num_layers, top_k]`` routing; ~0.5 GiB at this bound with 48 x 8 routing), so an
untrusted header may not size those buffers beyond it."""


class SequenceRecord(BaseModel):
    """One sequence of a packed micro batch."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_tokens: int = Field(ge=1)
    """Tokens of this sequence in the packed streams; with a ref, also the ref's kept tokens
    (the first ``num_tokens`` tokens of the branch, after truncation)."""
    env_name: str
    """Environment that produced the sample (one per sequence, not per token)."""
    ref: int | None = None
    """Index into ``StepHeader.refs`` of the chunk holding this sequence's side channels; None: none."""
    borrowed: bool = False
    """A zero-loss padding dummy reusing ``refs[ref]``'s rows; the chunk's owner deletes it, once."""
    policy_version: int = Field(default=0, ge=0)
    """Trainer step whose weights sampled the sequence (a padding dummy: its source's), so the
    trainer can tell on-policy tokens from off-policy ones."""


class MicroBatchRecord(BaseModel):
    """One micro batch of one DP rank."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dp_rank: int = Field(ge=0)
    index: int = Field(ge=0)
    """Position of this micro batch among its DP rank's micro batches."""
    sequences: list[SequenceRecord] = Field(min_length=1)
    num_padding_tokens: int = Field(ge=0)
    """``seq_len - num_tokens``: tokens the trainer pads to reach ``seq_len``."""
    has_routing: bool
    """Every sequence carries token-domain rows (``routed_experts``, or a declared token-domain field: micro
    batches never mix with and without; ``has_token_rows``)."""

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens: the sum of the sequences' tokens."""
        return sum(s.num_tokens for s in self.sequences)

    def cu_seqlens(self) -> np.ndarray:
        """[num_sequences + 1] int32 cumulative sequence lengths, starting at 0."""
        return np.concatenate([[0], np.cumsum([s.num_tokens for s in self.sequences])]).astype(np.int32)


class StepHeader(BaseModel):
    """Everything in a step file except the token streams."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_version: int
    run_uri: str
    """Provenance: the run prefix URI as the orchestrator saw it. Readers resolve the step's refs
    against the run as they opened it (``PayloadRef.key``), so this may differ (a symlink, another
    mount path, a copy of the run) and is never compared."""
    step: int = Field(ge=0)
    seq_len: int = Field(ge=1)
    """Token budget of every micro batch: ``<= MAX_SEQ_LEN``, and every micro batch's tokens plus padding."""
    dp_world_size: int = Field(ge=1)
    micro_batches: list[MicroBatchRecord]
    """Ordered by ``(dp_rank, index)``; every DP rank has the same number."""
    refs: list[PayloadRef]
    """Every chunk the step references, once each."""
    owners: list[int]
    """``owners[i]``: the DP rank whose trainer deletes ``refs[i]`` after the step."""
    fields: FieldsConfig
    """The run's side-channel field shapes (trailing shapes and ``num_experts``) at the time the step
    was packed; every ref's stored arrays agree with it (checked on construction and on read)."""
    metrics: dict[str, float] = Field(default_factory=dict)
    """Orchestrator metrics of this step (reward mean, samples, ...)."""
    extra_streams: dict[str, str] = Field(default_factory=dict)
    """Per-token streams beside ``STREAMS`` that the publisher named: name -> ``EXTRA_STREAM_DTYPES`` entry; each
    micro batch holds each of them as ``[T]``, like ``STREAMS``."""
    stream_crc32c: dict[str, Annotated[int, Field(ge=0, lt=2**32)]] = Field(default_factory=dict)
    """Stream member name (``member_name``) -> crc32c of the member's bytes (its whole ``.npy``: header and array),
    for every stream member. Set by ``encode_step_file`` (a header not yet published has none); every read checks
    each member once against it (``StepFile``)."""

    def stream_dtypes(self) -> dict[str, str]:
        """Every stream of each micro batch: ``STREAMS`` then ``extra_streams``, name -> ``dtype.str``."""
        return {**STREAMS, **self.extra_streams}

    @model_validator(mode="after")
    def _consistent(self) -> "StepHeader":
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(f"schema_version {self.schema_version}: expected {SCHEMA_VERSION}")
        for name, dtype in self.extra_streams.items():
            check_extra_stream(name, dtype)
        if self.seq_len > MAX_SEQ_LEN:
            raise ValueError(f"seq_len {self.seq_len}: expected at most {MAX_SEQ_LEN} tokens (MAX_SEQ_LEN: a reader "
                             f"pads every micro batch to seq_len)")
        if len(self.owners) != len(self.refs) or any(not 0 <= o < self.dp_world_size for o in self.owners):
            raise ValueError(f"owners: expected {len(self.refs)} DP ranks in [0, {self.dp_world_size})")
        per_rank = [0] * self.dp_world_size
        for mb in self.micro_batches:
            if mb.dp_rank >= self.dp_world_size or mb.index != per_rank[mb.dp_rank]:
                raise ValueError(f"micro batch dp_rank={mb.dp_rank} index={mb.index} out of order")
            per_rank[mb.dp_rank] += 1
            self._check_micro_batch(mb)
        if len(set(per_rank)) > 1:
            raise ValueError(f"micro batches per DP rank differ: {per_rank}")
        for i, ref in enumerate(self.refs):
            self._check_ref_fields(i, ref)
        return self

    def _check_ref_fields(self, i: int, ref: PayloadRef) -> None:
        """Every stored array of ``refs[i]`` is a field ``self.fields`` configures, with its trailing shape."""
        registry = self.fields.registry()
        for name, spec in ref.arrays.items():
            fdef = registry.get(name.split(".")[0])
            trailing = None if fdef is None else fdef.trailing(self.fields.dims)
            if trailing is None:
                raise ValueError(f"ref {i} ({ref.uri}): array {name!r} is not a field configured in "
                                 f"fields ({self.fields!r})")
            if tuple(spec.shape[1:]) != trailing:
                raise ValueError(f"ref {i} ({ref.uri}): array {name!r} has trailing shape {list(spec.shape[1:])}: "
                                 f"expected {list(trailing)} from fields ({self.fields!r})")

    def _check_micro_batch(self, mb: MicroBatchRecord) -> None:
        if mb.num_tokens + mb.num_padding_tokens != self.seq_len:
            raise ValueError(f"micro batch dp_rank={mb.dp_rank} index={mb.index}: tokens {mb.num_tokens} "
                             f"+ padding {mb.num_padding_tokens} != seq_len {self.seq_len}")
        for seq in mb.sequences:
            if seq.ref is None:
                if mb.has_routing or seq.borrowed:
                    raise ValueError(f"micro batch dp_rank={mb.dp_rank} index={mb.index}: a sequence without "
                                     "a ref in a routing micro batch or marked borrowed")
                continue
            if not 0 <= seq.ref < len(self.refs):
                raise ValueError(f"micro batch dp_rank={mb.dp_rank} index={mb.index}: ref {seq.ref} missing")
            if mb.has_routing != has_token_rows(self.refs[seq.ref]):
                raise ValueError(f"micro batch dp_rank={mb.dp_rank} index={mb.index}: has_routing={mb.has_routing} "
                                 f"but ref {seq.ref} disagrees")

    def micro_batch_problem(self, mb: MicroBatchRecord) -> str | None:
        """Why ``mb``'s side channels cannot be used, or None: a sequence keeps more tokens than its ref holds, or
        a ref's rows disagree with its token counts (``PayloadRef.rows_problem``). Checked per micro batch, not
        on reading the header: a trainer drops such a micro batch (on every rank, counted) and trains the rest."""
        for j, seq in enumerate(mb.sequences):
            if seq.ref is None:
                continue
            ref, what = self.refs[seq.ref], f"micro batch dp_rank={mb.dp_rank} index={mb.index}: sequence {j}"
            if seq.num_tokens > ref.num_tokens:
                return (f"{what} keeps {seq.num_tokens} tokens of ref {seq.ref} (branch {ref.branch_id!r}), "
                        f"which holds {ref.num_tokens}")
            problem = ref.rows_problem()
            if problem:
                return f"{what}: ref {seq.ref} (branch {ref.branch_id!r}): {problem}"
        return None

    def micro_batches_of(self, dp_rank: int) -> list[MicroBatchRecord]:
        """The micro batches DP rank ``dp_rank`` trains, in order."""
        return [mb for mb in self.micro_batches if mb.dp_rank == dp_rank]

    def owned_refs(self, dp_rank: int) -> list[PayloadRef]:
        """The refs DP rank ``dp_rank`` deletes after the step (each ref has one owner)."""
        return [ref for ref, owner in zip(self.refs, self.owners) if owner == dp_rank]


def has_token_rows(ref: PayloadRef) -> bool:
    """Whether a ref stores a token-domain array (routing): its samples pack apart from the others."""
    return any(spec.domain == "tokens" for spec in ref.arrays.values())


def check_extra_stream(name: str, dtype: str) -> None:
    """Raise ``ValueError`` unless ``name`` is a new stream name (``[a-z][a-z0-9_]{0,63}``, not in ``STREAMS``) and
    ``dtype`` one of ``EXTRA_STREAM_DTYPES``."""
    if not _STREAM_NAME.fullmatch(name) or name in STREAMS:
        raise ValueError(f"extra stream {name!r}: expected a name of [a-z][a-z0-9_]{{0,63}} not in {list(STREAMS)}")
    if dtype not in EXTRA_STREAM_DTYPES:
        raise ValueError(f"extra stream {name!r}: dtype {dtype!r}: expected a numpy dtype.str of {EXTRA_STREAM_DTYPES}")


def member_name(dp_rank: int, index: int, stream: str) -> str:
    """Zip member of one stream of one micro batch."""
    return f"dp{dp_rank}.mb{index}.{stream}.npy"


def encode_step_file(header: StepHeader, streams: Mapping[tuple[int, int], Mapping[str, np.ndarray]]) -> bytes:
    """Serialise a step: ``streams[(dp_rank, index)][name]`` is a [T] array of ``header.stream_dtypes()[name]``.

    The header is written with ``stream_crc32c`` set to the crc32c of every stream member's bytes.

    Raises:
        StepFileError: a stream is missing, of the wrong dtype, or not [T] for its micro batch.
    """
    members: dict[str, tuple[bytes, np.ndarray]] = {}
    for mb in header.micro_batches:
        arrays = streams.get((mb.dp_rank, mb.index), {})
        for name, dtype in header.stream_dtypes().items():
            a = arrays.get(name)
            if a is None or a.dtype.str != dtype or a.shape != (mb.num_tokens,):
                got = None if a is None else f"{a.dtype.str} {list(a.shape)}"
                raise StepFileError(f"step {header.step} dp_rank={mb.dp_rank} micro batch {mb.index}: stream "
                                    f"{name!r} is {got}: expected {dtype} [{mb.num_tokens}]")
            # the .npy bytes np.lib.format.write_array writes: its 1.0 header, then the array
            members[member_name(mb.dp_rank, mb.index, name)] = (npy_header_bytes(dtype, mb.num_tokens),
                                                                np.ascontiguousarray(a).view(np.uint8))
    crcs = {member: crc32c.crc32c(body, crc32c.crc32c(head))  # type: ignore[arg-type]  # numpy stubs: an ndarray is a Buffer only from Python 3.12
            for member, (head, body) in members.items()}
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
        # members dated 1980-01-01 (ZipInfo's default), not now: the same step encodes to the same bytes, so a
        # publish retried after a lost answer is recognised as this writer's own (the store's write token)
        zf.writestr(zipfile.ZipInfo(HEADER_MEMBER), header.model_copy(update={"stream_crc32c": crcs}).model_dump_json())
        for member, (head, body) in members.items():
            with zf.open(zipfile.ZipInfo(member), "w") as f:
                f.write(head)
                f.write(body)  # type: ignore[call-overload]  # numpy stubs: ndarray a Buffer only from 3.12
    return buf.getvalue()


def publish_step_file(store: Store, header: StepHeader,
                      streams: Mapping[tuple[int, int], Mapping[str, np.ndarray]]) -> str:
    """Write a step file with one exclusive put; return its URI.

    A publish that failed although its put was applied (every answer lost) is done when the same step is
    published again: the step file already there holds these very bytes (``Store.put`` tells only the retries of
    one call apart by its write token).

    Raises:
        StepFileError: as ``encode_step_file``, or the header belongs to another run.
        KeyExistsError: this step was already published with other contents.
    """
    if header.run_uri != store.prefix.uri:
        raise StepFileError(f"step {header.step}: header run_uri {header.run_uri!r}, expected {store.prefix.uri!r}")
    key = step_key(header.step)
    data = encode_step_file(header, streams)
    try:
        store.put(key, data, exclusive=True)
    except KeyExistsError:
        if store.get(key) != data:
            raise
    return store.uri(key)


class StepFile:
    """A step file, read-only: its validated header and the token streams of every micro batch.

    Open one with ``read_step_file(uri)`` (a path or URI of ``<root>/<run_id>/steps/step_<N:08d>.npz``),
    ``StepFile.read(store, step)`` (a run's store, as every trainer rank does) or ``StepFile.from_bytes``
    (a file already in memory). Reading validates the header (``StepHeader``) and every stream member
    once: its crc32c against ``StepHeader.stream_crc32c``, then its ``.npy`` dtype, shape and byte count
    against the header; any damage is a ``StepFileError`` naming the file and the member. Nothing here
    writes, deletes or imports torch.

    Token streams of a micro batch of ``T`` real tokens (``StepFile.streams``; ``STREAMS``), each ``[T]``,
    its sequences concatenated in packing order, no padding:

    - ``input_ids`` int32 (``<i4``): token ids, each sequence's prompt then completion;
    - ``loss_mask`` bool (``|b1``): True on completion tokens (trained), False on prompt tokens and on
      a padding dummy's;
    - ``advantages`` float32 (``<f4``): the sequence's advantage on completion tokens, 0 on prompt tokens;
    - ``inference_logprobs`` float32 (``<f4``): logprob of each completion token under the sampling
      policy, 0 on prompt tokens;
    - ``position_ids`` int32 (``<i4``): 0, 1, ... within each sequence;
    - ``temperatures`` float32 (``<f4``): the sampling temperature of each token.

    Attributes:
        header: the ``StepHeader`` (micro batches, sequences, refs, owners, fields, metrics).
        uri: the step file's URI (in the run as opened); errors name it.
        damaged: member name -> what is wrong with it; empty unless opened with ``parse``.
    """

    stream_names: tuple[str, ...] = tuple(STREAMS)
    """Names of the token streams of every micro batch, in member order."""

    def __init__(self, header: StepHeader, streams: dict[str, np.ndarray], damaged: dict[str, str], uri: str):
        self.header, self._streams, self.damaged, self.uri = header, streams, damaged, uri

    @classmethod
    def read(cls, store: Store, step: int) -> "StepFile":
        """Read and validate step ``step`` of the store's run (one ``Store.get``).

        Raises:
            KeyNotFoundError: the step file does not exist (yet).
            StepFileError: truncated, foreign, unknown schema version, a ref whose URI names
                another chunk than its branch id, a ref whose arrays disagree with ``header.fields``,
                a stream member missing, damaged (crc32c) or of another dtype or shape than the header
                says, or a header whose ``step`` is not ``step``.
        """
        key = step_key(step)
        step_file = cls.from_bytes(store.get(key), store.uri(key))
        check_step(step_file.header, step, step_file.uri)
        return step_file

    @classmethod
    def from_bytes(cls, data: bytes, uri: str) -> "StepFile":
        """Validate a step file's bytes (see ``read``); ``uri`` names it in errors."""
        step_file = cls.parse(data, uri)
        if step_file.damaged:
            raise StepFileError(next(iter(step_file.damaged.values())))
        return step_file

    @classmethod
    def parse(cls, data: bytes, uri: str) -> "StepFile":
        """As ``from_bytes``, but a damaged stream member is listed in ``damaged`` (``refpipe verify``: every
        problem, one line each) instead of raised; ``streams`` raises it for its micro batch.

        Raises:
            StepFileError: the container or the header cannot be read (as ``read``).
        """
        try:
            zf = zipfile.ZipFile(io.BytesIO(data))
            compressed = [i.filename for i in zf.infolist() if i.compress_type != zipfile.ZIP_STORED]
            if compressed:  # a stored member reads at most the file's own bytes; a deflated one its declared size
                raise ValueError(f"member {compressed[0]} is compressed: expected every member stored")
            raw = json.loads(zf.read(HEADER_MEMBER))
        except (zipfile.BadZipFile, KeyError, ValueError, EOFError) as e:
            raise StepFileError(f"step file {uri}: not a readable step file (truncated or foreign): {e}") from e
        if raw.get("schema_version") != SCHEMA_VERSION:
            raise StepFileError(f"step file {uri}: schema_version {raw.get('schema_version')!r}, "
                                f"expected {SCHEMA_VERSION}")
        try:
            header = StepHeader.model_validate(raw, context=REF_ROWS_CHECKED_PER_USE)
        except ValidationError as e:
            raise StepFileError(f"step file {uri}: invalid header: {validation_problems(e)}") from e
        streams, damaged = {}, {}
        view = memoryview(data)
        for mb in header.micro_batches:
            num_tokens = mb.num_tokens
            for name, dtype in header.stream_dtypes().items():
                member = member_name(mb.dp_rank, mb.index, name)
                try:
                    streams[member] = stream_member(view, zf, member, dtype, num_tokens, header.stream_crc32c)
                except ValueError as e:
                    damaged[member] = f"step file {uri}: {e}"
        return cls(header, streams, damaged, uri)

    def streams(self, dp_rank: int, index: int) -> dict[str, np.ndarray]:
        """The token streams of one micro batch: name -> [T] array of ``header.stream_dtypes()[name]`` (fresh,
        writable copies).

        Raises:
            StepFileError: no such micro batch, or (opened with ``parse``) one of its members is damaged.
        """
        out = {}
        for name in self.header.stream_dtypes():
            member = member_name(dp_rank, index, name)
            if member in self.damaged:
                raise StepFileError(self.damaged[member])
            if member not in self._streams:
                raise StepFileError(f"step file {self.uri}: no micro batch dp_rank={dp_rank} index={index}")
            out[name] = self._streams[member].copy()
        return out


def read_step_file(uri: str, *, s3_endpoint_url: str | None = None) -> StepFile:
    """Open the step file at ``uri`` read-only: ``StepFile.read`` of its run's store.

    Args:
        uri: ``<root>/<run_id>/steps/step_<N:08d>.npz`` as a local path (relative or absolute), a
            ``file://`` or an ``s3://`` URI.
        s3_endpoint_url: S3 endpoint (MinIO, Ceph RGW, moto); default: ``AWS_ENDPOINT_URL`` or AWS.

    Raises:
        ConfigError: ``uri`` does not name a step file under a run's ``steps/``.
        KeyNotFoundError, StepFileError: as ``StepFile.read``.
    """
    store, step = locate_step_file(uri, s3_endpoint_url)
    return StepFile.read(store, step)


def locate_step_file(uri: str, s3_endpoint_url: str | None = None) -> tuple[Store, int]:
    """The run's store and the step of ``<root>/<run_id>/steps/step_<N:08d>.npz`` (see ``read_step_file``);
    the store is opened, nothing is read.

    Raises:
        ConfigError: ``uri`` does not name a step file under a run's ``steps/``.
    """
    absolute = uri if "://" in uri else os.path.abspath(os.path.expanduser(uri))
    run_uri, _, name = absolute.rpartition(f"/{STEPS_PREFIX}/")
    step = parse_step_key(f"{STEPS_PREFIX}/{name}") if run_uri else None
    if step is None or step_key(step) != f"{STEPS_PREFIX}/{name}":
        raise ConfigError(f"step URI {uri!r}: expected <root>/<run_id>/steps/step_<N:08d>.npz")
    return open_store(run_storage(run_uri, s3_endpoint_url)), step


def check_step(header: StepHeader, step: int, uri: str) -> None:
    """Raise ``StepFileError`` unless the header of the file at ``uri`` (named for ``step``) holds step ``step``."""
    if header.step != step:
        raise StepFileError(f"step file {uri}: header says step {header.step}, expected step {step}")


__all__ = ["MAX_SEQ_LEN", "MicroBatchRecord", "SequenceRecord", "StepFile", "StepHeader", "STREAMS",
           "publish_step_file", "read_step_file"]
