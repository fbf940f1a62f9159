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
    total = sum(len(r.chunks) for r in refs.values())
    assert total == 7  # on a filesystem a writer life's segments are one object: one chunk per branch here
    assert (summary["num_chunks"], summary["num_chunks_missing"]) == (total, 0)
    mb = summary["micro_batches"][0]
    assert [s["num_segments"] for s in mb["sequences"]] == [len(refs[n].segments) for n in "abc"]
    assert mb["num_segments"] == sum(len(refs[n].segments) for n in "abc")
    table = invoke(["inspect", uris[0]]).stdout
    assert (mb["num_chunks"], mb["num_segments"]) == (3, sum(len(refs[n].segments) for n in "abc"))
    assert f"{mb['num_chunks']} present ({mb['num_segments']} segments)" in table
    verified = invoke(["verify", uris[0]])
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
    ledger = Ledger(store, "trainer_dp1")
    ledger.delete([g.segments[1]], reason="test: one segment")  # the object of all of them
    ledger.close()  # its reaper has removed the object's bytes
    summary = json.loads(invoke(["inspect", uris[0], "--json"]).stdout)
    assert summary["missing"] == [{"uri": store.uri(g.segments[1].key), "branch_id": "g-turns", "owner_dp_rank": 1,
                                   "problem": "deleted by trainer_dp1 (test: one segment)"}]
    shown = invoke(["show", uris[0], "--micro-batch", "1", "--dp-rank", "1"])
    assert shown.exit_code == 0
    assert shown.stdout.splitlines()[1] == (
        f"gone: sampling_mask, topk_ids, topk_logprobs of sequence 0: chunk {store.uri(g.key)}: segment g-turns.0 "
        "deleted by trainer_dp1 (test: one segment)")


def test_inspect_and_verify_count_a_shared_prefix_once(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    store = open_store(local_config)
    rng = np.random.default_rng(9)
    keeper = Keeper(store, Ledger(store, "env_worker_0"), FIELDS_CFG, local_config)
    branches = {name: make_branch(rng, name, name in ROUTING) for name in "abcdefg"}
    holders = sorted(ROUTING)  # a, b, c, d hold one prefix of 2 prompt tokens
    prefix = keeper.keep_prefix(2, {"routed_experts": branches["a"].fields["routed_experts"][:2]},
                                holders=[f"{n}-turns" for n in holders], prefix_id="group-prompt")
    refs = {}
    for name, branch in branches.items():
        opened = keeper.open_branch(branch.num_prompt_tokens, branch_id=f"{name}-turns",
                                    prefix=prefix if name in holders else None)
        n = branch.num_prompt_tokens + branch.num_completion_tokens
        for start in range(opened.num_tokens, n, 3):
            end = min(n, start + 3)
            opened.append(start, end, rows_of(dict(branch.fields), start, end, num_prompt=branch.num_prompt_tokens))
        refs[name] = opened.close()
    keeper.ledger.close()
    uri = publish_step_file(store, *packed_header(store, refs, 0))
    objects = [len(r.chunks) for r in refs.values()]  # a holder: the prefix and its writer life's object
    distinct = sum(objects) - 3  # the prefix once, not once per holder
    assert (sum(objects), distinct) == (11, 8)
    summary = json.loads(invoke(["inspect", uri, "--json"]).stdout)
    assert (summary["num_chunks"], summary["num_chunks_present"]) == (distinct, distinct)
    assert summary["micro_batches"][0]["num_chunks"] == 4  # a, b, c and their one prefix
    verified = invoke(["verify", uri])
    assert verified.exit_code == 0 and verified.stdout.splitlines()[-1].startswith(f"step 0: {distinct} chunks (")
