"""The built-in task: reverse a short word, with a dense verifiable reward.

A prompt is ``"rev:<word>="`` (``word`` drawn from ``alphabet``); the target completion is
the word reversed, then EOS. The reward is partial credit in [0, 1]: the fraction of
target positions the completion gets right, divided by the longer of the two lengths,
so extra or missing letters cost credit.

From scratch the policy samples random bytes (reward ~0). ``warm_start`` gives it the
format in a few seconds of supervised training on the task (deterministic), leaving
room for RL to raise the reward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pydantic import BaseModel, Field, model_validator

from refpipe.job.workload.model import BOS_ID, EOS_ID, MoELM
from refpipe.storage.config import CONFIG
from refpipe.storage.errors import ConfigError


class TaskConfig(BaseModel):
    """Prompt generation of the reverse task."""

    model_config = CONFIG

    alphabet: str = "abcdefgh"
    """Letters words are drawn from (ASCII)."""
    min_letters: int = Field(default=3, ge=1)
    """Shortest word."""
    max_letters: int = Field(default=7, ge=1)
    """Longest word; a prompt is ``max_letters + 6`` tokens at most (BOS, ``rev:``, ``=``)."""
    seed: int = 0
    """Seeds prompt generation."""

    @model_validator(mode="after")
    def _check(self) -> TaskConfig:
        if not self.alphabet or not self.alphabet.isascii():
            raise ConfigError(f"TaskConfig.alphabet={self.alphabet!r}: expected a non-empty ASCII string")
        if self.max_letters < self.min_letters:
            raise ConfigError(f"TaskConfig.max_letters={self.max_letters} < min_letters={self.min_letters}")
        return self


@dataclass(frozen=True)
class Problem:
    """One prompt and its target."""

    prompt_ids: np.ndarray
    """[P] int32: BOS then the bytes of ``rev:<word>=``."""
    target_ids: np.ndarray
    """[len(word)] int32: the bytes of the reversed word (EOS not included)."""


def make_problems(cfg: TaskConfig, num: int, *, index: int) -> list[Problem]:
    """``num`` problems, a deterministic function of ``(cfg.seed, index)``, index >= 0 (e.g. a step)."""
    return _generate(cfg, num, np.random.default_rng([cfg.seed, 0, index]))


def _generate(cfg: TaskConfig, num: int, rng: np.random.Generator) -> list[Problem]:
    letters = np.frombuffer(cfg.alphabet.encode(), dtype=np.uint8)
    problems = []
    for length in rng.integers(cfg.min_letters, cfg.max_letters + 1, size=num):
        word = rng.choice(letters, size=int(length)).astype(np.int32)
        prompt = np.concatenate([[BOS_ID], np.frombuffer(b"rev:", np.uint8), word, [ord("=")]]).astype(np.int32)
        problems.append(Problem(prompt_ids=prompt, target_ids=word[::-1].copy()))
    return problems


def reward(completion_ids: np.ndarray, target_ids: np.ndarray) -> float:
    """Partial credit in [0, 1]: matching positions / max(len(answer), len(target)).

    ``answer`` is the completion up to (not including) its first EOS; a completion with
    no EOS is scored whole. Two empty sequences score 1.
    """
    completion = np.asarray(completion_ids)
    eos = np.flatnonzero(completion == EOS_ID)
    answer = completion[: eos[0]] if eos.size else completion
    n = min(answer.size, target_ids.size)
    longest = max(answer.size, target_ids.size)
    return 1.0 if longest == 0 else float((answer[:n] == target_ids[:n]).sum()) / longest


def warm_start(model: MoELM, cfg: TaskConfig, *, steps: int = 100, batch_size: int = 32,
               lr: float = 3e-3) -> list[float]:
    """Supervised warm start on the task: teacher-forced cross-entropy on ``target + EOS``.

    Deterministic given the model's weights and ``cfg``; its problems come from a stream
    apart from ``make_problems``'.
    Trains ``model`` in place with Adam; returns the loss of each step (nats per token).
    """
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        problems = _generate(cfg, batch_size, np.random.default_rng([cfg.seed, 1, step]))
        seqs = [np.concatenate([p.prompt_ids, p.target_ids, [EOS_ID]]) for p in problems]
        lengths = torch.tensor([len(s) for s in seqs])
        cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]).to(torch.int32)
        input_ids = torch.as_tensor(np.concatenate(seqs), dtype=torch.int64)
        positions = torch.cat([torch.arange(n) for n in lengths.tolist()])
        is_target = torch.cat([torch.arange(len(s)) >= len(p.prompt_ids) for s, p in zip(seqs, problems)])
        logits, _ = model(input_ids, positions, cu_seqlens)
        rows = is_target.nonzero()[:, 0]
        loss = torch.nn.functional.cross_entropy(logits[rows - 1], input_ids[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses
