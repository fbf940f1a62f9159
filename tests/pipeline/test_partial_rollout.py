"""Partial rollouts: an open branch cut at a step boundary is recorded, held while the run lives, continued by a
restarted env server (byte-identical to the branch kept whole) or discarded once; an abandoned one is swept whole."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from refpipe.cli.main import app
from refpipe.pipeline import open_branch
from refpipe.pipeline.audit import audit
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.pipeline.sweep import sweep
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.errors import OpenBranchError
from refpipe.storage.layout import node_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_open import open_key
from tests.pipeline.test_keep import CFG, fields_of
from tests.pipeline.test_open_branch import P, assert_same, rows_of

C = 26


def keeper_of(config, cfg=CFG) -> Keeper:
    store = open_store(config)
    return Keeper(store, Ledger(store, "env_worker_0"), cfg, config)


@pytest.fixture(autouse=True)
def segment_per_append(monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)


def test_a_branch_cut_at_a_step_boundary_is_held_then_continued_after_a_restart(local_config):
    fields = fields_of(P, C, seed=1)
    first = keeper_of(local_config)
    orchestrator = Ledger(first.store, "orchestrator")  # a live session of the run
    branch = first.open_branch(P, branch_id="long")
    for start, end in [(0, 7), (7, 12)]:
        branch.append(start, end, rows_of(fields, start, end))
    suspended = branch.suspend()
    assert (suspended.num_tokens, [s.branch_id for s in suspended.segments]) == (12, ["long.0", "long.0"])
    with pytest.raises(OpenBranchError, match=r"^branch long: append rows \[12, 13\): the branch was suspended after "
                                              r"12 tokens: expected an open branch; resume it \(Keeper.resume_branch"
                                              r"\('long'\)\) and use the branch that returns$"):
        branch.append(12, 13, rows_of(fields, 12, 13))
    first.ledger.close()  # the env server restarts
    assert audit(first.store).outstanding_by_holder == {"open branch long (suspended)": 1}  # one object per life

    again = keeper_of(local_config)
    resumed = again.resume_branch("long")
    assert (resumed.num_tokens, len(resumed.segments)) == (12, 2)
    for start, end in [(12, 20), (20, P + C)]:
        resumed.append(start, end, rows_of(fields, start, end))
    ref = resumed.close()
    assert [s.branch_id for s in ref.segments] == ["long.0", "long.0", "long.r1.2", "long.r1.2"]
    assert not again.store.exists(open_key("long"))
    whole = again.keep(Branch(P, C, fields, branch_id="whole"))
    assert_same(fetch_arrays(again.store, ref), fetch_arrays(again.store, whole))
    with pytest.raises(OpenBranchError, match=rf"^branch long: no suspended branch of that id in run .* \(already "
                                              rf"closed or discarded by env worker env_worker_0 \(ledger session "
                                              rf"{again.ledger.session}\), its last resumer \(claim .*/long\.claim\.0"
                                              rf"\), or its record removed by a sweep\)$"):
        again.resume_branch("long")
    with pytest.raises(OpenBranchError, match=r"^branch never: no suspended branch of that id in run .* \(never "
                                              r"opened in this run\)$"):
        again.resume_branch("never")
    again.open_branch(P, branch_id="open").discard()
    with pytest.raises(OpenBranchError, match=rf"^branch open: no suspended branch of that id in run .* \(opened by "
                                              rf"env worker env_worker_0 \(ledger session {again.ledger.session}\) "
                                              rf"and never suspended, or its record removed by a sweep\)$"):
        again.resume_branch("open")
    again.discard([ref, whole])
    again.ledger.close()
    orchestrator.close()
    report = audit(again.store, finished=True)
    assert (report.kept, report.deleted, report.present, report.outstanding) == (3, 3, 0, 0) and report.clean


def test_the_last_tokens_rows_wait_across_the_cut_for_its_routing_row(local_config):
    cfg = CFG.model_copy(update={"routing_rows": "all_but_last"})
    fields = fields_of(P, C, seed=2)
    keeper = keeper_of(local_config, cfg)
    branch = keeper.open_branch(P, branch_id="lag")
    branch.append(0, 7, rows_of(fields, 0, 7, lag=True))
    branch.append(7, 12, rows_of(fields, 7, 12, lag=True))
    suspended = branch.suspend()  # token 11's routing row has not arrived; its other rows are in the record
    assert (suspended.num_tokens, [s.num_tokens for s in suspended.segments]) == (12, [6, 5])
    assert suspended.waiting is not None and suspended.waiting.num_tokens == 1
    assert {n: s.shape for n, s in suspended.waiting.arrays.items()} == {
        "routed_experts": (0, 3, 2), "topk_ids": (1, 4), "topk_logprobs": (1, 4), "sample_support": (1, 5),
        "sampling_mask.counts": (1,), "sampling_mask.ids": (int(fields["sampling_mask"].counts[7]),)}
    assert suspended.waiting.rows()["topk_logprobs"].tobytes() == fields["topk_logprobs"][7:8].tobytes()
    keeper.ledger.close()  # the env server restarts: only the record knows token 11's completion rows
    keeper = keeper_of(local_config, cfg)
    resumed = keeper.resume_branch("lag")
    assert resumed.num_tokens == 12
    resumed.append(12, 20, rows_of(fields, 12, 20, lag=True))  # routing of positions [11, 19), as uncut
    resumed.append(20, P + C, rows_of(fields, 20, P + C, lag=True))
    ref = resumed.close()
    whole = keeper.keep(Branch(P, C, dict(fields, routed_experts=fields["routed_experts"][:-1]), branch_id="whole"))
    assert_same(fetch_arrays(keeper.store, ref), fetch_arrays(keeper.store, whole))


def test_a_suspended_branch_is_continued_or_discarded_once(local_config):
    fields = fields_of(P, C, seed=3)
    keeper = keeper_of(local_config)
    other = Keeper(keeper.store, Ledger(keeper.store, "env_worker_1"), CFG, local_config)
    branch = keeper.open_branch(P, branch_id="once")
    branch.append(0, 7, rows_of(fields, 0, 7))
    branch.suspend()
    one = keeper.resume_branch("once")
    with pytest.raises(OpenBranchError, match=rf"^branch once: already resumed by env worker env_worker_0 \(ledger "
                                              rf"session {keeper.ledger.session}\) \(claim .*/once\.claim\.0\): a "
                                              rf"suspended branch is continued or discarded once$"):
        other.resume_branch("once")  # before writing or deleting anything
    one.append(7, 9, rows_of(fields, 7, 9))
    one.suspend()  # cut again: the next resume takes the next claim
    two = other.resume_branch("once")
    with pytest.raises(OpenBranchError, match=rf"^branch once: already resumed by env worker env_worker_1 \(ledger "
                                              rf"session {other.ledger.session}\) \(claim .*/once\.claim\.1\)"):
        keeper.resume_branch("once")
    two.append(9, 12, rows_of(fields, 9, 12))
    ref = two.close()
    assert [s.branch_id for s in ref.segments] == ["once.0", "once.r1.1", "once.r2.2"]
    whole = keeper.keep(Branch(P, 12 - P, rows_of(fields, 0, 12), branch_id="whole"))
    assert_same(fetch_arrays(keeper.store, ref), fetch_arrays(keeper.store, whole))
    assert not keeper.store.exists(open_key("once"))
    with pytest.raises(OpenBranchError, match="no suspended branch of that id"):
        keeper.resume_branch("once")
    assert other.discard([ref], reason="episode dropped").deleted == [
        keeper.store.uri(node_key(n)) for n in ("once.0", "once.r1.1", "once.r2.2")]
    keeper.discard([whole])
    keeper.ledger.close()
    other.ledger.close()
    report = audit(keeper.store, finished=True)
    assert (report.kept, report.deleted, report.present, report.double_deletes) == (4, 4, 0, 0) and report.clean


def test_a_resumer_that_died_leaves_its_segments_to_the_sweep_and_no_id_is_reused(local_config):
    fields = fields_of(P, C, seed=5)
    keeper = keeper_of(local_config)
    branch = keeper.open_branch(P, branch_id="crash")
    branch.append(0, 7, rows_of(fields, 0, 7))
    branch.suspend()
    dying = Keeper(keeper.store, Ledger(keeper.store, "env_worker_1"), CFG, local_config)
    dying.resume_branch("crash").append(7, 12, rows_of(fields, 7, 12))  # crash.r1.1, uncommitted, not in the record
    dying.ledger.close()  # the resumer dies: its session is dead, its claim passed over
    resumed = keeper.resume_branch("crash")
    assert (resumed.num_tokens, [s.branch_id for s in resumed.segments]) == (7, ["crash.0"])
    for start, end in [(7, 12), (12, P + C)]:
        resumed.append(start, end, rows_of(fields, start, end))
    ref = resumed.close()
    assert [s.branch_id for s in ref.segments] == ["crash.0", "crash.r2.1", "crash.r2.1"]
    whole = keeper.keep(Branch(P, C, fields, branch_id="whole"))
    assert_same(fetch_arrays(keeper.store, ref), fetch_arrays(keeper.store, whole))
    orphan = keeper.store.uri(node_key("crash.r1.1"))
    report = audit(keeper.store)  # no zarr.json (its life never ended): an incomplete keep, held while the run lives
    assert (report.incomplete_keeps, report.outstanding_by_holder) == ([orphan], {"env_worker_0": 3,
                                                                                 "incomplete keep": 1})
    keeper.discard([ref, whole])
    keeper.ledger.close()
    report = audit(keeper.store, stopped=True)
    assert (report.leaked_chunks, report.incomplete_keeps) == ([orphan], [orphan])
    swept = sweep(keeper.store, stopped=True)
    assert (swept.deleted, swept.removed_incomplete) == ([], [orphan])
    assert keeper.store.list_prefix("payloads") == []
    report = audit(keeper.store, finished=True)
    assert (report.kept, report.deleted, report.present, report.double_deletes) == (3, 3, 0, 0) and report.clean


def test_an_abandoned_open_branch_is_swept_whole(local_config):
    fields = fields_of(P, C, seed=4)
    keeper = keeper_of(local_config)
    branch = keeper.open_branch(P, branch_id="lost")
    for start, end in [(0, 7), (7, 12), (12, 15)]:
        branch.append(start, end, rows_of(fields, start, end))
    branch.suspend()
    keeper.ledger.close()
    listed = CliRunner().invoke(app, ["ls", keeper.store.prefix.uri, "--json"], catch_exceptions=False)
    assert json.loads(listed.stdout)["ledger"]["num_suspended_branches"] == 1
    assert sweep(keeper.store, stopped=True).deleted == []  # a resumed run may still continue it
    assert audit(keeper.store, stopped=True).outstanding_by_holder == {"open branch lost (suspended)": 1}
    swept = sweep(keeper.store, abandon=True)
    assert swept.deleted == [keeper.store.uri(node_key("lost.0"))]  # its writer life's object
    assert not keeper.store.exists(open_key("lost"))  # its segments are gone: it can no longer be resumed
    listed = CliRunner().invoke(app, ["ls", keeper.store.prefix.uri, "--json"], catch_exceptions=False)
    assert json.loads(listed.stdout)["ledger"]["num_suspended_branches"] == 0
    again = keeper_of(local_config)
    with pytest.raises(OpenBranchError, match=r"^branch lost: no suspended branch of that id in run "):
        again.resume_branch("lost")
    again.ledger.close()
    report = audit(keeper.store, finished=True)
    assert (report.kept, report.deleted, report.present) == (1, 1, 0) and report.clean
