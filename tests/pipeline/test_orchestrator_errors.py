"""Bad input to the orchestrator: a typed error naming the episode; a refused episode's own chunks deleted once."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest

from refpipe.pipeline.audit import audit
from refpipe.pipeline.orchestrator import Orchestrator, OrchestratorConfig
from refpipe.pipeline.step_file import StepFile
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import EpisodeError, KeyExistsError, LedgerClosedError, OutsideRunError, PackingError
from refpipe.storage.layout import step_key
from refpipe.storage.ledger_records import delete_record_of
from tests.pipeline.orchestrator_helpers import FIELDS, branch, chunks, counting_store, episode, make_keeper, tombstones

CFG = OrchestratorConfig(seq_len=32, dp_world_size=2, groups_per_step=1, group_size=2)
F32_MAX = float(np.finfo(np.float32).max)


@pytest.fixture
def env(local_config):
    store = open_store(local_config)
    return Orchestrator(CFG, counting_store(local_config), fields=FIELDS), make_keeper(store, local_config), store


def _assert_nothing_deleted(orch, store, expected: set[str]):
    assert chunks(store) == expected and tombstones(store) == set()
    assert sum(orch.deleted.values()) == 0 and orch.pending_groups == 0 and orch.store.gets == 0


def test_ref_of_a_sibling_run_is_refused_before_any_delete(env, tmp_path):
    orch, keeper, store = env
    sibling = StorageConfig(root=str(tmp_path / "root"), run_id="run_10")
    sibling_store = open_store(sibling)
    foreign = episode(make_keeper(sibling_store, sibling), np.random.default_rng(0), "x0", "g0", 1.0)
    for bad in (foreign, replace(foreign, is_eval=True)):
        with pytest.raises(OutsideRunError, match=r"episode 'x0' \(group 'g0', env 'reverse'\) branch 0: ref x0-b0"):
            orch.submit(bad)
    assert chunks(sibling_store) == {"x0-b0"} and tombstones(sibling_store) == set()
    _assert_nothing_deleted(orch, store, set())


def _assert_refused(orch, store, kept: set[str], deleted: set[str]):
    """The refusal deleted exactly ``deleted`` (path ``refused``); the rest of ``kept`` is untouched."""
    assert tombstones(store) == deleted and chunks(store) == kept - deleted
    assert orch.deleted == ({"refused": len(deleted)} if deleted else {}) and orch.pending_groups == 0


def test_ref_token_counts_that_disagree_with_the_episode(env):
    orch, keeper, store = env
    rng = np.random.default_rng(1)
    good = episode(keeper, rng, "e0", "g0", 1.0, branches=2)
    shorter = replace(good.branches[1], completion_ids=good.branches[1].completion_ids[:-1],
                      inference_logprobs=good.branches[1].inference_logprobs[:-1])
    with pytest.raises(EpisodeError, match=r"episode 'e0' .* branch 1: ref .*/e0-b1 holds 4 prompt \+ 6 "
                                           r"completion tokens: expected 4 \+ 5"):
        orch.submit(replace(good, branches=[good.branches[0], shorter]))
    _assert_refused(orch, store, {"e0-b0", "e0-b1"}, {"e0-b0", "e0-b1"})
    record = delete_record_of(store, "e0-b0")
    assert record.holder == "orchestrator" and record.reason == (
        f"orchestrator refused: episode 'e0' (group 'g0', env 'reverse') branch 1: ref {shorter.ref.uri} holds 4 "
        f"prompt + 6 completion tokens: expected 4 + 5 (the branch's tokens)")


@pytest.mark.parametrize("change, message", [
    ({"prompt_ids": np.zeros(4, np.int64)}, r"branch 0: prompt_ids is <i8 \[4\]: expected int32"),
    ({"inference_logprobs": np.zeros(5, np.float32)}, r"inference_logprobs is <f4 \[5\]: expected float32 \[6\]"),
    ({"temperature": 0.0}, r"temperature 0.0"),
    ({"temperature": float("inf")}, r"temperature inf, policy_version 0: expected >= 1 token, a finite float32 "
                                    r"temperature > 0, policy_version >= 0$"),
    ({"temperature": 1e39}, r"temperature 1e\+39"),  # inf once stored as the float32 stream
    ({"policy_version": -1}, r"policy_version -1"),
    ({"advantages": np.full(6, np.nan, np.float32)}, r"advantages hold a non-finite value at completion token 0"),
])
def test_malformed_branches(env, change, message):
    orch, keeper, store = env
    good = episode(keeper, np.random.default_rng(2), "e0", "g0", 1.0)
    with pytest.raises(EpisodeError, match=r"episode 'e0' .*" + message):
        orch.submit(replace(good, branches=[replace(good.branches[0], **change)]))
    _assert_refused(orch, store, {"e0-b0"}, {"e0-b0"})


@pytest.mark.parametrize("reward, branches", [([1.0], 2), (float("nan"), 1), ([], 0)])
def test_malformed_rewards_and_empty_episodes(env, reward, branches):
    orch, keeper, store = env
    e = episode(keeper, np.random.default_rng(3), "e0", "g0", 0.0, branches=branches)
    with pytest.raises(EpisodeError, match=r"episode 'e0'"):
        orch.submit(replace(e, reward=reward))
    ids = {f"e0-b{i}" for i in range(branches)}
    _assert_refused(orch, store, ids, ids)


def test_same_ref_twice_and_resubmitted_episode(env):
    orch, keeper, store = env
    rng = np.random.default_rng(4)
    e = episode(keeper, rng, "e0", "g0", 1.0)
    with pytest.raises(EpisodeError, match=r"episode 'e0' .*the same ref appears in more than one branch"):
        orch.submit(replace(e, reward=[1.0, 0.0], branches=[e.branches[0], e.branches[0]]))
    _assert_refused(orch, store, {"e0-b0"}, {"e0-b0"})  # deleted once, though named twice
    with pytest.raises(EpisodeError, match=r"episode 'e0' .*the same ref appears"):  # again: nothing more to delete
        orch.submit(replace(e, reward=[1.0, 0.0], branches=[e.branches[0], e.branches[0]]))
    assert orch.deleted == {"refused": 1}
    e1 = episode(keeper, rng, "e1", "g0", 1.0)
    orch.submit(e1)
    with pytest.raises(EpisodeError, match=r"episode 'e1' of group 'g0' was already submitted"):
        orch.submit(e1)
    with pytest.raises(EpisodeError, match=r"episode 'e9' of group 'g1' was already submitted \(refs \['e1-b0'\] "):
        orch.submit(replace(e1, episode_id="e9", group_id="g1"))
    fresh = replace(e1, branches=[branch(keeper, rng, branch_id="e1-again")])  # the same id, a chunk of its own
    with pytest.raises(EpisodeError, match=r"episode 'e1' of group 'g0' was already submitted$"):
        orch.submit(fresh)
    assert chunks(store) == {"e1-b0"} and orch.deleted == {"refused": 2} and orch.pending_groups == 1


def test_republishing_a_step_keeps_its_groups_queued(env):
    orch, keeper, store = env
    rng = np.random.default_rng(5)
    for g in range(2):
        orch.submit(episode(keeper, rng, f"e{g}0", f"g{g}", 1.0))
        orch.submit(episode(keeper, rng, f"e{g}1", f"g{g}", 0.0))
    first = orch.build_step(0)
    with pytest.raises(KeyExistsError, match="steps/step_00000000.npz already exists"):
        orch.build_step(0)
    assert orch.ready_groups == 1
    second = orch.build_step(1)
    assert {r.branch_id for r in first.refs} == {"e00-b0", "e01-b0"}
    assert {r.branch_id for r in second.refs} == {"e10-b0", "e11-b0"}
    assert chunks(store) == {"e00-b0", "e01-b0", "e10-b0", "e11-b0"} and tombstones(store) == set()


def test_a_shipped_ref_submitted_again_is_refused_and_left_to_its_trainer(env):
    orch, keeper, store = env
    rng = np.random.default_rng(7)
    e0, e1 = episode(keeper, rng, "e0", "g0", 1.0), episode(keeper, rng, "e1", "g0", 0.0)
    orch.submit(e0)
    orch.submit(e1)
    assert {r.branch_id for r in orch.build_step(0).refs} == {"e0-b0", "e1-b0"}
    with pytest.raises(EpisodeError) as refused:
        orch.submit(replace(e0, episode_id="e9", group_id="g1"))  # would train step 0's rows twice
    assert str(refused.value) == (f"episode 'e9' of group 'g1': ref {e0.branches[0].ref.uri} was already shipped in "
                                  f"step 0: expected a ref not shipped before (a ref trains once; that step's trainer "
                                  f"deletes its chunk)")
    assert chunks(store) == {"e0-b0", "e1-b0"} and tombstones(store) == set()  # step 0's trainer deletes it
    assert sum(orch.deleted.values()) == 0 and orch.pending_groups == 0


def test_refs_disagreeing_with_the_run_fields_keep_their_groups_queued(local_config):
    store = open_store(local_config)
    wider = FIELDS.model_copy(update={"logprobs_k": 4})  # the env servers kept a top-3 head
    orch, keeper = Orchestrator(CFG, counting_store(local_config), fields=wider), make_keeper(store, local_config)
    rng = np.random.default_rng(6)
    orch.submit(episode(keeper, rng, "e0", "g0", 1.0))
    orch.submit(episode(keeper, rng, "e1", "g0", 0.0))
    with pytest.raises(PackingError, match=r"^step 0: ref 0 \(.*/e[01]-b0\): array 'topk_ids' has trailing shape "
                                           r"\[3\]: expected \[4\] from fields"):
        orch.build_step(0)
    assert not store.exists(step_key(0)) and orch.ready_groups == 1
    _assert_nothing_deleted(orch, store, {"e0-b0", "e1-b0"})


def test_config_is_validated():
    with pytest.raises(ValueError, match=r"reward_range \[1.0, 0.0\]: expected low <= high"):
        OrchestratorConfig(reward_range=(1.0, 0.0))
    with pytest.raises(ValueError, match="extra_forbidden"):
        OrchestratorConfig(seq_lenn=3)


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_a_discarded_ref_is_refused_naming_its_deleter_and_the_audit_stays_clean(request, backend):
    config = request.getfixturevalue(f"{backend}_config")
    store = open_store(config)
    orch, keeper = Orchestrator(CFG, store, fields=FIELDS), make_keeper(store, config)
    rng = np.random.default_rng(8)
    orch.submit(episode(keeper, rng, "e0", "g0", 1.0))
    e1 = episode(keeper, rng, "e1", "g0", 0.0, branches=2)
    keeper.discard([e1.branches[1].ref])  # the env worker gave up on it, then submitted its episode anyway
    with pytest.raises(EpisodeError) as refused:
        orch.submit(replace(e1, reward=[0.0, 1.0]))
    assert str(refused.value) == (
        f"episode 'e1' (group 'g0', env 'reverse') branch 1: ref {e1.branches[1].ref.uri} was deleted by "
        f"env_worker_0 (discarded by env server): expected a kept chunk (a discarded or deleted ref cannot train: "
        f"keep the branch again)")
    assert orch.deleted == {"refused": 1} and chunks(store) == {"e0-b0"} and orch.pending_groups == 1
    assert delete_record_of(store, "e1-b0").reason.startswith("orchestrator refused: episode 'e1' (group 'g0', env "
                                                              "'reverse') branch 1: ref ")
    orch.shutdown()
    keeper.ledger.close()
    report = audit(store, finished=True)
    assert (report.kept, report.deleted, report.leaked, report.violations) == (3, 3, 0, [])
    assert report.clean and chunks(store) == set()


def test_a_ref_never_kept_is_refused(env):
    orch, keeper, store = env
    e0 = episode(keeper, np.random.default_rng(9), "e0", "g0", 1.0)
    store.delete_keys([k for k in store.list_prefix("payloads")])  # gone without a delete record
    with pytest.raises(EpisodeError, match=r"^episode 'e0' \(group 'g0', env 'reverse'\) branch 0: ref .*/e0-b0 has "
                                           r"no commit marker and no delete record of its own \(never kept, or "
                                           r"released by a trainer\): expected a kept chunk"):
        orch.submit(e0)
    assert orch.deleted == {} and orch.pending_groups == 0 and tombstones(store) == set()  # no delete tried


@pytest.mark.parametrize("reward", [1.7e308, -1e39, [1.0, 3.5e38]])
def test_a_reward_beyond_float32_is_refused_at_its_own_submit(env, reward):
    orch, keeper, store = env
    rng = np.random.default_rng(10)
    n = 2 if isinstance(reward, list) else 1
    orch.submit(episode(keeper, rng, "e0", "g0", 1.0, branches=n))
    with pytest.raises(EpisodeError) as refused:
        orch.submit(episode(keeper, rng, "e1", "g0", reward, branches=n))
    assert str(refused.value) == (f"episode 'e1' (group 'g0', env 'reverse'): reward {reward!r}: expected one finite "
                                  f"float with |reward| <= 3.402823e+38 (float32's largest) or one per branch ({n})")
    assert orch.deleted == {"refused": n} and orch.pending_groups == 1
    assert chunks(store) == {f"e0-b{i}" for i in range(n)}


def test_rewards_at_float32s_largest_train_without_overflow(env):
    orch, keeper, store = env
    rng = np.random.default_rng(11)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy overflow warning either
        orch.submit(episode(keeper, rng, "e0", "g0", F32_MAX))
        orch.submit(episode(keeper, rng, "e1", "g0", -F32_MAX))
        header = orch.build_step(0)
    step_file = StepFile.read(store, 0)
    advantages = {a for mb in step_file.header.micro_batches
                  for a in step_file.streams(mb.dp_rank, mb.index)["advantages"].tolist()}
    assert advantages == {-1.0, 0.0, 1.0} and header.metrics["reward_mean"] == 0.0


def test_after_shutdown_submit_and_build_step_are_refused_and_say_who_deletes(env):
    orch, keeper, store = env
    orch.shutdown()
    e0 = episode(keeper, np.random.default_rng(12), "e0", "g0", 1.0)
    run = store.prefix.uri
    with pytest.raises(LedgerClosedError) as refused:
        orch.submit(e0)
    assert str(refused.value) == (f"orchestrator of run {run} is shut down: submit of episode 'e0' of group 'g0' "
                                  f"refused: its chunks are not deleted; discard its refs with the Keeper that kept "
                                  f"them (Keeper.discard), else `refpipe sweep` deletes them once the run stopped")
    with pytest.raises(LedgerClosedError) as refused:
        orch.build_step(0)
    assert str(refused.value) == f"orchestrator of run {run} is shut down: build_step(0) refused (nothing is published)"
    assert chunks(store) == {"e0-b0"} and not store.exists(step_key(0))
    keeper.discard(e0.refs())  # as the error says
    keeper.ledger.close()
    orch.shutdown()  # a second shutdown does nothing
    report = audit(store, finished=True)
    assert (report.kept, report.deleted, report.leaked, report.violations) == (1, 1, 0, []) and report.clean


def test_a_malformed_episode_with_a_discarded_ref_deletes_only_its_kept_chunks(local_config):
    store = open_store(local_config)
    orch, keeper = Orchestrator(CFG, store, fields=FIELDS), make_keeper(store, local_config)
    e0 = episode(keeper, np.random.default_rng(13), "e0", "g0", [1.0, 0.0], branches=2)
    keeper.discard([e0.branches[1].ref])
    bad = replace(e0.branches[0], prompt_ids=e0.branches[0].prompt_ids.astype(np.int64))
    with pytest.raises(EpisodeError, match=r"^episode 'e0' .* branch 0: prompt_ids is <i8 \[4\]: expected int32"):
        orch.submit(replace(e0, branches=[bad, e0.branches[1]]))
    assert orch.deleted == {"refused": 1} and chunks(store) == set()
    orch.shutdown()
    keeper.ledger.close()
    report = audit(store, finished=True)  # no second delete of the discarded chunk on record
    assert (report.kept, report.deleted, report.leaked, report.violations) == (2, 2, 0, []) and report.clean
