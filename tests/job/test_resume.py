"""Restart-safe runs (issue 12): SIGKILL the whole `refpipe run` tree at each crash point, then `--resume`.

One run lives several lives: each life is stopped at a different point (``trainer.pause``: the
process waits there, the test SIGKILLs the launcher, env workers and trainer ranks at once), and
the next life is `refpipe run --resume`. The last life trains to ``num_steps`` and the run must
end with a clean ``audit --finished`` (kept == deleted + retained, no double delete, nothing
leaked); with ``release = "after_checkpoint"`` every replayed micro batch hashes as the first
time and the weights after it are the ones the first time published (a mismatch would stop the run,
exit 1).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from typer.testing import CliRunner

from refpipe.cli.main import app
from refpipe.job.train_rank import check_replay, policy_masks
from refpipe.job.weights import check_same_weights, publish_weights
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import ReplayMismatchError
from refpipe.storage.layout import SUMMARY_KEY, address_key, metrics_key, step_key, weights_key
from refpipe.trainer.pause import ENV
from refpipe.trainer.resume import ResumePlan

REFPIPE = os.path.join(os.path.dirname(sys.executable), "refpipe")


def write_config(tmp_path: Path, storage: StorageConfig, *, release: str, num_steps: int,
                 heartbeat_s: tuple[float, float] = (5.0, 15.0)) -> Path:
    """A tiny run: 2 groups of 4 per step, 1 env worker, 2 DP ranks, a checkpoint every 2 steps; heartbeats
    every ``heartbeat_s[0]`` seconds, dead after ``heartbeat_s[1]``. Each life starts 4 processes that import
    torch: the launcher, the env worker, the 2 trainer ranks."""
    endpoint = f's3_endpoint_url = "{storage.s3_endpoint_url}"\n' if storage.s3_endpoint_url else ""
    path = tmp_path / "run.toml"
    path.write_text(f'[storage]\nroot = "{storage.root}"\nrun_id = "{storage.run_id}"\n{endpoint}'
                    f"heartbeat_interval_s = {heartbeat_s[0]}\nheartbeat_timeout_s = {heartbeat_s[1]}\n"
                    f"[job]\nnum_steps = {num_steps}\nnum_env_workers = 1\nwarm_start_steps = 10\n"
                    "checkpoint_every_steps = 2\n"
                    "eval_every_steps = 0\n"
                    "[orchestrator]\nseq_len = 128\ndp_world_size = 2\ngroups_per_step = 2\ngroup_size = 4\n"
                    f'[trainer]\nstep_timeout_s = 120\ncollective_timeout_s = 120\nrelease = "{release}"\n'
                    "retain_steps = [1]\n")
    return path


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it."""
    return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]


def _kill_tree(pid: int) -> None:
    for member in _tree(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def as_node(hostname: str) -> list[str]:
    """The command prefix that runs a command as on another node: its own UTS namespace and host name, so the
    heartbeats it writes name ``hostname`` and the pid shortcut of ``storage.liveness`` cannot apply."""
    if subprocess.run(["unshare", "--uts", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs `unshare --uts` (root or user namespaces) to give a process another host name")
    return ["unshare", "--uts", "sh", "-c", f'hostname {hostname} && exec "$@"', "sh"]


def life(tmp_path: Path, args: list[str], pause: str | None, store,
         wait_for=None) -> subprocess.CompletedProcess | None:
    """Run one life of the run. With ``pause`` ("<point>:<step>"), SIGKILL its whole process tree once a
    process reached that point (and ``wait_for(store)`` holds); else let it finish and return its result."""
    marker = tmp_path / f"paused-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if pause:
        env[ENV] = f"{pause}:{marker}"
    proc = subprocess.Popen([REFPIPE, "run", *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    if not pause:
        out, _ = proc.communicate(timeout=600)
        return subprocess.CompletedProcess(proc.args, proc.returncode, out)
    deadline = time.monotonic() + 600
    while not (marker.exists() and (wait_for is None or wait_for(store))):
        assert proc.poll() is None, f"life ended before pausing at {pause}: {proc.communicate()[0]}"
        assert time.monotonic() < deadline, f"never paused at {pause}"
        time.sleep(0.2)
    _kill_tree(proc.pid)
    proc.communicate()
    return None


def weights(store, versions: list[int]) -> dict[tuple[int, str], torch.Tensor]:
    """(version, parameter name) -> tensor of the published weights ``versions``."""
    return {(v, name): t for v in versions
            for name, t in torch.load(io.BytesIO(store.get(weights_key(v))), weights_only=True).items()}


def released_by(dp_ranks: list[int], step: int):
    """``wait_for``: each of ``dp_ranks`` recorded the release of ``step`` (releases run in the background)."""
    def done(store) -> bool:
        events = [json.loads(line) for r in dp_ranks for key in store.list_prefix(f"ledger/events/trainer_dp{r}")
                  for line in store.get(key).splitlines()]
        return {e["dp_rank"] for e in events if e["event"] == "release" and e["step"] == step} == set(dp_ranks)
    return done


def assert_finished_clean(store, args_endpoint: list[str], num_steps: int) -> dict:
    summary = json.loads(store.get(SUMMARY_KEY))
    audit = summary["audit"]
    assert not summary["failed"] and summary["trained_steps"] == num_steps
    assert audit["clean"] and audit["finished"], audit["violations"]
    assert (audit["outstanding"], audit["leaked"], audit["double_deletes"], audit["unknown_deletes"]) == (0, 0, 0, 0)
    assert audit["kept"] == audit["deleted"] + audit["retained"] and audit["retained"] > 0
    result = CliRunner().invoke(app, ["audit", store.prefix.uri, "--finished", *args_endpoint])
    assert result.exit_code == 0, result.output
    return summary


def test_after_checkpoint_run_survives_a_kill_at_every_crash_point(tmp_path, local_config):
    """Six lives, each SIGKILLed at another point; the seventh trains to the end; replays are byte-identical."""
    store = open_store(local_config)
    config = write_config(tmp_path, local_config, release="after_checkpoint", num_steps=6)
    resume = ["--resume", store.prefix.uri]
    life(tmp_path, ["--config", str(config)], "keep:1", store)  # an env worker killed mid-group
    life(tmp_path, resume, "fetch:0", store)  # from the warm start; step 0 published, nothing fetched
    assert not store.list_prefix("checkpoints")
    life(tmp_path, resume, "train:1", store)  # killed training step 1
    # From the warm start: checkpoint 1, then steps 2 and 3 trained on (weights 3 and 4 published), killed writing
    # checkpoint 3 (skipped at resume).
    life(tmp_path, resume, "checkpoint:3", store)
    assert store.exists("checkpoints/step_00000003/.metadata")
    assert not store.exists("checkpoints/step_00000003/commit.json")
    trained_on = weights(store, [3, 4])
    # From checkpoint 1: steps 2 and 3 replayed, with the same weights after each as the life that trained on
    # (samples that life took with them are in the replayed step files); dp0 released step 2 (at checkpoint 3).
    life(tmp_path, resume, "release_dp1:2", store, released_by([0], 2))
    replayed = weights(store, [3, 4])
    assert all(torch.equal(replayed[k], trained_on[k]) for k in trained_on), "replayed weights differ"
    life(tmp_path, resume, "after_release:4", store)  # step 4 trained and held, checkpoint 5 not written
    done = life(tmp_path, resume, None, store)
    assert done.returncode == 0, done.stdout
    summary = assert_finished_clean(store, [], 6)
    assert summary["resumed"]["life"] == 6 and summary["resumed"]["from_checkpoint_step"] == 3
    assert summary["resumed"]["replayed_steps"] >= 1 and summary["resumed"]["skipped_steps"] == 0
    assert "replayed steps" in done.stdout and "resumed from" in done.stdout
    assert store.list_prefix("ledger/events/sweep")  # what dead sessions kept was reclaimed at a resume
    step0 = json.loads(store.get(metrics_key(0)))  # replayed by life 4, its hashes equal to life 3's
    assert step0["replayed"] and len(step0["micro_batch_hashes"]) == 2

    before = sorted(store.list_prefix(""))
    again = life(tmp_path, resume, None, store)  # a finished run: says so, changes nothing
    assert again.returncode == 0 and "is finished (6 of 6 steps trained" in again.stdout
    assert sorted(store.list_prefix("")) == before


def test_after_step_run_on_s3_skips_steps_whose_chunks_are_gone(tmp_path, s3_config):
    store = open_store(s3_config)
    endpoint = ["--s3-endpoint-url", s3_config.s3_endpoint_url]
    config = write_config(tmp_path, s3_config, release="after_step", num_steps=4)
    life(tmp_path, ["--config", str(config)], "after_release:2", store, released_by([0, 1], 2))  # checkpoint of 1
    resume = ["--resume", store.prefix.uri, *endpoint]
    life(tmp_path, resume, "release_dp1:3", store, released_by([0], 3))  # step 2 skipped; step 3 half released
    done = life(tmp_path, resume, None, store)
    assert done.returncode == 0, done.stdout
    summary = assert_finished_clean(store, endpoint, 4)
    assert summary["resumed"]["from_checkpoint_step"] == 1 and summary["resumed"]["skipped_steps"] == 2


def _rank_of(pid: int) -> str:
    """The ``RANK`` in process ``pid``'s environment ("" for a process that is not a trainer rank)."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        return next((v.decode() for k, _, v in (e.partition(b"=") for e in f.read().split(b"\0")) if k == b"RANK"), "")


def test_a_second_resume_and_a_stopped_sweep_are_refused_by_heartbeats_of_another_node(tmp_path, local_config):
    """The first life runs as "node-a" (its own host name: no pid of it can be checked here), paused with every
    session open; a resume and a `sweep --stopped` from this host are refused by the live heartbeats (1 s). Once
    its tree is SIGKILLed, its sessions are dead after their 4 s timeout and the stopped sweep goes ahead."""
    store = open_store(local_config)
    config = write_config(tmp_path, local_config, release="after_checkpoint", num_steps=2, heartbeat_s=(1.0, 4.0))
    marker = tmp_path / "paused"
    first = subprocess.Popen([*as_node("node-a"), REFPIPE, "run", "--config", str(config)],
                             env={**os.environ, ENV: f"fetch:0:{marker}"}, stdout=subprocess.DEVNULL)
    try:
        while not marker.exists():
            assert first.poll() is None
            time.sleep(0.2)
        tree = _tree(first.pid)
        trainers = {_rank_of(pid): pid for pid in tree[1:] if _rank_of(pid)}
        pids = [json.loads(store.get(address_key(0)))["pid"], first.pid, trainers["0"], trainers["1"]]
        running = ", ".join(f"{actor} (pid {pid} on node-a)" for actor, pid in zip(
            ["env_worker_0", "orchestrator", "trainer_dp0", "trainer_dp1"], pids))
        resumed = CliRunner().invoke(app, ["run", "--resume", store.prefix.uri])
        assert (resumed.exit_code, resumed.output) == (2, (
            f"error: refusing to resume {store.prefix.uri}: another life of the run is still running: {running} "
            "(heartbeats live); stop it (on every node) first\n"))
        swept = CliRunner().invoke(app, ["sweep", store.prefix.uri, "--stopped"])
        assert (swept.exit_code, swept.output) == (2, (
            f"error: refusing to sweep {store.prefix.uri} as stopped: {running} are still running (heartbeat live); "
            "stop the run first, or pass --force if those processes are not part of the run\n"))
    finally:
        _kill_tree(first.pid)
        first.wait()
    report = json.loads(CliRunner().invoke(app, ["audit", store.prefix.uri, "--json"]).stdout)
    assert report["live_sessions"] == []  # every heartbeat unchanged for 4 s, by this process's clock
    swept = CliRunner().invoke(app, ["sweep", store.prefix.uri, "--stopped", "--json"])
    assert swept.exit_code == 0, swept.output
    result = json.loads(swept.stdout)
    assert sorted(result["deleted"] + result["removed_incomplete"]) == sorted(report["leaked_chunks"])


def test_a_replayed_micro_batch_that_differs_stops_the_run(local_config):
    store = open_store(local_config)
    store.put(metrics_key(3), json.dumps({"micro_batch_hashes": [["aa", "bb"], ["cc"]]}).encode())
    check_replay(store, 3, [["aa", "bb"], ["cc"]])
    with pytest.raises(ReplayMismatchError, match="step 3 replayed from .*step_00000003.npz: micro batch hashes"):
        check_replay(store, 3, [["aa", "bX"], ["cc"]])
    check_replay(store, 4, [["dd"]])  # the first life died before its metrics of step 4: nothing to compare


def test_a_replayed_step_whose_chunks_are_damaged_names_its_dropped_micro_batches_and_the_way_out(local_config):
    """Fresh-user input: a byte of a replayed step's c.0 flipped and another c.0 removed in a stopped run; every
    ``refpipe run --resume`` ended in both ranks' tracebacks of ``ReplayMismatchError: ... micro batch hashes [['',
    ...`` and the launcher's advice to resume again. The ranks now print this one line (``failures_end_the_rank``)."""
    store = open_store(local_config)
    store.put(metrics_key(4), json.dumps({"micro_batch_hashes": [["aa", "bb"], ["cc"]]}).encode())
    with pytest.raises(ReplayMismatchError) as e:
        check_replay(store, 4, [["aa", ""], [""]])
    assert str(e.value) == (
        f"step 4 replayed from {store.uri(step_key(4))}: 2 micro batches the earlier life trained could not be "
        f"fetched this time (dp_rank=0 micro batch 1, dp_rank=1 micro batch 0; the ranks' fetch errors above name "
        f"their chunks), so the replay cannot train what the earlier life trained; resuming again meets the same "
        f"chunks: restore them from a copy of the run, or end the run with `refpipe sweep --abandon "
        f"{store.prefix.uri}` (deletes its chunks)")


def test_a_version_published_again_must_be_the_earlier_lifes_weights(local_config):
    store = open_store(local_config)
    model = torch.nn.Linear(3, 2)
    publish_weights(store, model, 5)
    check_same_weights(store, model, 5)  # exactly the earlier life's tensors
    check_same_weights(store, model, 6)  # never published: nothing to compare
    with torch.no_grad():
        model.bias[1] += 1e-6
    with pytest.raises(ReplayMismatchError, match=r"weights version 5: 1 of 2 tensors \(bias\) differ from the ones "
                                                  r"an earlier life published at .*policy_00000005.pt"):
        check_same_weights(store, model, 5)
    other = torch.nn.Sequential(torch.nn.Linear(3, 2))  # other tensor names ("0.weight"): before, a KeyError
    with pytest.raises(ReplayMismatchError, match=r"weights version 5: 2 of 2 tensors \(0.weight, 0.bias\) differ"):
        check_same_weights(store, other, 5)


def test_samples_of_a_version_whose_weights_a_skip_changed_are_off_policy():
    # After step 2 was skipped (its chunks gone), this life's weights 3, 4, ... are not the earlier life's.
    plan = ResumePlan(-1, published=6, released={0: 1, 1: 1}, skipped=[2, 4])
    assert plan.diverged_from == 3 and ResumePlan(-1, 6, {0: 1}, []).diverged_from is None
    versions = torch.tensor([2, 3, 3, 4, 4, -1])
    mask = torch.tensor([True, True, True, True, False, False])
    on, off = policy_masks(versions, mask, 3, None)
    assert (on.tolist(), off.tolist()) == ([False, True, True, False, False, False], [True] + [False] * 5)
    on, off = policy_masks(versions, mask, 3, plan.diverged_from)  # a step file an earlier life published
    assert (on.tolist(), off.tolist()) == ([False] * 6, [True, True, True, True, False, False])


def test_a_resume_config_may_change_num_steps_only(tmp_path, local_config):
    store = open_store(local_config)
    config = write_config(tmp_path, local_config, release="after_step", num_steps=2)
    from refpipe.job.config import load_config

    store.put("config.json", load_config(config).model_dump_json().encode())
    bad = tmp_path / "bad.toml"
    bad.write_text("[job]\nnum_steps = 9\nlearning_rate = 0.5\n[orchestrator]\ngroup_size = 6\n")
    result = CliRunner().invoke(app, ["run", "--resume", store.prefix.uri, "--config", str(bad)])
    assert result.exit_code == 2
    assert "job.learning_rate, orchestrator.group_size differ from the run's config.json" in result.output
    assert store.list_prefix("") == ["config.json"]


def test_a_plan_says_in_one_line_which_steps_of_an_earlier_life_it_replays_and_skips():
    checkpoint = 1
    assert ResumePlan(checkpoint, 4, {0: 2, 1: 2}, [2]).describe() == (
        "from the checkpoint of step 1: steps 2..3 of an earlier life: 1 replayed (3), 1 skipped (2: a chunk already "
        "deleted)")
    assert ResumePlan(-1, 2, {0: -1}, []).describe() == (
        "from the warm start: steps 0..1 of an earlier life: 2 replayed (0, 1), 0 skipped (none)")
    assert ResumePlan(checkpoint, 2, {0: 1}, []).describe() == (
        "from the checkpoint of step 1: no step of an earlier life after it")
    assert ResumePlan(checkpoint, 4, {0: 2}, [2]).replayed == [3]


def test_a_step_the_resumed_life_publishes_itself_is_trained_not_replayed(tmp_path, local_config, monkeypatch):
    """The first life (after_step, 3 steps) is killed once both DP ranks released step 2 (checkpoint of step 1):
    steps 0..2 published. The resume (4 steps) skips step 2 (its chunks are gone); its orchestrator publishes step 3
    while the trainer ranks start. Step 3 is this life's, so it is trained for the first time, not replayed: the
    launcher's line, the trainer's line and the summary all say 0 replayed, 1 skipped. The rank read the listing when
    its plan was ready and said "steps 2..3 trained again (1 of them skipped)", counted step 3 as replayed (summary:
    replayed 1, skipped 1), while the launcher said "steps 2..2 trained again"."""
    monkeypatch.setenv("COLUMNS", "400")  # the launcher's log line on one line
    store = open_store(local_config)
    config = write_config(tmp_path, local_config, release="after_step", num_steps=3)
    life(tmp_path, ["--config", str(config)], "after_release:2", store, released_by([0, 1], 2))
    assert store.list_prefix("steps") == [f"steps/step_{s:08d}.npz" for s in range(3)]
    longer = tmp_path / "longer.toml"
    longer.write_text("[job]\nnum_steps = 4\n")
    done = life(tmp_path, ["--resume", store.prefix.uri, "--config", str(longer)], None, store)
    assert done.returncode == 0, done.stdout
    resumed = json.loads(store.get(SUMMARY_KEY))["resumed"]
    assert (resumed["from_checkpoint_step"], resumed["replayed_steps"], resumed["skipped_steps"]) == (1, 0, 1)
    assert [json.loads(store.get(metrics_key(s))).get("replayed") for s in (2, 3)] == [None, False]
    line = ("from the checkpoint of step 1: steps 2..2 of an earlier life: 0 replayed (none), 1 skipped (2: a chunk "
            "already deleted)")
    assert f"[trainer rank 0] resumed {line}\n" in done.stdout, done.stdout
    assert f"resuming run {store.prefix.uri} (life 1) {line}; steps released 3;" in done.stdout, done.stdout


def test_a_plan_for_a_checkpoint_of_the_callers_own_starts_after_it(local_config):
    from refpipe.storage.errors import ConfigError
    from refpipe.trainer.resume import read_plan

    store = open_store(local_config)
    plan = read_plan(store, 2, published=0, checkpoint_step=4)  # no refpipe checkpoint: the caller's own step 4
    assert (plan.checkpoint_step, plan.start_step, plan.released, plan.skipped) == (4, 5, {0: -1, 1: -1}, [])
    assert read_plan(store, 2, published=0).checkpoint_step == -1
    with pytest.raises(ConfigError) as e:
        read_plan(store, 2, published=0, checkpoint_step=-2)
    assert str(e.value) == "checkpoint_step=-2: expected the step a checkpoint covers, or -1 for none"
