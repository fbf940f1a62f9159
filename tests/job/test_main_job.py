"""The main job end to end: real env-worker processes, real trainer ranks (gloo), real stores.

Each run is small (3 steps, a short warm start) and ends with the ledger audit written to
``<run>/summary.json``, which the tests read back.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import threading
import time

import pytest
from rich.console import Console

from refpipe.job.config import JobConfig, RunConfig
from refpipe.job.launcher import Launcher
from refpipe.pipeline.orchestrator import OrchestratorConfig
from refpipe.pipeline.step_file import StepFile
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.layout import SUMMARY_KEY, address_key, step_key
from refpipe.trainer.config import TrainerConfig
from tests.helpers.fault_proxy import Fault, FaultProxy


def small_config(storage: StorageConfig, **job) -> RunConfig:
    """3 steps of 2 groups of 4 branches, 2 env workers, 2 DP ranks."""
    return RunConfig(
        storage=storage,
        job=JobConfig(**{"num_steps": 3, "warm_start_steps": 20, "eval_every_steps": 1, **job}),
        orchestrator=OrchestratorConfig(seq_len=128, dp_world_size=2, groups_per_step=2, group_size=4,
                                        max_async_level=1),
        trainer=TrainerConfig(step_timeout_s=120, collective_timeout_s=120, release="after_step"),
    )


def run_job(cfg: RunConfig) -> tuple[int, dict, str]:
    """Run the job in this process; return (exit code, summary.json, console text)."""
    out = io.StringIO()
    code = Launcher(cfg, Console(file=out, width=120)).run()
    summary = json.loads(open_store(cfg.storage).get(SUMMARY_KEY))
    return code, summary, out.getvalue()


def assert_clean_end(cfg: RunConfig, summary: dict) -> None:
    audit = summary["audit"]
    assert audit["violations"] == [] and audit["clean"]
    assert audit["kept"] == audit["deleted"] > 0
    assert (audit["outstanding"], audit["leaked"], audit["double_deletes"], audit["unknown_deletes"]) == (0, 0, 0, 0)
    assert open_store(cfg.storage).list_prefix("payloads") == []
    assert summary["trained_steps"] == cfg.job.num_steps


@pytest.mark.parametrize("backend", ["local", "moto", "seaweedfs"])
def test_main_job_trains_through_refpipe_and_ends_clean(request, backend):
    """On S3 (moto, SeaweedFS) behind the fault proxy: the answer to the PUT of the first chunk is lost after the
    server stored it (the retry finds this writer's own object), and every DeleteObjects is refused (400
    MissingContentMD5: each delete falls back to single-key DELETEs)."""
    if backend == "local":
        cfg = small_config(request.getfixturevalue("local_config"))
        code, summary, text = run_job(cfg)
        assert code == 0, text
        assert_clean_end(cfg, summary)
    else:
        config = request.getfixturevalue("s3_config" if backend == "moto" else "seaweed_config")
        with FaultProxy(config.s3_endpoint_url, Fault("reset_after", "PUT", r"/g000000-a0-0/c\.0$"),
                        Fault("refuse_delete", "POST", "", times=None)) as proxy:
            # no DCP checkpoints: torch's fsspec writer talks to S3 through its own s3fs client, not refpipe's store
            cfg = small_config(config.model_copy(update={"s3_endpoint_url": proxy.url}), checkpoint_every_steps=0)
            code, summary, text = run_job(cfg)
            assert code == 0, text
            assert_clean_end(cfg, summary)
        assert proxy.hits["reset_after"] == 1 and proxy.hits["refuse_delete"] > 0
        cfg = cfg.model_copy(update={"storage": config})  # the proxy is gone: read the run straight from the server
    assert summary["alignment_ok"] and 0 <= summary["alignment_max_abs_diff"] < 1e-4
    assert summary["alignment_on_policy_tokens"] > 0  # the check compared real tokens
    deletes = summary["deletes"]
    assert deletes["trainer"] == summary["audit"]["shipped"]  # borrowed chunks are shipped once and deleted once
    assert deletes["orchestrator eval"] >= cfg.orchestrator.group_size
    assert sum(deletes.values()) == summary["audit"]["deleted"]
    assert "audit clean; alignment ok" in text
    run = open_store(cfg.storage).prefix.uri
    assert f"wrote {run}/summary.json and {run}/report.png" in text.replace("\n", "")
    assert_costs(cfg, summary)


def assert_costs(cfg: RunConfig, summary: dict) -> None:
    """summary.json's costs: every process's peak RSS, per-step exposed seconds and bytes in flight; report.png."""
    rss = summary["peak_rss_bytes"]
    assert {"orchestrator", "trainer_rank_0", "trainer_rank_1"} <= set(rss) <= {
        "orchestrator", "trainer_rank_0", "trainer_rank_1", "env_worker_0", "env_worker_1"}
    assert all(nbytes > 50 * 2**20 for nbytes in rss.values())  # every process holds torch and a model
    assert [s["step"] for s in summary["steps"]] == list(range(cfg.job.num_steps))
    assert len(summary["exposed_data_seconds_per_step"]) == cfg.job.num_steps
    assert all(seconds > 0 for seconds in summary["exposed_data_seconds_per_step"])
    in_flight = summary["kept_bytes_in_flight_per_step"]
    assert min(in_flight) > 0 and summary["peak_kept_bytes_in_flight"] == max(in_flight)
    assert open_store(cfg.storage).get("report.png")[:8] == b"\x89PNG\r\n\x1a\n"


def test_after_checkpoint_release_and_retained_steps_end_clean(local_config):
    """The default release: chunks held until a checkpoint covers their step (every 2 steps and the last), step 1
    retained. Its cost, bytes held for a checkpoint, per step in summary.json and at its peak in the end table."""
    assert TrainerConfig().release == "after_checkpoint"
    cfg = small_config(local_config, checkpoint_every_steps=2)
    cfg = cfg.model_copy(update={"trainer": TrainerConfig(step_timeout_s=120, collective_timeout_s=120,
                                                          retain_steps=[1])})
    code, summary, text = run_job(cfg)
    assert code == 0, text
    store = open_store(cfg.storage)
    step_nbytes = [sum(r.nbytes for r in StepFile.read(store, s).header.refs) for s in range(3)]
    held = [step_nbytes[0], step_nbytes[0] + step_nbytes[1], step_nbytes[2]]  # checkpoint of step 1 releases 0, 1
    assert summary["held_for_checkpoint_bytes_per_step"] == held
    assert summary["peak_held_for_checkpoint_bytes"] == max(held) > 0
    assert re.search(rf"release after_checkpoint +│ peak {max(held) / 2**20:.2f} MiB held for a checkpoint", text)
    audit = summary["audit"]
    assert audit["clean"] and (audit["outstanding"], audit["leaked"], audit["double_deletes"]) == (0, 0, 0)
    assert audit["kept"] == audit["deleted"] + audit["retained"] and audit["retained"] > 0
    assert summary["deletes"]["trainer"] + summary["retained_chunks"] == audit["shipped"]
    assert summary["retained_chunks"] == audit["retained"]
    store = open_store(cfg.storage)
    retained = {k.rsplit("/", 1)[0] for k in store.list_prefix("payloads")}
    assert retained == {store.prefix.key_of(r.uri) for r in StepFile.read(store, 1).header.refs}
    assert {k for k in store.list_prefix("checkpoints") if k.endswith("commit.json")} == {
        "checkpoints/step_00000001/commit.json", "checkpoints/step_00000002/commit.json"}


def test_alignment_check_fails_when_routing_is_shifted_by_one_row(local_config):
    cfg = small_config(local_config, num_steps=1, alignment_shift_rows=1)
    code, summary, text = run_job(cfg)
    assert code == 1
    assert not summary["alignment_ok"] and summary["alignment_max_abs_diff"] > 1e-3
    assert "alignment check failed" in text
    assert_clean_end(cfg, summary)


def test_killed_env_worker_run_continues_and_audit_is_clean(local_config):
    cfg = small_config(local_config, num_steps=4)
    store = open_store(cfg.storage)
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(zip(("code", "summary", "text"), run_job(cfg))))
    thread.start()
    deadline = time.monotonic() + 300
    while not store.exists(step_key(0)) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.kill(json.loads(store.get(address_key(0)))["pid"], signal.SIGKILL)  # env-server replica 0
    thread.join(timeout=600)
    assert not thread.is_alive()
    assert result["code"] == 0, result["text"]
    assert result["summary"]["dead_env_workers"] == [0]
    assert_clean_end(cfg, result["summary"])


def write_config(tmp_path, root, run_id: str, num_steps: int = 3, warm_start_steps: int = 20, **orchestrator) -> str:
    """A TOML run config of the small job under ``root`` with a fixed run id."""
    orch = {"seq_len": 128, "dp_world_size": 2, "groups_per_step": 2, "group_size": 4, **orchestrator}
    text = (f'[storage]\nroot = "{root}"\nrun_id = "{run_id}"\n'
            f"[job]\nnum_steps = {num_steps}\nwarm_start_steps = {warm_start_steps}\n"
            "[orchestrator]\n" + "".join(f"{k} = {v}\n" for k, v in orch.items()) +
            '[trainer]\nstep_timeout_s = 120\ncollective_timeout_s = 120\nrelease = "after_step"\n')
    path = tmp_path / f"{run_id}.toml"
    path.write_text(text)
    return str(path)


def test_an_existing_run_id_is_refused_and_the_run_is_untouched(tmp_path):
    from typer.testing import CliRunner

    from refpipe.cli.main import app

    store = open_store(StorageConfig(root=str(tmp_path / "root"), run_id="fixed"))
    store.put("config.json", b"{}")
    result = CliRunner().invoke(app, ["run", "--config", write_config(tmp_path, tmp_path / "root", "fixed")])
    assert result.exit_code == 2
    assert "already exists: choose another storage.run_id" in result.output
    assert store.list_prefix("") == ["config.json"] and store.get("config.json") == b"{}"


def test_config_that_cannot_train_is_refused_before_anything_starts(tmp_path):
    from typer.testing import CliRunner

    from refpipe.cli.main import app

    for override, expected in (({"seq_len": 8}, "orchestrator.seq_len=8"), ({"group_size": 1}, "group_size=1")):
        result = CliRunner().invoke(app, ["run", "--config", write_config(tmp_path, tmp_path / "root", "bad",
                                                                          **override)])
        assert result.exit_code == 2 and expected in result.output
    assert not (tmp_path / "root").exists()


def test_sigterm_stops_the_run_its_workers_and_trainers(tmp_path):
    """SIGTERM to `refpipe run`: the launcher stops the fleet, audits as stopped, exits 143 (128 + SIGTERM, the shell's
    convention; it exited 1 like a failed audit); nothing lingers. Its piped log keeps the 82-column step lines
    whole."""
    import subprocess
    import sys

    from refpipe.job.progress import COLUMNS, _line

    root = tmp_path / "root"
    path = write_config(tmp_path, root, "term", num_steps=50)
    refpipe = os.path.join(os.path.dirname(sys.executable), "refpipe")
    proc = subprocess.Popen([refpipe, "run", "--config", path], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    store = open_store(StorageConfig(root=str(root), run_id="term"))
    deadline = time.monotonic() + 300
    while not store.exists(step_key(1)) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    children = _children(proc.pid)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, out
    assert "run FAILED: interrupted (SIGTERM)" in out
    assert _line(COLUMNS) in out.splitlines()  # piped (80 columns): each progress line stays whole, it wrapped
    summary = json.loads(store.get(SUMMARY_KEY))
    assert summary["failed"] and summary["audit"]["leaked"] == 0
    time.sleep(1)
    assert [pid for pid in children if _alive(pid)] == []


def test_sigterm_during_the_warm_start_exits_143(tmp_path):
    """Before the fleet exists (warm start): "interrupted before the run started", exit 128 + SIGTERM (it was 130,
    SIGINT's code, whatever the signal)."""
    import subprocess
    import sys

    root = tmp_path / "root"
    path = write_config(tmp_path, root, "early", warm_start_steps=100_000)
    refpipe = os.path.join(os.path.dirname(sys.executable), "refpipe")
    proc = subprocess.Popen([refpipe, "run", "--config", path], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    store = open_store(StorageConfig(root=str(root), run_id="early"))
    deadline = time.monotonic() + 120
    while not store.exists("config.json") and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.1)
    time.sleep(0.5)  # into the warm start
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert (proc.returncode, "interrupted before the run started" in out) == (143, True), out


def _children(pid: int) -> list[int]:
    import subprocess

    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_sigkill_of_the_launcher_leaves_no_worker_or_trainer_behind(tmp_path):
    """Env workers and trainer ranks watch the launcher and exit when it is SIGKILLed."""
    import subprocess
    import sys

    root = tmp_path / "root"
    path = write_config(tmp_path, root, "kill", num_steps=50)
    refpipe = os.path.join(os.path.dirname(sys.executable), "refpipe")
    proc = subprocess.Popen([refpipe, "run", "--config", path], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = open_store(StorageConfig(root=str(root), run_id="kill"))
    deadline = time.monotonic() + 300
    while not store.exists(step_key(1)) and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    children = [pid for pid in _children(proc.pid) if _cmdline(pid) and "resource_tracker" not in _cmdline(pid)]
    assert len(children) == 4  # 2 env workers, 2 trainer ranks
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 30
    while [pid for pid in children if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert [pid for pid in children if _alive(pid)] == []


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def test_a_group_whose_send_fails_goes_to_one_other_replica_once(tmp_path, local_config):
    """Replica 0's connection is gone when a group is sent to it: replica 1 gets that group exactly once."""
    from multiprocessing import Pipe

    from refpipe.job.dispatch import Dispatcher
    from refpipe.job.env_worker import GroupRequest
    from refpipe.job.fleet import Fleet
    from refpipe.job.report import RunTally
    from refpipe.pipeline.orchestrator import Orchestrator

    cfg = small_config(local_config)
    orchestrator = Orchestrator(cfg.orchestrator, open_store(cfg.storage), fields=cfg.fields)
    (gone, gone_peer), (live, live_peer) = Pipe(), Pipe()
    gone_peer.close()
    fleet = Fleet(conns=[gone, live], in_flight=[{}, {}])
    Dispatcher(cfg, fleet, orchestrator, Console(file=io.StringIO()), RunTally()).send(GroupRequest(0, "g000000", 0))
    orchestrator.shutdown()
    received = []
    while live_peer.poll(0.5):
        received.append(live_peer.recv())
    assert received == [GroupRequest(0, "g000000", 0)]
    assert (fleet.dead, fleet.in_flight) == ({0}, [{}, {0: GroupRequest(0, "g000000", 0)}])


def test_a_dead_trainer_rank_is_named_with_how_it_ended_and_where_to_look():
    """A SIGKILLed rank printed nothing, so "see its log above" pointed at nothing: the line says it was killed and
    where the kernel names an OOM kill; a rank that exited with a code printed its error to this terminal."""
    import subprocess
    import sys

    from refpipe.job.fleet import Fleet

    ranks = [subprocess.Popen([sys.executable, "-c", code]) for code in
             ("pass", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "raise SystemExit(3)")]
    for proc in ranks:
        proc.wait(timeout=60)
    assert Fleet(conns=[], trainers=ranks).dead_trainers() == [
        "trainer rank 1 (killed by SIGKILL, so it printed nothing; if nobody killed it, look for the kernel's OOM "
        "killer in `journalctl -k` or `dmesg` on this host)",
        "trainer rank 2 (exited with code 3; its error is in its output above)"]


def test_delete_paths_get_the_rest_of_the_audits_total_as_one_labelled_path():
    """The summary's per-path deletes sum to the audit's ``deleted``: what no path reported is one labelled path, a
    surplus (a delete two paths counted) another; paths that agree with the total are left as they are."""
    from collections import Counter

    from refpipe.job.run_end import DOUBLE_COUNTED_DELETES, UNREPORTED_DELETES, with_unreported

    reported = Counter({"trainer": 22, "orchestrator eval": 8, "orchestrator untrained": 3, "env worker discard": 0})
    assert with_unreported(reported, 52) == {"trainer": 22, "orchestrator eval": 8, "orchestrator untrained": 3,
                                             "env worker discard": 0, UNREPORTED_DELETES: 19}
    assert with_unreported(reported, 33) == reported and "env worker discard" in with_unreported(reported, 33)
    assert with_unreported(reported, 31) == {**reported, DOUBLE_COUNTED_DELETES: -2}
    assert reported == {"trainer": 22, "orchestrator eval": 8, "orchestrator untrained": 3, "env worker discard": 0}


def test_a_stopped_runs_delete_rows_sum_to_the_deleted_total(tmp_path):
    """SIGTERM while every trainer rank waits after step 1's release, before its metrics: the trainer deleted steps 0
    and 1's chunks, but its metrics reported none (step s's metrics count step s - 2's release) and it is killed
    before its finish metrics. The summary (table and summary.json) names those deletes as unreported; its delete
    rows summed to 15 below a `deleted` of 52 in the run that found it."""
    import subprocess
    import sys

    from refpipe.trainer.pause import ENV
    from tests.job.test_resume import released_by

    root = tmp_path / "root"
    path = write_config(tmp_path, root, "stop", num_steps=6)
    marker = tmp_path / "paused"
    refpipe = os.path.join(os.path.dirname(sys.executable), "refpipe")
    proc = subprocess.Popen([refpipe, "run", "--config", path], env={**os.environ, ENV: f"after_release:1:{marker}"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    store = open_store(StorageConfig(root=str(root), run_id="stop"))
    deadline = time.monotonic() + 300
    while not (marker.exists() and released_by([0, 1], 1)(store)):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 143, out
    summary = json.loads(store.get(SUMMARY_KEY))
    trained = {ref.branch_id for step in (0, 1) for ref in StepFile.read(store, step).header.refs}
    deletes = summary["deletes"]
    rows = [line.split("│")[1:3] for line in out.splitlines() if line.startswith("│ deletes: ")]
    assert (sum(int(n) for _, n in rows), sum(deletes.values())) == (summary["audit"]["deleted"],) * 2, out
    from refpipe.job.run_end import UNREPORTED_DELETES

    assert (deletes["trainer"], deletes[UNREPORTED_DELETES]) == (0, len(trained))
