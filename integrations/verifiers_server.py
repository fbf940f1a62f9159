"""A verifiers 0.4 env server that keeps side channels through refpipe and streams refs.

verifiers' ``EnvServer`` streams each served episode as deltas (``serve.delta.
DeltaStreamer``): new nodes with their ``routed_experts`` and ``sampling_mask`` as raw
bytes, and ``routing_repairs`` when a later turn's prefill replaces the placeholder
last routing row of an earlier node. ``RefpipeEnvServer`` swaps in
``RefDeltaStreamer``, which

- keeps the trainable branches of each trace turn by turn (``verifiers_turns``): an
  open branch per trainable branch, appended with the rows each new turn made final
  (a turn's placeholder last routing row is held back until the next turn's prefill
  repairs it, so it is never written), closed when the trace completes
  (``Trace.is_completed``); at the end of the run it closes every trace the episode
  holds. A trace that still changes after its branches closed is kept again whole
  (the stale chunks are deleted, so no stale row is ever shipped);
- writes the refs into ``Trace.info["refpipe"]`` (``verifiers_branches.INFO_KEY``),
  which rides the stream as a scalar field and survives the client's validation;
- strips the arrays from every node it streams and drops ``routing_repairs``;
- deletes, through the ledger and exactly once, the kept and open branches of a trace
  that leaves the run (a retried agent attempt or episode attempt, announced as
  ``discard``), and every kept or open branch of a run that is cancelled or fails.

Appends, keeps and deletes run on a thread pool, one job at a time per run, so the event loop
never waits on storage. Once the run's reply is sent, its refs belong to the client.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field
from verifiers.v1.configs.env import EnvConfig
from verifiers.v1.serve.delta import DeltaStreamer, TraceSummary, dump, pack
from verifiers.v1.serve.server import EnvServer
from verifiers.v1.serve.types import RunRequest, RunResponse
from verifiers.v1.trace import Trace

from refpipe.integrations.verifiers_branches import (
    INFO_KEY,
    BranchRef,
    fingerprint,
    refs_record,
    side_channels,
    trainable_branches,
)
from refpipe.integrations.verifiers_turns import OpenBranches, Step, TraceTurns
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import RefpipeError
from refpipe.storage.ledger import Ledger

logger = logging.getLogger(__name__)

ARRAY_KEYS = ("routed_experts", "sampling_mask")
"""``MessageNode`` fields that never ride the stream."""


class RefpipeServeConfig(BaseModel):
    """What a refpipe env-server worker needs: the run's storage and fields, and its name."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    storage: StorageConfig
    """The run's storage (where branches are kept)."""
    fields: FieldsConfig
    """The run's field shapes: ``num_layers``, ``top_k``, ``num_experts`` and/or ``sampling_mask``."""
    actor: str = Field(default_factory=lambda: default_env_actor(os.getpid()))
    """Ledger actor name, unique per worker process (a second live session of one actor is refused).
    Default ``env_<host>_<pid>``: never shared by two processes; set ``env_<host>_<replica>`` to keep one
    name across restarts of a replica."""
    max_concurrent_keeps: int = Field(default=4, ge=1, le=64)
    """Threads this worker uses to keep and delete branches (each run uses one at a time)."""


def default_env_actor(replica: int) -> str:
    """``env_<host>_<replica>`` with the host name cut to the actor alphabet (``[A-Za-z0-9._-]``)."""
    host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname()).strip(".-")[:100] or "host"
    return f"env_{host}_{replica}"


@dataclass
class _Kept:
    fingerprint: tuple
    refs: list[BranchRef]


@dataclass
class _Job:
    trace_id: str
    reason: str | None = None
    """Why the trace's closed refs (if any) are deleted first; None: they stay."""
    steps: list[Step] = field(default_factory=list)
    """Open-branch steps (``verifiers_turns``): this turn's appends, closes, discards."""
    fingerprint: tuple | None = None
    """Set: the trace's refs are published (its branches close, or are kept whole)."""
    branches: list[tuple[int, Branch]] | None = None
    """``(leaf, branch)`` to keep whole (a trace that changed after its branches closed)."""


class RunKeeps:
    """The kept branches of one served run, by trace id.

    ``plan`` runs on the event loop (it reads live traces); ``apply`` and ``abandon``
    run in a worker thread, one at a time (``RefDeltaStreamer`` serialises them).
    """

    def __init__(self, keeper: Keeper):
        self.keeper = keeper
        self.kept: dict[str, _Kept] = {}
        self.turns: dict[str, TraceTurns] = {}
        self.branches = OpenBranches(keeper)

    def plan(self, traces: list[Trace], *, final: bool) -> list[_Job]:
        """Jobs bringing the kept set in line with ``traces``: discard the branches of traces
        that left, append each live trace's new rows, close the branches of completed traces
        (``final``: every trace), keep whole again a closed trace whose arrays changed.

        Raises:
            FieldError: a path's nodes carry routing only in part (nothing of the plan ran).
        """
        live = {trace.id for trace in traces}
        jobs = [self._left(tid) for tid in {**self.kept, **self.turns} if tid not in live]
        for trace in traces:
            done = final or trace.is_completed
            old = self.kept.get(trace.id)
            if old is None:
                turns = self.turns.setdefault(trace.id, TraceTurns(trace.id))
                steps = turns.advance(trace, close=done)
                if done:
                    del self.turns[trace.id]
                if steps or done:
                    jobs.append(_Job(trace.id, steps=steps, fingerprint=fingerprint(trace) if done else None))
                continue
            fp = fingerprint(trace)
            if not done or old.fingerprint == fp:
                continue
            branches = [(leaf, b) for leaf, tb in trainable_branches(trace)
                        if (b := side_channels(trace.id, leaf, tb)) is not None]
            jobs.append(_Job(trace.id, f"stale: trace {trace.id} changed after keep", fingerprint=fp,
                             branches=branches))
        return jobs

    def _left(self, trace_id: str) -> _Job:
        """The job deleting the closed and open branches of a trace that left the run."""
        reason = f"discarded attempt: trace {trace_id} left the run (retried)"
        turns = self.turns.pop(trace_id, None)
        return _Job(trace_id, reason, turns.drop(reason) if turns is not None else [])

    def apply(self, jobs: list[_Job]) -> dict[str, list[BranchRef]]:
        """Run ``jobs``: delete previous refs, run the open-branch steps, keep whole branches;
        return trace id -> refs published.

        Raises:
            RefpipeError: a keep, append, close or delete failed (what was kept so far stays tracked).
        """
        out: dict[str, list[BranchRef]] = {}
        for job in jobs:
            old = self.kept.pop(job.trace_id, None) if job.reason is not None else None
            if old is not None and old.refs:
                self.keeper.discard([r.ref for r in old.refs], reason=job.reason or "")
            refs: list[BranchRef] = []
            if job.fingerprint is not None:
                self.kept[job.trace_id] = _Kept(job.fingerprint, refs)
                out[job.trace_id] = refs
            self.branches.run(job.steps, refs)
            for leaf, branch in job.branches or ():
                refs.append(BranchRef(leaf, self.keeper.keep(branch)))
        return out

    def abandon(self, reason: str) -> int:
        """Delete every branch this run kept or holds open; return how many."""
        refs = [r.ref for kept in self.kept.values() for r in kept.refs]
        self.kept.clear()
        self.turns.clear()
        n = self.branches.discard_all(reason)
        if refs:
            self.keeper.discard(refs, reason=reason)
        return len(refs) + n


def _after(previous: concurrent.futures.Future | None, fn: Callable, *args):
    if previous is not None:
        concurrent.futures.wait([previous])
    return fn(*args)


class RefDeltaStreamer(DeltaStreamer):
    """verifiers' ``DeltaStreamer`` that ships refs instead of arrays (see the module doc).

    Args:
        traces: the run's live traces (``lambda: slot.traces``).
        send: sends one delta.
        keeps: this run's ``RunKeeps``.
        pool: threads for keeps and deletes.

    Raises (from ``__aexit__``, after deleting everything the run kept):
        RefpipeError: a keep or delete failed during the run.
    """

    def __init__(self, traces: Callable[[], Iterable[Trace]], send: Callable[[dict], Awaitable[None]],
                 keeps: RunKeeps, pool: concurrent.futures.Executor) -> None:
        super().__init__(traces, self._send_nonempty)
        self._send = send
        self.keeps, self.pool = keeps, pool
        self.failure: RefpipeError | None = None
        self._final = False
        self._job: concurrent.futures.Future | None = None
        self._keep_lock = asyncio.Lock()

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self._final = exc_type is None
        try:
            await super().__aexit__(exc_type, exc, tb)
        except BaseException as e:
            await self._abandon(f"run failed while streaming its end: {type(e).__name__}")
            raise
        if exc_type is not None or self.failure is not None:
            failed = exc_type or type(self.failure)
            why = "cancelled" if failed is asyncio.CancelledError else f"failed: {failed.__name__}"
            await self._abandon(f"run abandoned: {why}")
        if exc_type is None and self.failure is not None:
            raise self.failure

    async def flush(self) -> None:
        async with self._keep_lock:
            if self.failure is None:
                await self._sync_refs()
        await super().flush()

    def diff(self) -> list[tuple[str, dict, object]]:
        deltas = super().diff()
        for _, delta, _ in deltas:
            delta.pop("routing_repairs", None)
            for node in delta.get("nodes", ()):
                for key in ARRAY_KEYS:
                    node.pop(key, None)
        return deltas

    async def _send_nonempty(self, delta: dict) -> None:
        if len(delta) > 1:  # a delta whose only change was stripped carries nothing
            await self._send(delta)

    async def _sync_refs(self) -> None:
        traces = list(self.traces())
        try:
            jobs = self.keeps.plan(traces, final=self._final)
            if not jobs:
                return
            kept = await self._in_thread(self.keeps.apply, jobs)
        except RefpipeError as e:
            logger.error("refpipe keep failed; the run will fail: %s", e)
            self.failure = e
            return
        for trace in traces:
            if trace.id in kept:
                if kept[trace.id]:
                    trace.info[INFO_KEY] = refs_record(kept[trace.id])
                else:
                    trace.info.pop(INFO_KEY, None)

    async def _abandon(self, reason: str) -> None:
        try:
            n = await self._in_thread(self.keeps.abandon, reason)
        except RefpipeError as e:
            logger.error("refpipe: deleting the branches of an abandoned run failed (audit lists them): %s", e)
            return
        if n:
            logger.info("refpipe: deleted %d kept branches (%s)", n, reason)

    async def _in_thread(self, fn: Callable, *args):
        """Run ``fn`` on the pool after this run's previous job; a cancelled caller does
        not cancel the job (a keep in flight is always tracked, so ``abandon`` sees it)."""
        self._job = self.pool.submit(_after, self._job, fn, *args)
        done = asyncio.wrap_future(self._job)
        done.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if we are cancelled
        await asyncio.wait([done])
        return done.result()


class RefpipeEnvServer(EnvServer):
    """verifiers' ``EnvServer`` whose episode streams carry refs instead of side-channel arrays.

    One per worker process (verifiers' ``EnvServerPool`` spawns plain ``EnvServer``s; run
    several of these with distinct ``refpipe.actor`` names instead). Start it like the
    base: ``RefpipeEnvServer.run_server(config=..., refpipe=..., address=...)``. Clients
    are unchanged (``EnvClient``); ``integrations.verifiers_client`` turns the episodes
    into orchestrator episodes.

    Args:
        config: the env config (as for ``EnvServer``).
        refpipe: storage, fields and ledger actor of this worker.
        address: ZMQ bind address (``tcp://127.0.0.1:0`` picks a port).
        max_concurrent: episode bound of this worker.
    """

    def __init__(self, config: EnvConfig, refpipe: RefpipeServeConfig, address: str = "tcp://127.0.0.1:5000",
                 max_concurrent: int | None = None) -> None:
        super().__init__(config, address, max_concurrent)
        store = open_store(refpipe.storage)
        self.ledger = Ledger(store, refpipe.actor)
        self.keeper = Keeper(store, self.ledger, refpipe.fields, refpipe.storage)
        self.keep_pool = concurrent.futures.ThreadPoolExecutor(refpipe.max_concurrent_keeps,
                                                               thread_name_prefix=f"refpipe-{refpipe.actor}")

    async def _run(self, req: RunRequest, client_id: bytes, request_id: bytes) -> RunResponse:
        # EnvServer._run (verifiers 0.4.0) with RefDeltaStreamer in place of DeltaStreamer.
        ctx = self._context(req.client, req.model, req.sampling)
        (slot,) = self.env.slots(self._build_task(req.task_data))

        async def send_delta(delta: dict) -> None:
            await self.frontend.send_multipart([client_id, request_id, b"delta", pack(delta)], copy=False)

        async with RefDeltaStreamer(lambda: slot.traces, send_delta, RunKeeps(self.keeper), self.keep_pool) as streamer:
            episode = await self.env.run_slot(slot, ctx, self._gate, on_trace=streamer.watch)
        return RunResponse(
            head=dump(episode, exclude={"traces"}),
            traces=[TraceSummary(id=t.id, nodes=len(t.nodes), calls=len(t.calls)) for t in episode.traces],
        )

    async def run(self) -> None:
        """Serve until cancelled; then let cancelled runs delete what they kept, and close the ledger."""
        try:
            await super().run()
        finally:
            runs = list(self._running.values())
            for task in runs:
                task.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
            self.keep_pool.shutdown(wait=True)
            self.ledger.close()
