"""The ``refpipe`` command."""

from __future__ import annotations

import typer

app = typer.Typer(help="refpipe: side-channel arrays of LLM RL training, passed by reference.", no_args_is_help=True)


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
