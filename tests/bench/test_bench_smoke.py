"""Every script in ``bench/`` runs at a small shape and prints its JSON summary (so no benchmark rots unnoticed).

Each bench runs as a user runs it (``python bench/<name>.py``, a subprocess); the test checks that it exits 0 and
that its last line is a JSON object with the keys the bench documents. Figures are not asserted: at these shapes
they measure nothing (the benches print ratios against a baseline of the same run; docs/benchmarks.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"

SMOKE = {
    "keep_fetch.py": (["--branches", "8", "--rounds", "2", "--threads", "2", "--fetch-batch", "4"],
                      {"keep_time_ratio", "fetch_throughput_ratio", "delete_time_ratio", "keep_time_vs_one_file",
                       "fetch_throughput_vs_one_file", "delete_time_vs_one_file", "objects_per_branch",
                       "ledger_overhead_ratio", "fs_ops_per_branch", "fs_entries_created_per_branch"}),
    "orchestrator.py": (["--branches", "16", "--tokens", "256", "--prompt-tokens", "64", "--layers", "4",
                         "--logprobs-k", "8", "--group-size", "8", "--dp", "2"],
                        {"orchestrator_peak_rss_ratio", "step_file_bytes_ratio", "refpipe_peak_rss_bytes",
                         "inline_peak_rss_bytes", "refpipe_step_file_bytes", "inline_step_file_bytes"}),
    "trainer_fetch.py": (["--branches", "4", "--steps", "1", "--rounds", "1"],
                         {"fetch_assemble_vs_limit", "read_crc32c_vs_limit", "exposed_data_seconds_per_step",
                          "exposed_data_ratio", "peak_rss_MiB"}),
    "scale_sim.py": (["--sizes", "1024"],
                     {"max_entries_per_dir", "max_entries_per_dir_at_10M", "audit_seconds_growth",
                      "incremental_audit_seconds", "incremental_audit_seconds_growth"}),
    "release_hold.py": (["--steps", "2", "--checkpoint-every", "1"],
                        {"peak_held_bytes", "after_checkpoint_vs_after_step", "resume_wall_s"}),
    "multi_turn.py": (["--branches", "4", "--turns", "4", "--turn-tokens", "16", "--prompt-tokens", "32",
                       "--group-size", "2", "--layers", "2", "--top-k", "2", "--rounds", "1"],
                      {"bytes_written_vs_unique_rows", "env_peak_rss_growth_vs_one_turn",
                       "keep_seconds_last_vs_first_turns", "fetch_segmented_vs_whole", "raw_read_segmented_vs_whole",
                       "shared_prefix_copies", "partial_rollouts_continued", "audit_violations"}),
    "peers.py": (["--arrays", "4", "--rounds", "2", "--threads", "2", "--get-batch", "2"],
                 {"keep_vs_ray_put", "fetch_vs_ray_get", "free_vs_ray_free", "keep_vs_transferqueue_put",
                  "fetch_vs_transferqueue_get", "free_vs_transferqueue_clear", "keep_vs_np_save", "fetch_vs_np_load",
                  "free_vs_os_remove", "put_gib_per_s", "get_gib_per_s", "frees_per_s", "frees_per_s_drained",
                  "free_drained_vs_transferqueue_clear"}),
}


def test_every_bench_has_a_smoke_shape():
    assert sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_")) == sorted(SMOKE)


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_bench_completes_and_prints_its_summary(script, tmp_path):
    args, keys = SMOKE[script]
    extra = ["--tmp", str(tmp_path)] if script in ("trainer_fetch.py", "scale_sim.py") else \
        ["--dir", str(tmp_path)] if script in ("keep_fetch.py", "release_hold.py", "peers.py", "multi_turn.py") else \
        ["--workdir", str(tmp_path)]
    out = subprocess.run([sys.executable, str(BENCH / script), *args, *extra], capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert keys <= summary.keys(), sorted(keys - summary.keys())
