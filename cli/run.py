"""The main job's commands: ``run`` (one machine; ``--resume`` for a later life), ``init``, and one per
role (``orchestrate``, ``env-server``, ``train``)."""

from __future__ import annotations

import signal
import socket
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console

from refpipe.cli.inspect_common import fail
from refpipe.storage.errors import RefpipeError

DEFAULT_CONFIG = Path("configs/local.toml")


def run_job(config: Optional[Path] = typer.Option(
                None, "--config", "-c", help="Run config (TOML; default configs/local.toml); see configs/ and "
                                             "docs/configuration.md. With --resume: only the keys a resumed "
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

    console = Console(soft_wrap=True)  # a piped log (SLURM, CI) keeps each step line whole
    signals: list[int] = []
    try:
        if resume:
            cfg = _resume_config(resume, config, s3_endpoint_url, console)
            if cfg is None:
                raise typer.Exit(0)
        else:
            cfg = load_config(config or DEFAULT_CONFIG)
        launcher = Launcher(cfg, console, resume=bool(resume))
        signals = launcher.signals
        code = launcher.run()
    except RefpipeError as e:  # raised before the run started: bad config, root, credentials, existing run
        fail(str(e))
    except KeyboardInterrupt:  # before the fleet started (warm start): only config.json and weights were written
        console.print("[red]interrupted before the run started[/]", highlight=False)
        raise typer.Exit(128 + (signals[0] if signals else signal.SIGINT)) from None
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


def init_run(config: Path = typer.Option(Path("configs/local.toml"), "--config", "-c",
                                         help="Run config (TOML); see configs/ and docs/configuration.md."),
             ) -> None:
    """Prepare a run for its roles: write <run>/config.json (absolute root), the env servers' auth key and the
    warm-started weights; print the commands that start the orchestrator, the env servers and the trainer."""
    from refpipe.job.config import load_config
    from refpipe.job.launcher import Launcher
    from refpipe.job.roles import start_commands

    console = Console(soft_wrap=True)  # a piped log (SLURM, CI) keeps each step line whole
    try:
        launcher = Launcher(load_config(config), console)
        launcher.prepare()
    except RefpipeError as e:
        fail(str(e))
    uri = launcher.store.prefix.uri
    console.print(f"run {uri} is ready; start each role, on any node that reaches the run (in any order):",
                  soft_wrap=True, highlight=False)
    for command in start_commands(launcher.cfg, uri):
        console.print(f"  {command}", soft_wrap=True, highlight=False, markup=False)


RUN_HELP = "The run URI (<root>/<run_id>, a path or file:// or s3:// URI), as this node reaches it."
S3_HELP = "S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)."


def orchestrate(run: str = typer.Argument(..., metavar="RUN_URI", help=RUN_HELP),
                s3_endpoint_url: Optional[str] = typer.Option(None, help=S3_HELP)) -> None:
    """The orchestrator of a run prepared by `refpipe init`: connects to every env-server replica, builds the
    step files, ends with the ledger audit (exit 0 only if clean and the alignment check passed)."""
    from refpipe.job.launcher import Launcher
    from refpipe.job.roles import open_run, refuse_ended

    console = Console(soft_wrap=True)  # a piped log (SLURM, CI) keeps each step line whole
    try:
        cfg, store = open_run(run, s3_endpoint_url)
        refuse_ended(store)
        code = Launcher(cfg, console).orchestrate()
    except (RefpipeError, TimeoutError) as e:
        fail(str(e))
    except KeyboardInterrupt:
        console.print("[red]interrupted before the run started[/]", highlight=False)
        raise typer.Exit(130) from None
    raise typer.Exit(code)


def env_server(run: str = typer.Argument(..., metavar="RUN_URI", help=RUN_HELP),
               replica: int = typer.Option(..., "--replica", help="This replica's index: 0 .. job.num_env_workers-1."),
               host: str = typer.Option(socket.gethostname(), help="Address to listen on and to publish "
                                        "(default: this host's name)."),
               s3_endpoint_url: Optional[str] = typer.Option(None, help=S3_HELP)) -> None:
    """One env-server replica of a run prepared by `refpipe init`: listens, publishes <run>/envs/<replica>.address,
    serves the orchestrator's group requests until it stops."""
    from refpipe.job.env_worker import serve_replica

    try:
        serve_replica(run, replica, host, s3_endpoint_url)
    except RefpipeError as e:
        fail(str(e))


def train_rank(run: str = typer.Argument(..., metavar="RUN_URI", help=RUN_HELP),
               s3_endpoint_url: Optional[str] = typer.Option(None, help=S3_HELP),
               resume: bool = typer.Option(False, "--resume", help="A later life: start from the newest complete "
                                                                   "checkpoint (see `refpipe run --resume`)."),
               published: Optional[int] = typer.Option(
                   None, "--published", metavar="N", help="With --resume: steps 0..N-1 are the earlier lives' "
                                                          "(default: the step files listed when the rank starts)."),
               ) -> None:
    """One trainer rank of a run (torchrun environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    from refpipe.job.train_rank import main

    try:
        main(run, s3_endpoint_url, resume=resume, published=published)
    except RefpipeError as e:
        fail(str(e))
