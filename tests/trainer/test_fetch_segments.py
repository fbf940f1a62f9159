"""Segmented branches through a real step: each segment read straight into the micro batch's arrays, byte-identical
to the layout computed from the whole branches; a lost segment fails only its micro batch; after release every
segment is deleted exactly once and the audit is clean."""

from __future__ import annotations

import numpy as np
import pytest

from refpipe.pipeline import open_branch
from refpipe.pipeline.audit import audit
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.pipeline.step_file import StepFile
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.layout import chunk_keys
from refpipe.storage.ledger import Ledger
from refpipe.trainer.fetch import fetch_own
from tests.pipeline.test_open_branch import rows_of
from tests.trainer.test_fetch_direct import RecordingStore
from tests.trainer.trainer_helpers import (
    FIELDS,
    Seq,
    assert_same,
    build_step,
    expected_micro_batch,
    flatten,
    make_branch,
)

SEQ_LEN = 40
TURN_TOKENS = 4


def keep_segmented(keeper: Keeper, branch: Branch) -> PayloadRef:
    """``branch`` appended in turns of ``TURN_TOKENS`` tokens (the first: its prompt and one turn)."""
    n, p = branch.num_prompt_tokens + branch.num_completion_tokens, branch.num_prompt_tokens
    opened = keeper.open_branch(p, branch_id=branch.branch_id)
    bounds = [0, *range(p + TURN_TOKENS, n, TURN_TOKENS), n]
    for start, end in zip(bounds, bounds[1:]):
        opened.append(start, end, rows_of(dict(branch.fields), start, end, num_prompt=p))
    return opened.close()


@pytest.fixture
def built(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)  # a segment per turn
    store = open_store(local_config)
    rng = np.random.default_rng(5)
    branches = {"a": make_branch(rng, 5, 14, "a"), "b": make_branch(rng, 3, 11, "b"),
                "c": make_branch(rng, 4, 9, "c", routing=False), "g": make_branch(rng, 2, 9, "g"),
                "e": make_branch(rng, 6, 5, "e", routing=False)}
    keeper = Keeper(store, Ledger(store, "env_worker_0"), FIELDS, local_config)
    refs = {name: keep_segmented(keeper, b) for name, b in branches.items()}
    keeper.ledger.close()
    layout = [[[Seq("a", 19), Seq("b", 9)], [Seq("c", 13)]],   # b cut through its second segment
              [[Seq("a", 19, borrowed=True), Seq("g", 11)], [Seq("e", 11)]]]
    return RecordingStore(store.prefix, local_config), build_step(store, 0, SEQ_LEN, layout, branches, refs, rng)


def test_segments_land_in_the_micro_batch_arrays_byte_for_byte(built):
    store, step = built
    assert [len(step.refs[n].segments) for n in "abcge"] == [4, 3, 3, 3, 2]
    step_file = StepFile.read(store, 0)
    assert step_file.header.refs == [step.refs[n] for n in "abcge"]
    for dp in (0, 1):
        fetched = fetch_own(store, step_file, dp, FIELDS, max_concurrency=3)
        assert fetched.failed == set() and fetched.errors == []
        for index, mb in fetched.assembled.items():
            assert_same(flatten(mb.streams, mb.cu_seqlens, mb.fields), expected_micro_batch(step, dp, index))
    store.into.clear()
    fetched = fetch_own(store, step_file, 0, FIELDS, max_concurrency=3)
    routing = fetched.assembled[0].fields["routed_experts"].padded
    a, b = step.refs["a"], step.refs["b"]
    assert a.nodes == (a.segments[0].key,) and b.nodes == (b.segments[0].key,)  # one object per writer life
    a_read = store.into[chunk_keys(a.nodes[0])[0]]  # a whole: one read of its object, into the routing array
    assert sum(x.nbytes for x in a_read) == a.nbytes and any(np.shares_memory(x, routing) for x in a_read)
    b_read = store.into[chunk_keys(b.nodes[0])[0]]  # b cut at token 9: its first segment read into place, the
    assert sum(x.nbytes for x in b_read) == b.segments[0].nbytes  # second (tokens [7, 11)) by a ranged read


def test_a_lost_segment_fails_only_its_micro_batch(built):
    store, step = built
    store.delete_key(chunk_keys(step.refs["c"].segments[1].key)[0])
    fetched = fetch_own(store, StepFile.read(store, 0), 0, FIELDS, max_concurrency=2)
    assert fetched.failed == {1} and len(fetched.errors) == 1
    assert f"ChunkNotFoundError: {store.uri(chunk_keys(step.refs['c'].segments[1].key)[0])} does not exist" \
        in fetched.errors[0]
    mb = fetched.assembled[0]
    assert_same(flatten(mb.streams, mb.cu_seqlens, mb.fields), expected_micro_batch(step, 0, 0))


def test_released_segments_are_deleted_once_and_the_audit_is_clean(built):
    store, step = built
    header = StepFile.read(store, 0).header
    for dp in (0, 1):
        trainer = Ledger(store, f"trainer_dp{dp}")
        result = trainer.delete(header.owned_refs(dp), reason=f"trainer dp_rank={dp} step 0")
        assert sorted(result.deleted) == sorted(store.uri(n) for r in header.owned_refs(dp) for n in r.nodes)
        trainer.record("release", step=0, dp_rank=dp)
        trainer.close()
    report = audit(store, finished=True)
    assert (report.kept, report.shipped, report.borrowed, report.deleted, report.present) == (5, 5, 1, 5, 0)
    assert report.violations == [] and report.clean and report.outstanding == 0
