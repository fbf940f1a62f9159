"""Episodes in, training samples out: the orchestrator's typed data.

An env server returns an ``Episode`` per rollout: token ids, inference logprobs and,
for each branch with side channels, the ``PayloadRef`` that ``Keeper.keep`` returned
(never the arrays). The orchestrator turns each trainable branch into a ``Sample``:
the six typed per-token streams of a step file (``step_header.STREAMS``) plus an
optional ``PayloadSlice`` (the ref and how many of its tokens are kept after
truncation). Every stream is built with vectorised numpy; Python loops run per
sample or per branch, never per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from refpipe.pipeline.slices import PayloadSlice, check_in_run
from refpipe.pipeline.step_header import STREAMS, has_token_rows
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import EpisodeError, PackingError
from refpipe.storage.uri import RunPrefix

MAX_ABS_REWARD = float(np.finfo(np.float32).max)
"""Largest |reward| an episode may carry (about 3.4e38): a group's reward sums, means and squares then stay finite in
float64, so no estimator overflows to NaN on finite rewards."""


@dataclass(frozen=True, eq=False)
class BranchResult:
    """One branch of an episode, as the env server returns it.

    Attributes:
        prompt_ids: [P] int32 prompt token ids.
        completion_ids: [C] int32 completion token ids, C >= 1.
        inference_logprobs: [C] float32 logprob of each completion token under the sampling policy.
        temperature: sampling temperature (finite in float32, > 0), the same for every token of the branch.
        policy_version: trainer step whose weights generated the completion (>= 0).
        ref: the branch's kept side channels (``Keeper.keep``), or None when it carries none.
        trainable: False for branches that are never trained; their chunks are deleted on arrival.
        completion_mask: [C] bool, True on the completion tokens the policy sampled (trained on);
            multi-turn branches mark tool and user tokens False. None: every completion token.
        advantages: [C] float32 the caller's own advantage of each completion token (GAE, a value model, ...),
            used by the ``advantages.from_episode`` estimator; None: the orchestrator's estimator computes them.
    """

    prompt_ids: np.ndarray
    completion_ids: np.ndarray
    inference_logprobs: np.ndarray
    temperature: float
    policy_version: int
    ref: PayloadRef | None = None
    trainable: bool = True
    completion_mask: np.ndarray | None = None
    advantages: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        """Prompt + completion tokens."""
        return len(self.prompt_ids) + len(self.completion_ids)


@dataclass(frozen=True, eq=False)
class Episode:
    """One rollout of an environment: one or more branches and their reward(s).

    Attributes:
        episode_id: unique within the run.
        group_id: the group whose members share an advantage baseline.
        env_name: environment that produced the episode.
        reward: one reward for the whole episode, or one per branch (in branch order).
        branches: at least one branch.
        is_eval: an evaluation episode; never trained (its chunks are deleted on arrival).
    """

    episode_id: str
    group_id: str
    env_name: str
    reward: float | Sequence[float]
    branches: Sequence[BranchResult]
    is_eval: bool = False

    def branch_rewards(self) -> np.ndarray:
        """[num_branches] float64 reward of each branch (an episode reward is broadcast)."""
        return np.broadcast_to(np.asarray(self.reward, np.float64), (len(self.branches),))

    def refs(self) -> list[PayloadRef]:
        """Every ref the episode carries, trainable or not, in branch order."""
        return [b.ref for b in self.branches if b.ref is not None]


@dataclass(frozen=True, eq=False)
class Sample:
    """One training sequence of ``L`` tokens, built from one branch (or a padding dummy).

    Attributes:
        input_ids: [L] int32 prompt then completion token ids.
        loss_mask: [L] bool, True on completion tokens.
        advantages: [L] float32, the branch's advantage on completion tokens, 0 on prompt tokens.
        inference_logprobs: [L] float32, 0 on prompt tokens.
        position_ids: [L] int32, 0..L-1.
        temperatures: [L] float32 sampling temperature per token.
        env_name: environment of the sample (one per sequence).
        payload: the kept side channels (``payload.num_tokens == L``), or None.
        policy_version: trainer step whose weights generated the completion.
        reward: the branch's reward.
        episode_id: the episode it came from (names it in errors and ledger reasons).

    Raises:
        PackingError: (on construction) a stream's dtype or shape is not [L] of ``STREAMS``,
            or the payload keeps a different number of tokens than L.
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    advantages: np.ndarray
    inference_logprobs: np.ndarray
    position_ids: np.ndarray
    temperatures: np.ndarray
    env_name: str
    payload: PayloadSlice | None
    policy_version: int
    reward: float
    episode_id: str

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        for name, dtype in STREAMS.items():
            a = getattr(self, name)
            if a.dtype.str != dtype or a.shape != (n,):
                raise PackingError(f"sample of episode {self.episode_id}: stream {name} is {a.dtype.str} "
                                   f"{list(a.shape)}: expected {dtype} [{n}]")
        if self.payload is not None and not 1 <= self.payload.num_tokens == n <= self.payload.ref.num_tokens:
            raise PackingError(f"sample of episode {self.episode_id}: keeps {self.payload.num_tokens} tokens of "
                               f"{self.payload.ref.uri}: expected {n} (<= {self.payload.ref.num_tokens})")

    @property
    def num_tokens(self) -> int:
        """L: tokens of the sample."""
        return len(self.input_ids)

    @property
    def has_routing(self) -> bool:
        """Whether the sample's chunk carries token-domain rows (``routed_experts``: ``step_header.has_token_rows``)."""
        return self.payload is not None and has_token_rows(self.payload.ref)

    def streams(self) -> dict[str, np.ndarray]:
        """The six streams by name, in ``STREAMS`` order."""
        return {name: getattr(self, name) for name in STREAMS}


def kept_completion_tokens(branch: BranchResult, seq_len: int) -> int:
    """Completion tokens left after truncating the branch to its first ``seq_len`` tokens (may be 0)."""
    return max(0, min(len(branch.completion_ids), seq_len - len(branch.prompt_ids)))


def build_sample(episode: Episode, branch: BranchResult, *, reward: float, advantage: float | np.ndarray,
                 seq_len: int) -> Sample:
    """Build the sample of one branch, truncated to its first ``seq_len`` tokens.

    Truncation never touches the chunk: the ``PayloadSlice`` just keeps fewer tokens. ``advantage``
    is one float broadcast over the kept completion tokens, or ``[kept_completion_tokens]`` float32.

    Raises:
        PackingError: no completion token survives truncation (``kept_completion_tokens == 0``).
    """
    num_prompt = len(branch.prompt_ids)
    num_completion = kept_completion_tokens(branch, seq_len)
    if num_completion == 0:
        raise PackingError(f"episode {episode.episode_id}: prompt of {num_prompt} tokens leaves no completion "
                           f"token within seq_len={seq_len}")
    n = num_prompt + num_completion
    completion = np.arange(n) >= num_prompt
    if branch.completion_mask is not None:
        completion[num_prompt:] &= branch.completion_mask[:num_completion]
    logprobs = np.zeros(n, np.float32)
    logprobs[num_prompt:] = branch.inference_logprobs[:num_completion]
    payload = None if branch.ref is None else PayloadSlice(branch.ref, n)
    return Sample(
        input_ids=np.concatenate([branch.prompt_ids, branch.completion_ids[:num_completion]]),
        loss_mask=completion,
        advantages=np.where(completion, np.pad(np.broadcast_to(np.float32(advantage), num_completion),
                                               (num_prompt, 0)), np.float32(0)),
        inference_logprobs=logprobs,
        position_ids=np.arange(n, dtype=np.int32),
        temperatures=np.full(n, branch.temperature, np.float32),
        env_name=episode.env_name, payload=payload, policy_version=branch.policy_version,
        reward=float(reward), episode_id=episode.episode_id,
    )


def check_episode(episode: Episode, prefix: RunPrefix, *, vocab_size: int | None = None) -> None:
    """Validate an episode before the orchestrator acts on it (no I/O, nothing deleted).

    ``vocab_size`` (``FieldsConfig.vocab_size``): token ids must be below it; None checks ``>= 0`` only.

    Raises:
        OutsideRunError: a ref was kept in another run (the run id in its URI is not this run's;
            the rest of the URI is the env server's view of the run and may differ), or its URI
            names another chunk than its branch id (names the episode and branch).
        EpisodeError: no branches; a token array of the wrong dtype or shape; a non-positive
            temperature or negative policy version; rewards that are not finite, above
            ``MAX_ABS_REWARD`` in magnitude, or not one per branch; a token id < 0 or >= ``vocab_size``;
            an inference logprob that is NaN, infinite or > 0 (one line naming the episode, branch,
            array and index); a ref whose prompt/completion token counts disagree with the branch's
            tokens; the same ref twice.
    """
    what = f"episode {episode.episode_id!r} (group {episode.group_id!r}, env {episode.env_name!r})"
    if not episode.branches:
        raise EpisodeError(f"{what}: has no branches: expected at least one")
    rewards = np.asarray(episode.reward, np.float64)
    if rewards.shape not in ((), (len(episode.branches),)) or not (np.abs(rewards) <= MAX_ABS_REWARD).all():
        raise EpisodeError(f"{what}: reward {episode.reward!r}: expected one finite float with |reward| <= "
                           f"{MAX_ABS_REWARD:.7g} (float32's largest) or one per branch ({len(episode.branches)})")
    for i, branch in enumerate(episode.branches):
        _check_branch(branch, f"{what} branch {i}", prefix)
        _check_values(branch, f"{what} branch {i}", vocab_size)
    branch_ids = [ref.branch_id for ref in episode.refs()]
    if len(set(branch_ids)) != len(branch_ids):
        raise EpisodeError(f"{what}: the same ref appears in more than one branch: {branch_ids}")


def _check_branch(branch: BranchResult, what: str, prefix: RunPrefix) -> None:
    c = len(branch.completion_ids) if isinstance(branch.completion_ids, np.ndarray) else -1
    for name, dtype, shape in (("prompt_ids", "<i4", None), ("completion_ids", "<i4", None),
                               ("inference_logprobs", "<f4", (c,)), ("completion_mask", "|b1", (c,)),
                               ("advantages", "<f4", (c,))):
        a = getattr(branch, name)
        if name in ("completion_mask", "advantages") and a is None:
            continue
        if not isinstance(a, np.ndarray) or a.dtype.str != dtype or a.ndim != 1 or (shape and a.shape != shape):
            got = f"{a.dtype.str} {list(a.shape)}" if isinstance(a, np.ndarray) else type(a).__name__
            raise EpisodeError(f"{what}: {name} is {got}: expected {np.dtype(dtype)} [{shape[0] if shape else 'n'}]")
    if branch.advantages is not None and not np.isfinite(branch.advantages).all():
        raise EpisodeError(f"{what}: advantages hold a non-finite value at completion token "
                           f"{int(np.argmin(np.isfinite(branch.advantages)))}: expected finite floats")
    if c < 1 or not 0 < branch.temperature <= float(np.finfo(np.float32).max) or branch.policy_version < 0:
        raise EpisodeError(f"{what}: completion of {c} tokens, temperature {branch.temperature}, policy_version "
                           f"{branch.policy_version}: expected >= 1 token, a finite float32 temperature > 0, "
                           f"policy_version >= 0")
    if branch.ref is None:
        return
    check_in_run(branch.ref, prefix, what)
    held = (branch.ref.num_prompt_tokens, branch.ref.num_completion_tokens)
    if held != (len(branch.prompt_ids), c):
        raise EpisodeError(f"{what}: ref {branch.ref.uri} holds {held[0]} prompt + {held[1]} completion tokens: "
                           f"expected {len(branch.prompt_ids)} + {c} (the branch's tokens)")


def _check_values(branch: BranchResult, what: str, vocab_size: int | None) -> None:
    """Token ids in ``[0, vocab_size)``, inference logprobs finite and <= 0: else one line naming the index."""
    problem = (token_id_problem(branch.prompt_ids, "prompt_ids", vocab_size)
               or token_id_problem(branch.completion_ids, "completion_ids", vocab_size)
               or logprob_problem(branch.inference_logprobs, "inference_logprobs"))
    if problem:
        raise EpisodeError(f"{what}: {problem}")


def token_id_problem(ids: np.ndarray, name: str, vocab_size: int | None) -> str | None:
    """``<name>[i] = v: expected a token id >= 0 (and < vocab_size)`` for the first bad id, or None: the rule for
    token ids wherever they enter (episodes, ``publish_step``'s ``input_ids``)."""
    if ids.size and (int(ids.min()) < 0 or (vocab_size is not None and int(ids.max()) >= vocab_size)):
        bad = int(np.argmax((ids < 0) | (ids >= (vocab_size or np.iinfo(np.int32).max))))
        limit = "" if vocab_size is None else f" and < vocab_size={vocab_size}"
        return f"{name}[{bad}] = {int(ids[bad])}: expected a token id >= 0{limit}"
    return None


def logprob_problem(logprobs: np.ndarray, name: str) -> str | None:
    """``<name>[i] = v: expected a finite logprob <= 0`` for the first bad value, or None."""
    top = logprobs.max() if logprobs.size else 0.0  # NaN and +inf propagate into the max, -inf into the min
    if not top <= 0 or (logprobs.size and np.isneginf(logprobs.min())):
        bad = int(np.argmax(~(np.isfinite(logprobs) & (logprobs <= 0))))
        return f"{name}[{bad}] = {float(logprobs[bad])}: expected a finite logprob <= 0"
    return None
