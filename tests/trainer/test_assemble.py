"""Assembly without processes: byte identity with the kept arrays, row ids, dropped stand-ins, errors."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from refpipe.pipeline.fields import FieldsConfig, spread_expert_rows
from refpipe.pipeline.keep import Branch
from refpipe.pipeline.step_file import StepFile, publish_step_file
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.errors import FieldError, PackingError, StepFileError
from refpipe.storage.layout import chunk_keys
from refpipe.trainer.assemble import assemble_dropped_micro_batch, assemble_micro_batch, finish_micro_batch
from refpipe.trainer.fetch import fetch_own, own_requests, wait_for_step
from refpipe.trainer.plan import plan_micro_batch
from refpipe.trainer.replay_hash import micro_batch_hash
from refpipe.trainer.tensors import to_torch
from tests.trainer.trainer_helpers import (
    FIELDS,
    Seq,
    assert_same,
    build_step,
    expected_micro_batch,
    flatten,
    keep_all,
    make_branch,
)

SEQ_LEN = 24


@pytest.fixture
def step(store, storage_config):
    """A published step over 2 DP ranks covering truncation, mixed refs, dummies and padding (each backend)."""
    return _build(store, storage_config)


@pytest.fixture
def local(local_config):
    """``(store, step)`` as ``step`` on a local run only, for tests where the backend does not matter."""
    store = open_store(local_config)
    return store, _build(store, local_config)


def _build(store, storage_config):
    rng = np.random.default_rng(7)
    branches = {
        "a": make_branch(rng, 5, 9, "a"),                          # routing + completion fields
        "b": make_branch(rng, 3, 6, "b"),
        "c": make_branch(rng, 4, 7, "c", routing=False),           # completion fields only
        "d": make_branch(rng, 1, 5, "d", routing=False),           # one prompt token
        "e": make_branch(rng, 6, 4, "e", routing=False),
        "f": make_branch(rng, 2, 3, "f", completion=False),        # routing only
    }
    refs = keep_all(store, storage_config, branches)
    layout = [
        [[Seq("a", 11), Seq("b", 9), Seq("f", 4)],                 # a cut in its completion; f: routing only
         [Seq("c", 8), Seq(None, 5), Seq("d", 6), Seq("e", 3)]],   # with and without arrays; e cut in its prompt
        [[Seq("a", 14, borrowed=True), Seq("b", 3)],               # borrowed dummy of a (owned by DP 0); b: prompt only
         [Seq("c", 11), Seq("d", 2)]],
    ]
    return build_step(store, 3, SEQ_LEN, layout, branches, refs, rng)


def test_every_array_is_the_kept_bytes_cut_and_ordered(store, step):
    header = StepFile.read(store, 3).header
    for dp in range(2):
        need = own_requests(header, dp)
        arrays = {i: fetch_arrays(store, header.refs[i], n) for i, n in need.items()}
        for mb in header.micro_batches_of(dp):
            got = assemble_micro_batch(mb, step.streams[(dp, mb.index)], arrays, header.refs, seq_len=SEQ_LEN,
                                       fields=FIELDS)
            assert not got.dropped and got.num_tokens == mb.num_tokens
            assert_same(flatten(got.streams, got.cu_seqlens, got.fields), expected_micro_batch(step, dp, mb.index))
            assert set(got.fields) == ({"routed_experts"} if mb.has_routing else set()) | {
                "topk_ids", "topk_logprobs", "sample_support", "sampling_mask"}
            assert all(a.flags.writeable for a in got.streams.values())


def test_row_ids_place_completion_row_r_before_completion_token_r(local):
    store, step = local
    header = step.header
    mb = header.micro_batches_of(0)[0]  # a: P=5 keeps 6 completion rows; b: P=3 keeps 6; f has none
    arrays = {i: fetch_arrays(store, header.refs[i], n) for i, n in own_requests(header, 0).items()}
    got = assemble_micro_batch(mb, step.streams[(0, 0)], arrays, header.refs, seq_len=SEQ_LEN, fields=FIELDS)
    want = np.full(SEQ_LEN, -1)
    want[4:10] = np.arange(0, 6)       # a starts at 0: completion token r sits at 5 + r, predicted from 4 + r
    want[11 + 2:11 + 8] = np.arange(6, 12)  # b starts at 11: P=3, 6 rows, last position 19 has none
    for name in ("topk_ids", "topk_logprobs", "sample_support", "sampling_mask"):
        assert got.fields[name].row_ids.tolist() == want.tolist(), name
    ids = got.fields["topk_ids"]
    a, b = step.branches["a"], step.branches["b"]
    assert ids.values[ids.row_ids[4]].tobytes() == a.fields["topk_ids"][0].tobytes()
    assert ids.values[ids.row_ids[18]].tobytes() == b.fields["topk_ids"][5].tobytes()


def test_dropped_micro_batch_repeats_real_routing_rows_and_has_no_loss(local):
    _, step = local
    mb = step.header.micro_batches_of(0)[0]
    real = step.branches["a"].fields["routed_experts"][:5]
    got = assemble_dropped_micro_batch(mb, step.streams[(0, 0)], seq_len=SEQ_LEN, fields=FIELDS,
                                       token_rows={"routed_experts": real})
    assert got.dropped and not got.streams["loss_mask"].any()
    padded = got.fields["routed_experts"].padded
    assert padded.shape == (SEQ_LEN, 2, 2) and padded.dtype == np.uint8
    assert padded.tobytes() == np.concatenate([real] * 5)[:SEQ_LEN].tobytes()
    assert got.streams["input_ids"][:mb.num_tokens].tobytes() == step.streams[(0, 0)]["input_ids"].tobytes()
    for name in ("topk_ids", "sampling_mask"):
        f = got.fields[name]
        assert len(f.values) == 0 and (f.row_ids == -1).all() and f.cu_seqlens.tolist() == [0, 0, 0, 0]
    spread = assemble_dropped_micro_batch(mb, step.streams[(0, 0)], seq_len=SEQ_LEN, fields=FIELDS, token_rows=None)
    assert spread.fields["routed_experts"].padded.tobytes() == spread_expert_rows(SEQ_LEN, 2, 2, 8, np.uint8).tobytes()


def test_bad_inputs_are_typed_errors(local):
    store, step = local
    header = step.header
    mb = header.micro_batches_of(0)[0]
    arrays = {i: fetch_arrays(store, header.refs[i], n) for i, n in own_requests(header, 0).items()}
    with pytest.raises(FieldError, match="no fetched arrays for ref 0"):
        assemble_micro_batch(mb, step.streams[(0, 0)], {1: arrays[1]}, header.refs, seq_len=SEQ_LEN, fields=FIELDS)
    short = {**arrays, 0: fetch_arrays(store, header.refs[0], 8)}  # a is kept to 11 tokens in this micro batch
    with pytest.raises(FieldError, match="routed_experts is \\[8, 2, 2\\]: expected at least 11 rows"):
        assemble_micro_batch(mb, step.streams[(0, 0)], short, header.refs, seq_len=SEQ_LEN, fields=FIELDS)
    with pytest.raises(PackingError, match="24 tokens, expected at most seq_len=20"):
        assemble_micro_batch(mb, step.streams[(0, 0)], arrays, header.refs, seq_len=20, fields=FIELDS)


def test_fetch_own_dedups_reads_kept_rows_assembles_and_flags_failed_micro_batches(store, step):
    step_file = StepFile.read(store, 3)
    header = step_file.header
    need = own_requests(header, 1)
    assert need == {0: 14, 1: 3, 3: 11, 4: 2}  # refs: a b f c d e; a: the larger of its uses on DP 1
    fetched = fetch_own(store, step_file, 1, FIELDS, max_concurrency=4)
    assert fetched.failed == set() and fetched.errors == [] and fetched.chunks == 4
    kept = {i: fetch_arrays(store, header.refs[i], n) for i, n in need.items()}
    assert fetched.nbytes == sum(a.nbytes for arrays in kept.values() for a in arrays.values())
    assert kept[1]["topk_ids"].shape == (0, 3)  # b kept to its 3 prompt tokens: no completion rows read
    for index, mb in fetched.assembled.items():
        assert_same(flatten(mb.streams, mb.cu_seqlens, mb.fields), expected_micro_batch(step, 1, index))
    # the replay hashes come with the fetch (hashed on the fetch threads), each over its micro batch as assembled
    assert fetched.hashes == {index: micro_batch_hash(mb, header.refs) for index, mb in fetched.assembled.items()}
    assert len(set(fetched.hashes.values())) == 2
    store.delete_keys(list(chunk_keys(header.refs[4].key)))  # d: used by DP 1 index 1
    fetched = fetch_own(store, step_file, 1, FIELDS, max_concurrency=4)
    assert fetched.failed == {1} and len(fetched.errors) == 1 and "ChunkNotFoundError" in fetched.errors[0]
    assert sorted(fetched.assembled) == [0] and fetched.chunks == 3
    assert sorted(fetched.hashes) == [0]  # no hash for a micro batch that failed


def test_to_torch_widens_streams_once_and_shares_field_memory(local):
    store, step = local
    header = step.header
    arrays = {i: fetch_arrays(store, header.refs[i], n) for i, n in own_requests(header, 0).items()}
    record = header.micro_batches_of(0)[0]
    mb = assemble_micro_batch(record, step.streams[(0, 0)], arrays, header.refs, seq_len=SEQ_LEN, fields=FIELDS)
    t = to_torch(mb)
    assert t.record is record
    assert t.streams["input_ids"].dtype == torch.int64 and t.streams["position_ids"].dtype == torch.int64
    assert t.streams["loss_mask"].dtype == torch.bool and t.streams["temperatures"].dtype == torch.float32
    assert t.fields["routed_experts"].padded.data_ptr() == mb.fields["routed_experts"].padded.ctypes.data
    assert t.fields["routed_experts"].values.data_ptr() == mb.fields["routed_experts"].padded.ctypes.data
    # ids and positions are the one copy (widened); the streams of their own dtype are wrapped as they are
    assert {name for name, a in mb.streams.items() if t.streams[name].data_ptr() == a.ctypes.data} == {
        "loss_mask", "advantages", "inference_logprobs", "temperatures"}
    assert_same(flatten(t.streams, t.cu_seqlens, t.fields), expected_micro_batch(step, 0, 0), widened=True)


def test_streams_and_row_ids_are_allocated_where_the_plans_arrays_are(local):
    """A trainer rank's padded streams and row ids come from its buffer pool like the field arrays (memory already
    faulted in), through the ``empty`` the plan was made with."""
    store, step = local
    header = step.header
    arrays = {i: fetch_arrays(store, header.refs[i], n) for i, n in own_requests(header, 0).items()}
    made: list[np.ndarray] = []

    def empty(shape, dtype):
        made.append(np.empty(shape, dtype))
        return made[-1]

    record = header.micro_batches_of(0)[0]
    plan = plan_micro_batch(record, header.refs, seq_len=SEQ_LEN, fields=FIELDS, empty=empty)
    mb = finish_micro_batch(plan, step.streams[(0, 0)], arrays)
    row_ids = {name: f.row_ids for name, f in mb.fields.items() if f.row_ids is not None}
    assert sorted(row_ids) == ["sample_support", "sampling_mask", "topk_ids", "topk_logprobs"]
    allocated = {id(a) for a in made}
    assert all(id(a) in allocated for a in [*mb.streams.values(), *row_ids.values()])
    assert len({a.ctypes.data for a in row_ids.values()}) == len(row_ids)  # equal, but each field's own array
    assert len(made) == 4 + len(mb.streams) + len(row_ids)  # routing, topk_ids, topk_logprobs, sample_support
    assert_same(flatten(mb.streams, mb.cu_seqlens, mb.fields), expected_micro_batch(step, 0, 0))


def test_micro_batch_hash_is_xxh3_128_of_the_refs_and_what_assembly_made(local):
    store, step = local
    header = step.header
    arrays = {i: fetch_arrays(store, header.refs[i], n) for i, n in own_requests(header, 0).items()}
    mb = assemble_micro_batch(header.micro_batches_of(0)[0], step.streams[(0, 0)], arrays, header.refs,
                              seq_len=SEQ_LEN, fields=FIELDS)
    digest = micro_batch_hash(mb, header.refs)
    # pinned: a replay after a crash compares it with the first life's (trainer metrics); XXH3-128, not BLAKE2b
    assert digest == "a96d6163ff8ab62faceb049cdd351433"
    changed = dict(mb.streams, advantages=mb.streams["advantages"].copy())
    changed["advantages"][3] += 1
    assert micro_batch_hash(dataclasses.replace(mb, streams=changed), header.refs) != digest
    topk = mb.fields["topk_ids"]
    row_ids = topk.row_ids.copy()
    row_ids[0] = 0  # made by assembly, hashed by its bytes (padding rows too: tests/trainer/test_declared_fields.py)
    assert micro_batch_hash(dataclasses.replace(mb, fields={**mb.fields, "topk_ids": dataclasses.replace(
        topk, row_ids=row_ids)}), header.refs) != digest
    routing = mb.fields["routed_experts"]
    # rows read from a chunk enter by the ref the fetch checked them against (another crc32c: another digest) ...
    first = mb.record.sequences[0].ref
    other = list(header.refs)
    other[first] = other[first].model_copy(update={"checksum": other[first].checksum ^ 1})
    assert micro_batch_hash(mb, other) != digest
    # ... not by a second pass over their bytes: a chunk holding other bytes fails its fetch with ChunkCorruptError
    # (tests/trainer/test_fetch_direct.py, a flipped byte), so its micro batch is dropped and never hashed
    padded = routing.padded.copy()
    padded[1, 0, 0] += 1
    changed_routing = dataclasses.replace(routing, padded=padded, values=padded[: len(routing.values)])
    assert micro_batch_hash(dataclasses.replace(mb, fields={**mb.fields, "routed_experts": changed_routing}),
                            header.refs) == digest


def test_assemble_imports_without_torch():
    code = "import sys, refpipe.trainer.assemble; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_wait_for_step_names_the_file_and_the_wait(store, storage_config, step):
    with pytest.raises(StepFileError, match=r"step file .*steps/step_00000004\.npz did not appear: waited [0-9.]+ s"):
        wait_for_step(store, 4, timeout_s=0.2, poll_s=0.05)
    later = step.header.model_copy(update={"step": 5})
    timer = threading.Timer(0.2, publish_step_file, (store, later, step.streams))
    timer.start()
    try:
        published = wait_for_step(store, 5, timeout_s=30, poll_s=0.05).header
        assert published.model_copy(update={"stream_crc32c": {}}) == later  # crcs: set by the publish
    finally:
        timer.join()


def test_padding_ids_are_sized_from_num_experts_never_from_the_refs_dtype(local_config):
    """Issue 14 input 10: 384 experts, top-8, 4 layers, a chunk kept as uint8 (every kept id < 256), a micro batch of
    20 tokens padded to 1,024. The padding ids were cast to the refs' uint8: ids >= 256 wrapped onto experts 0-127,
    128 experts got no padding load and the load ranged 0..168 (mean 83.7). Now uint16, every expert 80..84."""
    cfg = FieldsConfig(num_layers=4, top_k=8, num_experts=384)
    store = open_store(local_config)
    rng = np.random.default_rng(3)
    routing = ((rng.integers(0, 248, (20, 4, 1)) + np.arange(8)) % 256).astype(np.uint8)
    branches = {"a": Branch(8, 12, {"routed_experts": routing}, branch_id="a")}
    refs = keep_all(store, local_config, branches, cfg)
    assert refs["a"].arrays["routed_experts"].dtype == "|u1"
    build_step(store, 0, 1024, [[[Seq("a", 20)]]], branches, refs, rng, cfg=cfg)
    step_file = StepFile.read(store, 0)
    padded = fetch_own(store, step_file, 0, cfg, max_concurrency=1).assembled[0].fields["routed_experts"].padded
    assert padded.dtype == np.dtype("<u2") and padded[:20].tobytes() == routing.astype("<u2").tobytes()
    load = np.bincount(padded[20:].ravel(), minlength=384)
    assert (int(load.min()), int(load.max()), int(padded.max())) == (80, 84, 383)
    stand_in = assemble_dropped_micro_batch(step_file.header.micro_batches[0], step_file.streams(0, 0),
                                            seq_len=1024, fields=cfg, token_rows=None)
    spread = stand_in.fields["routed_experts"].padded
    assert spread.dtype == np.dtype("<u2") and int(spread.max()) == 383
    assert spread.tobytes() == spread_expert_rows(1024, 4, 8, 384, np.dtype("<u2")).tobytes()


def test_a_required_field_absent_from_a_trained_sequence_fails_its_micro_batch_by_name(local_config):
    """Issue 14 input 2, trainer side: a step file whose micro batch lacks a required field (here a sequence without
    routing in a micro batch without routing) is refused for that micro batch, never handed to the loss."""
    cfg = FIELDS.model_validate({**FIELDS.model_dump(), "required": ["routed_experts"]})
    store = open_store(local_config)
    rng = np.random.default_rng(5)
    branches = {"a": make_branch(rng, 3, 5, "a"), "c": make_branch(rng, 4, 7, "c", routing=False)}
    refs = keep_all(store, local_config, branches, cfg)
    built = build_step(store, 0, SEQ_LEN, [[[Seq("a", 8)], [Seq("c", 11), Seq(None, 5)]]], branches, refs, rng, cfg=cfg)
    loss_tokens = int(built.streams[(0, 1)]["loss_mask"][:11].sum())
    fetched = fetch_own(store, StepFile.read(store, 0), 0, cfg, max_concurrency=2)
    assert sorted(fetched.assembled) == [0] and fetched.failed == {1}
    assert fetched.errors == [f"micro batch 1: FieldError: micro batch dp_rank=0 index=1: sequence 0 (env 'test', "
                              f"ref 1) trains {loss_tokens} loss tokens without required fields ['routed_experts'] "
                              "(FieldsConfig.required)"]
