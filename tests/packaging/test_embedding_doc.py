"""docs/embedding.md, sections "Keep → ref" to "Refused episodes": their Python blocks run as one program, and
the run they leave is exact: two published steps held for their trainers, the refused chunk deleted, no leak."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from refpipe.pipeline.audit import audit
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig

PAGE = Path(__file__).parents[2] / "docs" / "embedding.md"
SECTIONS = ("Keep → ref", "A sample's slice", "Publish a step from your own packing", "A pluggable orchestrator",
            "Refused episodes")


def program() -> str:
    """The ```python blocks of ``SECTIONS``, in page order."""
    text = PAGE.read_text()
    blocks = []
    for title in SECTIONS:
        section = text[text.index(f"\n## {title}\n"):]
        end = section.find("\n## ", 1)
        blocks += re.findall(r"```python\n(.*?)```", section[: end if end > 0 else None], re.S)
    return "\n".join(blocks)


def test_the_layers_program_runs_as_written(tmp_path):
    (tmp_path / "layers.py").write_text(program())
    root = str(tmp_path / "runs")
    result = subprocess.run([sys.executable, "layers.py"], env={**os.environ, "REFPIPE_ROOT": root}, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-4000:]
    assert result.stdout == ("tokens per DP rank: [22, 22]\n"
                             "refused: episode 'e9' (group 'g1', env 'my_env'): reward nan: expecte | deleted: "
                             "{'refused': 1}\n")
    report = audit(open_store(StorageConfig(root=root, run_id="embed")), stopped=True)
    assert (report.kept, report.shipped, report.deleted, report.leaked, report.violations) == (9, 8, 1, 0, [])
    assert report.outstanding_by_holder == {"trainer step 0": 4, "trainer step 1": 4}
