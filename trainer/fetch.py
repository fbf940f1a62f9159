"""A trainer rank's reads: wait for a step file; fetch and assemble its own micro batches.

Every rank fetches for itself (model-parallel peers of one DP rank each fetch the same
chunks): only the refs its DP rank's micro batches use, each once, cut to the most
tokens any of its sequences keeps, so a truncated slice reads only its kept rows
(``storage.chunk_read.fetch_into``). Fetches run on at most ``StorageConfig.max_concurrent_fetches``
threads (``storage.concurrency.bounded_map``; its default: ``StorageConfig.fetch_threads``);
transient store errors are retried inside the store (``StorageConfig.max_retries``).

Each micro batch's output arrays are allocated first (``trainer.plan.plan_micro_batch``)
and each whole uncompressed chunk is read straight into them: the chunk's rows land in
their final place (``storage.chunk_read.fetch_into``, one ``preadv``, the crc32c
computed over those arrays). A ref is read once, into the targets the first micro batch
planning it names (``MicroBatchPlan.read_targets``: its first sequence that keeps as many tokens
as are fetched), which then records them as read (``mark_read``); its other uses (a borrowed padding dummy, a
shorter cut) and cut or compressed chunks are copied. The thread that fetches a chunk checks
its arrays against their declared bounds right after the read, while they are in cache
(``trainer.assemble.clean_fetched``). The thread that fetches a micro batch's last chunk
finishes it (``finish_micro_batch``: the copies, padding, streams), hashes it
(``micro_batch_hash``: the step's replay hash, over the refs and what assembly made, not the rows read
again) and then drops the chunks no other micro batch needs. A micro batch that fails is dropped
whole, so rows written into it before the failure never reach training.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.step_file import StepFile
from refpipe.pipeline.step_header import StepHeader
from refpipe.storage.chunk_read import fetch_into
from refpipe.storage.concurrency import bounded_map
from refpipe.storage.errors import KeyNotFoundError, RefpipeError, StepFileError
from refpipe.storage.layout import step_key
from refpipe.storage.store import Store
from refpipe.trainer.assemble import AssembledMicroBatch, clean_fetched, finish_micro_batch
from refpipe.trainer.buffers import BufferPool
from refpipe.trainer.plan import MicroBatchPlan, plan_micro_batch
from refpipe.trainer.replay_hash import micro_batch_hash

log = logging.getLogger(__name__)


def wait_for_step(store: Store, step: int, *, timeout_s: float, poll_s: float) -> StepFile:
    """Read step ``step``'s file, polling every ``poll_s`` seconds until it appears.

    Raises:
        StepFileError: the file did not appear within ``timeout_s`` seconds (the message
            names its URI and how long this rank waited), or it is invalid.
    """
    started = time.monotonic()
    while True:
        try:
            return StepFile.read(store, step)
        except KeyNotFoundError:
            waited_s = time.monotonic() - started
            if waited_s >= timeout_s:
                raise StepFileError(f"step file {store.uri(step_key(step))} did not appear: waited {waited_s:.1f} s "
                                    f"(step_timeout_s={timeout_s}, polled every {poll_s} s)") from None
            time.sleep(min(poll_s, max(0.0, timeout_s - waited_s)))


@dataclass
class FetchedStep:
    """What one rank fetched and assembled of its DP rank's micro batches of one step."""

    assembled: dict[int, AssembledMicroBatch] = field(default_factory=dict)
    """index (within the DP rank) -> the micro batch, for every micro batch fetched and assembled here."""
    failed: set[int] = field(default_factory=set)
    """Indices of micro batches this rank could not fetch or assemble."""
    hashes: dict[int, str] = field(default_factory=dict)
    """index -> ``trainer.replay_hash.micro_batch_hash`` of ``assembled[index]``, computed by the thread that
    assembled it (off the rank's main thread; the step's replay hashes)."""
    errors: list[str] = field(default_factory=list)
    """One line per failed fetch or assembly (or one for an exception that ended the whole fetch)."""
    chunks: int = 0
    """Chunks fetched."""
    nbytes: int = 0
    """Bytes of the arrays fetched (kept rows only)."""
    chunks_in_place: int = 0
    """Chunks read straight into their micro batch's arrays (``Fetched.in_place``: no copy)."""
    seconds: float = 0.0
    """Wall time of fetching and assembling."""


def own_requests(header: StepHeader, dp_rank: int) -> dict[int, int]:
    """ref index -> tokens to fetch: the most any sequence of ``dp_rank``'s micro batches keeps of it, over the
    micro batches whose refs can be used (``StepHeader.micro_batch_problem``)."""
    need: dict[int, int] = {}
    for mb in header.micro_batches_of(dp_rank):
        if header.micro_batch_problem(mb):
            continue
        for seq in mb.sequences:
            if seq.ref is not None:
                need[seq.ref] = max(need.get(seq.ref, 0), seq.num_tokens)
    return need


def fetch_own(store: Store, step_file: StepFile, dp_rank: int, fields: FieldsConfig, *,
              max_concurrency: int, buffers: BufferPool | None = None) -> FetchedStep:
    """Fetch the chunks of DP rank ``dp_rank``'s micro batches and assemble each micro batch.

    ``buffers``: where the micro batches' arrays are allocated (the rank's pool, reused across
    steps); default: fresh ``np.empty`` arrays.

    Never raises for a failed fetch. A micro batch whose refs cannot be used (a slice longer than
    its chunk, a ref whose rows disagree with its token counts: ``StepHeader.micro_batch_problem``)
    fails without a read. A fetch or assembly that ends in a typed error (missing, corrupt, still
    failing after retries, rows that disagree with the step file) fails the micro batches that use
    that ref. Any other exception (an I/O error the store does not
    classify, a bug) is logged with its traceback and fails every micro batch of the DP
    rank, so this rank still joins the failure all-reduce instead of leaving its peers waiting.

    Returns:
        ``FetchedStep``: the assembled micro batches, the failed indices and the counters.
    """
    started = time.monotonic()
    run = _OwnFetch(store, step_file, dp_rank, fields, np.empty if buffers is None else buffers.empty)
    try:
        run.run(max_concurrency)
    except Exception as e:  # noqa: BLE001 -- the documented boundary: any failure becomes failure flags
        log.exception("step %d dp_rank=%d: fetch raised; every micro batch of this DP rank fails",
                      step_file.header.step, dp_rank)
        run.out.assembled.clear()
        run.out.hashes.clear()
        run.out.failed = set(run.ref_indices_of_mb)
        run.out.errors.append(f"fetch raised {type(e).__name__}: {e}")
    run.out.seconds = time.monotonic() - started
    for line in run.out.errors:
        log.warning("step %d dp_rank=%d: %s", step_file.header.step, dp_rank, line)
    return run.out


class _OwnFetch:
    """Shared state of one rank's pipelined fetch: which chunks each micro batch still waits for."""

    def __init__(self, store: Store, step_file: StepFile, dp_rank: int, fields: FieldsConfig,
                 empty: Callable[..., np.ndarray]):
        self.store, self.step_file, self.dp_rank, self.fields, self.empty = store, step_file, dp_rank, fields, empty
        self.header = step_file.header
        self.need = own_requests(self.header, dp_rank)
        self.micro_batches = self.header.micro_batches_of(dp_rank)
        self.unusable = {mb.index: problem for mb in self.micro_batches
                         if (problem := self.header.micro_batch_problem(mb))}
        # Identities only: a micro batch by its index within the DP rank, a ref by its index in ``header.refs``.
        self.ref_indices_of_mb: dict[int, list[int]] = {
            mb.index: [] if mb.index in self.unusable else sorted({s.ref for s in mb.sequences if s.ref is not None})
            for mb in self.micro_batches}
        self.mb_indices_of_ref: dict[int, list[int]] = {i: [] for i in self.need}
        for index, refs in self.ref_indices_of_mb.items():
            for ref in refs:
                self.mb_indices_of_ref[ref].append(index)
        self.chunks_pending = {index: len(refs) for index, refs in self.ref_indices_of_mb.items()}
        """micro batch index -> its refs not fetched (or failed) yet; 0: it can be assembled."""
        self.mbs_pending = {ref: len(indices) for ref, indices in self.mb_indices_of_ref.items()}
        """ref index -> micro batches using it not yet assembled; 0: its fetched arrays are dropped."""
        self.arrays: dict[int, dict[str, np.ndarray]] = {}
        self.clean: dict[int, frozenset[str]] = {}
        """ref index -> its fetched arrays whose every value passed its bounds (``clean_fetched``)."""
        self.out, self.lock = FetchedStep(), threading.Lock()
        self.plans: dict[int, MicroBatchPlan] = {}

    def read_targets(self, ref: int) -> tuple[MicroBatchPlan | None, int, dict[str, np.ndarray]]:
        """``(plan, s, destinations)`` ref ``ref`` is read into: what the first planned micro batch using it
        names (``MicroBatchPlan.read_targets``); ``(None, -1, {})``: fresh arrays."""
        for index in self.mb_indices_of_ref[ref]:
            plan = self.plans.get(index)
            found = plan.read_targets(ref, self.need[ref]) if plan else None
            if found:
                return plan, *found
        return None, -1, {}

    def run(self, max_concurrency: int) -> None:
        """Fail the micro batches whose refs cannot be used, plan the others, then fetch every ref they use on a
        bounded pool (micro batches without refs finish there)."""
        for index, problem in self.unusable.items():
            self._fail([index], problem)
        for mb in self.micro_batches:
            if mb.index in self.unusable:
                continue
            try:
                self.plans[mb.index] = plan_micro_batch(mb, self.header.refs, seq_len=self.header.seq_len,
                                                        fields=self.fields, empty=self.empty)
            except RefpipeError as e:
                self._fail([mb.index], f"micro batch {mb.index}: {type(e).__name__}: {e}")
        no_refs = [index for index, refs in self.ref_indices_of_mb.items() if not refs and index not in self.unusable]
        tasks = [(self.fetch_ref, ref) for ref in sorted(self.need)] + [(self.assemble, i) for i in no_refs]
        bounded_map(lambda task: task[0](task[1]), tasks, max_concurrency)

    def fetch_ref(self, ref: int) -> None:
        """Fetch one ref; assemble each micro batch whose last chunk this was."""
        plan, s, destinations = self.read_targets(ref)
        try:
            fetched = fetch_into(self.store, self.header.refs[ref], self.need[ref], destinations, self.header.step)
            clean = clean_fetched(fetched.arrays, self.fields)  # right after the read: its bytes are in cache
        except RefpipeError as e:
            fetched = None
            self._fail(self.mb_indices_of_ref[ref], f"ref {ref} ({self.header.refs[ref].uri}): {type(e).__name__}: {e}")
        ready = []
        with self.lock:
            if fetched is not None:
                self.arrays[ref], self.clean[ref] = fetched.arrays, clean
                if plan is not None:
                    plan.mark_read(s, destinations)
                self.out.chunks += 1
                self.out.nbytes += sum(a.nbytes for a in fetched.arrays.values())
                self.out.chunks_in_place += fetched.in_place
            for index in self.mb_indices_of_ref[ref]:
                self.chunks_pending[index] -= 1
                if self.chunks_pending[index] == 0:
                    ready.append(index)
        for index in ready:
            self.assemble(index)

    def assemble(self, index: int) -> None:
        """Finish micro batch ``index`` unless it failed, then release chunks no one else waits for."""
        with self.lock:
            failed = index in self.out.failed
            arrays = {ref: self.arrays[ref] for ref in self.ref_indices_of_mb[index] if ref in self.arrays}
            clean = {ref: self.clean[ref] for ref in arrays}
        if not failed:
            try:
                done = finish_micro_batch(self.plans[index], self.step_file.streams(self.dp_rank, index), arrays,
                                          clean)
            except RefpipeError as e:
                self._fail([index], f"micro batch {index}: {type(e).__name__}: {e}")
            else:
                digest = micro_batch_hash(done, self.header.refs)
                with self.lock:
                    self.out.assembled[index], self.out.hashes[index] = done, digest
        with self.lock:
            for ref in self.ref_indices_of_mb[index]:
                self.mbs_pending[ref] -= 1
                if self.mbs_pending[ref] == 0:
                    self.arrays.pop(ref, None)
                    self.clean.pop(ref, None)

    def _fail(self, indices: list[int], line: str) -> None:
        with self.lock:
            self.out.failed.update(indices)
            self.out.errors.append(line)
