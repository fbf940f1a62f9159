"""Orchestrator deletion paths: which chunks exist afterwards, exactly; and zero store reads."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from refpipe.pipeline.orchestrator import Orchestrator, OrchestratorConfig
from refpipe.pipeline.step_file import StepFile
from refpipe.storage.backends import open_store
from refpipe.storage.layout import step_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_records import delete_record_of
from tests.pipeline.orchestrator_helpers import FIELDS, chunks, counting_store, episode, make_keeper, tombstones

CFG = OrchestratorConfig(seq_len=32, dp_world_size=2, groups_per_step=2, group_size=2, max_async_level=1)


@pytest.fixture
def env(local_config):
    """(orchestrator, env-side keeper, env-side store, rng) on a local run."""
    return _env(local_config, CFG)


def _env(config, cfg):
    env_store = open_store(config)
    orch = Orchestrator(cfg, counting_store(config), fields=FIELDS)
    return orch, make_keeper(env_store, config), env_store, np.random.default_rng(0)


def _reason(store, branch_id: str) -> str:
    record = delete_record_of(store, branch_id)
    assert record.holder == "orchestrator"
    return record.reason


def test_shipped_chunks_stay_and_the_step_references_them(env):
    orch, keeper, store, rng = env
    for g in range(2):
        for i, r in enumerate((0.0, 1.0)):
            orch.submit(episode(keeper, rng, f"e{g}{i}", f"g{g}", r))
    assert orch.ready_groups == 2 and orch.pending_groups == 0
    header = orch.build_step(0)
    assert sorted(r.branch_id for r in header.refs) == ["e00-b0", "e01-b0", "e10-b0", "e11-b0"]
    assert chunks(store) == {"e00-b0", "e01-b0", "e10-b0", "e11-b0"} and tombstones(store) == set()
    assert StepFile.read(store, 0).header.model_copy(update={"stream_crc32c": {}}) == header  # crcs: set by the publish
    assert header.fields == FIELDS
    assert header.metrics["num_samples"] == 4.0 and header.metrics["reward_mean"] == 0.5
    assert orch.ready_groups == 0 and sum(orch.deleted.values()) == 0
    assert orch.store.gets == 0


def test_eval_episodes_are_deleted_on_arrival(env):
    orch, keeper, store, rng = env
    orch.submit(episode(keeper, rng, "ev0", "eval-g", 0.25, branches=2, is_eval=True))
    orch.submit(episode(keeper, rng, "t0", "g0", 1.0))
    assert chunks(store) == {"t0-b0"}
    assert tombstones(store) == {"ev0-b0", "ev0-b1"}
    assert "orchestrator eval:" in _reason(store, "ev0-b0")
    assert orch.eval_rewards == [("reverse", 0.25), ("reverse", 0.25)]
    assert orch.deleted == {"eval": 2} and orch.pending_groups == 1 and orch.store.gets == 0


def test_untrained_branches_are_deleted_and_trainable_ones_shipped(env):
    orch, keeper, store, rng = env
    e = episode(keeper, rng, "e0", "g0", [1.0, 0.0], branches=2)
    orch.submit(replace(e, branches=[e.branches[0], replace(e.branches[1], trainable=False)]))
    orch.submit(episode(keeper, rng, "e1", "g0", 0.0))
    assert chunks(store) == {"e0-b0", "e1-b0"} and orch.deleted == {"untrained": 1}
    assert "orchestrator untrained:" in _reason(store, "e0-b1")
    header = orch.build_step(0)
    assert sorted(r.branch_id for r in header.refs) == ["e0-b0", "e1-b0"]


def test_late_episode_of_a_completed_group_is_deleted_and_said(env, caplog):
    orch, keeper, store, rng = env
    orch.submit(episode(keeper, rng, "e0", "g0", 1.0))
    orch.submit(episode(keeper, rng, "e1", "g0", 0.0))
    with caplog.at_level("WARNING", logger="refpipe.pipeline.orchestrator"):
        orch.submit(episode(keeper, rng, "e2", "g0", 0.5))
    assert chunks(store) == {"e0-b0", "e1-b0"} and orch.deleted == {"late": 1}
    assert "arrived after its group was completed" in _reason(store, "e2-b0")
    assert caplog.messages == ["orchestrator: episode e2 of group g0 arrived after its group was completed: its chunks "
                               "are deleted, never trained (a group id names one group per run: give each group of "
                               "each step its own id)"]


def test_truncated_away_branch_is_deleted_and_long_ones_keep_their_first_tokens(env):
    orch, keeper, store, rng = env
    orch.submit(episode(keeper, rng, "e0", "g0", 1.0, num_prompt=32, num_completion=3))
    orch.submit(episode(keeper, rng, "e1", "g0", [0.0, 1.0], branches=2, num_prompt=30, num_completion=5))
    orch.submit(episode(keeper, rng, "e2", "g1", 0.0, num_prompt=4, num_completion=40))
    orch.submit(episode(keeper, rng, "e3", "g1", 1.0))
    assert chunks(store) == {"e1-b0", "e1-b1", "e2-b0", "e3-b0"} and orch.deleted == {"truncated": 1}
    assert "no completion token within seq_len=32" in _reason(store, "e0-b0")
    header = orch.build_step(0)
    kept = {header.refs[seq.ref].branch_id: seq.num_tokens for mb in header.micro_batches
            for seq in mb.sequences if seq.ref is not None and not seq.borrowed}
    assert kept == {"e1-b0": 32, "e1-b1": 32, "e2-b0": 32, "e3-b0": 10}
    assert {r.branch_id: r.num_tokens for r in header.refs} == {"e1-b0": 35, "e1-b1": 35, "e2-b0": 44, "e3-b0": 10}


def test_group_outside_reward_range_is_filtered_and_no_step_file_is_written(local_config):
    orch, keeper, store, rng = _env(local_config, CFG.model_copy(update={"reward_range": (0.1, 0.9)}))
    orch.submit(episode(keeper, rng, "e0", "g0", 1.0))
    orch.submit(episode(keeper, rng, "e1", "g0", 1.0, branches=2))
    assert chunks(store) == set() and orch.deleted == {"filtered_group": 3}
    assert "outside reward_range [0.1, 0.9]" in _reason(store, "e1-b1")
    assert orch.build_step(0) is None and not store.exists(step_key(0))
    assert orch.store.gets == 0


def test_zero_advantage_group_is_filtered_and_zero_samples_pruned(env):
    orch, keeper, store, rng = env
    orch.submit(episode(keeper, rng, "e0", "g0", 0.5))
    orch.submit(episode(keeper, rng, "e1", "g0", 0.5))
    assert orch.deleted == {"filtered_group": 2} and "every advantage is zero" in _reason(store, "e0-b0")
    orch.submit(episode(keeper, rng, "e2", "g1", [1.0, 0.5, 0.0], branches=3))
    orch.submit(episode(keeper, rng, "e3", "g1", 0.5))
    assert orch.deleted == {"filtered_group": 2, "pruned": 2}
    assert chunks(store) == {"e2-b0", "e2-b2"}
    header = orch.build_step(0)
    assert sorted(r.branch_id for r in header.refs) == ["e2-b0", "e2-b2"]


def test_without_pruning_zero_advantage_samples_are_shipped(local_config):
    orch, keeper, store, rng = _env(local_config, CFG.model_copy(update={"prune_zero_advantage": False}))
    orch.submit(episode(keeper, rng, "e0", "g0", 0.5))
    orch.submit(episode(keeper, rng, "e1", "g0", 0.5))
    header = orch.build_step(0)
    assert sorted(r.branch_id for r in header.refs) == ["e0-b0", "e1-b0"] and sum(orch.deleted.values()) == 0


def test_stale_samples_are_voided_at_build(env):
    orch, keeper, store, rng = env
    orch.submit(episode(keeper, rng, "old0", "g0", 1.0, policy_version=0))
    orch.submit(episode(keeper, rng, "new0", "g0", 0.0, policy_version=1))
    assert orch.build_step(2) is not None  # policy 1 is within max_async_level=1 of step 2, policy 0 is not
    orch.submit(episode(keeper, rng, "old1", "g1", 1.0, policy_version=1))
    orch.submit(episode(keeper, rng, "new1", "g1", 0.0, policy_version=2))
    assert orch.build_step(3) is not None
    assert orch.deleted == {"stale": 2}
    assert chunks(store) == {"new0-b0", "new1-b0"}
    assert "policy older than step 2 - max_async_level 1" in _reason(store, "old0-b0")
    assert [r.branch_id for r in StepFile.read(store, 2).header.refs] == ["new0-b0"]
    assert [r.branch_id for r in StepFile.read(store, 3).header.refs] == ["new1-b0"]


def test_all_stale_publishes_nothing(env):
    orch, keeper, store, rng = env
    orch.submit(episode(keeper, rng, "e0", "g0", 1.0))
    orch.submit(episode(keeper, rng, "e1", "g0", 0.0))
    assert orch.build_step(5) is None and not store.exists(step_key(5))
    assert chunks(store) == set() and orch.deleted == {"stale": 2} and orch.ready_groups == 0


def test_incomplete_stale_group_is_dropped_and_its_late_episodes_deleted(env):
    orch, keeper, store, rng = env
    orch.submit(episode(keeper, rng, "e0", "g0", 1.0, policy_version=0))
    orch.submit(episode(keeper, rng, "f0", "g1", 1.0, policy_version=2))
    assert orch.build_step(2) is None
    assert orch.deleted == {"dropped_group": 1} and orch.pending_groups == 1
    orch.submit(episode(keeper, rng, "e1", "g0", 0.0, policy_version=2))
    assert orch.deleted == {"dropped_group": 1, "late": 1}
    assert chunks(store) == {"f0-b0"}
    assert "arrived after its group was dropped at step 2" in _reason(store, "e1-b0")


def test_shutdown_deletes_everything_queued_and_closes_the_ledger(env):
    orch, keeper, store, rng = env
    for g in range(3):
        orch.submit(episode(keeper, rng, f"e{g}0", f"g{g}", 1.0))
        orch.submit(episode(keeper, rng, f"e{g}1", f"g{g}", 0.0))
    orch.submit(episode(keeper, rng, "p0", "g9", 0.0, branches=2))
    header = orch.build_step(0)
    shipped = {r.branch_id for r in header.refs}
    assert shipped == {"e00-b0", "e01-b0", "e10-b0", "e11-b0"}
    orch.shutdown()
    assert chunks(store) == shipped and orch.deleted == {"shutdown": 4}
    assert tombstones(store) == {"e20-b0", "e21-b0", "p0-b0", "p0-b1"}
    events = [json.loads(line) for k in store.list_prefix("ledger/events/orchestrator")
              for line in store.get(k).decode().splitlines()]
    assert [e["event"] for e in events].count("close") == 1
    assert [e["step"] for e in events if e["event"] == "ship"] == [0]
    assert orch.store.gets == 0


def test_borrowed_chunks_are_deleted_exactly_once_by_their_owners(local_config):
    orch, keeper, store, rng = _env(local_config, CFG.model_copy(update={"dp_world_size": 4}))
    orch.submit(episode(keeper, rng, "e0", "g0", 1.0, num_completion=20))
    orch.submit(episode(keeper, rng, "e1", "g0", 0.0, num_completion=9))
    header = orch.build_step(0)
    borrowed = [(mb.dp_rank, header.refs[s.ref].branch_id) for mb in header.micro_batches for s in mb.sequences
                if s.borrowed]
    assert borrowed == [(2, "e1-b0"), (3, "e1-b0")]
    assert [r.branch_id for r in header.owned_refs(0)] == ["e0-b0"]
    assert [r.branch_id for r in header.owned_refs(1)] == ["e1-b0"]
    for rank in range(4):
        ledger = Ledger(store, f"trainer_dp{rank}")
        ledger.delete(header.owned_refs(rank), reason="trained")
        ledger.close()  # its reaper has removed the chunks' bytes
    assert chunks(store) == set() and tombstones(store) == {"e0-b0", "e1-b0"}


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_paths_on_each_backend(request, backend):
    config = request.getfixturevalue(f"{backend}_config")
    orch, keeper, store, rng = _env(config, CFG.model_copy(update={"reward_range": (0.0, 0.9)}))
    orch.submit(episode(keeper, rng, "a0", "g0", 1.0))
    orch.submit(episode(keeper, rng, "a1", "g0", 1.0))       # filtered_group
    orch.submit(episode(keeper, rng, "b0", "g1", 1.0))
    orch.submit(episode(keeper, rng, "b1", "g1", 0.0))       # ready, shipped
    orch.submit(episode(keeper, rng, "ev", "g2", 0.0, is_eval=True))
    orch.submit(episode(keeper, rng, "c0", "g3", 0.0))       # pending at shutdown
    header = orch.build_step(0)
    orch.shutdown()
    assert orch.deleted == {"filtered_group": 2, "eval": 1, "shutdown": 1}
    assert chunks(store) == {"b0-b0", "b1-b0"} == {r.branch_id for r in header.refs}
    assert tombstones(store) == {"a0-b0", "a1-b0", "ev-b0", "c0-b0"}
    assert StepFile.read(store, 0).header.model_copy(update={"stream_crc32c": {}}) == header
    assert orch.store.gets == 0


def test_a_branch_missing_a_required_field_is_filtered_at_submit_and_its_chunk_deleted_once(local_config):
    """Issue 14 input 2: with routing required, a branch with ``ref=None`` and one whose chunk lacks
    ``routed_experts`` were packed into a micro batch with ``has_routing=False``; the policy update then
    crashed with KeyError and the step was never released."""
    fields = FIELDS.model_validate({**FIELDS.model_dump(), "required": ["routed_experts"]})
    env_store = open_store(local_config)
    orch = Orchestrator(CFG.model_copy(update={"group_size": 4}), counting_store(local_config), fields=fields)
    keeper, rng = make_keeper(env_store, local_config), np.random.default_rng(0)
    orch.submit(episode(keeper, rng, "e0", "g", 1.0))
    orch.submit(episode(None, rng, "e1", "g", 0.5, routing=False, topk=False))   # ref=None
    orch.submit(episode(keeper, rng, "e2", "g", 0.5, routing=False))             # a chunk without routing
    orch.submit(episode(keeper, rng, "e3", "g", 0.0))
    assert (dict(orch.deleted), dict(orch.filtered)) == ({"missing_fields": 1}, {"missing_fields": 2})
    assert _reason(env_store, "e2-b0") == ("orchestrator missing_fields: episode e2 of group g branch 0 lacks "
                                           "required fields ['routed_experts']")
    header = orch.build_step(0)
    assert sorted(r.branch_id for r in header.refs) == ["e0-b0", "e3-b0"]
    assert all(mb.has_routing for mb in header.micro_batches)
    orch.shutdown()
    assert chunks(env_store) == {"e0-b0", "e3-b0"} and tombstones(env_store) == {"e2-b0"}
