"""The main job end to end (issue 6): real env-worker processes, real trainer ranks (gloo), real stores.

Each run is small (3 steps, a short warm start) and ends with the ledger audit written to
``<run>/summary.json``, which the tests read back.
"""

from __future__ import annotations

import io
import json
import os
import signal
import threading
import time
import multiprocessing

import pytest
from rich.console import Console

from job.config import JobConfig, RunConfig
from job.launcher import SUMMARY_KEY, Launcher
from pipeline.orchestrator import OrchestratorConfig
from pipeline.step_file import step_key
from storage.config import StorageConfig
from storage.store import open_store
from trainer.config import TrainerConfig


def small_config(storage: StorageConfig, **job) -> RunConfig:
    """3 steps of 2 groups of 4 branches, 2 env workers, 2 DP ranks."""
    return RunConfig(
        storage=storage,
        job=JobConfig(**{"num_steps": 3, "warm_start_steps": 20, "eval_every_steps": 1, **job}),
        orchestrator=OrchestratorConfig(seq_len=128, dp_world_size=2, groups_per_step=2, group_size=4,
                                        max_async_level=1),
        trainer=TrainerConfig(step_timeout_s=120, collective_timeout_s=120),
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


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_main_job_trains_through_refpipe_and_ends_clean(request, backend):
    cfg = small_config(request.getfixturevalue(f"{backend}_config"))
    code, summary, text = run_job(cfg)
    assert code == 0, text
    assert_clean_end(cfg, summary)
    assert summary["alignment_ok"] and 0 <= summary["alignment_max_abs_diff"] < 1e-4
    deletes = summary["deletes"]
    assert deletes["trainer"] == summary["audit"]["shipped"] - summary["audit"]["borrowed"] * 0
    assert deletes["orchestrator eval"] >= cfg.orchestrator.group_size
    assert sum(deletes.values()) == summary["audit"]["deleted"]
    assert "audit clean; alignment ok" in text


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
    victim = next(p for p in multiprocessing.active_children() if p.name == "env_worker_0")
    os.kill(victim.pid, signal.SIGKILL)
    thread.join(timeout=600)
    assert not thread.is_alive()
    assert result["code"] == 0, result["text"]
    assert result["summary"]["dead_env_workers"] == [0]
    assert_clean_end(cfg, result["summary"])
