"""Publish a step from the caller's own packed micro batches: one step file, its ref table, ship events.

The layer below any orchestrator: the caller packed its samples itself (its own advantages,
its own DP balancing) and hands over, per DP rank, its micro batches: the concatenated
per-token streams of ``STREAMS`` (plus any extra streams it names) and, per sequence, its
length and optional ``PayloadSlice``. ``publish_step`` validates all of it, builds the
``StepHeader`` (every ref once in ``refs``, owned by the DP rank of the sequence that
slices it; a ``borrowed`` sequence reuses an owned ref's rows and is never its owner),
publishes the step file with one exclusive put and records ``ship`` in the caller's
ledger. ``Orchestrator.build_step`` is this plus its own packing.

Rules (DESIGN.md, Actors): nothing here deletes. A refused or failed publish leaves every
chunk with the caller, who publishes again or ``Ledger.delete``s what it will never ship;
once published, each DP rank's trainer deletes the refs it owns, once.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral

import numpy as np
from pydantic import ValidationError

from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.samples import logprob_problem, token_id_problem
from refpipe.pipeline.slices import PayloadSlice, check_in_run
from refpipe.pipeline.step_file import publish_step_file
from refpipe.pipeline.step_header import (
    MAX_SEQ_LEN,
    SCHEMA_VERSION,
    STREAMS,
    MicroBatchRecord,
    SequenceRecord,
    StepHeader,
    check_extra_stream,
    has_token_rows,
)
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import PackingError, SliceError, validation_problems
from refpipe.storage.ledger import Ledger
from refpipe.storage.store import Store

Streams = dict[tuple[int, int], dict[str, np.ndarray]]
"""``streams[(dp_rank, index)][name]``: a micro batch's [T] stream ``name``."""


@dataclass(frozen=True)
class PackedSequence:
    """One sequence of a caller's micro batch.

    Attributes:
        num_tokens: its tokens in the micro batch's streams (>= 1); with a payload, ``payload.num_tokens``.
        env_name: environment that produced it (the trainer's metrics group by it).
        payload: its side channels, or None.
        policy_version: trainer step whose weights sampled it (>= 0).
        borrowed: a zero-loss stand-in reusing the rows of a ref another sequence of the step owns (a
            padding micro batch of a routing step); the owner's DP rank deletes the chunk, once.
    """

    num_tokens: int
    env_name: str
    payload: PayloadSlice | None = None
    policy_version: int = 0
    borrowed: bool = False


@dataclass(frozen=True, eq=False)
class StepMicroBatch:
    """One packed micro batch of one DP rank, as the caller built it.

    Attributes:
        sequences: at least one, in packing order; ``T = sum(s.num_tokens)`` <= the step's ``seq_len``.
        streams: name -> [T] array: every ``STREAMS`` entry in its dtype (``input_ids`` int32, ``loss_mask``
            bool, ``advantages`` float32, ``inference_logprobs`` float32, ``position_ids`` int32,
            ``temperatures`` float32) and every extra stream the step names, in its dtype.
    """

    sequences: Sequence[PackedSequence]
    streams: Mapping[str, np.ndarray]


def publish_step(store: Store, ledger: Ledger, step: int, micro_batches: Sequence[Sequence[StepMicroBatch]], *,
                 seq_len: int, fields: FieldsConfig, extra_streams: Mapping[str, str] | None = None,
                 metrics: Mapping[str, float] | None = None) -> StepHeader:
    """Publish step ``step`` from the caller's packed micro batches; record ``ship`` in ``ledger``.

    Called by the one process that publishes steps (the caller's orchestrator), with increasing steps.

    Args:
        store: the run's store; every ref must have been kept in its run.
        ledger: the publisher's ledger session (``ship`` is recorded and flushed there).
        step: the trainer step (>= 0).
        micro_batches: ``micro_batches[r]``: DP rank ``r``'s micro batches in training order; every DP rank
            the same number (>= 1): pad a short rank with a zero-loss micro batch.
        seq_len: token budget of every micro batch (tokens, <= ``MAX_SEQ_LEN``); the trainer pads to it.
        fields: the run's field shapes; every ref's arrays must agree with them.
        extra_streams: per-token streams beside ``STREAMS``: name -> numpy ``dtype.str``.
        metrics: numbers written into the step header (e.g. the caller's reward mean).

    Returns:
        The published header (``header.refs``, ``header.owners``: who deletes what).

    Raises:
        PackingError: the input does not describe a valid step (names the DP rank, micro batch, sequence or
            stream and what was expected), or a ref was published before by ``ledger``'s session
            (``LedgerSession.shipped``: names the step); nothing is written.
        SliceError: a payload is not a ``PayloadSlice`` of 1..``ref.num_tokens`` tokens.
        OutsideRunError: a ref was kept in another run.
        KeyExistsError: step ``step`` was already published.
    """
    header, streams = step_contents(micro_batches, step=step, run_uri=store.prefix.uri, seq_len=seq_len,
                                    fields=fields, extra_streams=extra_streams or {}, metrics=metrics or {})
    for i, ref in enumerate(header.refs):
        check_in_run(ref, store.prefix, f"step {step} ref {i}")
        if ledger.shipped.get(ref.branch_id, step) != step:  # the same step again: its step file refuses it
            raise PackingError(f"step {step} ref {i}: chunk {ref.uri} (branch {ref.branch_id}) was already published "
                               f"in step {ledger.shipped[ref.branch_id]} by {ledger.actor}: expected each ref in one "
                               f"step (a ref trains once; its owner deletes it after that step)")
    uri = publish_step_file(store, header, streams)
    ledger.record("ship", step=step, uri=uri, branch_ids=[r.branch_id for r in header.refs])
    ledger.shipped.update((r.branch_id, step) for r in header.refs)
    ledger.flush()
    return header


def step_contents(micro_batches: Sequence[Sequence[StepMicroBatch]], *, step: int, run_uri: str, seq_len: int,
                  fields: FieldsConfig, extra_streams: Mapping[str, str], metrics: Mapping[str, float]
                  ) -> tuple[StepHeader, Streams]:
    """The validated header and streams ``publish_step`` writes (see there; no I/O)."""
    _check_shape(micro_batches, step, seq_len, extra_streams, fields)
    refs, owners, index_of = _ref_table(micro_batches, step)
    records = [_record(rank, i, mb, index_of, step, seq_len)
               for rank, batches in enumerate(micro_batches) for i, mb in enumerate(batches)]
    try:
        header = StepHeader(schema_version=SCHEMA_VERSION, run_uri=run_uri, step=step, seq_len=seq_len,
                            dp_world_size=len(micro_batches), micro_batches=records, refs=refs, owners=owners,
                            fields=fields, metrics=dict(metrics), extra_streams=dict(extra_streams))
    except ValidationError as e:
        raise PackingError(f"step {step}: {validation_problems(e)}") from e
    names = header.stream_dtypes()
    streams = {(rank, i): {name: mb.streams[name] for name in names}
               for rank, batches in enumerate(micro_batches) for i, mb in enumerate(batches)}
    return header, streams


def _ref_table(micro_batches: Sequence[Sequence[StepMicroBatch]], step: int
               ) -> tuple[list[PayloadRef], list[int], dict[str, int]]:
    """``(refs, owners, index_of)``: each ref a sequence owns (not ``borrowed``) once, in sequence order, the DP rank
    owning it, and branch id -> its index in ``refs``."""
    refs: list[PayloadRef] = []
    owners: list[int] = []
    index_of: dict[str, int] = {}
    for rank, batches in enumerate(micro_batches):
        for i, mb in enumerate(batches):
            for j, seq in enumerate(mb.sequences):
                if seq.payload is None or seq.borrowed:
                    continue
                ref = seq.payload.ref
                if ref.branch_id in index_of:
                    raise PackingError(f"step {step} dp_rank={rank} micro batch {i} sequence {j}: chunk {ref.uri} "
                                       f"is used by two samples (sequences) of the step: expected one owning "
                                       f"sequence per ref (mark stand-ins borrowed)")
                index_of[ref.branch_id] = len(refs)
                refs.append(ref)
                owners.append(rank)
    return refs, owners, index_of


def _check_shape(micro_batches: Sequence[Sequence[StepMicroBatch]], step: int, seq_len: int,
                 extra_streams: Mapping[str, str], fields: FieldsConfig) -> None:
    """DP ranks with equal, non-zero counts of micro batches within ``seq_len``, each with exactly the streams, and
    their values trainable (``_check_values``)."""
    if not 1 <= seq_len <= MAX_SEQ_LEN:
        raise PackingError(f"step {step}: seq_len {seq_len}: expected 1..{MAX_SEQ_LEN} tokens")
    for name, dtype in extra_streams.items():
        try:
            check_extra_stream(name, dtype)
        except ValueError as e:
            raise PackingError(f"step {step}: {e}") from None
    counts = [len(batches) for batches in micro_batches]
    if not counts or min(counts) == 0 or len(set(counts)) > 1:
        raise PackingError(f"step {step}: micro batches per DP rank {counts}: expected the same number (>= 1) on "
                           f"every DP rank (pad a short rank with a zero-loss micro batch)")
    expected = {**STREAMS, **extra_streams}
    for rank, batches in enumerate(micro_batches):
        for i, mb in enumerate(batches):
            what = f"step {step} dp_rank={rank} micro batch {i}"
            if not isinstance(mb, StepMicroBatch) or not mb.sequences:
                raise PackingError(f"{what}: expected a StepMicroBatch with at least one sequence")
            for j, seq in enumerate(mb.sequences):
                _check_sequence(seq, f"{what} sequence {j}")
            num_tokens = sum(s.num_tokens for s in mb.sequences)
            if num_tokens > seq_len:
                raise PackingError(f"{what}: {num_tokens} tokens: expected at most seq_len={seq_len}")
            unknown = sorted(set(mb.streams) - set(expected))
            if unknown:
                raise PackingError(f"{what}: streams {unknown} are neither STREAMS nor named in extra_streams")
            for name, dtype in expected.items():
                _check_stream(mb.streams.get(name), f"{what} stream {name!r}", dtype, num_tokens)
            _check_values(mb.streams, what, fields.vocab_size)
            _check_temperatures(mb, what)
            _check_required(mb, what, fields)


def _check_values(streams: Mapping[str, np.ndarray], what: str, vocab_size: int | None) -> None:
    """Token ids in ``[0, vocab_size)``, inference logprobs finite and <= 0, advantages finite: the rules an
    episode meets at ``Orchestrator.submit`` (``pipeline.samples``), so no bad value trains silently."""
    advantages = streams["advantages"]
    problem = (token_id_problem(streams["input_ids"], "input_ids", vocab_size)
               or logprob_problem(streams["inference_logprobs"], "inference_logprobs"))
    if problem is None and not np.isfinite(advantages).all():
        bad = int(np.argmin(np.isfinite(advantages)))
        problem = f"advantages[{bad}] = {float(advantages[bad])}: expected a finite float"
    if problem:
        raise PackingError(f"{what} stream {problem}")


def _check_temperatures(mb: StepMicroBatch, what: str) -> None:
    """Every token's temperature finite and > 0, the rule a branch meets at ``Orchestrator.submit``
    (``pipeline.samples``): the trainer divides the logits by it, so 0 (or NaN, inf, < 0) would train NaN losses
    silently, padding and zero-loss sequences included."""
    temperatures = mb.streams["temperatures"]
    bad = ~(np.isfinite(temperatures) & (temperatures > 0))
    if bad.any():
        k = int(np.argmax(bad))
        j = int(np.searchsorted(np.cumsum([s.num_tokens for s in mb.sequences]), k, side="right"))
        payload = mb.sequences[j].payload
        branch = "" if payload is None else f" (branch {payload.ref.branch_id})"
        raise PackingError(f"{what} sequence {j}{branch} stream temperatures[{k}] = {float(temperatures[k])} "
                           f"({int(bad.sum())} of {bad.size} tokens): expected a finite sampling temperature > 0 "
                           f"(the trainer divides the logits by it)")


def _check_required(mb: StepMicroBatch, what: str, fields: FieldsConfig) -> None:
    """Every sequence with loss tokens carries each of ``fields.required`` (the trainer would drop its micro batch,
    ``trainer.assemble``): refused here, before anything is written."""
    if not fields.required:
        return
    registry, start = fields.registry(), 0
    for j, seq in enumerate(mb.sequences):
        loss_tokens = int(mb.streams["loss_mask"][start:start + seq.num_tokens].sum())
        start += seq.num_tokens
        stored = () if seq.payload is None else seq.payload.ref.arrays
        missing = [name for name in fields.required if registry[name].names()[0] not in stored]
        if loss_tokens and missing:
            raise PackingError(f"{what} sequence {j}: {loss_tokens} loss tokens without required fields {missing} "
                               f"(FieldsConfig.required): expected every trained sequence to carry them")


def _check_stream(a: object, what: str, dtype: str, num_tokens: int) -> None:
    if not isinstance(a, np.ndarray) or a.dtype.str != dtype or a.shape != (num_tokens,):
        got = f"{a.dtype.str} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
        raise PackingError(f"{what} is {got}: expected {np.dtype(dtype)} [{num_tokens}] (the micro batch's tokens)")


def _check_sequence(seq: PackedSequence, what: str) -> None:
    if not isinstance(seq, PackedSequence):
        raise PackingError(f"{what}: is {type(seq).__name__}: expected a PackedSequence")
    if not (_is_int(seq.num_tokens) and seq.num_tokens >= 1 and _is_int(seq.policy_version)
            and seq.policy_version >= 0 and isinstance(seq.env_name, str)):
        raise PackingError(f"{what}: num_tokens {seq.num_tokens!r}, policy_version {seq.policy_version!r}, env_name "
                           f"{seq.env_name!r}: expected num_tokens >= 1, policy_version >= 0, env_name a str")
    if seq.payload is None:
        if seq.borrowed:
            raise PackingError(f"{what}: borrowed without a payload: expected the slice whose rows it borrows")
        return
    if not isinstance(seq.payload, PayloadSlice):
        raise SliceError(f"{what}: payload is {type(seq.payload).__name__}: expected a PayloadSlice (resolve a "
                         f"SliceId against the refs first)")
    seq.payload.checked(what)
    if seq.payload.num_tokens != seq.num_tokens:
        raise PackingError(f"{what}: {seq.num_tokens} tokens but its payload slice keeps {seq.payload.num_tokens}: "
                           f"expected equal")


def _is_int(value: object) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _record(rank: int, index: int, mb: StepMicroBatch, index_of: Mapping[str, int], step: int,
            seq_len: int) -> MicroBatchRecord:
    """The header record of one micro batch; its sequences carry routing all or none."""
    routing = [s.payload is not None and has_token_rows(s.payload.ref) for s in mb.sequences]
    if any(routing) and not all(routing):
        j = routing.index(False)
        raise PackingError(f"step {step} dp_rank={rank} micro batch {index} sequence {j}: carries no "
                           f"token-domain rows (routing) but sequence {routing.index(True)} does: expected micro "
                           f"batches never to mix sequences with and without routing")
    sequences = []
    for j, s in enumerate(mb.sequences):
        ref = None
        if s.payload is not None:
            ref = index_of.get(s.payload.ref.branch_id)
            if ref is None:
                raise PackingError(f"step {step} dp_rank={rank} micro batch {index} sequence {j}: borrows "
                                   f"{s.payload.ref.uri}, which no sequence of the step owns")
        sequences.append(SequenceRecord(num_tokens=int(s.num_tokens), env_name=s.env_name, ref=ref, borrowed=s.borrowed,
                                        policy_version=int(s.policy_version)))
    return MicroBatchRecord(dp_rank=rank, index=index, sequences=sequences,
                            num_padding_tokens=seq_len - sum(s.num_tokens for s in mb.sequences),
                            has_routing=any(routing))
