"""A group's shared prompt kept once: its branches read it back as their own first rows; the ledger deletes it
exactly once after its last holder is released, also when holders are released by processes at once; the audit
explains a prefix still held; bad holders are typed errors."""

from __future__ import annotations

import multiprocessing

import pytest

from refpipe.pipeline import open_branch
from refpipe.pipeline.audit import audit
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import DoubleDeleteError, OpenBranchError, UnknownRefError
from refpipe.storage.layout import chunk_keys, node_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_holds import released_holders
from refpipe.storage.ledger_records import delete_record_of
from tests.pipeline.test_keep import CFG, fields_of
from tests.pipeline.test_open_branch import assert_same, rows_of

P, C = 6, 14
HOLDERS = ["g-b0", "g-b1", "g-b2", "g-b3"]


def group(keeper: Keeper, cfg_lag: bool = False) -> tuple[PayloadRef, dict[str, PayloadRef], dict[str, dict]]:
    """Keep the group's prompt once, then each holder's branch turn by turn: (prefix, refs, whole fields)."""
    prompt = fields_of(P, C, seed=0)["routed_experts"][:P]
    prefix = keeper.keep_prefix(P, {"routed_experts": prompt}, holders=HOLDERS, prefix_id="g-prompt")
    refs, wholes = {}, {}
    for i, holder in enumerate(HOLDERS):
        fields = fields_of(P, C, seed=10 + i)
        fields["routed_experts"][:P] = prompt
        branch = keeper.open_branch(P, branch_id=holder, prefix=prefix)
        for start, end in [(P, P + 5), (P + 5, P + C)]:
            rows = rows_of(fields, start, end, num_prompt=P)
            if cfg_lag:  # rows of positions [start, end - 1), then [start - 1, end - 1)
                rows["routed_experts"] = fields["routed_experts"][start - (start > P) : end - 1]
            branch.append(start, end, rows)
        refs[holder], wholes[holder] = branch.close(), fields
    return prefix, refs, wholes


@pytest.fixture
def keeper(local_config, monkeypatch) -> Keeper:
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    store = open_store(local_config)
    return Keeper(store, Ledger(store, "env_worker_0"), CFG, local_config)


@pytest.mark.parametrize("lag", [False, True])
def test_branches_read_the_prefix_back_as_their_own_rows(local_config, monkeypatch, lag):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    store = open_store(local_config)
    cfg = CFG.model_copy(update={"routing_rows": "all_but_last"}) if lag else CFG
    keeper = Keeper(store, Ledger(store, "env_worker_0"), cfg, local_config)
    prefix, refs, wholes = group(keeper, lag)
    assert prefix.holders == tuple(HOLDERS) and prefix.arrays.keys() == {"routed_experts"}
    payloads = {k.rsplit("/", 1)[0] for k in store.list_prefix("payloads")}
    assert sum(n.endswith("/g-prompt") for n in payloads) == 1  # one copy of the prompt rows
    for holder, ref in refs.items():
        assert ref.segments[0] == prefix and [s.branch_id for s in ref.segments[1:]][:1] == [f"{holder}.1"]
        fields = wholes[holder]
        engine = dict(fields, routed_experts=fields["routed_experts"][:-1]) if lag else fields
        whole = keeper.keep(Branch(P, C, engine, branch_id=f"{holder}-whole"))
        assert_same(fetch_arrays(store, ref), fetch_arrays(store, whole))
        for n in (1, P, P + 1, P + 7):
            assert_same(fetch_arrays(store, ref, n), fetch_arrays(store, whole, n))


def test_the_prefix_is_deleted_once_after_its_last_holder_and_the_audit_explains_it_meanwhile(keeper):
    store = keeper.store
    prefix, refs, _ = group(keeper)
    trainers = [Ledger(store, f"trainer_dp{r}") for r in range(2)]
    for i, holder in enumerate(HOLDERS[:3]):
        result = trainers[i % 2].delete([refs[holder]], reason="released")
        assert result.deleted == [store.uri(node_key(f"{holder}.1"))]  # its one writer life's object
    for trainer in trainers:
        trainer.wait_freed()
    assert store.exists(chunk_keys(prefix.key)[0]) and released_holders(store, "g-prompt") == set(HOLDERS[:3])
    report = audit(store)
    assert report.outstanding_by_holder == {"env_worker_0": 1, "shared prefix (3 of 4 holders released)": 1}
    with pytest.raises(DoubleDeleteError, match=r"shared prefix .*/g-prompt: branch 'g-b1' released it twice: first "
                                                r".*second by trainer_dp0 \(again\)"):
        trainers[0].delete([refs["g-b1"]], reason="again")
    result = trainers[1].delete([refs["g-b3"]], reason="released")
    trainers[1].wait_freed()
    assert store.uri(prefix.key) in result.deleted and not store.exists(chunk_keys(prefix.key)[0])
    for ledger in [keeper.ledger, *trainers]:
        ledger.close()
    report = audit(store, finished=True)
    assert (report.kept, report.deleted, report.present, report.leaked, report.outstanding) == (5, 5, 0, 0, 0)
    assert report.double_deletes == 2  # the second release of g-b1: its segments' object and its hold on the prefix
    assert f"double_delete of {store.uri(prefix.key)} by trainer_dp0 (again), first deleted by trainer_dp1 " \
           f"(released)" in report.delete_problems


def _release(root: str, run_id: str, rank: int, ref_json: str, barrier) -> None:
    from refpipe.storage.config import StorageConfig
    store = open_store(StorageConfig(root=root, run_id=run_id))
    ledger = Ledger(store, f"trainer_dp{rank}")
    barrier.wait()
    ledger.delete([PayloadRef.model_validate_json(ref_json)], reason=f"released by dp {rank}")
    ledger.close()


def test_holders_released_by_processes_at_once_delete_the_prefix_exactly_once(keeper, local_config):
    store = keeper.store
    prefix, refs, _ = group(keeper)
    keeper.ledger.close()
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(HOLDERS))
    procs = [ctx.Process(target=_release, args=(local_config.root, local_config.run_id, r,
                                                refs[h].model_dump_json(), barrier)) for r, h in enumerate(HOLDERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * len(HOLDERS)
    assert delete_record_of(store, "g-prompt") is not None and not store.exists(chunk_keys(prefix.key)[0])
    report = audit(store, finished=True)
    assert (report.kept, report.deleted, report.present, report.double_deletes) == (5, 5, 0, 0)
    assert report.violations == [] and report.clean


def test_bad_holders_are_typed_errors_and_discards_release_the_prefix(keeper):
    store = keeper.store
    prompt = fields_of(P, C)["routed_experts"][:P]
    with pytest.raises(OpenBranchError, match=r"^shared prefix p: holders \['a', 'a'\]: expected distinct branch ids"):
        keeper.keep_prefix(P, {"routed_experts": prompt}, holders=["a", "a"], prefix_id="p")
    prefix = keeper.keep_prefix(P, {"routed_experts": prompt}, holders=["a", "b", "c"], prefix_id="p")
    with pytest.raises(OpenBranchError, match=r"^branch x: prefix p is held by \['a', 'b', 'c'\]: expected 'x' among "
                                              r"them \(declare every holder in keep_prefix\)"):
        keeper.open_branch(P, branch_id="x", prefix=prefix)
    with pytest.raises(OpenBranchError, match=r"^branch a: prefix p has 6 \+ 0 tokens: expected at most the "
                                              r"branch's 5 prompt tokens"):
        keeper.open_branch(5, branch_id="a", prefix=prefix)
    with pytest.raises(UnknownRefError, match=r"shared prefix .*/p: release by env_worker_0 \(gone\) for branch 'x' "
                                              r"refused: not one of its declared holders \['a', 'b', 'c'\]"):
        keeper.release_holders(prefix, ["x"], reason="gone")
    branch = keeper.open_branch(P, branch_id="a", prefix=prefix)
    branch.append(P, P + 3, rows_of(fields_of(P, C), P, P + 3, num_prompt=P))
    assert branch.discard(reason="episode failed").deleted == [store.uri(node_key("a.1"))]
    keeper.release_holders(prefix, ["b"], reason="episode failed before opening")
    assert store.exists(chunk_keys(prefix.key)[0])
    with pytest.raises(OpenBranchError, match=r"^branch b: prefix p was already released for holder 'b' "
                                              r"\(release_holders, or a discard\): expected a holder that still holds "
                                              r"it"):
        keeper.open_branch(P, branch_id="b", prefix=prefix)  # else c's release would delete it while b is open
    with pytest.raises(OpenBranchError, match=r"^branch a: prefix p was already released for holder 'a'"):
        keeper.open_branch(P, branch_id="a", prefix=prefix)
    assert keeper.release_holders(prefix, ["c"]).deleted == [store.uri(prefix.key)]
    keeper.ledger.close()
    report = audit(store, finished=True)
    assert (report.kept, report.deleted, report.present, report.unknown_deletes) == (2, 2, 0, 1)
