"""``refpipe run`` and ``refpipe train``: the main job and one trainer rank of it."""

from __future__ import annotations

from pathlib import Path

import typer
from refpipe.cli.text import markup_safe
from refpipe.storage.errors import RefpipeError
from rich.console import Console


def run_job(config: Path = typer.Option(Path("configs/local.toml"), "--config", "-c",
                                        help="Run config (TOML); see configs/ and the README's config reference."),
            ) -> None:
    """Train the small MoE policy end to end through refpipe; end with the ledger audit."""
    from refpipe.job.config import load_config
    from refpipe.job.launcher import Launcher

    console = Console()
    try:
        cfg = load_config(config)
        launcher = Launcher(cfg, console)
        code = launcher.run()
    except RefpipeError as e:  # raised before the run started: bad config, root, credentials, existing run
        console.print(f"[red]error:[/] {markup_safe(e)}", soft_wrap=True, highlight=False)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:  # before the fleet started (warm start): only config.json and weights were written
        console.print("[red]interrupted before the run started[/]", highlight=False)
        raise typer.Exit(130) from None
    raise typer.Exit(code)


def train_rank(config: Path = typer.Argument(..., help="The run's resolved config.json (fixed run_id).")) -> None:
    """One trainer rank of a run (torchrun environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    from refpipe.job.train_rank import main

    main(str(config))
