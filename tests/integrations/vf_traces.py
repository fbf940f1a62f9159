"""Multi-turn verifiers traces built offline through verifiers' own data model (no model server).

Each turn goes through ``graph.prepare_turn(...).commit(Response)`` exactly as verifiers'
train client commits an engine's ``generate`` result (``TurnTokens.model_construct``
with ``routed_experts`` as base64 + shape + start, and a ``SamplingMask``). The
``Engine`` stands in for the inference engine, deterministically:

- a position's routing row is a function of the token prefix up to it (a prefill routes
  a position the way the decode did), distinct experts within a (position, layer);
- the engine returns no row for a turn's final token (no forward pass follows it), so
  verifiers pads that node with a placeholder row, and the next turn's prefill
  (``start = path_len - 1``, as the train client's bridged turns request) repairs it;
- one sampling-mask row of 1-4 token ids per completion token.

Builds are deterministic: the same seed gives the same trace (node timestamps and the
trace's timing start are 0), so two builds can be streamed side by side.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Iterator

import numpy as np
from verifiers.v1.configs.agent import AgentConfig
from verifiers.v1.graph import prepare_turn
from verifiers.v1.task import TaskData
from verifiers.v1.trace import AgentInfo, Timing, Trace, TraceTask
from verifiers.v1.types import AssistantMessage, Message, Response, SamplingMask, TurnTokens, UserMessage

LAYERS, TOP_K, NUM_EXPERTS = 3, 2, 16


class Engine:
    """Deterministic token ids, routing rows, logprobs and sampling masks for one trace."""

    def __init__(self, seed: int, *, layers: int = LAYERS, top_k: int = TOP_K, num_experts: int = NUM_EXPERTS,
                 completion_scale: int = 1):
        self.rng = np.random.default_rng(seed)
        self.layers, self.top_k, self.num_experts = layers, top_k, num_experts
        self.completion_scale = completion_scale
        """Multiplies every turn's completion length (bigger traces for size measurements)."""

    def tokens(self, n: int) -> list[int]:
        return self.rng.integers(10, 50_000, n).tolist()

    def routing(self, ids: list[int], start: int, dtype: str = "uint8") -> np.ndarray:
        """[len(ids) - 1 - start, layers, top_k] rows of positions start .. len(ids) - 2.

        Row of position p: expert ``(crc32(ids[:p + 1]) + 5 * layer + k) % num_experts``,
        distinct within a (position, layer) while top_k <= num_experts.
        """
        prefix = np.asarray(ids, np.int32)
        h = np.array([zlib.crc32(prefix[: p + 1].tobytes()) for p in range(start, len(ids) - 1)], np.int64)
        layer = np.arange(self.layers, dtype=np.int64)[None, :, None] * 5
        k = np.arange(self.top_k, dtype=np.int64)[None, None, :]
        return ((h[:, None, None] + layer + k) % self.num_experts).astype(dtype)

    def sampling_mask(self, num_completion: int) -> SamplingMask:
        counts = self.rng.integers(1, 5, num_completion).astype(np.int32)
        return SamplingMask(ids=self.rng.integers(0, 50_000, int(counts.sum())).astype(np.int32), counts=counts)


def new_trace(trace_id: str, *, trainable: bool = True) -> Trace:
    """An empty trace of a trainable (or not) agent."""
    return Trace(id=trace_id, task=TraceTask(type="OfflineTask", data=TaskData(prompt="q")),
                 agent=AgentInfo(config=AgentConfig(), trainable=trainable), timing=Timing(start=0.0))


def commit_turn(trace: Trace, engine: Engine, prompt: list[Message], reply: str, num_completion: int,
                *, dtype: str = "uint8") -> AssistantMessage:
    """Commit one model turn on ``prompt``; return the assistant message (for later prompts)."""
    pending = prepare_turn(trace, prompt)
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    for nid in pending.prefix_node_ids:
        spans.append((len(ids), len(ids) + len(trace.nodes[nid].token_ids)))
        ids += trace.nodes[nid].token_ids
    for _ in pending.tail:
        new = engine.tokens(int(engine.rng.integers(3, 8)))
        spans.append((len(ids), len(ids) + len(new)))
        ids += new
    ids += engine.tokens(2)  # generation-prompt scaffold
    num_completion *= engine.completion_scale
    completion = engine.tokens(num_completion)
    start = max(pending.path_len - 1, 0)
    rows = engine.routing(ids + completion, start, dtype)
    message = AssistantMessage(content=reply)
    tokens = TurnTokens.model_construct(
        prompt_ids=ids, completion_ids=completion,
        completion_logprobs=(-engine.rng.random(num_completion)).tolist(), message_spans=spans,
        routed_experts={"data": base64.b64encode(rows.tobytes()), "shape": list(rows.shape), "start": start,
                        "dtype": dtype},
        sampling_mask=engine.sampling_mask(num_completion))
    pending.commit(Response(id=f"r{len(trace.nodes)}", created=0, model="m", message=message,
                            finish_reason="stop", tokens=tokens))
    for node in trace.nodes:
        node.timestamp = 0.0
    return message


def complete(trace: Trace, reward: float = 1.0) -> None:
    """End the trace as an agent run does (stopped, ok, completed) with one reward."""
    trace.record_reward("correct", reward)
    trace.stop("agent_completed")
    trace.ok = True


def multi_turn_steps(trace: Trace, engine: Engine) -> Iterator[None]:
    """Three turns (tool-result and user turns in between), then a fork from the first
    reply: two branches sharing a prefix; every later turn repairs a placeholder row.
    Yields after each turn."""
    u1, u2, u3, u2b = (UserMessage(content=c) for c in ("q1", "tool says 4", "and 5?", "try again"))
    a1 = commit_turn(trace, engine, [u1], "a1", 5)
    yield
    a2 = commit_turn(trace, engine, [u1, a1, u2], "a2", 4)
    yield
    commit_turn(trace, engine, [u1, a1, u2, a2, u3], "a3", 6)
    yield
    commit_turn(trace, engine, [u1, a1, u2b], "a4", 3)
    yield


def multi_turn(trace: Trace, engine: Engine) -> None:
    """All of ``multi_turn_steps``."""
    for _ in multi_turn_steps(trace, engine):
        pass


def inline_arrays(trace: Trace) -> dict[int, tuple[int, np.ndarray | None, SamplingMask | None]]:
    """leaf -> (P, routed_experts, sampling_mask) a trainer builds from the inline stream."""
    from refpipe.integrations.verifiers_branches import num_prompt_tokens, trainable_branches

    return {leaf: (num_prompt_tokens(b), b.routed_experts, b.sampling_mask) for leaf, b in trainable_branches(trace)}
