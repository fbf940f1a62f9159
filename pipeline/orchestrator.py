"""The orchestrator: episodes in, step files out, and every chunk it will never ship deleted.

It never reads a chunk: episodes carry ``PayloadRef``s, step files carry them on, so its
memory does not depend on the side channels' size (DESIGN.md, Actors).

Deletion paths (each through ``Ledger.delete`` with a reason naming the path, counted in
``Orchestrator.deleted``): ``eval`` (every eval episode: the eval sink), ``untrained`` (branches
marked not trainable), ``missing_fields`` (a trainable branch lacking a field of
``FieldsConfig.required``: filtered at submit, its chunk deleted, the branch no longer trains),
``refused`` (an episode ``submit`` refuses: its chunks in this run that no queued episode holds and that
are still kept, once; then the error is raised; and every trainable chunk of a group whose advantages the
estimator fails), ``late`` (episodes of a group that was already completed or dropped), ``truncated`` (no
completion token within ``seq_len``), ``filtered_group`` (mean reward outside ``reward_range``,
or every advantage zero), ``pruned`` (zero-advantage samples), ``stale`` (queued samples of a
policy older than ``max_async_level`` steps), ``dropped_group`` (an incomplete group holding a
stale episode) and ``shutdown`` (everything still queued).

Pluggable: the advantage estimator (``pipeline.advantages``: group-normalised by default, ``rloo``,
``from_episode`` or the caller's own function) and the packer (``pipeline.packing``: ``balanced_packer``
by default) are constructor arguments; pruning (``prune_zero_advantage``), the staleness filter
(``drop_stale``) and the reward-range filter (``reward_range``) are options. Publishing is
``pipeline.publish.publish_step``.
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np
from pydantic import BaseModel, Field, field_validator

from refpipe.pipeline.advantages import (
    AdvantageEstimator,
    GroupRollouts,
    group_normalized,
    per_sample,
    reward_in_range,
    stale,
    zero_advantage,
)
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.kept_refs import gone_refs, why_gone
from refpipe.pipeline.packing import Packer, balanced_packer, pack_step, step_metrics, step_micro_batches
from refpipe.pipeline.publish import publish_step
from refpipe.pipeline.samples import BranchResult, Episode, Sample, build_sample, check_episode, kept_completion_tokens
from refpipe.pipeline.slices import check_in_run
from refpipe.pipeline.step_header import MAX_SEQ_LEN, StepHeader
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.config import CONFIG
from refpipe.storage.errors import DoubleDeleteError, EpisodeError, LedgerClosedError, OutsideRunError, UnknownRefError
from refpipe.storage.layout import ORCHESTRATOR_ACTOR
from refpipe.storage.ledger import Ledger
from refpipe.storage.store import Store

log = logging.getLogger(__name__)


class OrchestratorConfig(BaseModel):
    """How the orchestrator turns groups of episodes into steps."""

    model_config = CONFIG

    seq_len: int = Field(default=4096, ge=1, le=MAX_SEQ_LEN)
    """Token budget of a micro batch (tokens, at most ``pipeline.step_header.MAX_SEQ_LEN``); samples keep their
    first ``seq_len`` tokens."""
    dp_world_size: int = Field(default=1, ge=1, le=65536)
    """Data-parallel ranks of the trainer; each gets the same number of micro batches."""
    groups_per_step: int = Field(default=8, ge=1, le=65536)
    """Groups one step trains (at most; fewer when fewer are ready; at most 65,536)."""
    group_size: int = Field(default=8, ge=1, le=4096)
    """Episodes per group (at most 4,096); a group's advantages are computed once all of them arrived."""
    max_async_level: int = Field(default=1, ge=0)
    """Step ``s`` trains samples of policy versions ``s - max_async_level .. s``; older ones are stale."""
    drop_stale: bool = True
    """Delete stale samples (and incomplete groups holding a stale episode) before each step; False trains
    samples of any policy version (the main job still samples at most ``max_async_level`` steps ahead)."""
    reward_range: tuple[float, float] | None = Field(default=None, strict=False)
    """Keep a group only if its mean reward lies in ``[low, high]``; None keeps every group."""
    std_normalize: bool = True
    """Divide advantages by the group's reward standard deviation (the default estimator, ``group_normalized``)."""
    length_weighted_baseline: bool = False
    """Baseline = completion-token-weighted mean reward of the group, else the plain mean (the default estimator)."""
    prune_zero_advantage: bool = True
    """Drop samples whose advantage is zero (a group with only such samples is filtered)."""

    @field_validator("reward_range")
    @classmethod
    def _ordered(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not v[0] <= v[1]:
            raise ValueError(f"reward_range {list(v)}: expected low <= high")
        return v


@dataclass
class _ReadyGroup:
    group_id: str
    samples: list[Sample]


class Orchestrator:
    """Turns episodes into published step files; deletes what it will never ship.

    One instance per run, driven from one thread. Call order:

    1. ``Orchestrator(config, store, fields=run_fields)`` opens the ledger actor ``orchestrator``;
       ``fields`` (the run's field shapes) goes into every step header. ``advantages`` (an
       ``AdvantageEstimator``; default ``group_normalized`` with the config's options) and ``packer``
       (a ``Packer``; default ``balanced_packer``) replace the built-in policies.
    2. ``submit(episode)`` for every episode as it returns (any order, any group); a group
       whose ``group_size`` episodes arrived becomes ready (or is filtered) at once.
    3. ``build_step(step)`` whenever ``ready_groups >= config.groups_per_step`` (or earlier
       to train fewer), with increasing steps: voids stale samples, packs up to
       ``groups_per_step`` ready groups and publishes their step file.
    4. ``shutdown()`` once: deletes all still queued, closes the ledger (then submit, build_step: LedgerClosedError).

    Attributes:
        deleted: chunks deleted so far, per deletion path (see the module doc).
        filtered: branches filtered at submit, per reason (``missing_fields``), with or without a chunk.
        eval_rewards: ``(env_name, reward)`` of every eval episode received; the caller clears it.
    """

    def __init__(self, config: OrchestratorConfig, store: Store, *, fields: FieldsConfig,
                 advantages: AdvantageEstimator | None = None, packer: Packer = balanced_packer):
        self.config, self.store, self.fields, self.packer = config, store, fields, packer
        self.advantages = advantages or group_normalized(std_normalize=config.std_normalize,
                                                         length_weighted_baseline=config.length_weighted_baseline)
        self.ledger = Ledger(store, ORCHESTRATOR_ACTOR)
        self.deleted: Counter[str] = Counter()
        self.filtered: Counter[str] = Counter()
        self.deleted_nbytes = 0
        """Bytes of the chunks deleted so far (all paths)."""
        self.eval_rewards: list[tuple[str, float]] = []
        self._pending: dict[str, list[Episode]] = {}
        self._ready: deque[_ReadyGroup] = deque()
        self._closed: dict[str, str] = {}
        self._queued_refs: set[str] = set()
        self._refused_refs: set[str] = set()

    @property
    def ready_groups(self) -> int:
        """Groups complete, filtered and waiting for a step."""
        return len(self._ready)

    @property
    def pending_groups(self) -> int:
        """Groups still waiting for episodes."""
        return len(self._pending)

    def submit(self, episode: Episode) -> None:
        """Take one episode from an env server; the episode's chunks are the orchestrator's from here on.

        A refused episode's chunks are deleted here, once (path ``refused``), before the error is raised:
        each ``PayloadRef`` of it kept in this run that no queued episode holds. A ref of another run
        (its branch id may name a chunk of this one), one already queued or shipped, or one whose chunk is
        gone is left alone.

        Cost: one ``Store.exists`` of each ref's commit marker (per segment of a segmented ref: ``pipeline.kept_refs``),
        a missing one's delete record read only then; the ``receive`` event is buffered.

        Raises:
            OutsideRunError: a ref lies outside the run prefix.
            EpisodeError: malformed episode; its id or a ref of it is already queued; a ref of it was already
                shipped in a step; a ref's chunk is gone (discarded or deleted: names the deleter and why, from its
                delete record).
            LedgerClosedError: after ``shutdown``; nothing is deleted (the orchestrator's ledger is closed): the
                caller still holds the episode's chunks (``Keeper.discard`` them, else ``refpipe sweep`` does).
        """
        self._check_running(f"submit of episode {episode.episode_id!r} of group {episode.group_id!r}",
                            ": its chunks are not deleted; discard its refs with the Keeper that kept them "
                            "(Keeper.discard), else `refpipe sweep` deletes them once the run stopped")
        queued = self._pending.get(episode.group_id, [])
        try:
            check_episode(episode, self.store.prefix, vocab_size=self.fields.vocab_size)
            self._check_new(episode, queued)
            gone = gone_refs(self.store, episode)
            if gone:
                raise EpisodeError("; ".join(gone.values()))
        except (EpisodeError, OutsideRunError) as e:
            self._refuse(episode, e)
            raise
        self.ledger.record("receive", episode_id=episode.episode_id, group_id=episode.group_id,
                           branch_ids=[c.branch_id for r in episode.refs() for c in r.chunks])
        what = f"episode {episode.episode_id} of group {episode.group_id}"
        if not episode.is_eval:
            episode = self._filter_missing_fields(episode, what)
        if episode.is_eval:
            self.eval_rewards += [(episode.env_name, float(r)) for r in episode.branch_rewards()]
            self._delete("eval", episode.refs(), f"{what} is an eval episode")
        elif episode.group_id in self._closed:
            reason = f"{what} arrived after its group was {self._closed[episode.group_id]}"
            log.warning("orchestrator: %s: its chunks are deleted, never trained (a group id names one group per "
                        "run: give each group of each step its own id)", reason)
            self._delete("late", episode.refs(), reason)
        else:
            self._delete("untrained", [b.ref for b in episode.branches if not b.trainable and b.ref],
                         f"{what}: branch not trainable")
            self._pending[episode.group_id] = queued + [episode]
            self._queued_refs.update(r.branch_id for r in _trainable_refs([episode]))
            if len(queued) + 1 == self.config.group_size:
                self._complete_group(episode.group_id)

    def _filter_missing_fields(self, episode: Episode, what: str) -> Episode:
        """The episode with every trainable branch lacking a ``fields.required`` field made untrainable and
        ref-less; each such chunk is deleted here, once (path ``missing_fields``)."""
        branches = list(episode.branches)
        for i, branch in enumerate(branches):
            stored = {} if branch.ref is None else branch.ref.arrays
            missing = [name for name in self.fields.required if name not in stored and f"{name}.counts" not in stored]
            if branch.trainable and missing:
                self._delete("missing_fields", [branch.ref] if branch.ref else [],
                             f"{what} branch {i} lacks required fields {missing}")
                self.filtered["missing_fields"] += 1
                branches[i] = replace(branch, trainable=False, ref=None)
        return replace(episode, branches=branches) if branches != list(episode.branches) else episode

    def _refuse(self, episode: Episode, error: Exception) -> None:
        """Delete (path ``refused``) the chunks of a refused episode that are the orchestrator's: refs kept in
        this run, not queued, not shipped (a trainer deletes those), not refused before, still kept (``why_gone``:
        one ``Store.exists`` per chunk; a gone one is not deleted again), once each. A ref the ledger finds already
        deleted or never kept is logged, not raised: the refusal's own error follows."""
        own: dict[str, PayloadRef] = {}
        skip = self._queued_refs | self._refused_refs | self.ledger.shipped.keys()
        for branch in getattr(episode, "branches", None) or ():
            ref = getattr(branch, "ref", None)
            if isinstance(ref, PayloadRef) and _in_run(ref, self.store) and ref.branch_id not in skip | own.keys() \
                    and why_gone(self.store, ref) is None:
                own[ref.branch_id] = ref
        reason = (str(error).splitlines() or [type(error).__name__])[0][:300]  # the error names the episode
        try:
            self._delete("refused", list(own.values()), reason)
        except (DoubleDeleteError, UnknownRefError) as e:
            log.warning("orchestrator refused: %s", e)
        self._refused_refs.update(own)

    def _check_new(self, episode: Episode, queued: list[Episode]) -> None:
        """Refuse an episode already queued in its group, or carrying a ref that is queued or was shipped
        (``LedgerSession.shipped``: a ref trains once)."""
        what = f"episode {episode.episode_id!r} of group {episode.group_id!r}"
        shipped = [f"ref {r.uri} was already shipped in step {self.ledger.shipped[r.branch_id]}"
                   for r in episode.refs() if r.branch_id in self.ledger.shipped]
        if shipped:
            raise EpisodeError(f"{what}: {'; '.join(shipped)}: expected a ref not shipped before (a ref trains once; "
                               f"that step's trainer deletes its chunk)")
        again = [r.branch_id for r in episode.refs() if r.branch_id in self._queued_refs]
        if again or any(e.episode_id == episode.episode_id for e in queued):
            raise EpisodeError(f"{what} was already submitted{f' (refs {again} are queued)' if again else ''}")

    def _check_running(self, what: str, consequence: str = "") -> None:
        """Raise ``LedgerClosedError`` before ``what`` once ``shutdown`` ran (names the run, then ``consequence``)."""
        if self.ledger.closed:
            raise LedgerClosedError(f"orchestrator of run {self.store.prefix.uri} is shut down: {what} refused"
                                    f"{consequence}")

    def build_step(self, step: int) -> StepHeader | None:
        """Void stale samples, pack up to ``groups_per_step`` ready groups, publish step ``step``.

        Returns:
            The published header, or None when no sample is left (no step file is written).

        Raises:
            KeyExistsError: step ``step`` was already published (its groups stay queued).
            PackingError: a ref's arrays disagree with ``fields`` (its groups stay queued).
            LedgerClosedError: after ``shutdown`` (nothing is published).
        """
        self._check_running(f"build_step({step})", " (nothing is published)")
        self.void_stale(step)
        groups = [self._ready[i] for i in range(min(self.config.groups_per_step, len(self._ready)))]
        samples = [s for g in groups for s in g.samples]
        if not samples:
            return None
        cfg = self.config
        packed = pack_step(samples, seq_len=cfg.seq_len, dp_world_size=cfg.dp_world_size, packer=self.packer)
        metrics = step_metrics(samples, len(groups), packed)
        header = publish_step(self.store, self.ledger, step, step_micro_batches(packed, cfg.dp_world_size),
                              seq_len=cfg.seq_len, fields=self.fields, metrics=metrics)
        for _ in groups:
            self._ready.popleft()
        self._queued_refs.difference_update(r.branch_id for r in header.refs)
        return header

    def shutdown(self) -> None:
        """Delete every chunk still queued (pending or ready groups), close the ledger; a second call does nothing."""
        refs = _trainable_refs(e for episodes in self._pending.values() for e in episodes)
        refs += [s.payload.ref for g in self._ready for s in g.samples if s.payload is not None]
        self._delete("shutdown", refs, "queued when the orchestrator shut down")
        self._pending.clear()
        self._ready.clear()
        self._queued_refs.clear()
        self.ledger.close()

    def _complete_group(self, group_id: str) -> None:
        """Compute a complete group's advantages, filter and prune it, queue its samples.

        Raises:
            EpisodeError: the advantage estimator raised one or returned no valid advantages (e.g. ones beyond
                float32 without ``std_normalize``): the group is refused, every trainable chunk of it deleted at
                once (path ``refused``); the message names the group and which episode each sample is.
        """
        episodes = self._pending[group_id]
        units = [(e, b, float(r)) for e in episodes for b, r in zip(e.branches, e.branch_rewards()) if b.trainable]
        kept = np.array([kept_completion_tokens(b, self.config.seq_len) for _, b, _ in units], np.int64)
        truncated = [b.ref for (_, b, _), k in zip(units, kept) if k == 0 and b.ref]
        units, kept = [u for u, k in zip(units, kept) if k > 0], kept[kept > 0]
        rewards = np.array([r for _, _, r in units], np.float64)
        group = GroupRollouts(group_id, rewards, kept, [b for _, b, _ in units])
        try:
            adv = per_sample(self.advantages(group), group)
        except EpisodeError as e:
            raise self._refuse_group(group_id, units, e) from None
        del self._pending[group_id]
        self._closed[group_id] = "completed"
        self._delete("truncated", truncated,
                     f"group {group_id}: prompt leaves no completion token within seq_len={self.config.seq_len}")
        zero = zero_advantage(adv) if self.config.prune_zero_advantage else np.zeros(len(units), np.bool_)
        problem = self._group_filter(rewards, zero)
        if problem:
            self._closed[group_id] = "filtered"
            self._delete("filtered_group", _unit_refs(units), f"group {group_id}: {problem}")
            return
        self._delete("pruned", _unit_refs(u for u, z in zip(units, zero) if z), f"group {group_id}: zero advantage")
        samples = [build_sample(e, b, reward=r, advantage=a, seq_len=self.config.seq_len)
                   for (e, b, r), a, z in zip(units, adv, zero) if not z]
        self._ready.append(_ReadyGroup(group_id, samples))

    def _refuse_group(self, group_id: str, units: list[tuple[Episode, BranchResult, float]],
                      error: EpisodeError) -> EpisodeError:
        """Close a group whose advantages failed and delete its trainable chunks (path ``refused``); the error to
        raise: ``error`` and which episode and branch each of its samples ``units`` is."""
        samples = ", ".join(f"{e.episode_id!r} branch {e.branches.index(b)}" for e, b, _ in units)
        message = f"{error} (samples in order: {samples}); the group is refused, its chunks deleted"
        self._closed[group_id] = "refused"
        self._delete("refused", _trainable_refs(self._pending.pop(group_id)), message.splitlines()[0][:300])
        return EpisodeError(message)

    def _group_filter(self, rewards: np.ndarray, zero: np.ndarray) -> str | None:
        """Why a group with ``rewards`` [G] and zero-advantage mask ``zero`` [G] is filtered, or None."""
        if rewards.size == 0:
            return "no trainable sample"
        if self.config.reward_range is not None and not reward_in_range(rewards, self.config.reward_range):
            return f"mean reward {rewards.mean():.4g} outside reward_range {list(self.config.reward_range)}"
        if zero.all():
            return "every advantage is zero"
        return None

    def void_stale(self, step: int) -> None:
        """Delete queued samples too old for ``step``; drop incomplete groups holding a stale episode.

        ``build_step`` calls it first; a driver may call it before reading ``ready_groups`` so that
        count only holds groups step ``step`` can still train. Does nothing unless ``config.drop_stale``.
        """
        if not self.config.drop_stale:
            return
        level = self.config.max_async_level
        for group in self._ready:
            old = stale([s.policy_version for s in group.samples], step=step, max_async_level=level)
            self._delete("stale", [s.payload.ref for s, o in zip(group.samples, old) if o and s.payload],
                         f"group {group.group_id}: policy older than step {step} - max_async_level {level}")
            group.samples = [s for s, o in zip(group.samples, old) if not o]
        self._ready = deque(g for g in self._ready if g.samples)
        for group_id, episodes in list(self._pending.items()):
            versions = [b.policy_version for e in episodes for b in e.branches]
            if stale(versions, step=step, max_async_level=level).any():
                del self._pending[group_id]
                self._closed[group_id] = f"dropped at step {step} (stale episode)"
                self._delete("dropped_group", _trainable_refs(episodes),
                             f"incomplete group {group_id} holds an episode older than step {step} - {level}")

    def _delete(self, path: str, refs: list[PayloadRef], detail: str) -> None:
        """Delete through the ledger; a delete that fails after the store's retries is the ledger's unfinished
        delete (retried at its next delete and at ``shutdown``), not an error of the orchestrator."""
        if refs:
            self.ledger.finish_unfinished()
            result = self.ledger.delete(refs, reason=f"orchestrator {path}: {detail}")
            if result.failed:
                log.warning("orchestrator %s: %d deletes failed (retried later); first: %s", path, len(result.failed),
                            next(iter(result.failed.values())))
            self.deleted[path] += len(refs)
            self.deleted_nbytes += sum(r.nbytes for r in refs)
            self._queued_refs.difference_update(r.branch_id for r in refs)


def _in_run(ref: PayloadRef, store: Store) -> bool:
    """Whether ``ref`` was kept in ``store``'s run and its URI names its branch's chunk."""
    try:
        check_in_run(ref, store.prefix, "ref")
    except OutsideRunError:
        return False
    return True


def _trainable_refs(episodes: Iterable[Episode]) -> list[PayloadRef]:
    return [b.ref for e in episodes for b in e.branches if b.trainable and b.ref is not None]


def _unit_refs(units: Iterable[tuple[Episode, BranchResult, float]]) -> list[PayloadRef]:
    return [b.ref for _, b, _ in units if b.ref is not None]
