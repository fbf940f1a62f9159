"""Trainer config: rank topology, waits and collective timeouts.

Fetch concurrency is ``StorageConfig.max_concurrent_fetches`` (threads per rank) and
fetch retries are ``StorageConfig.max_retries``; they are not repeated here.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class TrainerConfig(BaseModel):
    """How trainer ranks are laid out and how long they wait for step files and peers."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model_parallel_size: int = Field(default=1, ge=1)
    """Ranks per DP rank (tensor x pipeline x context parallel). ``world_size`` must be a multiple;
    ``dp_rank = rank // model_parallel_size``, ``mp_rank = rank % model_parallel_size``."""
    step_timeout_s: float = Field(default=1800.0, gt=0)
    """Seconds a rank waits for a step file to appear before raising ``StepFileError``."""
    step_poll_s: float = Field(default=0.5, gt=0)
    """Seconds between looks for a step file that has not appeared yet."""
    collective_timeout_s: float = Field(default=600.0, gt=0)
    """Timeout of every collective of the trainer's process group (``init_process_group(timeout=...)``):
    a rank whose peer died or hangs raises after this many seconds instead of waiting forever."""
