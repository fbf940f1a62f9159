"""verl's DataProto with MoE routing by reference, checked against verl's own inline path.

Builds one batch of engine outputs (prompt and response token ids, ``routed_experts`` rows as vLLM
returns them: P + C - 1 per sample, fewer where a multi-turn loop stopped recording) and turns it into
a ``DataProto`` twice through verl 0.9.1's own agent-loop post-processing
(``AgentLoopWorker._agent_loop_postprocess`` then ``_postprocess``):

- inline, as verl does today: ``batch["routed_experts"]`` [B, prompt_length + response_length,
  num_layers, top_k] int16;
- by reference: ``refpipe.integrations.verl.keep_output`` keeps the rows first, so the batch carries one
  ``RolloutPayload`` per sample in ``non_tensor_batch`` instead.

Then it ships the by-reference batch as Ray does (pickle), materialises ``routed_experts`` on the
"actor" side, compares it with the inline tensor, releases the chunks once and audits the run.
Prints one JSON line: verl's version, whether the tensors are byte-identical, the pickled
``DataProto`` bytes by reference / inline (the whole batch: verl's own int64 token tensors stay
inline), the audit's verdict, and ``routing_bytes_ratio``: the pickled payloads / the pickled inline
``routed_experts`` tensor alone.

    python examples/verl_dataproto.py           # 64 samples x 4,096 tokens x 48 layers x top-8
    python examples/verl_dataproto.py --smoke   # a small shape (the test suite runs this)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pickle
import tempfile
import types
from typing import NamedTuple

import numpy as np
import torch
import verl
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker

from refpipe.integrations.verl import PAYLOAD_KEY, keep_output, materialize, release
from refpipe.pipeline.audit import audit
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.keep import Keeper
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.ledger import Ledger


class Shape(NamedTuple):
    """A batch's shape: samples, padded widths (tokens), MoE layers, experts per token, experts per layer."""

    samples: int
    prompt_length: int
    response_length: int
    num_layers: int
    top_k: int
    num_experts: int


FULL = Shape(64, 1024, 3072, 48, 8, 128)  # Qwen3-30B-A3B's routing: 48 layers, top-8 of 128 experts
SMOKE = Shape(8, 16, 48, 3, 2, 8)


def verl_worker(shape: Shape) -> AgentLoopWorker:
    """verl's ``AgentLoopWorker`` with just what its post-processing reads for a text-only batch with no
    reward workers and no teacher: a tokenizer (for ``pad``; built here, no hub), no processor, the widths."""
    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    vocab = Tokenizer(models.WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>"))
    worker.tokenizer = PreTrainedTokenizerFast(tokenizer_object=vocab, pad_token="<pad>")
    worker.processor, worker.mm_processor_kwargs = None, None
    worker.reward_loop_worker_handles, worker.distillation_enabled = None, False
    worker.rollout_config = types.SimpleNamespace(prompt_length=shape.prompt_length,
                                                  response_length=shape.response_length)
    return worker


def engine_outputs(shape: Shape, seed: int = 0) -> list[AgentLoopOutput]:
    """One ``AgentLoopOutput`` per sample: P in [prompt_length / 2, prompt_length], C in [1, response_length],
    ``routed_experts`` [R, num_layers, top_k] int32 distinct ids, R = P + C - 1 (every 4th sample: P + C // 2)."""
    rng = np.random.default_rng(seed)
    outputs = []
    for i in range(shape.samples):
        num_prompt = int(rng.integers(shape.prompt_length // 2, shape.prompt_length + 1))
        num_response = int(rng.integers(1, shape.response_length + 1))
        num_rows = num_prompt + (num_response // 2 if i % 4 == 3 else num_response - 1)
        first = rng.integers(0, shape.num_experts, (num_rows, shape.num_layers, 1), dtype=np.int32)
        outputs.append(AgentLoopOutput(
            prompt_ids=rng.integers(2, 50_000, num_prompt).tolist(),
            response_ids=rng.integers(2, 50_000, num_response).tolist(),
            response_mask=[1] * num_response, response_logprobs=(-rng.exponential(1.0, num_response)).tolist(),
            routed_experts=(first + np.arange(shape.top_k, dtype=np.int32)) % shape.num_experts,
            metrics=AgentLoopMetrics()))
    return outputs


def to_dataproto(worker: AgentLoopWorker, outputs: list[AgentLoopOutput]) -> verl.DataProto:
    """verl's own path from agent-loop outputs to the batch its workers return."""
    async def postprocess_all():
        return [await worker._agent_loop_postprocess(o, validate=False, raw_prompt=[]) for o in outputs]

    return worker._postprocess(asyncio.run(postprocess_all()))


def main(shape: Shape) -> dict:
    worker = verl_worker(shape)
    inline_dp = to_dataproto(worker, engine_outputs(shape))
    inline_bytes = len(pickle.dumps(inline_dp, protocol=5))
    inline = inline_dp.batch["routed_experts"]
    inline_routing_bytes = len(pickle.dumps(inline, protocol=5))
    del inline_dp
    with tempfile.TemporaryDirectory() as root:
        storage = StorageConfig(root=root, run_id="verl_example")
        store = open_store(storage)
        fields = FieldsConfig(num_layers=shape.num_layers, top_k=shape.top_k, num_experts=shape.num_experts)
        keeper = Keeper(store, Ledger(store, "agent_loop_worker_0"), fields, storage)
        outputs = engine_outputs(shape)
        for o in outputs:  # agent-loop worker: keep the rows, leave a payload in the output
            keep_output(keeper, o)
        by_ref = to_dataproto(worker, outputs)
        payload_bytes = len(pickle.dumps(by_ref.non_tensor_batch[PAYLOAD_KEY], protocol=5))
        shipped = pickle.dumps(by_ref, protocol=5)  # agent-loop worker -> driver -> actor worker, as Ray ships it
        actor_dp = materialize(pickle.loads(shipped), store)  # actor worker
        routed = actor_dp.batch["routed_experts"]
        identical = routed.dtype == inline.dtype and routed.shape == inline.shape and torch.equal(routed, inline)
        driver = Ledger(store, "verl_driver")
        release(driver, actor_dp)  # driver, after the actor update
        driver.close()
        keeper.ledger.close()
        clean = audit(store, finished=True).clean
    return {"verl_version": verl.__version__, "byte_identical_to_inline": identical,
            "dataproto_bytes_ratio": round(len(shipped) / inline_bytes, 6), "audit_clean": clean,
            "inline_bytes": inline_bytes, "by_reference_bytes": len(shipped),
            "routing_bytes_ratio": round(payload_bytes / inline_routing_bytes, 6), "shape": shape._asdict()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help=f"small shape {tuple(SMOKE)} instead of {tuple(FULL)}")
    print(json.dumps(main(SMOKE if parser.parse_args().smoke else FULL)))
