"""A run root (or run directory) that is a regular file: every command that takes a run says so in one line and
exits 2; it said "<run>/config.json does not exist" (init, run --resume) or "nothing under the run prefix" (audit,
sweep). Nothing is written, and the file is untouched."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from refpipe.cli.main import app

STEP = "steps/step_00000000.npz"


def _expected(run: str, path: str, what: str) -> str:
    return (f"error: run file://{run}: {path} is a file, not a directory ({what}): pass the run's real location, "
            "or set storage.root to a directory (or a path that can become one)\n")


COMMANDS = [["ls", "{run}"], ["audit", "{run}"], ["sweep", "{run}"], ["sweep", "--stopped", "{run}"],
            ["show", f"{{run}}/{STEP}", "--micro-batch", "0"], ["inspect", f"{{run}}/{STEP}"],
            ["verify", f"{{run}}/{STEP}"], ["run", "--resume", "{run}"], ["orchestrate", "{run}"],
            ["env-server", "{run}", "--replica", "0"], ["train", "{run}"]]


@pytest.mark.parametrize("args", COMMANDS)
def test_every_command_names_the_file_in_the_way(tmp_path, args):
    root = tmp_path / "root"
    root.write_bytes(b"not a directory")
    run = f"{root}/run_0"
    result = CliRunner().invoke(app, [a.format(run=run) for a in args], prog_name="refpipe")
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == _expected(run, str(root), "the run root")
    assert root.read_bytes() == b"not a directory"


def test_a_run_directory_that_is_a_file(tmp_path):
    (tmp_path / "run_0").write_bytes(b"x")
    result = CliRunner().invoke(app, ["ls", str(tmp_path / "run_0")], prog_name="refpipe")
    assert (result.exit_code, result.stderr) == (2, _expected(f"{tmp_path}/run_0", f"{tmp_path}/run_0",
                                                             "the run directory"))


def test_init_with_a_root_under_a_file(tmp_path):
    (tmp_path / "root").write_bytes(b"x")
    config = tmp_path / "run.toml"
    config.write_text(f'[storage]\nroot = "{tmp_path}/root/sub"\nrun_id = "r1"\n[job]\nwarm_start_steps = 0\n')
    result = CliRunner().invoke(app, ["init", "--config", str(config)], prog_name="refpipe")
    assert result.exit_code == 2
    assert result.stderr == _expected(f"{tmp_path}/root/sub/r1", f"{tmp_path}/root", "a directory above the run root")
