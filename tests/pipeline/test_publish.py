"""publish_step: a step from the caller's own packed micro batches, validated, published once, shipped."""

from __future__ import annotations

import io
import zipfile
from dataclasses import replace

import numpy as np
import pytest
from pydantic import ValidationError

from refpipe.pipeline.audit import audit
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.publish import PackedSequence, StepMicroBatch, publish_step
from refpipe.pipeline.slices import PayloadSlice
from refpipe.pipeline.step_file import HEADER_MEMBER, StepFile
from refpipe.pipeline.step_header import STREAMS, StepHeader
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import KeyExistsError, OutsideRunError, PackingError, SliceError, StepFileError
from refpipe.storage.layout import ORCHESTRATOR_ACTOR, step_key
from refpipe.storage.ledger import Ledger
from tests.pipeline.orchestrator_helpers import FIELDS, branch, make_keeper

SEQ_LEN = 32


def _micro_batch(rng, branches, *, extra: bool = True, borrowed=()) -> StepMicroBatch:
    """The caller's packing of ``branches`` (whole, with slices) into one micro batch; its own advantages."""
    sequences = [PackedSequence(b.num_tokens, "reverse", PayloadSlice(b.ref, b.num_tokens) if b.ref else None,
                                policy_version=3, borrowed=i in borrowed) for i, b in enumerate(branches)]
    t = sum(b.num_tokens for b in branches)
    streams = {"input_ids": np.concatenate([np.concatenate([b.prompt_ids, b.completion_ids]) for b in branches]),
               "loss_mask": rng.random(t) < 0.5, "advantages": rng.standard_normal(t).astype(np.float32),
               "inference_logprobs": -rng.random(t, dtype=np.float32), "position_ids": np.arange(t, dtype=np.int32),
               "temperatures": np.full(t, 0.7, np.float32)}
    if extra:
        streams["values"] = rng.standard_normal(t).astype(np.float32)
    return StepMicroBatch(sequences, streams)


@pytest.fixture
def run(local_config):
    store = open_store(local_config)
    keeper = make_keeper(store, local_config)
    rng = np.random.default_rng(0)
    kept = [branch(keeper, rng, branch_id=f"b{i}", num_completion=4 + i) for i in range(4)]
    kept.append(branch(keeper, rng, routing=False, branch_id="s0"))  # side channels without routing
    plain = branch(None, rng, routing=False, topk=False)
    keeper.ledger.flush()
    return store, Ledger(store, ORCHESTRATOR_ACTOR), kept, plain, rng


def test_a_step_from_the_callers_packing_round_trips_and_ships(run):
    store, ledger, kept, plain, rng = run
    batches = [[_micro_batch(rng, kept[:2])], [_micro_batch(rng, kept[2:4])]]
    header = publish_step(store, ledger, 4, batches, seq_len=SEQ_LEN, fields=FIELDS, extra_streams={"values": "<f4"},
                          metrics={"reward_mean": 0.5})
    assert [r.branch_id for r in header.refs] == ["b0", "b1", "b2", "b3"] and header.owners == [0, 0, 1, 1]
    assert header.metrics == {"reward_mean": 0.5} and header.extra_streams == {"values": "<f4"}
    step = StepFile.read(store, 4)
    assert step.header.model_copy(update={"stream_crc32c": {}}) == header  # crcs: set by the publish
    for rank in (0, 1):
        mb = step.header.micro_batches_of(rank)[0]
        assert [s.ref for s in mb.sequences] == [2 * rank, 2 * rank + 1]
        assert [s.num_tokens for s in mb.sequences] == [kept[2 * rank].num_tokens, kept[2 * rank + 1].num_tokens]
        assert mb.num_padding_tokens == SEQ_LEN - mb.num_tokens and mb.has_routing
        got = step.streams(rank, 0)
        assert list(got) == [*STREAMS, "values"]
        assert all(got[k].tobytes() == batches[rank][0].streams[k].tobytes() for k in got)
    ledger.flush()
    report = audit(store)
    assert (report.kept, report.shipped, report.deleted, report.leaked) == (5, 4, 0, 0)
    assert report.outstanding_by_holder == {"trainer step 4": 4, "orchestrator": 1}  # s0: never shipped
    with pytest.raises(KeyExistsError, match="steps/step_00000004.npz already exists"):
        publish_step(store, ledger, 4, batches, seq_len=SEQ_LEN, fields=FIELDS, extra_streams={"values": "<f4"})


def test_a_ref_published_in_an_earlier_step_is_refused(run):
    store, ledger, kept, plain, rng = run
    publish_step(store, ledger, 4, [[_micro_batch(rng, kept[:2], extra=False)]], seq_len=SEQ_LEN, fields=FIELDS)
    again = [[_micro_batch(rng, [kept[2], kept[1]], extra=False)]]
    with pytest.raises(PackingError, match=r"^step 5 ref 1: chunk .*/b1 \(branch b1\) was already published in step 4 "
                                           r"by orchestrator: expected each ref in one step \(a ref trains once; its "
                                           r"owner deletes it after that step\)$"):
        publish_step(store, ledger, 5, again, seq_len=SEQ_LEN, fields=FIELDS)
    assert not store.exists(step_key(5))  # nothing written: b2 stays the caller's
    header = publish_step(store, ledger, 5, [[_micro_batch(rng, [kept[2]], extra=False)]], seq_len=SEQ_LEN,
                          fields=FIELDS)
    assert [r.branch_id for r in header.refs] == ["b2"] and ledger.shipped == {"b0": 4, "b1": 4, "b2": 5}


def test_a_padding_micro_batch_borrows_an_owned_ref_and_sequences_without_refs_mix_with_side_channels(run):
    store, ledger, kept, plain, rng = run
    side = kept[4]
    batches = [[_micro_batch(rng, kept[:2], extra=False), _micro_batch(rng, [side, plain], extra=False)],
               [_micro_batch(rng, kept[2:4], extra=False), _micro_batch(rng, [kept[0]], extra=False, borrowed={0})]]
    header = publish_step(store, ledger, 0, batches, seq_len=SEQ_LEN, fields=FIELDS)
    assert [r.branch_id for r in header.refs] == ["b0", "b1", "s0", "b2", "b3"] and header.owners == [0, 0, 0, 1, 1]
    padding = header.micro_batches_of(1)[1]
    assert [(s.ref, s.borrowed) for s in padding.sequences] == [(0, True)] and padding.has_routing
    assert [(s.ref, s.borrowed) for s in header.micro_batches_of(0)[1].sequences] == [(2, False), (None, False)]
    assert header.owned_refs(1) == [kept[2].ref, kept[3].ref]


def _bad(kept, plain, rng):
    """name -> (micro batches, expected message) for every kind of refused input."""
    good = _micro_batch(rng, kept[:2])
    wrong_dtype = {**good.streams, "advantages": good.streams["advantages"].astype(np.float64)}
    short = {**good.streams, "input_ids": good.streams["input_ids"][:-1]}
    no_mask = {k: v for k, v in good.streams.items() if k != "loss_mask"}
    seqs = list(good.sequences)
    other = _micro_batch(rng, kept[2:3])
    at = r"^step 1 dp_rank=1 micro batch 0"
    return {
        "unequal": ([[good], [other, other]], r"^step 1: micro batches per DP rank \[1, 2\]: expected the same"),
        "none": ([[], []], r"micro batches per DP rank \[0, 0\]"),
        "dtype": ([[other], [replace(good, streams=wrong_dtype)]],
                  at + r" stream 'advantages' is <f8 \[17\]: expected float32 \[17\] \(the micro batch's tokens\)$"),
        "length": ([[other], [replace(good, streams=short)]],
                   at + r" stream 'input_ids' is <i4 \[16\]: expected int32 \[17\]"),
        "missing": ([[other], [replace(good, streams=no_mask)]],
                    at + r" stream 'loss_mask' is NoneType: expected bool"),
        "unknown": ([[other], [replace(good, streams={**good.streams, "value": good.streams["values"]})]],
                    at + r": streams \['value'\] are neither STREAMS nor named in extra_streams"),
        "too long": ([[other], [_micro_batch(rng, kept[:4])]], at + r": 38 tokens: expected at most seq_len=32$"),
        "slice": ([[other], [replace(good, sequences=[replace(seqs[0], payload=PayloadSlice(kept[0].ref, 7)),
                                                      seqs[1]])]],
                  at + r" sequence 0: 8 tokens but its payload slice keeps 7: expected equal$"),
        "mixed": ([[other], [_micro_batch(rng, [kept[3], plain])]],
                  at + r" sequence 1: carries no token-domain rows \(routing\) but sequence 0 does"),
        "twice": ([[other], [_micro_batch(rng, [kept[2]])]], at + r" sequence 0: chunk .*/b2 is used by two samples"),
        "unowned": ([[other], [_micro_batch(rng, [kept[3]], borrowed={0})]],
                    at + r" sequence 0: borrows .*/b3, which no sequence of the step owns"),
        "empty": ([[other], [replace(good, sequences=[])]], at + r": expected a StepMicroBatch with at least one"),
        "policy": ([[other], [replace(good, sequences=[replace(seqs[0], policy_version=-1), seqs[1]])]],
                   at + r" sequence 0: num_tokens 8, policy_version -1, env_name 'reverse': expected num_tokens >= 1"),
        "nan logprob": ([[other], [replace(good, streams=_with(good.streams, "inference_logprobs", 5, np.nan))]],
                        at + r" stream inference_logprobs\[5\] = nan: expected a finite logprob <= 0$"),
        "positive logprob": ([[other], [replace(good, streams=_with(good.streams, "inference_logprobs", 0, 3.0))]],
                             at + r" stream inference_logprobs\[0\] = 3.0: expected a finite logprob <= 0$"),
        "nan advantage": ([[other], [replace(good, streams=_with(good.streams, "advantages", 16, np.nan))]],
                          at + r" stream advantages\[16\] = nan: expected a finite float$"),
        "negative id": ([[other], [replace(good, streams=_with(good.streams, "input_ids", 2, -1))]],
                        at + r" stream input_ids\[2\] = -1: expected a token id >= 0$"),
        "zero temperatures": ([[other], [replace(good, streams={**good.streams,
                                                                "temperatures": np.zeros(17, np.float32)})]],
                              at + r" sequence 0 \(branch b0\) stream temperatures\[0\] = 0.0 \(17 of 17 tokens\): "
                                   r"expected a finite sampling temperature > 0 \(the trainer divides the logits by "
                                   r"it\)$"),
        "nan temperature": ([[other], [replace(good, streams=_with(good.streams, "temperatures", 9, np.nan))]],
                            at + r" sequence 1 \(branch b1\) stream temperatures\[9\] = nan \(1 of 17 tokens\)"),
    }


def _with(streams: dict, name: str, index: int, value) -> dict:
    """``streams`` with ``streams[name][index] = value`` (a copy)."""
    a = streams[name].copy()
    a[index] = value
    return {**streams, name: a}


@pytest.mark.parametrize("kind", ["unequal", "none", "dtype", "length", "missing", "unknown", "too long", "slice",
                                  "mixed", "twice", "unowned", "empty", "policy", "nan logprob", "positive logprob",
                                  "nan advantage", "negative id", "zero temperatures", "nan temperature"])
def test_bad_input_is_a_packing_error_naming_where_and_nothing_is_written(run, kind):
    store, ledger, kept, plain, rng = run
    batches, message = _bad(kept, plain, rng)[kind]
    with pytest.raises(PackingError, match=message):
        publish_step(store, ledger, 1, batches, seq_len=SEQ_LEN, fields=FIELDS, extra_streams={"values": "<f4"})
    assert not store.exists(step_key(1))


def test_token_ids_past_the_vocabulary_and_trained_sequences_without_a_required_field_are_refused(run):
    store, ledger, kept, plain, rng = run
    good = _micro_batch(rng, kept[:1], extra=False)
    with pytest.raises(PackingError, match=r"^step 1 dp_rank=0 micro batch 0 stream input_ids\[\d+\] = \d+: expected "
                                           r"a token id >= 0 and < vocab_size=2$"):
        publish_step(store, ledger, 1, [[good]], seq_len=SEQ_LEN, fields=FIELDS.model_copy(update={"vocab_size": 2}))
    unrouted = _micro_batch(rng, [plain], extra=False)
    trained = int(unrouted.streams["loss_mask"].sum())
    required = FieldsConfig(**{**FIELDS.model_dump(), "required": ("routed_experts",)})
    at = "^step 1 dp_rank=0 micro batch 0 sequence 0"
    with pytest.raises(PackingError, match=rf"{at}: {trained} loss tokens without "
                                           r"required fields \['routed_experts'\] \(FieldsConfig.required\)"):
        publish_step(store, ledger, 1, [[unrouted]], seq_len=SEQ_LEN, fields=required)
    assert trained > 0 and not store.exists(step_key(1))


def test_bad_slices_extra_streams_and_foreign_refs(run, tmp_path):
    store, ledger, kept, plain, rng = run
    good = _micro_batch(rng, kept[:1], extra=False)
    wire = replace(good, sequences=[replace(good.sequences[0], payload=good.sequences[0].payload.slice_id)])
    with pytest.raises(SliceError, match=r"sequence 0: payload is SliceId: expected a PayloadSlice \(resolve"):
        publish_step(store, ledger, 1, [[wire]], seq_len=SEQ_LEN, fields=FIELDS)
    for name, dtype, message in (("input_ids", "<i4", "not in"), ("Values", "<f4", "expected a name"),
                                 ("values", "object", "expected a numpy dtype.str"), ("values", "f4", "dtype.str")):
        with pytest.raises(PackingError, match=rf"^step 1: extra stream '{name}'.*{message}"):
            publish_step(store, ledger, 1, [[good]], seq_len=SEQ_LEN, fields=FIELDS, extra_streams={name: dtype})
    sibling = StorageConfig(root=str(tmp_path / "root"), run_id="run_9")
    foreign = branch(make_keeper(open_store(sibling), sibling), rng, branch_id="f0")
    with pytest.raises(OutsideRunError, match=r"^step 1 ref 0: ref f0 was kept in run 'run_9'"):
        publish_step(store, ledger, 1, [[_micro_batch(rng, [foreign], extra=False)]], seq_len=SEQ_LEN, fields=FIELDS)
    assert not store.exists(step_key(1))


def test_a_step_file_declaring_an_extra_stream_it_lacks_or_of_a_bad_dtype_is_refused(run):
    store, ledger, kept, plain, rng = run
    header = publish_step(store, ledger, 2, [[_micro_batch(rng, kept[:1])]], seq_len=SEQ_LEN, fields=FIELDS,
                          extra_streams={"values": "<f4"})
    raw = header.model_dump()
    with pytest.raises(ValidationError, match=r"extra stream 'values': dtype 'object': expected a numpy dtype.str"):
        StepHeader.model_validate({**raw, "extra_streams": {"values": "object"}})
    original = zipfile.ZipFile(io.BytesIO(store.get(step_key(2))))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as forged:  # the header also declares a stream "more"
        for info in original.infolist():
            body = original.read(info)
            if info.filename == HEADER_MEMBER:
                published = StepFile.read(store, 2).header  # with its stream checksums
                streams = {"values": "<f4", "more": "<i4"}
                body = published.model_copy(update={"extra_streams": streams}).model_dump_json()
            forged.writestr(info, body)
    with pytest.raises(StepFileError, match=r"^step file forged: member dp0.mb0.more.npy is missing$"):
        StepFile.from_bytes(buf.getvalue(), "forged")
