"""Checkpoints through torch.distributed.checkpoint (issue 12): 2 real gloo ranks, local directory and S3 (moto).

Each rank saves model, optimizer and RNG states, scrambles them, and loads the newest complete
checkpoint back (``checkpoint_worker.py``); the test compares what each rank recorded.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest
import torch

from refpipe.storage.backends import open_store
from refpipe.storage.checkpoints import newest_checkpoint
from refpipe.storage.errors import CheckpointError
from refpipe.storage.layout import segment_key, trainer_actor
from refpipe.storage.ledger_records import encode_record
from refpipe.trainer.checkpoint import checkpoint_key, load_checkpoint, training_state
from refpipe.trainer.resume import _highest_release
from tests.helpers.checkpoint import FILES, assert_loads_back, one_rank_world, save, trained
from tests.helpers.children import module_argv, module_env
from tests.helpers.ports import free_port

WORKER = "tests.trainer.checkpoint_worker"


def run_ranks(tmp_path: Path, storage, step: int) -> list[dict]:
    out = tmp_path / f"ranks{step}"
    out.mkdir()
    spec = {"out_dir": str(out), "init_method": f"tcp://127.0.0.1:{free_port()}", "storage": storage.model_dump(),
            "step": step}
    (out / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(module_argv(WORKER, out / "spec.json", r), env=module_env(env),
                              stderr=open(out / f"rank{r}.log", "w")) for r in range(2)]
    codes = [p.wait(timeout=120) for p in procs]
    logs = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(2))
    assert codes == [0, 0], logs
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def test_checkpoint_restores_model_optimizer_and_each_ranks_rng(tmp_path, storage_config):
    ranks = run_ranks(tmp_path, storage_config, step=3)
    store = open_store(storage_config)
    for r in ranks:
        assert "error" not in r and r["uri"] == store.uri(checkpoint_key(3))
        assert r["newest"] == [3, 4] and (r["loaded_step"], r["loaded_version"]) == (3, 4)
        assert r["loaded"] == r["saved"]  # weights, Adam moments and the next RNG draws, exactly
    assert ranks[0]["saved"]["draws"] != ranks[1]["saved"]["draws"]  # each rank got its own RNG state back
    keys = set(store.list_prefix("checkpoints"))
    assert {"checkpoints/step_00000003/.metadata", "checkpoints/step_00000003/commit.json"} <= keys
    assert json.loads(store.get("checkpoints/step_00000003/commit.json")) == {
        "step": 3, "policy_version": 4, "world_size": 2}


def test_incomplete_newer_checkpoints_are_skipped_with_a_warning(local_config, caplog):
    store = open_store(local_config)
    for key in ("step_00000003/.metadata", "step_00000003/__0_0.distcp", "step_00000005/.metadata",
                "step_00000007/__0_0.distcp"):
        store.put(f"checkpoints/{key}", b"x")
    store.put("checkpoints/step_00000003/commit.json", b'{"step": 3, "policy_version": 4, "world_size": 2}')
    with caplog.at_level(logging.WARNING):
        info = newest_checkpoint(store)
    assert (info.step, info.policy_version) == (3, 4)
    assert "step_00000007 is incomplete (no .metadata and no commit.json)" in caplog.text  # died while writing
    assert "step_00000005 is incomplete (no commit.json)" in caplog.text  # DCP done, refpipe's marker not


def test_a_rank_whose_write_fails_fails_the_checkpoint_on_every_rank(tmp_path, local_config):
    store = open_store(local_config)
    os.makedirs(store.path("checkpoints/step_00000002/__1_0.distcp"))  # rank 1 cannot create its file
    ranks = run_ranks(tmp_path, local_config, step=2)
    for r in ranks:
        assert "is not published" in r["error"] and r["newest"] is None
    assert not store.exists("checkpoints/step_00000002/commit.json")


@pytest.fixture(scope="module")
def world():
    with one_rank_world() as group:
        yield group


def test_an_unpublished_earlier_write_is_deleted_before_the_checkpoint_is_written_again(local_config, world, caplog):
    """A life that died writing checkpoint 3 left DCP's files without a commit marker; the next life's write of
    checkpoint 3 (every put exclusive) deletes them first."""
    store = open_store(local_config)
    for name in (".metadata", "__0_0.distcp", "__1_0.distcp"):
        store.put(f"{checkpoint_key(3)}/{name}", b"dead life", exclusive=True)
    model, optimizer = trained()
    with caplog.at_level(logging.WARNING):
        save(store, world, model, optimizer)
    assert (f"checkpoint {store.uri(checkpoint_key(3))}: deleting 3 files of an unpublished earlier write before "
            "writing it") in caplog.text
    assert store.list_prefix("checkpoints") == FILES
    assert_loads_back(store, model, optimizer)


def test_a_published_checkpoint_is_never_written_again(local_config, world):
    store = open_store(local_config)
    model, optimizer = trained()
    save(store, world, model, optimizer)
    before = {key: store.get(key) for key in FILES}
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(CheckpointError, match=r"step_00000003 of step 3: a rank's write or the commit marker failed"):
        save(store, world, model, optimizer)
    assert {key: store.get(key) for key in store.list_prefix("checkpoints")} == before


def test_a_checkpoint_symlinked_out_of_the_run_is_never_read(tmp_path, local_config, world):
    """DCP reads through the store too: a checkpoint directory moved out of the run and symlinked back is refused."""
    store = open_store(local_config)
    model, optimizer = trained()
    save(store, world, model, optimizer)
    outside = tmp_path / "outside"
    os.rename(store.path(checkpoint_key(3)), outside)
    os.symlink(outside, store.path(checkpoint_key(3)))
    fresh = torch.nn.Linear(3, 2)
    template = training_state(fresh, torch.optim.Adam(fresh.parameters()), step=-1, policy_version=-1)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(store, 3, template)
    assert str(info.value).startswith(f"checkpoint {store.uri(checkpoint_key(3))}: cannot load: ")
    assert (f"{store.uri(checkpoint_key(3))} is a symlink: the local store never follows a symlink below the run "
            "prefix") in str(info.value)


def test_no_checkpoint_is_none(local_config):
    store = open_store(local_config)
    store.put("config.json", b"{}")
    assert newest_checkpoint(store) is None


if __name__ == "__main__":
    pytest.main([__file__])


def test_a_checkpoints_directory_symlinked_out_of_the_run_is_never_written(tmp_path, local_config):
    store = open_store(local_config)
    outside = tmp_path / "outside"
    outside.mkdir()
    os.makedirs(store.prefix.path)
    os.symlink(outside, store.path("checkpoints"))
    ranks = run_ranks(tmp_path, local_config, step=2)
    link = store.uri("checkpoints")
    for r in ranks:
        assert "is not published" in r["error"] and r["newest"] is None
        assert r["newest_error"] == f"{link} is a symlink: the local store never follows a symlink below the run prefix"
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("marker", [b"{", b"[]", b'{"step": 5}', b'{"step": 4, "policy_version": 6}',
                                    b'{"step": 5, "policy_version": "6"}', b'{"step": 5, "policy_version": -1}'])
def test_a_newer_checkpoint_with_a_malformed_marker_is_skipped_with_a_warning(local_config, caplog, marker):
    store = open_store(local_config)
    for step, body in ((3, b'{"step": 3, "policy_version": 4, "world_size": 2}'), (5, marker)):
        store.put(f"checkpoints/step_0000000{step}/.metadata", b"x")
        store.put(f"checkpoints/step_0000000{step}/commit.json", body)
    with caplog.at_level(logging.WARNING):
        info = newest_checkpoint(store)
    assert (info.step, info.policy_version) == (3, 4)
    assert (f"checkpoint {store.uri('checkpoints/step_00000005')}: its commit.json is not "
            '{"step": 5, "policy_version": <int >= 0>, ...}: skipped') in caplog.text


def test_unreadable_release_records_are_skipped_when_planning_a_resume(local_config, caplog):
    store = open_store(local_config)
    events = [{"event": "release", "step": 2, "dp_rank": 0}, b"not json\n", {"event": "release", "step": "9"},
              {"event": "keep"}, {"event": "release", "step": 4, "dp_rank": 0},
              b'{"event": "release", "step": 7, "dp_rank": 0}\n']  # no crc: not a line the ledger wrote
    store.put(segment_key(trainer_actor(0), "s1", 0),
              b"".join(e if isinstance(e, bytes) else encode_record(e) for e in events))
    with caplog.at_level(logging.WARNING):
        assert _highest_release(store, 0) == 4
        assert _highest_release(store, 1) == -1
    uri = store.uri(segment_key(trainer_actor(0), "s1", 0))
    assert f"{uri} line 2: not a readable ledger event" in caplog.text
    assert f"{uri} line 3: not a readable ledger event" in caplog.text
    assert f"{uri} line 6: not a readable ledger event" in caplog.text
