"""``fetch_own`` reads whole chunks straight into each micro batch's arrays: byte identity, typed failures."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import threading
import zipfile

import crc32c
import numpy as np
import pytest

from refpipe.pipeline.step_file import HEADER_MEMBER, StepFile
from refpipe.storage.backends import open_store
from refpipe.storage.errors import StepFileError
from refpipe.storage.layout import chunk_keys, step_key
from refpipe.storage.local_store import LocalStore
from refpipe.trainer.buffers import BufferPool
from refpipe.trainer.fetch import fetch_own, wait_for_step
from refpipe.trainer.tensors import to_torch
from tests.helpers.step_file import forge_header
from tests.trainer.trainer_helpers import (
    FIELDS,
    Seq,
    assert_same,
    build_step,
    expected_micro_batch,
    flatten,
    forge_rows,
    keep_all,
    make_branch,
)

SEQ_LEN = 30


class RecordingStore(LocalStore):
    """A real LocalStore that keeps every buffer ``get_into`` read into, by key."""

    def __init__(self, prefix, config):
        super().__init__(prefix, config)
        self.lock, self.into = threading.Lock(), {}

    def get_into(self, key, buffers, offset=0):
        with self.lock:
            self.into[key] = self.into.get(key, []) + list(buffers)
        return super().get_into(key, buffers, offset)


@pytest.fixture
def built(local_config):
    store = open_store(local_config)
    rng = np.random.default_rng(3)
    branches = {"a": make_branch(rng, 5, 9, "a"), "b": make_branch(rng, 3, 6, "b"),
                "c": make_branch(rng, 4, 7, "c", routing=False), "d": make_branch(rng, 1, 5, "d", routing=False),
                "g": make_branch(rng, 2, 4, "g"), "e": make_branch(rng, 6, 4, "e", routing=False)}
    refs = keep_all(store, local_config, branches)
    layout = [
        [[Seq("a", 14), Seq("b", 6)],                      # a whole (read into place), b cut (ranged reads)
         [Seq("c", 11), Seq(None, 3), Seq("d", 6)]],        # no routing: completion rows read into place
        [[Seq("a", 14, borrowed=True), Seq("g", 6)],       # a's routing rows only, as a padding dummy
         [Seq("e", 10), Seq(None, 2)]],
    ]
    return RecordingStore(store.prefix, local_config), build_step(store, 0, SEQ_LEN, layout, branches, refs, rng)


def _read_into(store: RecordingStore, ref, array: np.ndarray) -> bool:
    """Whether ``ref``'s chunk was read by ``get_into`` into (part of) ``array``."""
    return any(np.shares_memory(b, array) for b in store.into.get(chunk_keys(ref.key)[0], []))


def test_whole_chunks_land_in_the_micro_batch_arrays_byte_for_byte(built):
    store, step = built
    step_file = StepFile.read(store, 0)
    refs = step.refs
    for dp in (0, 1):
        fetched = fetch_own(store, step_file, dp, FIELDS, max_concurrency=3)
        assert fetched.failed == set() and fetched.errors == [] and sorted(fetched.assembled) == [0, 1]
        for index, mb in fetched.assembled.items():
            assert_same(flatten(mb.streams, mb.cu_seqlens, mb.fields), expected_micro_batch(step, dp, index))
    fetched = fetch_own(store, step_file, 0, FIELDS, max_concurrency=3)
    assert (fetched.chunks, fetched.chunks_in_place) == (4, 3)  # a, c, d whole into place; b cut, then copied
    dp0 = fetched.assembled
    routing, topk = dp0[0].fields["routed_experts"].padded, dp0[1].fields["topk_ids"].values
    assert _read_into(store, refs["a"], routing) and not _read_into(store, refs["b"], routing)
    assert _read_into(store, refs["c"], topk) and _read_into(store, refs["d"], topk)
    assert _read_into(store, refs["a"], dp0[0].fields["topk_logprobs"].values)
    assert chunk_keys(refs["b"].key)[0] not in store.into  # cut: only its kept rows, by ranged reads


@pytest.mark.parametrize("damage", ["flipped", "truncated", "longer", "missing"])
def test_a_bad_chunk_fails_its_micro_batch_with_a_typed_error(built, damage):
    store, step = built
    key = chunk_keys(step.refs["c"].key)[0]
    data = bytearray(store.get(key))
    data[len(data) // 2] ^= 0x04
    damaged = {"flipped": bytes(data), "truncated": bytes(data[:-9]), "longer": store.get(key) + b"\x00" * 64}
    if damage == "missing":
        store.delete_key(key)
    else:
        store.put(key, damaged[damage])
    fetched = fetch_own(store, StepFile.read(store, 0), 0, FIELDS, max_concurrency=2)
    error = "ChunkNotFoundError" if damage == "missing" else "ChunkCorruptError"
    assert fetched.failed == {1} and len(fetched.errors) == 1 and error in fetched.errors[0], fetched.errors
    assert sorted(fetched.assembled) == [0] and fetched.chunks == 3
    mb = fetched.assembled[0]
    assert_same(flatten(mb.streams, mb.cu_seqlens, mb.fields), expected_micro_batch(step, 0, 0))


def test_routing_of_two_dtypes_in_one_micro_batch_takes_the_runs_routing_dtype(local_config):
    """Refs kept as uint16 and uint8 in one micro batch: laid out as ``FIELDS.routing_dtype`` (uint8, from
    num_experts=8), never as whatever the refs carry."""
    store = open_store(local_config)
    rng = np.random.default_rng(4)
    wide, narrow = make_branch(rng, 2, 5, "wide"), make_branch(rng, 3, 4, "narrow")
    wide.fields["routed_experts"] = wide.fields["routed_experts"].astype("<u2")
    step = build_step(store, 0, 16, [[[Seq("wide", 7), Seq("narrow", 7)]]],
                      {"wide": wide, "narrow": narrow}, keep_all(store, local_config, {"wide": wide, "narrow": narrow}),
                      rng)
    fetched = fetch_own(store, StepFile.read(store, 0), 0, FIELDS, max_concurrency=2)
    assert fetched.failed == set()
    padded = fetched.assembled[0].fields["routed_experts"].padded
    want = np.concatenate([wide.fields["routed_experts"], narrow.fields["routed_experts"]]).astype(np.uint8)
    assert padded.dtype == np.uint8 and padded[:14].tobytes() == want.tobytes()
    expected = expected_micro_batch(step, 0, 0)
    assert padded[14:].tobytes() == expected["field.routed_experts.padded"][14:].tobytes()
    assert fetched.assembled[0].fields["topk_ids"].values.tobytes() == expected["field.topk_ids.values"].tobytes()


def _planned_arrays(fetched) -> dict[tuple[int, str], np.ndarray]:
    """(index, field) -> the micro batch's allocated array (routing ``padded``, completion ``values``)."""
    return {(i, name): (f.padded if f.padded is not None else f.values)
            for i, mb in fetched.assembled.items() for name, f in mb.fields.items() if name != "sampling_mask"}


def test_a_fetch_reads_into_the_pools_buffers_of_an_earlier_step_unless_something_still_uses_them(built):
    """A rank's fetch reads into the memory of its earlier micro batch arrays (already faulted in) once nothing
    refers to them; a tensor the train callback kept keeps its memory and its bytes."""
    store, step = built
    step_file, pool = StepFile.read(store, 0), BufferPool()
    first = fetch_own(store, step_file, 0, FIELDS, max_concurrency=3, buffers=pool)
    kept = to_torch(first.assembled[1]).fields["topk_ids"].values  # micro batch 1's topk_ids, held on
    kept_bytes = kept.numpy().tobytes()
    before = {key: a.ctypes.data for key, a in _planned_arrays(first).items()}
    del first
    store.into.clear()  # the recording store's references to the buffers it read into
    pool.reclaim()
    again = fetch_own(store, step_file, 0, FIELDS, max_concurrency=3, buffers=pool)
    after = {key: a.ctypes.data for key, a in _planned_arrays(again).items()}
    held = before[(1, "topk_ids")]
    assert kept.data_ptr() == held and len(set(before.values())) == len(before) == len(after)
    assert set(after.values()) & set(before.values()) == set(before.values()) - {held}  # all but the held one
    assert kept.numpy().tobytes() == kept_bytes
    for index, mb in again.assembled.items():
        assert_same(flatten(mb.streams, mb.cu_seqlens, mb.fields), expected_micro_batch(step, 0, index))


@pytest.mark.parametrize("problem", ["slice longer than its chunk", "routing rows N-1", "routing rows N+1"])
def test_one_inconsistent_ref_fails_only_the_micro_batch_using_it(local_config, problem):
    """A slice longer than its chunk, or a ref whose routing has N-1 or N+1 rows against its N tokens, made the
    whole step file a ``StepFileError`` on every rank. Only the micro batch using it fails now (nothing is read
    from it); its DP rank's other micro batch and the other DP rank's are assembled byte for byte."""
    store = open_store(local_config)
    rng = np.random.default_rng(8)
    branches = {"a": make_branch(rng, 5, 9, "a"), "b": make_branch(rng, 3, 6, "b"), "g": make_branch(rng, 2, 4, "g"),
                "e": make_branch(rng, 6, 4, "e", routing=False)}
    refs = keep_all(store, local_config, branches)
    e_tokens = {"slice longer than its chunk": 11}.get(problem, 10)  # e holds 10 tokens
    layout = [[[Seq("a", 14), Seq("b", 6)], [Seq(None, 5)]],
              [[Seq("a", 14, borrowed=True), Seq("g", 6)], [Seq("e", e_tokens), Seq(None, 2)]]]
    step = build_step(store, 0, SEQ_LEN, layout, branches, refs, rng)
    if problem != "slice longer than its chunk":  # g holds 6 tokens
        forge_header(store, 0, lambda h: forge_rows(h, 2, "routed_experts", 6 + (1 if problem.endswith("+1") else -1)))
    step_file = StepFile.read(store, 0)
    assert [ref.branch_id for ref in step_file.header.refs] == ["a", "b", "g", "e"]
    fetched = {dp: fetch_own(store, step_file, dp, FIELDS, max_concurrency=2) for dp in (0, 1)}
    bad = 1 if problem == "slice longer than its chunk" else 0
    rows = {"routing rows N-1": 5, "routing rows N+1": 7}.get(problem)
    assert fetched[1].errors == [
        "micro batch dp_rank=1 index=1: sequence 0 keeps 11 tokens of ref 3 (branch 'e'), which holds 10"
        if rows is None else f"micro batch dp_rank=1 index=0: sequence 1: ref 2 (branch 'g'): array 'routed_experts': "
                             f"{rows} rows: expected 6 (tokens domain)"]
    assert (fetched[0].failed, fetched[1].failed, fetched[0].errors) == (set(), {bad}, [])
    assert (sorted(fetched[1].assembled), fetched[1].chunks) == ([1 - bad], 2 if bad else 1)  # never the bad use
    for dp, index in ((0, 0), (0, 1), (1, 1 - bad)):
        mb = fetched[dp].assembled[index]
        assert_same(flatten(mb.streams, mb.cu_seqlens, mb.fields), expected_micro_batch(step, dp, index))


def test_the_trainers_load_refuses_a_step_file_whose_stream_changed(built):
    """The trainer's load (``wait_for_step``, every rank) checks each stream member's crc32c: a flipped
    ``loss_mask`` byte refuses the whole step, naming the member; nothing is deleted."""
    store, step = built
    data = bytearray(store.get(step_key(0)))
    info = zipfile.ZipFile(io.BytesIO(bytes(data))).getinfo("dp1.mb1.loss_mask.npy")
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    data[start + 128] ^= 1  # the first token's loss_mask
    store.put(step_key(0), bytes(data))
    now = crc32c.crc32c(bytes(data[start:start + info.compress_size]))
    recorded = json.loads(zipfile.ZipFile(io.BytesIO(bytes(data))).read(HEADER_MEMBER))["stream_crc32c"]
    payloads = store.list_prefix("payloads")
    with pytest.raises(StepFileError) as info_:
        wait_for_step(store, 0, timeout_s=1, poll_s=0.1)
    assert str(info_.value) == (f"step file {store.uri(step_key(0))}: member dp1.mb1.loss_mask.npy: crc32c "
                                f"{now:#010x}, the header records {recorded['dp1.mb1.loss_mask.npy']:#010x} "
                                "(corrupted step file)")
    assert store.list_prefix("payloads") == payloads


def test_fetches_from_a_directory_run_on_one_thread_per_cpu_unless_configured(local_config):
    """A read from the page cache is CPU work: by default one fetch thread per CPU the process may run on; a
    configured ``max_concurrent_fetches`` (a network filesystem's reads wait on its servers) is taken as it is."""
    code = ("import os, sys; from refpipe.storage.config import StorageConfig; os.sched_setaffinity(0, {0}); "
            "config = StorageConfig.model_validate_json(sys.argv[1]); "
            "print(config.fetch_threads(), config.model_copy(update={'max_concurrent_fetches': 16}).fetch_threads())")
    got = subprocess.run([sys.executable, "-c", code, local_config.model_dump_json()], capture_output=True, text=True,
                         check=True).stdout.split()
    assert got == ["1", "16"]
    assert local_config.fetch_threads() == len(os.sched_getaffinity(0))


def test_fetches_from_s3_run_on_eight_threads_unless_configured(s3_config):
    """An S3 fetch waits on the network: 8 threads by default, whatever the CPUs."""
    assert s3_config.fetch_threads() == 8
    assert s3_config.model_copy(update={"max_concurrent_fetches": 64}).fetch_threads() == 64
