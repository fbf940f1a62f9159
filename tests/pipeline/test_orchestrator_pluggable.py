"""The pluggable orchestrator: balanced packing by default, the caller's advantage estimator, pruning and
staleness as options; and a refused episode leaves nothing behind (the audit, exactly)."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest

from refpipe.pipeline.advantages import from_episode, rloo
from refpipe.pipeline.audit import audit
from refpipe.pipeline.orchestrator import Orchestrator, OrchestratorConfig
from refpipe.pipeline.packing import first_fit_packer
from refpipe.pipeline.step_file import StepFile
from refpipe.storage.backends import open_store
from refpipe.storage.errors import EpisodeError, OutsideRunError
from tests.pipeline.orchestrator_helpers import FIELDS, chunks, episode, make_keeper, tombstones

LENGTHS = (20, 18, 16, 15, 14, 12, 12, 11)
"""Tokens of the 8 samples of one step (118 in all; 4 prompt tokens each)."""


def _orchestrator(store, **options):
    packer = options.pop("packer", None)
    advantages = options.pop("advantages", None)
    cfg = OrchestratorConfig(**{"seq_len": 128, "dp_world_size": 2, "groups_per_step": 1, "group_size": 8,
                                **options})
    return Orchestrator(cfg, store, fields=FIELDS, advantages=advantages,
                        **({"packer": packer} if packer else {}))


def _submit_group(orch, keeper, rng, rewards, lengths, group="g0", **kwargs):
    for i, (r, n) in enumerate(zip(rewards, lengths)):
        orch.submit(episode(keeper, rng, f"{group}e{i}", group, r, num_completion=n - 4, **kwargs))


def _advantages_by_branch(store, step: int) -> dict[str, list[float]]:
    """branch id -> the advantages its sequence carries on its completion tokens, read back from the step file."""
    step_file = StepFile.read(store, step)
    out = {}
    for mb in step_file.header.micro_batches:
        adv = step_file.streams(mb.dp_rank, mb.index)["advantages"]
        for seq, start in zip(mb.sequences, mb.cu_seqlens()[:-1].tolist()):
            if not seq.borrowed:
                out[step_file.header.refs[seq.ref].branch_id] = adv[start + 4:start + seq.num_tokens].tolist()
    return out


@pytest.mark.parametrize("packer, per_rank", [(None, [[59], [59]]), (first_fit_packer, [[118], [11]])])
def test_dp_ranks_get_comparable_work_by_default(local_config, packer, per_rank):
    store = open_store(local_config)
    orch, keeper = _orchestrator(store, packer=packer), make_keeper(store, local_config)
    _submit_group(orch, keeper, np.random.default_rng(0), range(8), LENGTHS)
    header = orch.build_step(0)
    assert [[mb.num_tokens for mb in header.micro_batches_of(r)] for r in (0, 1)] == per_rank
    assert header.metrics["num_dummies"] == (0.0 if packer is None else 1.0)
    loss_tokens = [sum(int(StepFile.read(store, 0).streams(r, 0)["loss_mask"].sum()) for _ in (0,)) for r in (0, 1)]
    assert loss_tokens == ([59 - 16, 59 - 16] if packer is None else [118 - 32, 0])


def test_rloo_advantages_and_zero_advantage_pruning(local_config):
    store = open_store(local_config)
    orch, keeper = _orchestrator(store, group_size=3, advantages=rloo), make_keeper(store, local_config)
    _submit_group(orch, keeper, np.random.default_rng(1), [0.0, 1.0, 2.0], [10, 10, 10])
    orch.build_step(0)
    assert _advantages_by_branch(store, 0) == {"g0e0-b0": [-1.5] * 6, "g0e2-b0": [1.5] * 6}
    assert orch.deleted == {"pruned": 1} and tombstones(store) == {"g0e1-b0"}


def test_advantages_already_in_the_episode_are_trained_as_given_truncation_included(local_config):
    store = open_store(local_config)
    orch = _orchestrator(store, group_size=2, seq_len=9, advantages=from_episode)
    keeper, rng = make_keeper(store, local_config), np.random.default_rng(2)
    own = {"a": np.array([0.5, -1, 2, 0, 3, 9], np.float32), "b": np.zeros(6, np.float32)}
    for name, adv in own.items():  # 4 prompt + 6 completion tokens; seq_len 9 keeps 5 completion tokens
        e = episode(keeper, rng, name, "g0", 1.0)
        orch.submit(replace(e, branches=[replace(e.branches[0], advantages=adv)]))
    orch.build_step(0)
    assert _advantages_by_branch(store, 0) == {"a-b0": [0.5, -1, 2, 0, 3]}  # b: every advantage zero, pruned
    assert orch.deleted == {"pruned": 1}


def test_pruning_and_staleness_can_be_turned_off(local_config):
    store = open_store(local_config)
    keeper, rng = make_keeper(store, local_config), np.random.default_rng(3)
    kept_all = _orchestrator(store, group_size=2, prune_zero_advantage=False, drop_stale=False, max_async_level=0)
    _submit_group(kept_all, keeper, rng, [1.0, 1.0], [10, 12], policy_version=0)
    header = kept_all.build_step(5)  # policy 0 at step 5: stale, but kept; equal rewards: zero advantage, kept
    assert sorted(r.branch_id for r in header.refs) == ["g0e0-b0", "g0e1-b0"] and kept_all.deleted == {}
    assert _advantages_by_branch(store, 5) == {"g0e0-b0": [0.0] * 6, "g0e1-b0": [0.0] * 8}
    kept_all.shutdown()
    default = _orchestrator(store, group_size=2, max_async_level=0)
    _submit_group(default, keeper, rng, [1.0, 0.0], [10, 12], group="g1", policy_version=0)
    assert default.build_step(6) is None and default.deleted == {"stale": 2}


def test_an_estimator_that_fails_refuses_its_group_and_deletes_its_chunks_at_once(local_config):
    store = open_store(local_config)
    orch = _orchestrator(store, group_size=2, advantages=lambda group: [1.0])
    keeper, rng = make_keeper(store, local_config), np.random.default_rng(4)
    orch.submit(episode(keeper, rng, "e0", "g0", 1.0))
    with pytest.raises(EpisodeError, match=r"^group g0: the advantage estimator returned 1 values: expected one per "
                                           r"sample \(2\) \(samples in order: 'e0' branch 0, 'e1' branch 0\); the "
                                           r"group is refused, its chunks deleted$"):
        orch.submit(episode(keeper, rng, "e1", "g0", 0.0))
    assert orch.pending_groups == 0 and orch.deleted == {"refused": 2} and chunks(store) == set()
    orch.submit(episode(keeper, rng, "e2", "g0", 0.0))  # the group is closed: a late episode
    orch.shutdown()
    assert orch.deleted == {"refused": 2, "late": 1} and chunks(store) == set()


def test_advantages_beyond_float32_refuse_their_group(local_config):
    store = open_store(local_config)
    orch = _orchestrator(store, group_size=3, std_normalize=False)
    keeper, rng = make_keeper(store, local_config), np.random.default_rng(5)
    big = float(np.finfo(np.float32).max)
    orch.submit(episode(keeper, rng, "e0", "g0", big))
    orch.submit(episode(keeper, rng, "e1", "g0", -big))
    with pytest.raises(EpisodeError, match=r"^group g0 sample 0: advantage of shape \[\]: expected a finite float or "
                                           r"\[6\] finite float32 \(its kept completion tokens\) \(samples in order: "
                                           r"'e0' branch 0, 'e1' branch 0, 'e2' branch 0\); the group is refused"), \
            warnings.catch_warnings():
        warnings.simplefilter("error")  # the refusal says it all: no numpy overflow warning beside it
        orch.submit(episode(keeper, rng, "e2", "g0", -big))  # e0's advantage: 4/3 of float32's largest
    assert orch.deleted == {"refused": 3} and chunks(store) == set() and orch.ready_groups == 0
    orch.shutdown()


def _refused(kind, keeper, rng, sibling_keeper):
    """A bad episode of ``kind``, its error type, how many of this run's chunks its refusal deletes, and good
    episodes to submit after it."""
    e = episode(keeper, rng, "e0", "g0", 1.0, branches=2 if kind == "nan reward" else 1)
    b = e.branches[0]
    if kind == "dtype":
        return replace(e, branches=[replace(b, prompt_ids=b.prompt_ids.astype(np.int64))]), EpisodeError, 1, []
    if kind == "nan reward":
        return replace(e, reward=float("nan")), EpisodeError, 2, []
    if kind == "token/ref mismatch":
        cut = replace(b, completion_ids=b.completion_ids[:-1], inference_logprobs=b.inference_logprobs[:-1])
        return replace(e, branches=[cut]), EpisodeError, 1, []
    if kind == "same ref twice":
        return replace(e, reward=[1.0, 1.0], branches=[b, b]), EpisodeError, 1, []
    # a ref of another run whose branch id also names a chunk of this run: neither is touched by the refusal
    other = episode(sibling_keeper, rng, "x", "g0", 1.0).branches[0]
    twin = episode(keeper, rng, "x", "g1", 1.0)
    return replace(e, reward=[1.0, 1.0], branches=[b, other]), OutsideRunError, 1, [twin]


@pytest.mark.parametrize("backend, kind", [("local", k) for k in ("dtype", "nan reward", "token/ref mismatch",
                                                                   "same ref twice", "foreign ref")]
                         + [("s3", "nan reward"), ("s3", "foreign ref")])
def test_after_every_refusal_kind_the_audit_is_clean(request, backend, kind):
    config = request.getfixturevalue(f"{backend}_config")
    store = open_store(config)
    sibling = config.model_copy(update={"run_id": "run_10"})
    sibling_store = open_store(sibling)
    keeper, sibling_keeper = make_keeper(store, config), make_keeper(sibling_store, sibling)
    bad, error, deleted, then = _refused(kind, keeper, np.random.default_rng(5), sibling_keeper)
    orch = _orchestrator(store, group_size=2)
    with pytest.raises(error):
        orch.submit(bad)
    assert orch.deleted == {"refused": deleted} and chunks(store) == {e.branches[0].ref.branch_id for e in then}
    for good in then:
        orch.submit(good)
    orch.shutdown()
    keeper.ledger.close()
    report = audit(store, finished=True)
    kept = deleted + len(then)
    assert (report.kept, report.deleted, report.leaked, report.outstanding, report.violations) == (kept, kept, 0, 0, [])
    assert report.clean and chunks(store) == set()
    assert chunks(sibling_store) == ({"x-b0"} if then else set())
