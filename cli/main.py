"""The ``refpipe`` command."""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from refpipe.cli.inspect_common import EXIT_ERROR, USAGE_ERRORS, one_line


class OneLineUsageErrors(TyperGroup):
    """The ``refpipe`` group: a usage error (missing or unknown argument, option or command, a value of the wrong
    type) of any command is one ``error:`` line with that command's usage on stderr and exit code 2, like every
    other bad input (``cli.inspect_common.fail``), never click's boxed usage panel. ``refpipe`` alone still
    prints the help."""

    def make_context(self, info_name, args, parent=None, **extra):
        try:
            return super().make_context(info_name, args, parent=parent, **extra)
        except USAGE_ERRORS as e:
            _usage_error(e)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except USAGE_ERRORS as e:
            _usage_error(e)


def _usage_error(e: Exception) -> None:
    """Print ``error: <what> (usage: <command usage>; see <command> --help)`` and exit 2; the no-arguments help
    passes through."""
    if type(e).__name__ == "NoArgsIsHelpError":
        raise e
    ctx = getattr(e, "ctx", None)
    hint = ""
    if ctx is not None:
        usage = one_line(ctx.get_usage()).removeprefix("Usage: ")
        hint = f" (usage: {usage}; see {ctx.command_path} --help)"
    message = e.format_message()  # type: ignore[attr-defined]  # a UsageError of click or of typer's vendored click
    typer.echo(f"error: {one_line(message).rstrip('.')}{hint}", err=True)
    raise typer.Exit(getattr(e, "exit_code", EXIT_ERROR) or EXIT_ERROR)


app = typer.Typer(help="refpipe: side-channel arrays of LLM RL training, passed by reference.", no_args_is_help=True,
                  cls=OneLineUsageErrors)


@app.callback()
def main() -> None:
    """refpipe: side-channel arrays of LLM RL training, passed by reference."""


@app.command()
def version() -> None:
    """Print the refpipe version."""
    from importlib.metadata import version as v

    typer.echo(v("refpipe"))


from refpipe.cli.inspect import inspect_step, ls_run, show_arrays, verify_step  # noqa: E402  (offline inspection)

app.command("inspect")(inspect_step)
app.command("show")(show_arrays)
app.command("ls")(ls_run)
app.command("verify")(verify_step)
from refpipe.cli.ledger import audit_run, sweep_run  # noqa: E402  (ledger audit and sweep)

app.command("audit")(audit_run)
app.command("sweep")(sweep_run)
from refpipe.cli.run import env_server, init_run, orchestrate, run_job, train_rank  # noqa: E402  (the main job)

app.command("run")(run_job)
app.command("init")(init_run)
app.command("orchestrate")(orchestrate)
app.command("env-server")(env_server)
app.command("train")(train_rank)

if __name__ == "__main__":
    app()
