"""verl by reference: a ``DataProto`` carries one small payload per sample instead of its side-channel tensors.

verl 0.9.1's agent loop carries MoE routing inline: ``AgentLoopWorker._agent_loop_postprocess``
(``verl/experimental/agent_loop/agent_loop.py``) builds, per sample, a dense int16
``routed_experts [1, prompt_length + response_length, num_layers, top_k]``: zeros, with the engine's
rows copied to ``[prompt_length - P, prompt_length - P + R)`` (the prompt is left-padded to
``prompt_length``, the response right-padded to ``response_length``; R <= P + C rows as the engine
returned them), and ``_postprocess`` concatenates them into ``DataProto.batch["routed_experts"]``,
which Ray ships from the agent-loop workers through the driver to every actor worker.

Here the side channels take refpipe's path instead, at three points:

1. agent-loop worker, per sample, before verl post-processes it: ``keep_output`` keeps
   ``routed_experts`` (and any other declared field) through the worker's ``Keeper`` and puts a
   ``RolloutPayload`` into ``output.extra_fields[PAYLOAD_KEY]``; verl's own ``_postprocess`` then
   carries it in ``DataProto.non_tensor_batch[PAYLOAD_KEY]`` (one object per sample, kept aligned by
   every ``DataProto`` reorder, split and concat);
2. actor worker, before a pass that replays routing (log probs, update): ``materialize`` fetches
   each sample's chunk and puts into ``data.batch`` exactly the tensor the inline path builds;
3. the process holding the whole batch (verl's driver), once the actor update returned:
   ``release`` deletes every sample's chunk exactly once through its ledger.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from refpipe.pipeline.fields import FIELDS, FieldsConfig, as_numpy, spread_expert_rows
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.pipeline.slices import PayloadSlice
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.concurrency import bounded_map
from refpipe.storage.delete_result import DeleteResult
from refpipe.storage.errors import FieldError
from refpipe.storage.ledger import Ledger
from refpipe.storage.store import Store

if TYPE_CHECKING:
    from verl import DataProto

PAYLOAD_KEY = "refpipe_payload"
"""Key of the payloads in ``AgentLoopOutput.extra_fields`` and ``DataProto.non_tensor_batch``."""
ROUTING = "routed_experts"
"""The field verl replays (router replay), and its key in ``DataProto.batch``."""


@dataclass(frozen=True)
class RolloutPayload:
    """What one sample of a verl batch carries instead of its side channels (picklable, a few hundred bytes).

    A dataclass, not a tuple: numpy stores it as one object per sample in ``non_tensor_batch``.

    Attributes:
        slice: the kept chunk and its tokens ``[0, P + C)`` (P prompt, C response tokens).
        num_routed_rows: R, the ``routed_experts`` rows the engine returned (0: none kept); verl's
            inline tensor is zero past them, so ``materialize`` copies exactly these.
    """

    slice: PayloadSlice
    num_routed_rows: int


def keep_output(keeper: Keeper, output: Any, *, fields: Mapping[str, np.ndarray] | None = None,
                branch_id: str | None = None) -> RolloutPayload:
    """Agent-loop worker: keep one ``AgentLoopOutput``'s side channels and leave a payload in their place.

    Call it in the agent loop (after the engine returned, before verl post-processes the output),
    in the worker process that owns ``keeper``. Sets ``output.routed_experts = None`` (verl then
    builds no routing tensor) and ``output.extra_fields[PAYLOAD_KEY]`` to the returned payload.

    Args:
        keeper: this worker's keeper; its ``FieldsConfig`` declares every field kept.
        output: verl's ``AgentLoopOutput``: ``prompt_ids`` [P] and ``response_ids`` [C] token ids,
            ``routed_experts`` [R, num_layers, top_k] integer expert ids (numpy or torch, any integer
            dtype, R <= P + C) or None.
        fields: other declared fields of this sample by name (``pipeline.fields.FIELDS``), e.g.
            ``topk_ids`` [C, k] int32.
        branch_id: the chunk's id, unique in the run (None: drawn at random).

    Raises:
        FieldError: routing rows not [R, num_layers, top_k], more than P + C of them, or any array breaking
            its field's rules, e.g. an expert id outside ``[0, num_experts)`` (nothing is kept, ``output`` is
            unchanged).
    """
    num_prompt, num_response = len(output.prompt_ids), len(output.response_ids)
    arrays = dict(fields or {})
    num_rows = 0
    if output.routed_experts is not None:
        rows = _routing_rows(output.routed_experts, num_prompt + num_response)
        num_rows = len(rows)
        arrays[ROUTING] = _pad_routing(rows, num_prompt + num_response, keeper.fields)
    ref = keeper.keep(Branch(num_prompt, num_response, arrays, branch_id))
    payload = RolloutPayload(PayloadSlice(ref, ref.num_tokens), num_rows)
    output.routed_experts = None
    output.extra_fields[PAYLOAD_KEY] = payload
    return payload


def _routing_rows(rows: Any, num_tokens: int) -> np.ndarray:
    """The engine's [R, num_layers, top_k] rows as numpy (a CPU tensor without a copy); keep checks their
    dtype and expert ids and stores them as uint8/uint16."""
    a = as_numpy(rows, f"field {ROUTING!r}")
    if a.ndim != 3 or not 1 <= len(a) <= num_tokens:
        raise FieldError(f"{ROUTING}: {a.dtype} {list(a.shape)}: expected rows [R, num_layers, top_k] "
                         f"with 1 <= R <= {num_tokens} (prompt + response tokens)")
    return a


def _pad_routing(rows: np.ndarray, num_tokens: int, cfg: FieldsConfig) -> np.ndarray:
    """``rows`` followed by the padding rule's rows up to the count keep expects (P + C, or P + C - 1 with
    ``routing_rows='all_but_last'``); the padding rows are never materialised (verl zero-fills them)."""
    wanted = num_tokens - (cfg.routing_rows == "all_but_last")
    if len(rows) >= wanted:
        return rows
    if cfg.num_experts is None:
        raise FieldError(f"{ROUTING}: the engine returned {len(rows)} routing rows but this run carries no routing: "
                         f"expected FieldsConfig num_layers, top_k and num_experts set to keep them")
    pad = spread_expert_rows(wanted, rows.shape[1], rows.shape[2], cfg.num_experts, rows.dtype)
    return np.concatenate([rows, pad[len(rows):]])


def payloads_of(data: DataProto) -> list[RolloutPayload]:
    """The batch's payloads in sample order (``data.non_tensor_batch[PAYLOAD_KEY]``).

    Raises:
        FieldError: the batch carries none, or an entry is not a ``RolloutPayload``.
    """
    found = data.non_tensor_batch.get(PAYLOAD_KEY)
    if found is None:
        raise FieldError(f"DataProto of {len(data)} samples has no non_tensor_batch[{PAYLOAD_KEY!r}]: expected the "
                         "payloads keep_output left in each AgentLoopOutput")
    bad = [i for i, p in enumerate(found) if not isinstance(p, RolloutPayload)]
    if bad:
        raise FieldError(f"non_tensor_batch[{PAYLOAD_KEY!r}][{bad[0]}] is {type(found[bad[0]]).__name__}: "
                         "expected a RolloutPayload")
    return list(found)


def materialize(data: DataProto, store: Store, *, names: Sequence[str] = (ROUTING,),
                max_concurrency: int = 8) -> DataProto:
    """Actor worker: fetch the batch's chunks and add the named fields to ``data.batch`` as verl lays them out.

    Call it in each actor worker on the ``DataProto`` it received (any share, order or concat of
    agent-loop batches), before the pass that needs the fields; it reads, never deletes.
    ``B`` samples, ``W_p`` = ``batch["prompts"].shape[1]``, ``W_r`` = ``batch["responses"].shape[1]``:

    - ``routed_experts`` -> [B, W_p + W_r, num_layers, top_k] int16: zeros, sample i's R_i engine rows at
      ``[W_p - P_i, W_p - P_i + R_i)``, byte for byte the tensor verl 0.9.1's agent loop builds inline;
    - a completion-domain field (``topk_ids``, ...) -> [B, W_r, *trailing] in its stored dtype: rows
      ``[0, C_i)`` aligned with ``batch["responses"]``, zeros after (as verl pads ``rollout_log_probs``).

    Returns:
        ``data`` itself, with the tensors set in ``data.batch``.

    Raises:
        FieldError: no payloads; a sample's P_i / C_i disagree with its ``attention_mask`` (its prompt and
            response pads); a field not kept, ragged, or of another trailing shape in some sample.
        ChunkNotFoundError, ChunkCorruptError: a chunk missing or damaged (never zeros).
    """
    payloads = payloads_of(data)
    width_p, width_r = data.batch["prompts"].shape[1], data.batch["responses"].shape[1]
    _check_alignment(payloads, data.batch["attention_mask"], width_p)
    fetched = bounded_map(lambda p: fetch_arrays(store, p.slice.ref, p.slice.num_tokens), payloads, max_concurrency)
    for name in names:
        data.batch[name] = _dense(name, payloads, fetched, width_p, width_r)
    return data


def _check_alignment(payloads: list[RolloutPayload], attention_mask: torch.Tensor, width_p: int) -> None:
    """Each sample's kept P and C are the tokens its attention mask marks in the prompt and response parts."""
    if len(payloads) != len(attention_mask):
        raise FieldError(f"{len(payloads)} payloads for a batch of {len(attention_mask)} samples: expected one each")
    kept = torch.tensor([(p.slice.ref.num_prompt_tokens, p.slice.num_tokens - p.slice.ref.num_prompt_tokens)
                         for p in payloads], dtype=torch.int64).reshape(-1, 2)
    masked = torch.stack([attention_mask[:, :width_p].sum(1), attention_mask[:, width_p:].sum(1)], 1).to(torch.int64)
    bad = (kept != masked).any(1).nonzero().flatten().tolist()
    if bad:
        i = bad[0]
        raise FieldError(f"sample {i} (branch {payloads[i].slice.ref.branch_id}): kept prompt/response tokens "
                         f"{kept[i].tolist()}, attention_mask marks {masked[i].tolist()}: expected equal")


def _dense(name: str, payloads: list[RolloutPayload], fetched: list[dict[str, np.ndarray]],
           width_p: int, width_r: int) -> torch.Tensor:
    fdef = FIELDS.get(name)
    if fdef is None or fdef.ragged:
        dense = sorted(n for n, f in FIELDS.items() if not f.ragged)
        raise FieldError(f"field {name!r}: expected a dense field, one of {dense}")
    missing = [p.slice.ref.branch_id for p, arrays in zip(payloads, fetched) if name not in arrays]
    if missing or (name == ROUTING and any(p.num_routed_rows == 0 for p in payloads)):
        raise FieldError(f"field {name!r}: not kept for branch {(missing or ['(no routed rows)'])[0]}")
    trailing = {arrays[name].shape[1:] for arrays in fetched}
    if len(trailing) != 1:
        raise FieldError(f"field {name!r}: trailing shapes {sorted(trailing)}: expected one for the whole batch")
    if name == ROUTING:
        out = torch.zeros((len(payloads), width_p + width_r, *trailing.pop()), dtype=torch.int16)
        for i, (p, arrays) in enumerate(zip(payloads, fetched)):
            start = width_p - p.slice.ref.num_prompt_tokens
            rows = arrays[name][:p.num_routed_rows].astype(np.int16)  # wraps as verl's .to(torch.int16)
            out[i, start:start + p.num_routed_rows] = torch.from_numpy(rows)
        return out
    dtype = torch.from_numpy(np.zeros(0, fetched[0][name].dtype)).dtype
    out = torch.zeros((len(payloads), width_r, *trailing.pop()), dtype=dtype)
    for i, arrays in enumerate(fetched):
        out[i, :len(arrays[name])] = torch.from_numpy(np.ascontiguousarray(arrays[name]))
    return out


def release(ledger: Ledger, data: DataProto, *, reason: str = "trained by the verl actor update") -> DeleteResult:
    """The process holding the whole batch (verl's driver), once the actor update returned: delete every
    sample's chunk exactly once.

    Also the way to drop samples verl filters out before training (pass that sub-batch and a reason).

    Returns:
        The ledger's ``DeleteResult`` (``deleted`` has one URI per sample).

    Raises:
        FieldError: the batch carries no payloads (nothing deleted).
        DoubleDeleteError: some chunks were already deleted (a second release); the others are deleted.
    """
    return ledger.delete([p.slice.ref for p in payloads_of(data)], reason=reason)
