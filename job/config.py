"""The main job's run config: one TOML file nesting every component's config.

``configs/local.toml`` (the default of ``make run``), ``configs/s3.toml`` and
``configs/lustre.toml`` are ready-made. A run writes its resolved config as
``<run>/config.json`` next to its data.
"""

from __future__ import annotations

import datetime
import json
import secrets
import tomllib
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, ValidationError, model_validator

from refpipe.job.workload.model import ModelConfig
from refpipe.job.workload.rollout import SamplingConfig
from refpipe.job.workload.task import TaskConfig
from refpipe.pipeline.field_decl import FieldDecl
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.orchestrator import OrchestratorConfig
from refpipe.storage.config import CONFIG, StorageConfig
from refpipe.storage.errors import ConfigError, validation_problems
from refpipe.trainer.config import TrainerConfig


class JobConfig(BaseModel):
    """The main job's own settings: processes, steps, optimisation and checks."""

    model_config = CONFIG

    num_steps: int = Field(default=16, ge=1)
    """Trainer steps (optimizer steps) of the run."""
    num_env_workers: int = Field(default=2, ge=1, le=1024)
    """Env-server replicas (``refpipe env-server --replica 0..N-1``, at most 1,024); each group goes to the one with
    the fewest in flight."""
    trainer_world_size: int = Field(default=2, ge=1, le=65536)
    """Trainer ranks (torch.distributed world size): what ``refpipe run`` starts, and what torchrun's
    ``--nnodes x --nproc-per-node`` must give."""
    eval_every_steps: int = Field(default=4, ge=0)
    """Send one eval group every this many steps (0 = never); eval episodes are never trained."""
    warm_start_steps: int = Field(default=60, ge=0)
    """Supervised warm-start steps on the task format before RL (``job.workload.task.warm_start``)."""
    learning_rate: float = Field(default=3e-3, gt=0)
    """Adam learning rate of the RL steps."""
    clip_eps: float = Field(default=0.2, gt=0, lt=1)
    """PPO-style ratio clip of the policy-gradient loss."""
    kl_coef: float = Field(default=0.05, ge=0)
    """Weight of the KL term to the fetched top-k head (``job.workload.loss.policy_loss``)."""
    alignment_tolerance: float = Field(default=1e-4, gt=0)
    """Max |recomputed - inference| logprob allowed on on-policy completion tokens (float32)."""
    alignment_shift_rows: int = Field(default=0, ge=0)
    """Test hook: replay routing shifted down by this many rows; any value > 0 must fail the check."""
    checkpoint_every_steps: int = Field(default=4, ge=0)
    """Write a trainer checkpoint (``trainer.checkpoint``) after every this many steps and after the last
    step (0 = never); ``trainer.release = "after_checkpoint"`` needs checkpoints."""
    step_deadline_s: float = Field(default=300.0, gt=0)
    """Seconds the launcher waits for a step's progress before giving up with an error."""
    seed: int = 0
    """Seeds the env workers' samplers."""


class RunFieldsConfig(BaseModel):
    """The run config's ``[fields]`` table: fields the run declares beyond the ones its model and sampler shape
    (``[[fields.declare]]``, one table per ``pipeline.field_decl.FieldDecl``; docs/fields.md)."""

    model_config = CONFIG

    declare: tuple[FieldDecl, ...] = Field(default=(), strict=False)
    """The run's own fields (``FieldsConfig.declare``)."""
    vocab_size: int | None = Field(default=None, ge=1)
    """Token ids must be below it (``FieldsConfig.vocab_size``); None checks ids >= 0 only."""


RUN_DEFAULTS: dict[str, dict[str, Any]] = {
    "orchestrator": {"seq_len": 256, "dp_world_size": 2, "groups_per_step": 8, "group_size": 8},
    "trainer": {"step_timeout_s": 300.0, "collective_timeout_s": 300.0}}
"""Where the run config's defaults differ from the component's own (docs/configuration.md): a section given
in part keeps these for the keys it does not set."""


class RunConfig(BaseModel):
    """Everything one run needs; each section is the config of one component.

    A section given as a mapping (a TOML table, ``config.json``) sets only its keys: the others keep the run's
    defaults (``RUN_DEFAULTS``, then the component's), and the trainer world (``job.trainer_world_size =
    orchestrator.dp_world_size x trainer.model_parallel_size``) is derived from whichever side is given
    (``_derive_sections``).
    """

    model_config = {**CONFIG, "validate_by_name": True, "serialize_by_alias": True}

    storage: StorageConfig = Field(default_factory=StorageConfig)  # built per config: a relative root resolves then
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sampling: SamplingConfig = SamplingConfig()
    orchestrator: OrchestratorConfig = OrchestratorConfig(**RUN_DEFAULTS["orchestrator"])
    trainer: TrainerConfig = TrainerConfig(**RUN_DEFAULTS["trainer"])
    job: JobConfig = JobConfig()
    declared: RunFieldsConfig = Field(default=RunFieldsConfig(), alias="fields")
    """``[fields]``: declared fields and the vocabulary size (``fields`` combines them with the model's)."""

    @model_validator(mode="before")
    @classmethod
    def _derive_sections(cls, data):
        """Partial sections never reset what the run's defaults or another section say: merge each given mapping
        over ``RUN_DEFAULTS``; derive ``orchestrator.dp_world_size`` from ``job.trainer_world_size`` when only the
        latter is given, and ``job.trainer_world_size`` from the DP and model-parallel sizes otherwise."""
        if not isinstance(data, dict):
            return data
        given: dict[str, Any] = {name: dict(data[name]) if isinstance(data.get(name), dict) else data.get(name)
                                 for name in ("orchestrator", "trainer", "job")}
        data = {**data, **{name: {**RUN_DEFAULTS[name], **given[name]} for name in RUN_DEFAULTS
                           if isinstance(given[name], dict)}}
        orchestrator, trainer, job = data.get("orchestrator", dict(RUN_DEFAULTS["orchestrator"])), \
            data.get("trainer"), given["job"] or {}
        if not isinstance(orchestrator, dict) or not isinstance(job, dict):
            return data  # given as objects: complete already
        mp = trainer.model_parallel_size if isinstance(trainer, TrainerConfig) else \
            (trainer or {}).get("model_parallel_size", 1)
        world, dp = job.get("trainer_world_size"), orchestrator.get("dp_world_size")
        if not all(isinstance(v, int) and v > 0 for v in (mp, dp, 1 if world is None else world)):
            return data  # the fields' own validation names the bad value
        if world is not None and "dp_world_size" not in (given["orchestrator"] or {}) and world % mp == 0:
            orchestrator = {**orchestrator, "dp_world_size": world // mp}
        elif world is None and dp is not None:  # (dp is an int > 0 here: checked above)
            job = {**job, "trainer_world_size": dp * mp}
        return {**data, "orchestrator": orchestrator, "job": job}

    @model_validator(mode="after")
    def _consistent(self) -> "RunConfig":
        mp = self.trainer.model_parallel_size
        if self.job.trainer_world_size != self.orchestrator.dp_world_size * mp:
            raise ConfigError(f"job.trainer_world_size={self.job.trainer_world_size}: expected orchestrator."
                              f"dp_world_size ({self.orchestrator.dp_world_size}) x trainer.model_parallel_size ({mp})")
        longest = self.task.max_letters + 6 + self.sampling.max_completion_tokens
        if longest > self.model.max_positions:
            raise ConfigError(f"model.max_positions={self.model.max_positions}: a prompt plus completion can take "
                              f"{longest} positions")
        if longest > self.orchestrator.seq_len:
            raise ConfigError(f"orchestrator.seq_len={self.orchestrator.seq_len}: expected >= {longest}, the longest "
                              "prompt plus completion of the task (shorter samples would be truncated or dropped)")
        if self.trainer.release == "after_checkpoint" and not self.job.checkpoint_every_steps:
            raise ConfigError('trainer.release="after_checkpoint" (the default) needs job.checkpoint_every_steps >= 1 '
                              "(with 0 no checkpoint is ever written, so no trained chunk would ever be deleted); "
                              'without checkpoints set trainer.release = "after_step"')
        if self.orchestrator.group_size < 2:
            raise ConfigError(f"orchestrator.group_size={self.orchestrator.group_size}: expected >= 2 (group-relative "
                              "advantages of a single sample are zero, so every group would be filtered)")
        return self

    @property
    def fields(self) -> FieldsConfig:
        """The side-channel fields the job carries, shaped by the model and the sampler; the policy loss needs
        routing and the top-k head of every trained sample (``required``); ``[fields]`` adds declared fields."""
        return FieldsConfig(num_layers=self.model.num_layers, top_k=self.model.top_k,
                            num_experts=self.model.num_experts, logprobs_k=self.sampling.logprobs_k,
                            support_width=self.sampling.support_width, vocab_size=self.declared.vocab_size,
                            declare=self.declared.declare, required=("routed_experts", "topk_ids", "topk_logprobs"))


def load_config(path: str | Path) -> RunConfig:
    """Read a TOML (or a resolved ``config.json``) run config.

    ``storage.run_id = "auto"`` is replaced by a fresh ``run-<UTC time>-<hex>`` id.

    Raises:
        ConfigError: the file is missing or unreadable, or a field is invalid (named in the message).
    """
    path = Path(path)
    try:
        text = path.read_text()
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config {path}: cannot read: {e}") from e
    storage = raw.setdefault("storage", {})
    if storage.get("run_id", "auto") == "auto":
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
        storage["run_id"] = f"run-{stamp}-{secrets.token_hex(2)}"
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(f"config {path}: {validation_problems(e)}") from e
