"""Turn an assembled micro batch (numpy) into torch tensors, without per-element Python.

Token ids and positions are widened to int64 (embedding and gather indices) with exactly
one numpy copy (``astype``); every other array is owned by the assembled micro batch and
wrapped with ``torch.from_numpy`` without a copy: the other streams (they keep their
step-file dtype), field arrays and ``cu_seqlens`` (routing stays uint8/uint16 as kept;
``row_ids`` is int64 already).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from refpipe.pipeline.step_header import MicroBatchRecord
from refpipe.trainer.assemble import AssembledMicroBatch

STREAM_TORCH_DTYPES: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int64),
    "loss_mask": np.dtype(np.bool_),
    "advantages": np.dtype(np.float32),
    "inference_logprobs": np.dtype(np.float32),
    "position_ids": np.dtype(np.int64),
    "temperatures": np.dtype(np.float32),
}
"""dtype each stream has as a tensor (the one copy widens int32 ids and positions to int64); an extra stream
(``StepHeader.extra_streams``) keeps its step-file dtype."""


@dataclass(frozen=True)
class FieldTensors:
    """One field as tensors; see ``trainer.assemble.FieldBatch`` for shapes."""

    values: torch.Tensor
    cu_seqlens: torch.Tensor
    counts: torch.Tensor | None
    padded: torch.Tensor | None
    row_ids: torch.Tensor | None


@dataclass(frozen=True)
class TrainMicroBatch:
    """What the train callback gets per micro batch: tensors in the layout of ``AssembledMicroBatch``."""

    record: MicroBatchRecord
    """The step file's record of this micro batch (DP rank, index, sequences, policy versions)."""
    streams: dict[str, torch.Tensor]
    """name -> [seq_len] tensor of ``STREAM_TORCH_DTYPES[name]`` (an extra stream: of its step-file dtype, 0 at
    padding tokens)."""
    cu_seqlens: torch.Tensor
    """int32 [S + 1] (or [S + 2] with padding)."""
    fields: dict[str, FieldTensors]
    dropped: bool
    """True: shapes only; its ``loss_mask`` is all False and it must not contribute to the loss."""


def _wrap(a: np.ndarray | None) -> torch.Tensor | None:
    return None if a is None else torch.from_numpy(a)


def to_torch(mb: AssembledMicroBatch) -> TrainMicroBatch:
    """Tensors of ``mb``: one widening copy of ids and positions, every other array shared with ``mb``."""
    streams = {name: torch.from_numpy(a.astype(STREAM_TORCH_DTYPES.get(name, a.dtype), copy=False))
               for name, a in mb.streams.items()}
    fields = {name: FieldTensors(torch.from_numpy(f.values), torch.from_numpy(f.cu_seqlens), _wrap(f.counts),
                                 _wrap(f.padded), _wrap(f.row_ids))
              for name, f in mb.fields.items()}
    return TrainMicroBatch(mb.record, streams, torch.from_numpy(mb.cu_seqlens), fields, mb.dropped)
