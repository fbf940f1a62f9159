"""A step published with extra per-token streams (``publish_step(extra_streams=...)``) reaches the trainer's
tensors: each in its own dtype, its real tokens as published, 0 at padding tokens."""

from __future__ import annotations

import numpy as np
import torch

from refpipe.pipeline.publish import PackedSequence, StepMicroBatch, publish_step
from refpipe.pipeline.slices import PayloadSlice
from refpipe.pipeline.step_file import StepFile
from refpipe.storage.backends import open_store
from refpipe.storage.ledger import Ledger
from refpipe.trainer.fetch import fetch_own
from refpipe.trainer.tensors import to_torch
from tests.trainer.trainer_helpers import FIELDS, keep_all, make_branch


def test_extra_streams_are_padded_with_zero_and_keep_their_dtype(local_config):
    store = open_store(local_config)
    rng = np.random.default_rng(2)
    ref = keep_all(store, local_config, {"x": make_branch(rng, 3, 4, "x")})["x"]
    streams = {"input_ids": np.arange(7, dtype=np.int32), "loss_mask": np.arange(7) >= 3,
               "advantages": np.full(7, 0.5, np.float32), "inference_logprobs": np.zeros(7, np.float32),
               "position_ids": np.arange(7, dtype=np.int32), "temperatures": np.ones(7, np.float32),
               "values": np.linspace(-1, 1, 7).astype(np.float32), "turn": np.array([0, 0, 0, 1, 1, 2, 2], np.int64)}
    ledger = Ledger(store, "my_orchestrator")
    publish_step(store, ledger, 0, [[StepMicroBatch([PackedSequence(7, "env", PayloadSlice(ref, 7))], streams)]],
                 seq_len=10, fields=FIELDS, extra_streams={"values": "<f4", "turn": "<i8"})
    ledger.close()
    fetched = fetch_own(store, StepFile.read(store, 0), 0, FIELDS, max_concurrency=2)
    got = to_torch(fetched.assembled[0]).streams
    assert sorted(got) == ["advantages", "inference_logprobs", "input_ids", "loss_mask", "position_ids",
                           "temperatures", "turn", "values"]
    assert got["values"].dtype == torch.float32 and got["turn"].dtype == torch.int64
    assert got["values"].tolist() == [*streams["values"].tolist(), 0.0, 0.0, 0.0]
    assert got["turn"].tolist() == [0, 0, 0, 1, 1, 2, 2, 0, 0, 0]
    assert got["input_ids"].dtype == torch.int64 and got["position_ids"].tolist() == [*range(7), 0, 1, 2]
