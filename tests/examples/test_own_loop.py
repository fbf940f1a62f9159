"""``examples/own_loop/run.py`` as an adopter runs it: its one JSON line, counted from what happened."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).parents[2] / "examples" / "own_loop" / "run.py"


def test_own_loop_is_killed_and_resumed_without_training_a_sample_twice_or_losing_one(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLE), "--work", str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {
        "own_advantages": True, "own_packing": True, "killed_and_resumed": True, "samples_trained_twice": 0,
        "samples_lost": 0, "audit_clean": True}
    assert json.loads((tmp_path / "plan_life2.json").read_text()) == {
        "checkpoint_step": 2, "start_step": 3, "skipped": [], "replayed": [3]}
    assert "ChunkNotFoundError" not in (tmp_path / "life2.log").read_text()
