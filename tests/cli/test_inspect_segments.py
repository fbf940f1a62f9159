"""``refpipe inspect``/``verify``/``show`` of a step whose branches were kept turn by turn (segmented refs)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from refpipe.pipeline import open_branch
from refpipe.pipeline.keep import Keeper
from refpipe.pipeline.step_file import publish_step_file
from refpipe.storage.backends import open_store
from refpipe.storage.ledger import Ledger
from tests.cli.test_inspect import FIELDS_CFG, PACKING, ROUTING, invoke, make_branch, packed_header
from tests.cli.test_inspect_show import load_npy, same_bytes
from tests.pipeline.test_open_branch import rows_of


@pytest.fixture
def segmented_run(local_config, monkeypatch):
    """Step 0 ships every branch kept in turns of 3 tokens (a segment per turn), step 1 the same rows kept whole."""
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    store = open_store(local_config)
    rng = np.random.default_rng(7)
    keeper = Keeper(store, Ledger(store, "env_worker_0"), FIELDS_CFG, local_config)
    branches = {name: make_branch(rng, name, name in ROUTING) for name in "abcdefg"}
    segmented, whole = {}, {}
    for name, branch in branches.items():
        opened = keeper.open_branch(branch.num_prompt_tokens, branch_id=f"{name}-turns")
        n = branch.num_prompt_tokens + branch.num_completion_tokens
        for start in range(0, n, 3):
            end = min(n, start + 3)
            opened.append(start, end, rows_of(dict(branch.fields), start, end, num_prompt=branch.num_prompt_tokens))
        segmented[name] = opened.close()
        whole[name] = keeper.keep(dataclasses.replace(branch, branch_id=f"{name}-whole"))
    keeper.ledger.close()
    uris = [publish_step_file(store, *packed_header(store, refs, step)) for step, refs in enumerate([segmented, whole])]
    return store, segmented, uris


def test_inspect_counts_segments_and_verify_reads_each(segmented_run):
    store, refs, uris = segmented_run
    summary = json.loads(invoke(["inspect", uris[0], "--json"]).stdout)
    assert (summary["num_chunks"], summary["num_chunks_missing"]) == (7, 0)
    mb = summary["micro_batches"][0]
    assert [s["num_segments"] for s in mb["sequences"]] == [len(refs[n].segments) for n in "abc"]
    assert mb["num_segments"] == sum(len(refs[n].segments) for n in "abc")
    table = invoke(["inspect", uris[0]]).stdout
    assert f"3 present ({mb['num_segments']} segments)" in table
    verified = invoke(["verify", uris[0]])
    total = sum(len(r.segments) for r in refs.values())
    assert verified.exit_code == 0 and verified.stdout.splitlines()[-1].startswith(f"step 0: {total} chunks (")


def test_show_of_segments_equals_show_of_whole_chunks(segmented_run, tmp_path):
    store, refs, uris = segmented_run
    for dp_rank, index in PACKING:
        for step in (0, 1):
            result = invoke(["show", uris[step], "--micro-batch", str(index), "--dp-rank", str(dp_rank), "--npy",
                             str(tmp_path / str(step))])
            assert result.exit_code == 0, result.output
        seg = load_npy(tmp_path / "0", f"step00000000.dp{dp_rank}.mb{index}")
        whole = load_npy(tmp_path / "1", f"step00000001.dp{dp_rank}.mb{index}")
        fields = [n for n in whole if n.split(".")[0] in ("routed_experts", "topk_ids", "topk_logprobs",
                                                          "sampling_mask")]
        assert fields and all(same_bytes(seg[n], whole[n]) for n in fields)


def test_a_deleted_segment_is_named_by_inspect_and_show(segmented_run):
    store, refs, uris = segmented_run
    g = refs["g"]
    Ledger(store, "trainer_dp1").delete([g.segments[1]], reason="test: one segment")  # the object of all of them
    summary = json.loads(invoke(["inspect", uris[0], "--json"]).stdout)
    assert summary["missing"] == [{"uri": store.uri(g.segments[1].key), "branch_id": "g-turns", "owner_dp_rank": 1,
                                   "problem": "deleted by trainer_dp1 (test: one segment)"}]
    shown = invoke(["show", uris[0], "--micro-batch", "1", "--dp-rank", "1"])
    assert shown.exit_code == 0
    assert shown.stdout.splitlines()[1] == (
        f"gone: sampling_mask, topk_ids, topk_logprobs of sequence 0: chunk {store.uri(g.key)}: segment g-turns.0 "
        "deleted by trainer_dp1 (test: one segment)")
