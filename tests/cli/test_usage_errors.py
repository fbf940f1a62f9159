"""A command line that does not parse is one ``error:`` line with the command's usage and exit code 2, for every
command (it was click's boxed usage panel: 5 lines of box drawing on stderr)."""

from __future__ import annotations

import pytest
import typer
from typer.testing import CliRunner

from refpipe.cli.main import app

COMMANDS = sorted(c.name for c in typer.main.get_command(app).commands.values())


def _invoke(args: list[str]):
    return CliRunner().invoke(app, args, prog_name="refpipe")


def test_every_command_is_covered():
    assert COMMANDS == ["audit", "env-server", "init", "inspect", "ls", "orchestrate", "run", "show", "sweep",
                        "train", "verify", "version"]


@pytest.mark.parametrize("command", COMMANDS)
def test_an_unknown_option_is_one_error_line_with_the_usage(command):
    result = _invoke([command, "--no-such-option"])
    assert result.exit_code == 2
    assert result.stdout == ""
    assert result.stderr.splitlines() == [result.stderr.rstrip("\n")]
    assert result.stderr.startswith("error: No such option: --no-such-option (usage: refpipe ")
    assert result.stderr.endswith(f"; see refpipe {command} --help)\n")


def test_a_missing_argument_names_it_and_the_usage():
    result = _invoke(["audit"])
    assert (result.exit_code, result.stdout) == (2, "")
    assert result.stderr == ("error: Missing argument 'RUN_URI' (usage: refpipe audit [OPTIONS] {RUN_URI}; "
                             "see refpipe audit --help)\n")


def test_a_missing_option_and_a_bad_value():
    result = _invoke(["env-server", "runs/run_0"])
    assert (result.exit_code, result.stderr) == (2, "error: Missing option '--replica' (usage: refpipe env-server "
                                                    "[OPTIONS] {RUN_URI}; see refpipe env-server --help)\n")
    result = _invoke(["show", "runs/run_0/steps/step_00000000.npz", "--micro-batch", "one"])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: Invalid value for '--micro-batch': ")
    assert result.stderr.endswith("(usage: refpipe show [OPTIONS] {STEP_URI}; see refpipe show --help)\n")


def test_an_unknown_command_names_the_top_level_usage():
    result = _invoke(["nosuch"])
    assert (result.exit_code, result.stderr) == (2, "error: No such command 'nosuch' (usage: refpipe [OPTIONS] "
                                                    "COMMAND [ARGS]...; see refpipe --help)\n")


def test_no_arguments_still_prints_the_help():
    result = _invoke([])
    assert "Usage: refpipe [OPTIONS] COMMAND [ARGS]..." in result.output and "error:" not in result.output


def test_the_trainer_module_entry_says_the_same_in_one_line(capsys):
    """``python -m refpipe.job.train_rank`` (what torchrun starts) parses with argparse: its two-line usage error
    is one line too."""
    from refpipe.job.train_rank import cli

    with pytest.raises(SystemExit) as exit_info:
        cli([])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: the following arguments are required: RUN_URI (usage: python -m refpipe.job.train_rank [-h] "
        "[--s3-endpoint-url S3_ENDPOINT_URL] [--resume] [--published N] RUN_URI; see python -m refpipe.job.train_rank "
        "--help)\n")
