"""``examples/custom_fields.py`` runs as an adopter runs it and measures what docs/fields.md promises."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "custom_fields.py"


def test_declared_fields_travel_byte_equal_and_the_run_audits_clean(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path / "runs")], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "declared_fields": ["teacher_logprobs", "token_rewards", "image_features"], "byte_equal": True,
        "audit_clean": True, "kept": 8, "deleted": 8}
