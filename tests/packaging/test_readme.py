"""README "Use refpipe in your own stack": its Python blocks run as written, on a local directory and on S3.

The env-server and orchestrator blocks run in one process (the orchestrator calls the worker's ``rollout``),
the trainer block under ``torchrun`` (one rank), the verifiers block as a program (imports and a definition:
serving needs an inference endpoint). Each run gets its own ``REFPIPE_ROOT``; the run is then audited clean.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from refpipe.pipeline.audit import audit
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig

README = Path(__file__).parents[2] / "README.md"


def section_blocks() -> list[str]:
    """The ```python blocks of the README section "Use refpipe in your own stack", in order."""
    text = README.read_text()
    section = text[text.index("## Use refpipe in your own stack"):]
    section = section[: section.index("\n## ", 1)]
    return re.findall(r"```python\n(.*?)```", section, re.S)


def run(args: list[str], env: dict, cwd: Path) -> str:
    result = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr[-4000:]}"
    return result.stdout


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_the_embedding_programs_run_as_written(backend, tmp_path, request):
    worker, orchestrator, trainer, verifiers = section_blocks()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    if backend == "local":
        root, endpoint = str(tmp_path / "runs"), None
    else:
        endpoint = request.getfixturevalue("s3_endpoint")
        root = f"s3://{request.getfixturevalue('s3_bucket')}/readme-{uuid.uuid4().hex[:8]}"
        env["AWS_ENDPOINT_URL"] = endpoint
    env["REFPIPE_ROOT"] = root
    (tmp_path / "orchestrate.py").write_text(worker + "\n" + orchestrator)
    (tmp_path / "train.py").write_text(trainer)
    (tmp_path / "serve.py").write_text(verifiers)
    assert run([sys.executable, "orchestrate.py"], env, tmp_path) == (
        "step 0: 8 chunks in 4 micro batches\nstep 1: 8 chunks in 4 micro batches\n")
    out = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "train.py"],
              env, tmp_path)
    assert "step 0: 8 chunks, 0 dropped\nstep 1: 8 chunks, 0 dropped\n" in out
    run([sys.executable, "serve.py"], env, tmp_path)
    report = audit(open_store(StorageConfig(root=root, run_id="demo", s3_endpoint_url=endpoint)), finished=True)
    assert report.violations == [] and report.present == 0  # every chunk kept was deleted exactly once
    assert report.kept == 17  # 16 trained + 1 discarded by the worker
