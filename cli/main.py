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
