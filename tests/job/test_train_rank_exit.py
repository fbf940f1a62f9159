"""``python -m refpipe.job.train_rank`` ends with its own exit code even when the interpreter's teardown would
abort the process (as torch's C++ threads do after a gloo world: ``job.roles.exit_without_teardown``).

The abort is made certain by a ``sitecustomize`` that registers ``os.abort`` with ``atexit``: a process that
runs its teardown dies of SIGABRT (-6), one that skips it exits with its code.
"""

from __future__ import annotations

import os
import subprocess
import sys


def _run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text("import atexit, os\natexit.register(os.abort)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, *args], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)


def test_an_aborting_teardown_aborts_a_plain_process(tmp_path):
    """The premise: with the ``sitecustomize``, an ordinary exit is SIGABRT."""
    assert _run(tmp_path, "-c", "print('done')").returncode == -6


def test_the_trainer_entry_exits_with_its_code_past_an_aborting_teardown(tmp_path):
    result = _run(tmp_path, "-m", "refpipe.job.train_rank", str(tmp_path / "no-such-run"))
    assert (result.returncode, result.stderr) == (
        2, f"error: run {(tmp_path / 'no-such-run').as_uri()}: no config.json (start the run with `refpipe init`)\n")


def test_a_usage_error_exits_2_past_an_aborting_teardown(tmp_path):
    result = _run(tmp_path, "-m", "refpipe.job.train_rank")
    assert (result.returncode, result.stderr) == (2, (
        "error: the following arguments are required: RUN_URI (usage: python -m refpipe.job.train_rank [-h] "
        "[--s3-endpoint-url S3_ENDPOINT_URL] [--resume] [--published N] RUN_URI; see python -m refpipe.job.train_rank "
        "--help)\n"))
