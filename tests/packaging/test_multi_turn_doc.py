"""docs/multi-turn.md: its Python blocks run as one program, and the run they leave is exact: every segment and the
shared prompt kept once and deleted once, nothing left."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from refpipe.pipeline.audit import audit
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig

PAGE = Path(__file__).parents[2] / "docs" / "multi-turn.md"


def test_the_multi_turn_program_runs_as_written(tmp_path):
    (tmp_path / "multi_turn.py").write_text("\n".join(re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S)))
    root = str(tmp_path / "runs")
    result = subprocess.run([sys.executable, "multi_turn.py"], env={**os.environ, "REFPIPE_ROOT": root},
                            cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout == "segments: [18]\ncontinued: 16 tokens in 2 segments\n"
    report = audit(open_store(StorageConfig(root=root, run_id="multi_turn")), finished=True)
    assert (report.kept, report.deleted, report.present, report.leaked, report.violations) == (8, 8, 0, 0, [])
