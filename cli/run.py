"""``refpipe run`` and ``refpipe train``: the main job (a new run, or the next life of one) and one trainer rank."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from refpipe.cli.text import markup_safe
from refpipe.storage.errors import RefpipeError
from rich.console import Console

DEFAULT_CONFIG = Path("configs/local.toml")


def run_job(config: Optional[Path] = typer.Option(
                None, "--config", "-c", help="Run config (TOML; default configs/local.toml); see configs/ and the "
                                             "README's config reference. With --resume: only the keys a resumed "
                                             "run may change (job.num_steps, job.step_deadline_s, "
                                             "trainer.step_timeout_s)."),
            resume: Optional[str] = typer.Option(
                None, "--resume", help="Resume the run at this URI from its newest complete checkpoint (config from "
                                       "its config.json)."),
            s3_endpoint_url: Optional[str] = typer.Option(None, help="S3 endpoint of the run to resume."),
            ) -> None:
    """Train the small MoE policy end to end through refpipe; end with the ledger audit."""
    from refpipe.job.config import load_config
    from refpipe.job.launcher import Launcher

    console = Console()
    try:
        if resume:
            cfg = _resume_config(resume, config, s3_endpoint_url, console)
            if cfg is None:
                raise typer.Exit(0)
        else:
            cfg = load_config(config or DEFAULT_CONFIG)
        code = Launcher(cfg, console, resume=bool(resume)).run()
    except RefpipeError as e:  # raised before the run started: bad config, root, credentials, existing run
        console.print(f"[red]error:[/] {markup_safe(e)}", soft_wrap=True, highlight=False)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:  # before the fleet started (warm start): only config.json and weights were written
        console.print("[red]interrupted before the run started[/]", highlight=False)
        raise typer.Exit(130) from None
    raise typer.Exit(code)


def _resume_config(run_uri: str, config: Optional[Path], s3_endpoint_url: Optional[str], console: Console):
    """The resumed run's config, or None (said on the console) when the run already finished its steps."""
    from refpipe.cli.inspect_common import open_run
    from refpipe.job.resume import finished_steps, resume_config

    store = open_run(run_uri, s3_endpoint_url)
    storage = store.config.model_copy(update={"s3_endpoint_url": s3_endpoint_url})
    cfg = resume_config(store, storage, config)
    done = finished_steps(store)
    if done is not None and done >= cfg.job.num_steps:
        console.print(f"run {store.prefix.uri} is finished ({done} of {cfg.job.num_steps} steps trained, audit in "
                      "summary.json); nothing to resume", soft_wrap=True, highlight=False)
        return None
    return cfg


def train_rank(config: Path = typer.Argument(..., help="The run's resolved config.json (fixed run_id)."),
               resume: bool = typer.Option(False, "--resume", help="A later life: start from the newest complete "
                                                                   "checkpoint (see `refpipe run --resume`)."),
               ) -> None:
    """One trainer rank of a run (torchrun environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    from refpipe.job.train_rank import main

    main(str(config), resume=resume)
