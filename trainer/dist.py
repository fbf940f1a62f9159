"""Trainer topology and the trainer's collectives (torch.distributed; gloo on CPU).

Topology: ``world_size = dp_world_size * model_parallel_size``;
``dp_rank = rank // model_parallel_size`` and ``mp_rank = rank % model_parallel_size``, so
the ``model_parallel_size`` consecutive ranks of one DP rank (its tensor/pipeline/context
parallel peers) consume the same micro batches, and the peer with ``mp_rank == 0`` deletes
their chunks.

The data path's collectives (per step: the failure all-reduce, then one metrics all-gather of a fixed-size
byte row per rank carrying counters and replay hashes, ``gather_rank_rows``) run on their own
gloo process group over the whole world (``new_data_group``), whatever the default group is: a
trainer whose default group is NCCL on GPUs calls them with the CPU tensors they use, and they never
interleave with the model's collectives. Its timeout is ``TrainerConfig.collective_timeout_s``: a rank
whose peer died or hangs raises instead of waiting forever.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from refpipe.storage.errors import ConfigError
from refpipe.trainer.config import TrainerConfig


@dataclass(frozen=True)
class Topology:
    """Where one rank sits: ``dp_rank = rank // model_parallel_size``, ``mp_rank = rank % model_parallel_size``."""

    rank: int
    world_size: int
    model_parallel_size: int

    def __post_init__(self) -> None:
        if self.world_size % self.model_parallel_size or not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} of world_size {self.world_size}: expected a rank in the world and "
                              f"world_size a multiple of model_parallel_size={self.model_parallel_size}")

    @property
    def dp_rank(self) -> int:
        """Data-parallel rank: which share of each step's micro batches this rank trains."""
        return self.rank // self.model_parallel_size

    @property
    def mp_rank(self) -> int:
        """Position among the DP rank's model-parallel peers; 0 deletes the DP rank's chunks."""
        return self.rank % self.model_parallel_size

    @property
    def dp_world_size(self) -> int:
        """Data-parallel ranks: ``world_size // model_parallel_size``."""
        return self.world_size // self.model_parallel_size

    @classmethod
    def current(cls, config: TrainerConfig) -> "Topology":
        """This process's topology in the initialised default process group."""
        return cls(dist.get_rank(), dist.get_world_size(), config.model_parallel_size)


def init_process_group(config: TrainerConfig, *, rank: int, world_size: int, init_method: str = "env://") -> Topology:
    """Join the trainer's gloo process group with ``config.collective_timeout_s`` on every collective.

    Every rank calls this once, before ``TrainerRank``. Under torchrun the defaults read
    ``MASTER_ADDR``/``MASTER_PORT``; tests pass ``init_method="tcp://127.0.0.1:<port>"``.

    Raises:
        ConfigError: ``world_size`` is not a multiple of ``config.model_parallel_size``.
    """
    topology = Topology(rank, world_size, config.model_parallel_size)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=config.collective_timeout_s))
    return topology


_GLOO_TRANSPORT = re.compile(r"gloo/transport/\S*:\d+\]\s*")
"""Where gloo's TCP transport names itself in an error: ``[<source path>/gloo/transport/tcp/pair.cc:553] ``."""


def peer_failure(error: BaseException) -> str | None:
    """How a collective failed, in one line, if it failed because a peer rank died or hangs; else None.

    Gloo reports a dead peer as a ``RuntimeError`` of its TCP transport (torch 2.13: ``[.../gloo/transport/tcp/
    pair.cc:553] Connection closed by peer [127.0.0.1]:58584. This is typically caused by a remote worker
    crashing. ...``), a hung one after ``collective_timeout_s`` as ``[.../unbound_buffer.cc:81] Timed out waiting
    600000ms for recv operation to complete``; torch raises ``DistNetworkError`` or ``DistStoreError`` once the
    rendezvous store's host is gone.

    Returns:
        The transport's message without its source location and advice (``Connection closed by peer
        [127.0.0.1]:58584``), the first line of a store or network error, or None for any other error.
    """
    lines = str(error).strip().splitlines()
    first = lines[0] if lines else type(error).__name__
    if match := _GLOO_TRANSPORT.search(first):
        return first[match.end():].split(". This is typically")[0].rstrip(". ")
    if isinstance(error, (dist.DistNetworkError, dist.DistStoreError)):
        return first
    return None


def new_data_group(config: TrainerConfig) -> dist.ProcessGroup:
    """A gloo process group over every rank of the default world, for the data path's collectives.

    Collective: every rank calls it once, after the default group is initialised (any backend) and in
    the same order as its other ``new_group`` calls (``TrainerRank`` does, at construction).
    """
    group: dist.ProcessGroup = dist.new_group(backend="gloo", timeout=timedelta(seconds=config.collective_timeout_s))
    return group


def agree_failures(failed: set[int], topology: Topology, micro_batches_per_dp_rank: int,
                   group: dist.ProcessGroup) -> np.ndarray:
    """All-reduce (MAX) of failure flags over ``group`` (the data group): which micro batches are dropped everywhere.

    Every rank contributes a flag vector of length ``dp_world_size * micro_batches_per_dp_rank``
    (entry ``dp_rank * micro_batches_per_dp_rank + index``), set only at its own DP rank's
    failed indices; a micro batch is dropped when any rank failed it, so all its peers agree.

    Returns:
        bool [dp_world_size, micro_batches_per_dp_rank], identical on every rank.
    """
    flags = torch.zeros(topology.dp_world_size * micro_batches_per_dp_rank, dtype=torch.int32)
    base = topology.dp_rank * micro_batches_per_dp_rank
    for index in failed:
        flags[base + index] = 1
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags.numpy().astype(bool).reshape(topology.dp_world_size, micro_batches_per_dp_rank)


def gather_rank_values(values: np.ndarray, group: dist.ProcessGroup) -> np.ndarray:
    """All-gather over ``group`` (the data group) of one float64 vector per rank: [world_size, len(values)] float64."""
    local = torch.from_numpy(np.ascontiguousarray(values, np.float64))
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return torch.stack(gathered).numpy()


def gather_rank_rows(row: np.ndarray, group: dist.ProcessGroup) -> np.ndarray:
    """All-gather over ``group`` (the data group) of one uint8 row per rank, one collective.

    Args:
        row: uint8 [n], ``n`` the same on every rank (callers pack float64 counters viewed as bytes and
            fixed-size digests into it: no pickled objects, no size exchange first).

    Returns:
        uint8 [world_size, n]: row ``r`` is rank ``r``'s.
    """
    local = torch.from_numpy(np.ascontiguousarray(row, np.uint8))
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    return torch.stack(gathered).numpy()
