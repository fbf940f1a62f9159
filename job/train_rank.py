"""One trainer rank of the main job: the refpipe data path plus the MoE policy update.

Started as ``torchrun --nnodes N --nproc-per-node M -m refpipe.job.train_rank RUN_URI``
on the training nodes, or by ``refpipe run`` with the same command and the environment torchrun
sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``). Each rank reads the run
config from ``RUN_URI`` as its node reaches the run (``job.roles.open_run``).

Per step ``s`` every rank, in order: ``TrainerRank.run_step`` (load the step file, fetch
its micro batches' chunks, all-reduce failures, assemble) calls ``train``: forward
with the fetched routing replayed, the alignment check, the loss, a gradient
all-reduce (SUM over the world, divided by the global loss tokens and the
model-parallel size), one optimizer step; then rank 0 publishes weights version
``s + 1``; every ``job.checkpoint_every_steps`` steps (and after the last) every rank writes
the checkpoint of step ``s`` (``trainer.checkpoint``) and ``TrainerRank.checkpointed(s)`` releases
the steps it covers (``release = "after_checkpoint"``); then rank 0 publishes the step's
metrics (``metrics/trainer_step_<s>.json``). After the last step every rank calls
``TrainerRank.finish`` (the last releases run in the background) and rank 0 writes its counts
(``metrics/trainer_finish.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import traceback
from dataclasses import asdict, dataclass
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from refpipe.job.config import RunConfig
from refpipe.job.report import peak_rss_bytes
from refpipe.job.roles import exit_with_launcher, exit_without_teardown, open_run
from refpipe.job.weights import check_same_weights, load_weights, publish_weights
from refpipe.job.workload.loss import policy_loss
from refpipe.job.workload.model import MoELM
from refpipe.storage.errors import ConfigError, KeyNotFoundError, RefpipeError, ReplayMismatchError
from refpipe.storage.layout import FINISH_METRICS_KEY, metrics_key, step_key
from refpipe.storage.store import Store
from refpipe.trainer.checkpoint import apply_training_state, load_checkpoint, save_checkpoint, training_state
from refpipe.trainer.dist import gather_rank_values, init_process_group, peer_failure
from refpipe.trainer.pause import pause_point
from refpipe.trainer.resume import ResumePlan, plan_resume
from refpipe.trainer.step import TrainerRank
from refpipe.trainer.tensors import TrainMicroBatch

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """Per-rank sums of one step's training, reduced over the world by ``reduce``."""

    loss_tokens: int = 0
    loss_sum: float = 0.0
    kl_sum: float = 0.0
    on_policy_tokens: int = 0
    on_policy_max_abs_diff: float = 0.0
    off_policy_tokens: int = 0
    off_policy_max_abs_diff: float = 0.0

    def reduce(self) -> "StepStats":
        sums = torch.tensor([self.loss_tokens, self.loss_sum, self.kl_sum, self.on_policy_tokens,
                             self.off_policy_tokens], dtype=torch.float64)
        maxes = torch.tensor([self.on_policy_max_abs_diff, self.off_policy_max_abs_diff], dtype=torch.float64)
        dist.all_reduce(sums)
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        return StepStats(int(sums[0]), float(sums[1]), float(sums[2]), int(sums[3]), float(maxes[0]),
                         int(sums[4]), float(maxes[1]))


class PolicyTrainer:
    """The ``train`` callback of ``TrainerRank.run_step`` for the MoE policy."""

    def __init__(self, cfg: RunConfig, model: MoELM):
        self.cfg, self.model = cfg, model
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # every rank all-reduces every gradient, whether or not it ran a backward
        self.optimizer = torch.optim.Adam(model.parameters(), lr=cfg.job.learning_rate)
        self.version = 0
        self.stats = StepStats()
        self.earlier_weights_from: int | None = None
        """In a later life: samples of versions ``>=`` this one in the step being trained were taken with an earlier
        life's weights of that number, which this life does not have (``ResumePlan.diverged_from``): off-policy."""

    def __call__(self, micro_batches: list[TrainMicroBatch]) -> None:
        """Forward/backward every fetched micro batch, all-reduce gradients, step the optimizer.

        Every rank enters the same collectives with the same shapes whatever it fetched: a rank
        whose micro batches were all dropped, or that got none, contributes zero gradients
        (allocated once in ``__init__`` and zeroed, never set to None) and zero loss tokens.
        """
        pause_point("train", self.version)
        live = [mb for mb in micro_batches if not mb.dropped]
        total = torch.tensor([sum(int(mb.streams["loss_mask"].sum()) for mb in live)], dtype=torch.float64)
        dist.all_reduce(total)
        self.optimizer.zero_grad(set_to_none=False)
        stats = StepStats()
        for mb in live:
            self._backward(mb, max(float(total[0]), 1.0), stats)
        self._all_reduce_gradients()
        self.optimizer.step()
        self.stats = stats.reduce()
        self.version += 1

    def _backward(self, mb: TrainMicroBatch, total_tokens: float, stats: StepStats) -> None:
        s = mb.streams
        routing = mb.fields["routed_experts"].padded
        assert routing is not None  # a token-domain field: assembled with its padded rows
        if self.cfg.job.alignment_shift_rows:
            routing = torch.roll(routing, self.cfg.job.alignment_shift_rows, dims=0)
        # Padding (its own sequence, never in the loss) may count past the model's positions.
        positions = s["position_ids"].clamp(max=self.cfg.model.max_positions - 1)
        logits, _ = self.model(s["input_ids"], positions, mb.cu_seqlens, routing)
        head = mb.fields["topk_ids"]
        assert head.row_ids is not None  # a completion-domain field: assembled with its row ids
        pos = torch.nonzero(head.row_ids >= 0)[:, 0]
        rows, nxt = head.row_ids[pos], pos + 1
        terms = policy_loss(logits[pos] / s["temperatures"][nxt, None], s["input_ids"][nxt],
                            s["inference_logprobs"][nxt], s["advantages"][nxt], s["loss_mask"][nxt],
                            head.values[rows], mb.fields["topk_logprobs"].values[rows], temperature=1.0,
                            clip_eps=self.cfg.job.clip_eps, kl_coef=self.cfg.job.kl_coef)
        (terms.loss_sum / total_tokens).backward()
        stats.loss_tokens += terms.num_tokens
        stats.loss_sum += float(terms.loss_sum.detach())
        stats.kl_sum += terms.kl_sum
        self._check_alignment(mb, terms.logprobs, s["inference_logprobs"][nxt], s["loss_mask"][nxt], nxt, stats)

    def _check_alignment(self, mb: TrainMicroBatch, logprobs, inference, mask, positions, stats: StepStats) -> None:
        """Max |recomputed - inference| logprob, apart for tokens sampled with these weights and with others (older
        versions, or an earlier life's weights of a version this life's differ from)."""
        diff = (logprobs - inference).abs()
        on, off = policy_masks(token_policy_versions(mb)[positions], mask, self.version, self.earlier_weights_from)
        stats.on_policy_tokens += int(on.sum())
        stats.off_policy_tokens += int(off.sum())
        stats.on_policy_max_abs_diff = max(stats.on_policy_max_abs_diff, _max_or_zero(diff[on]))
        stats.off_policy_max_abs_diff = max(stats.off_policy_max_abs_diff, _max_or_zero(diff[off]))

    def _all_reduce_gradients(self) -> None:
        scale = 1.0 / self.cfg.trainer.model_parallel_size
        for p in self.model.parameters():
            assert p.grad is not None  # backward gave every parameter a gradient (all_reduce needs one)
            dist.all_reduce(p.grad)
            p.grad.mul_(scale)


def _max_or_zero(t: torch.Tensor) -> float:
    return float(t.max()) if t.numel() else 0.0


def policy_masks(versions: torch.Tensor, mask: torch.Tensor, current: int,
                 earlier_weights_from: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """([N] bool on-policy, [N] bool off-policy) of loss tokens (``mask``, [N] bool) sampled with policy
    ``versions`` ([N] int64): on-policy = sampled with the trainer's current weights (version ``current``);
    off-policy = an older version, or (``earlier_weights_from``) a version ``>=`` it sampled by an earlier life
    whose weights of that number this life does not have (``PolicyTrainer.earlier_weights_from``)."""
    foreign = versions >= earlier_weights_from if earlier_weights_from is not None else torch.zeros_like(mask)
    return mask & (versions == current) & ~foreign, mask & ((versions < current) | foreign)


def token_policy_versions(mb: TrainMicroBatch) -> torch.Tensor:
    """[seq_len] int64 policy version of each position's sequence (-1 on padding)."""
    per_sequence = [seq.policy_version for seq in mb.record.sequences]
    per_sequence += [-1] * (len(mb.cu_seqlens) - 1 - len(per_sequence))  # the padding sequence, if any
    return torch.tensor(per_sequence, dtype=torch.int64).repeat_interleave(mb.cu_seqlens.diff().long())


def publish_step_metrics(store: Store, step: int, metrics: dict) -> None:
    """Rank 0: write one step's metrics for the launcher's progress view."""
    store.put(metrics_key(step), json.dumps(metrics).encode())


def checkpoint_due(cfg: RunConfig, step: int) -> bool:
    """Whether the checkpoint of step ``step`` is written: every ``job.checkpoint_every_steps`` steps, and after the
    last step (so ``release = "after_checkpoint"`` ends with nothing held)."""
    every = cfg.job.checkpoint_every_steps
    return bool(every) and ((step + 1) % every == 0 or step == cfg.job.num_steps - 1)


def main(run_uri: str, s3_endpoint_url: str | None = None, *, resume: bool = False,
         published: int | None = None) -> None:
    """Rank entry (torchrun environment). Trains ``job.num_steps`` steps, publishing weights after each.

    ``resume``: a later life of the run (``trainer.resume``): start from the newest complete checkpoint
    (or the warm start), finish the releases it covers, republish its weights, then replay or skip the
    steps after it. ``published``: with ``resume``, steps ``0 .. published - 1`` are the earlier lives' (the
    launcher's count, ``trainer.resume.read_plan``); None: the step files listed when the plan is read.

    Raises:
        ConfigError: not a run, or ``WORLD_SIZE`` is not ``orchestrator.dp_world_size x
            trainer.model_parallel_size`` of the run's config.
    """
    exit_with_launcher()
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format=f"[trainer rank {os.environ.get('RANK')}] %(message)s")
    cfg, store = open_run(run_uri, s3_endpoint_url)
    world_size, expected = int(os.environ["WORLD_SIZE"]), cfg.job.trainer_world_size
    if world_size != expected:
        raise ConfigError(f"WORLD_SIZE={world_size} (torchrun --nnodes x --nproc-per-node): run {store.prefix.uri} "
                          f"expects {expected} ranks (orchestrator.dp_world_size x trainer.model_parallel_size)")
    init_process_group(cfg.trainer, rank=int(os.environ["RANK"]), world_size=world_size)
    with failures_end_the_rank(store.prefix.uri):
        train_life(store, cfg, resume=resume, published=published)


@contextlib.contextmanager
def failures_end_the_rank(run_uri: str):
    """End the rank with one ``error:`` line on stderr and exit code 1 when a collective fails because a peer rank
    died or hangs (``trainer.dist.peer_failure``: an expected failure of a run over several processes, which the
    launcher or the orchestrator reports too, by the ranks' processes or heartbeats), or on a refpipe error (typed:
    its message names the cause and what to do, e.g. ``ReplayMismatchError``; it printed a traceback). Any other
    error propagates.

    Raises:
        SystemExit: code 1, after the line.
    """
    try:
        yield
    except RefpipeError as e:
        print(f"error: trainer rank {dist.get_rank()} of {dist.get_world_size()}: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    except RuntimeError as e:
        why = peer_failure(e)
        if why is None:
            raise
        print(f"error: trainer rank {dist.get_rank()} of {dist.get_world_size()}: a collective failed ({why}): a "
              f"peer rank died or stopped answering, so this rank stops too; once no role of the run is left, "
              f"continue it from its newest checkpoint with `refpipe run --resume {run_uri}`", file=sys.stderr,
              flush=True)
        raise SystemExit(1) from None


def train_life(store: Store, cfg: RunConfig, *, resume: bool, published: int | None) -> None:
    """Every rank, in the initialised process group: train this life's steps (``main``), finish, close."""
    model = MoELM(cfg.model)
    policy = PolicyTrainer(cfg, model)
    rank = TrainerRank(store, cfg.fields, cfg.storage, cfg.trainer)
    plan = resume_life(store, cfg, policy, rank, published) if resume else None
    if not resume:
        load_weights(store, model, 0)
    for step in range(plan.start_step if plan else 0, cfg.job.num_steps):
        metrics = train_step(store, cfg, policy, rank, step, plan)
        pause_point("after_release", step)
        if checkpoint_due(cfg, step):
            save_checkpoint(store, training_state(model, policy.optimizer, step=step, policy_version=policy.version),
                            rank.data_group)
            rank.checkpointed(step)
        if dist.get_rank() == 0:
            assert rank.ledger is not None  # global rank 0 has mp_rank 0, which opens the ledger
            metrics["life"] = rank.ledger.session
            publish_step_metrics(store, step, {**metrics, **asdict(policy.stats)})
    finished = rank.finish()
    rss = gather_rank_values(np.array([peak_rss_bytes()], np.float64), rank.data_group)[:, 0]
    if dist.get_rank() == 0:
        store.put(FINISH_METRICS_KEY, json.dumps({**finished.model_dump(),
                                                  "peak_rss_bytes": [int(b) for b in rss]}).encode())
    rank.close()
    dist.destroy_process_group()


def resume_life(store: Store, cfg: RunConfig, policy: PolicyTrainer, rank: TrainerRank,
                published: int | None = None) -> ResumePlan:
    """Every rank: load the newest complete checkpoint (or the warm start), release (in the background) what it
    covers that an earlier life had not, and (rank 0) republish its weights as the current version, so env
    workers restart on them (the launcher pointed them at the earlier life's file of that version: the same
    weights, ``check_same_weights``)."""
    plan = plan_resume(store, cfg.orchestrator.dp_world_size, rank.data_group, published)
    if plan.checkpoint_step >= 0:
        empty = training_state(policy.model, policy.optimizer, step=-1, policy_version=-1)
        state = load_checkpoint(store, plan.checkpoint_step, empty)
        apply_training_state(policy.model, policy.optimizer, state)
        policy.version = int(state["policy_version"])
        check_same_weights(store, policy.model, policy.version)
    else:
        load_weights(store, policy.model, 0)
    rank.resume(plan)
    if dist.get_rank() == 0:
        publish_weights(store, policy.model, policy.version, replace=True)
        log.warning("resumed %s", plan.describe())
    return plan


def train_step(store: Store, cfg: RunConfig, policy: PolicyTrainer, rank: TrainerRank, step: int,
               plan: ResumePlan | None) -> dict:
    """Every rank: train step ``step`` (or skip it, see ``trainer.resume``); rank 0 publishes weights
    version ``step + 1``. A replayed step's micro batches must hash as they did in the earlier life, and its
    weights must be the ones the earlier life published as ``step + 1`` (unless a skipped step came before).

    Raises:
        ReplayMismatchError: a replayed micro batch, or the weights after it, differ (on every rank).
    """
    diverged = plan.diverged_from if plan else None
    policy.earlier_weights_from = diverged if plan and step < plan.published else None
    if plan and step in plan.skipped:
        metrics = rank.skip_step(step, plan).model_dump()
        policy.version, policy.stats = step + 1, StepStats()
    else:
        metrics = rank.run_step(step, policy).model_dump()
        metrics["replayed"] = bool(plan and plan.replays(step))
        if metrics["replayed"]:
            check_replay(store, step, metrics["micro_batch_hashes"])
            if diverged is None or step + 1 < diverged:
                check_same_weights(store, policy.model, step + 1)
    if dist.get_rank() == 0:
        publish_weights(store, policy.model, step + 1, replace=plan is not None)
    return metrics


def check_replay(store: Store, step: int, hashes: list[list[str]]) -> None:
    """Compare a replayed step's micro batch hashes with the earlier life's metrics (when it wrote them).

    Raises:
        ReplayMismatchError: they differ.
    """
    try:
        first = json.loads(store.get(metrics_key(step)))["micro_batch_hashes"]
    except KeyNotFoundError:
        return  # the earlier life died before its metrics of this step: nothing to compare with
    if first == hashes:
        return
    where = f"step {step} replayed from {store.uri(step_key(step))}"
    dropped = [f"dp_rank={dp} micro batch {i}" for dp, (now, then) in enumerate(zip(hashes, first))
               for i, (h, h_first) in enumerate(zip(now, then)) if not h and h_first]
    if dropped:
        raise ReplayMismatchError(
            f"{where}: {len(dropped)} micro batches the earlier life trained could not be fetched this time "
            f"({', '.join(dropped)}; the ranks' fetch errors above name their chunks), so the replay cannot train "
            f"what the earlier life trained; resuming again meets the same chunks: restore them from a copy of the "
            f"run, or end the run with `refpipe sweep --abandon {store.prefix.uri}` (deletes its chunks)")
    raise ReplayMismatchError(f"{where}: micro batch hashes {hashes} differ from the first time's {first}; stopping")


class _OneLineErrors(argparse.ArgumentParser):
    """A command line that does not parse is one ``error:`` line with the usage and exit code 2, as for ``refpipe``."""

    def error(self, message: str) -> NoReturn:
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        self.exit(2, f"error: {message} (usage: {usage}; see {self.prog} --help)\n")


def cli(argv: list[str] | None = None) -> int:
    """``python -m refpipe.job.train_rank RUN_URI [--s3-endpoint-url URL] [--resume [--published N]]``; a bad run
    or world size is one ``error:`` line and exit code 2."""
    parser = _OneLineErrors(prog="python -m refpipe.job.train_rank", description=__doc__.splitlines()[0])
    parser.add_argument("run", metavar="RUN_URI", help="the run (<root>/<run_id>) as this node reaches it")
    parser.add_argument("--s3-endpoint-url", default=None, help="S3 endpoint (default: the AWS environment)")
    parser.add_argument("--resume", action="store_true", help="a later life: start from the newest complete "
                                                              "checkpoint (see `refpipe run --resume`)")
    parser.add_argument("--published", type=int, default=None, metavar="N",
                        help="with --resume: steps 0..N-1 are the earlier lives' (`refpipe run --resume` passes its "
                             "count; default: the step files listed when the rank starts)")
    args = parser.parse_args(argv)
    try:
        main(args.run, args.s3_endpoint_url, resume=args.resume, published=args.published)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def run_process() -> NoReturn:
    """``python -m refpipe.job.train_rank``: ``cli()``, then exit with its code (or a ``SystemExit``'s) without
    the interpreter's teardown (``job.roles.exit_without_teardown``); an unexpected error prints its traceback
    and exits 1, as Python would."""
    try:
        code = cli()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException:  # noqa: BLE001 -- printed as Python would, then the same exit without teardown
        traceback.print_exc()
        code = 1
    exit_without_teardown(code)


if __name__ == "__main__":
    run_process()
