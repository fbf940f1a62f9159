"""The bench scripts refuse counts below 1 at argument parsing (they divide by them), exit code 2."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("script, args", [
    ("keep_fetch.py", ["--branches", "0"]), ("keep_fetch.py", ["--rounds", "-1"]),
    ("trainer_fetch.py", ["--branches", "0", "--rounds", "1"]), ("trainer_fetch.py", ["--rounds", "0"]),
    ("orchestrator.py", ["--branches", "0"]), ("orchestrator.py", ["--dp", "0"]),
])
def test_counts_below_one_are_refused(script, args):
    result = subprocess.run([sys.executable, os.path.join(REPO, "bench", script), *args], capture_output=True,
                            text=True, timeout=60, cwd=REPO)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines()[-1].endswith(f"argument {args[0]}: expected an integer >= 1, got {args[1]!r}")
