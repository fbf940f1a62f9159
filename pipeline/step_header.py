"""The step file's header: its schema, validated whole on construction and on every read (docs/step-files.md).

``StepHeader`` is ``header.json`` of a step file (``pipeline.step_file``): schema version, run, step,
``seq_len``, the run's field shapes, every micro batch's sequences (``MicroBatchRecord``,
``SequenceRecord``) and the refs they use, their owner DP ranks, and each stream member's crc32c. The
token streams every micro batch holds are ``STREAMS`` plus the header's ``extra_streams``. A header
that disagrees with itself (micro batches out of order, a ref's arrays against ``fields``, a
``seq_len`` above ``MAX_SEQ_LEN``) is refused with a ``ValueError`` (pydantic's ``ValidationError``),
before anything is sized from it.
"""

from __future__ import annotations

import re
from typing import Annotated

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from refpipe.pipeline.fields import FieldsConfig
from refpipe.storage.chunk_ref import PayloadRef

SCHEMA_VERSION = 3
"""3: the header carries ``stream_crc32c`` (2: no stream checksums; 1: no field shapes)."""
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

    def chunks(self, refs: list[PayloadRef] | None = None) -> list[PayloadRef]:
        """The distinct chunks ``refs`` (default: every ref of the step) name, in order of first mention: each
        object of a segmented branch (``PayloadRef.chunks``: on a filesystem a writer life's segments share one), a
        shared prefix once however many of its holders
        the step ships. The one count of a step's chunks (``refpipe inspect`` and ``verify``)."""
        distinct: dict[str, PayloadRef] = {}
        for ref in self.refs if refs is None else refs:
            for chunk in ref.chunks:
                distinct.setdefault(chunk.key, chunk)
        return list(distinct.values())

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
