"""``refpipe run --resume RUN_URI``: the launcher's side of a run's later life.

The config comes from the run's ``config.json`` (where the run is now: root and run id from
``RUN_URI``); a config passed beside it may change only what a later life can safely change
(``RESUMABLE``). Before starting anything, ``LifeStart.read`` classifies every step of the run
from its step files, checkpoints and ledger (``pipeline.audit_scan``):

- released by every DP rank owning one of its chunks;
- released by some of them only;
- published but not trained by anyone (no release);
- never published (up to ``job.num_steps``).

The trainer's side (``trainer.resume``) decides what to replay and skip; the launcher only
needs where the numbering goes on: steps up to the checkpoint are done, steps after it up to the
last published one are trained again from their step files, and the orchestrator publishes from
the next one on.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from refpipe.job.config import RunConfig
from refpipe.pipeline.audit_scan import scan_run
from refpipe.storage.checkpoints import newest_checkpoint
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import ConfigError, KeyNotFoundError, validation_problems
from refpipe.storage.layout import CONFIG_KEY, EVENTS_PREFIX, ORCHESTRATOR_ACTOR, SUMMARY_KEY, parse_segment_key
from refpipe.storage.store import Store

RESUMABLE = {("job", "num_steps"), ("job", "step_deadline_s"), ("trainer", "step_timeout_s")}
"""``(section, key)`` a config passed to ``--resume`` may change; everything else must equal ``config.json``."""


def resume_config(store: Store, storage: StorageConfig, override: Path | None) -> RunConfig:
    """The run's config for its next life: ``config.json`` with ``storage`` (where the run is now) and the
    ``RESUMABLE`` values of ``override``.

    Raises:
        ConfigError: no readable ``config.json`` under the run, or ``override`` changes anything else
            (named in the message).
    """
    try:
        saved = RunConfig.model_validate_json(store.get(CONFIG_KEY)).model_dump()
    except (KeyNotFoundError, ValidationError) as e:
        raise ConfigError(f"run {store.prefix.uri}: no readable config.json to resume from: {e}") from e
    saved["storage"] = {**saved["storage"], "root": storage.root, "run_id": storage.run_id,
                        "s3_endpoint_url": storage.s3_endpoint_url or saved["storage"]["s3_endpoint_url"]}
    given = _read_toml(override) if override is not None else {}
    merged = {**given, **{section: {**values, **given.get(section, {})} if section != "storage" else values
                          for section, values in saved.items()}}
    try:
        cfg = RunConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(f"run {store.prefix.uri}: config.json with the changes of {override} is invalid: "
                          f"{validation_problems(e)}") from e
    wanted = cfg.model_dump()
    changed = sorted(f"{section}.{key}" for section, values in given.items() if section != "storage"
                     for key in values if wanted[section][key] != saved[section][key])
    refused = [c for c in changed if tuple(c.split(".")) not in RESUMABLE]
    if refused:
        raise ConfigError(f"config {override}: {', '.join(refused)} differ from the run's config.json; a resumed "
                          f"run may change only {', '.join(sorted('.'.join(r) for r in RESUMABLE))}")
    return cfg


def _read_toml(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config {path}: cannot read: {e}") from e


def finished_steps(store: Store) -> int | None:
    """Steps a run's last life trained if it ended cleanly (its ``summary.json`` says not failed), else None."""
    try:
        summary = json.loads(store.get(SUMMARY_KEY))
    except KeyNotFoundError:
        return None
    return None if summary.get("failed", True) else int(summary["trained_steps"])


def refuse_finished(store: Store, cfg: RunConfig) -> None:
    """``refpipe env-server``, before its ledger session: refuse a run that trained every step its ``config.json``
    asks for (a later life that raises ``job.num_steps`` rewrites ``config.json`` first, so its replicas start).
    Keeps into a finished run were leaked: no step trains them and its clean audit then counts them.

    Raises:
        ConfigError: the run is finished, saying how to start a new one or train this one further.
    """
    done = finished_steps(store)
    if done is not None and done >= cfg.job.num_steps:
        uri = store.prefix.uri
        raise ConfigError(f"run {uri} is finished ({done} of {cfg.job.num_steps} steps trained, see "
                          f"{store.uri(SUMMARY_KEY)}): an env server would keep chunks into it that nothing trains; "
                          f"start a new run (`refpipe init` with another storage.run_id, or \"auto\"), or train this "
                          f"one further: `refpipe run --resume {uri} --config FILE` with a larger job.num_steps")


@dataclass(frozen=True)
class LifeStart:
    """Where a later life of the run starts (launcher side)."""

    life: int
    """Lives of the run so far (sessions of the ``orchestrator`` actor): this one's number."""
    checkpoint_step: int
    """Step of the newest complete checkpoint, -1 without one (training restarts from the warm start)."""
    policy_version: int
    """The checkpoint's policy version (0 without one): the weights env workers restart on."""
    published: int
    """Steps ``0 .. published - 1`` have step files; the orchestrator goes on at ``published``."""
    classes: dict[str, list[int]]
    """Every step up to ``job.num_steps`` by state: ``released``, ``partly released``, ``published, not trained``,
    ``never published``."""

    @classmethod
    def read(cls, store: Store, num_steps: int) -> "LifeStart":
        """Read checkpoints, step files and the ledger (one audit scan; read-only)."""
        checkpoint = newest_checkpoint(store)
        scan = scan_run(store)
        published = next(s for s in range(len(scan.steps) + 1) if s not in scan.steps)
        classes: dict[str, list[int]] = {"released": [], "partly released": [], "published, not trained": [],
                                         "never published": []}
        for step in range(max(num_steps, published)):
            header = scan.steps.get(step)
            if header is None:
                classes["never published"].append(step)
                continue
            done = [scan.released.get(owner, -1) >= step for owner in set(header.owners)]
            kind = "released" if all(done) else "partly released" if any(done) else "published, not trained"
            classes[kind].append(step)
        lives = {parsed[1] for k in store.list_prefix(f"{EVENTS_PREFIX}/{ORCHESTRATOR_ACTOR}")
                 if (parsed := parse_segment_key(k))}
        return cls(len(lives), checkpoint.step if checkpoint else -1, checkpoint.policy_version if checkpoint else 0,
                   published, classes)
