"""Trainer config: rank topology, waits, collective timeouts, and what release does with a trained step.

Fetch and release concurrency are ``StorageConfig.max_concurrent_fetches`` and ``max_concurrent_deletes``
(threads per rank) and fetch retries are ``StorageConfig.max_retries``; they are not repeated here.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, field_validator

from refpipe.storage.config import CONFIG


class TrainerConfig(BaseModel):
    """How trainer ranks are laid out and how long they wait for step files and peers."""

    model_config = CONFIG

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
    prefetch_next_step: bool = True
    """Fetch and assemble step N+1 on a background thread while step N trains (a rank then holds up to
    two steps of its arrays in host memory); false: fetch each step when it starts."""
    release: Literal["after_step", "after_checkpoint"] = "after_checkpoint"
    """When a DP rank deletes a trained step's chunks: once a checkpoint covering the step is durable
    (``after_checkpoint``, the default: every step after the last checkpoint is replayed byte for byte after a
    crash, nothing sampled is lost; the cost: up to a checkpoint interval of steps' chunks stay on storage, and a
    loop that never calls ``TrainerRank.checkpointed`` never deletes them), or right after the step
    (``after_step``: less storage, but a resume skips every step after the last checkpoint). docs/release.md."""
    retain_steps: list[int] | int = Field(default_factory=list)
    """Steps whose chunks are kept after training for offline inspection (``refpipe show``/``verify``):
    a list of step numbers, or N for every step that is a multiple of N. Their release hands the chunks
    to the ``retained`` holder instead of deleting; ``refpipe sweep --retained`` deletes them."""

    def retains(self, step: int) -> bool:
        """Whether ``retain_steps`` keeps step ``step``'s chunks."""
        if isinstance(self.retain_steps, int):
            return step % self.retain_steps == 0
        return step in self.retain_steps

    @field_validator("retain_steps")
    @classmethod
    def _retain_steps(cls, v: list[int] | int) -> list[int] | int:
        if isinstance(v, int) and v < 1:
            raise ValueError(f"retain_steps={v}: expected a list of steps or every N-th step with N >= 1")
        if isinstance(v, list) and any(s < 0 for s in v):
            raise ValueError(f"retain_steps={v}: expected steps >= 0")
        return v
