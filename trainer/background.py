"""A trainer rank's data path off the critical path: prefetch of the next step, release in the background.

``Prefetch`` fetches and assembles step N+1 on one background thread while step N trains;
``BackgroundRelease`` deletes a trained step's chunks on another while the next step trains (at most two
releases pending, never waited for by the step right after).
Neither joins a collective: failure agreement, stand-ins and metrics stay on the rank's main
thread (``trainer.step``), so every rank joins every collective in the same order whether or
not its prefetch found the step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from refpipe.pipeline.step_file import StepFile
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import DoubleDeleteError, KeyNotFoundError, StorageError, UnknownRefError
from refpipe.storage.ledger import Ledger
from refpipe.trainer.fetch import FetchedStep

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """One step's data as the rank's main thread gets it: the step file and what this rank fetched."""

    step_file: StepFile
    fetched: FetchedStep
    prefetched: bool
    """Whether the fetch ran in the background while the previous step trained."""
    found_at: float
    """``time.monotonic()`` when the step file had been read (the end of waiting for it to appear)."""


class Prefetch:
    """Fetch + assemble of the next step on one background thread (at most one step ahead).

    ``start(s)`` looks for step ``s``'s file every ``poll_s`` seconds and, once it is there,
    loads it and fetches this rank's micro batches; ``take(s)`` stops the looking and waits
    for a fetch already under way. A step file that is not there when ``take`` comes ends
    the prefetch early: the caller then loads and fetches as usual. So is any error while
    loading (an invalid step file): the caller's own load raises it where it always did.

    Memory bound: one ``Prefetch`` holds at most one step's assembled arrays, and the
    caller starts it only after the current step's fetch is done, so a rank holds at most
    two steps of its arrays (the one training and the one prefetched).

    Args:
        load: loads and validates a step file that exists (raises ``KeyNotFoundError`` if it
            does not yet).
        fetch: fetches and assembles this rank's micro batches of a step file (never raises).
        poll_s: seconds between looks for the step file.
    """

    def __init__(self, load: Callable[[int], StepFile], fetch: Callable[[StepFile], FetchedStep], poll_s: float):
        self._load, self._fetch, self._poll_s = load, fetch, poll_s
        self._step: int | None = None
        self._thread: threading.Thread | None = None
        self._requests: queue.SimpleQueue[tuple[int, threading.Event, threading.Event] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._done: threading.Event | None = None
        self._result: Prepared | None = None

    def start(self, step: int) -> None:
        """Begin looking for and fetching step ``step`` (after ``take`` of the previous one).

        The prefetch thread is started once, at the first call (a daemon: a rank that exits without ``take``
        is not held up by its polling), then handed each step: ``Thread.start`` waits until the new thread
        holds the GIL, which behind busy fetch or release threads took 5-30 ms of the main thread per step."""
        self._step, self._result, self._stop, self._done = step, None, threading.Event(), threading.Event()
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, daemon=True, name="prefetch")
            self._thread.start()
        self._requests.put((step, self._stop, self._done))

    def _serve(self) -> None:
        while (request := self._requests.get()) is not None:
            step, stop, done = request
            try:
                self._run(step, stop)
            except Exception:  # noqa: BLE001 -- a bug: logged, and the caller loads and fetches the step itself
                log.exception("prefetch of step %d raised", step)
            finally:
                done.set()

    def _run(self, step: int, stop: threading.Event) -> None:
        while True:
            try:
                step_file = self._load(step)
            except KeyNotFoundError:
                if stop.wait(self._poll_s):
                    return
                continue
            except Exception as e:  # noqa: BLE001 -- the caller's own load raises it on its main thread
                log.info("prefetch of step %d ended: %s: %s", step, type(e).__name__, e)
                return
            found_at = time.monotonic()
            self._result = Prepared(step_file, self._fetch(step_file), prefetched=True, found_at=found_at)
            return

    def take(self, step: int) -> Prepared | None:
        """Stop looking; wait for a fetch under way. Returns step ``step``'s prefetched data, or None."""
        if self._done is None:
            return None
        self._stop.set()
        self._done.wait()
        result = self._result if self._step == step else None
        self._done, self._step, self._result = None, None, None
        return result

    def close(self) -> None:
        """Stop any prefetch (its result is dropped) and end the prefetch thread."""
        self.take(-1)
        if self._thread is not None:
            self._requests.put(None)
            self._thread.join()
            self._thread = None


@dataclass
class ReleaseCounts:
    """What background releases did (one rank), counted once the main thread collected them."""

    deletes: int = 0
    """Chunks deleted."""
    problems: int = 0
    """Double deletes and deletes of never-kept chunks the ledger reported."""
    failures: int = 0
    """Chunks whose delete failed (claimed or not; recorded as ``delete_failed``, retried at the next release)."""

    def add(self, other: ReleaseCounts) -> None:
        """Add ``other``'s counts to these."""
        self.deletes += other.deletes
        self.problems += other.problems
        self.failures += other.failures


class BackgroundRelease:
    """The ``mp_rank == 0`` rank's deletes of trained steps, on one background thread, in step order.

    ``submit`` queues a release and returns without waiting for the one before it: the deletes of
    step N run while step N+1 trains, and if they outlast it (under load a 32-chunk release that takes
    0.015 s alone took 0.1-0.3 s beside the next step's prefetch threads and the other rank, on 2 cores)
    step N+1's release queues behind them instead of stalling the main thread. Bound: at most two
    releases pending (one running, one queued); ``submit`` of step N first waits for the releases
    before step N-1's, so a store slower than a whole step still shows up as exposed time instead of a
    growing queue. Releases run one at a time, in the order submitted.

    A delete that fails (``StorageError``: the store refused or kept failing after its retries: the
    ref's outcome in ``DeleteResult`` is ``failed``) is recorded in the ledger as ``delete_failed`` and
    retried by the release thread before the next release's deletes, and once more at ``wait(retry=True)``;
    the ledger keeps this session's claims, so a retry finishes its own claim instead of reporting a double
    delete. A release that still fails at the end leaves its delete records, and ``refpipe sweep`` finishes
    the deletes.

    Counts are taken by the main thread only from releases it has waited for, so which release a
    step's metrics report depends on the call order alone, never on thread timing: with
    ``after_step``, step N's metrics count step N-2's release (``submit`` of step N waited for it),
    ``wait`` (``TrainerRank.finish``) the last two.

    Args:
        ledger: the DP rank's ledger (``trainer_dp<dp_rank>``).
        dp_rank: recorded in the ``release`` events.
        max_concurrency: threads claiming deletes at once.
    """

    MAX_PENDING = 2
    """Releases submitted and not yet waited for, at most (the one running and one queued)."""

    def __init__(self, ledger: Ledger, dp_rank: int, max_concurrency: int):
        self.ledger, self.dp_rank, self.max_concurrency = ledger, dp_rank, max_concurrency
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="release")
        self._pending: deque[Future[ReleaseCounts]] = deque()
        self._failed: list[tuple[int, list[PayloadRef]]] = []
        """Failed deletes awaiting their retry; touched by the release thread, or by the main thread once no
        release is pending."""
        self._counts = ReleaseCounts()

    def submit(self, step: int, refs: list[PayloadRef]) -> None:
        """Queue the deletes of ``refs`` (step ``step``'s owned chunks) in the background; first wait for (and count)
        the releases before the latest one, so at most ``MAX_PENDING`` are pending."""
        self._collect(keep=self.MAX_PENDING - 1)
        self._pending.append(self._pool.submit(self._release_with_retries, step, refs))

    def wait(self, *, retry: bool = False) -> None:
        """Wait for every pending release (re-raising a bug in one) and count them; ``retry``: then retry failed
        deletes once."""
        self._collect(keep=0)
        if retry and self._failed:
            failed, self._failed = self._failed, []
            self._counts.add(self._release_all(failed))

    def _collect(self, keep: int) -> None:
        """Wait for the oldest pending releases until ``keep`` are left, adding their counts."""
        while len(self._pending) > keep:
            self._counts.add(self._pending[0].result())
            self._pending.popleft()

    def take_counts(self) -> ReleaseCounts:
        """The counts of the releases collected by ``submit``/``wait`` since the last call, and reset them."""
        counts, self._counts = self._counts, ReleaseCounts()
        return counts

    def _release_with_retries(self, step: int, refs: list[PayloadRef]) -> ReleaseCounts:
        """On the release thread: retry the earlier releases' failed deletes, then delete step ``step``'s."""
        batches, self._failed = [*self._failed, (step, refs)], []
        return self._release_all(batches)

    def _release_all(self, batches: list[tuple[int, list[PayloadRef]]]) -> ReleaseCounts:
        counts = ReleaseCounts()
        for step, refs in batches:
            self._release(step, refs, counts)
        return counts

    def _release(self, step: int, refs: list[PayloadRef], counts: ReleaseCounts) -> None:
        try:
            result = self.ledger.release(step, refs, reason=f"trained step {step}",
                                         max_concurrency=self.max_concurrency)
        except (DoubleDeleteError, UnknownRefError) as e:
            log.error("step %d dp_rank=%d release: %s", step, self.dp_rank, e)
            assert e.result is not None  # Ledger.delete raises these with the call's result
            result = e.result
        except StorageError as e:  # the ledger could not write its own events
            self._failed_release(step, refs, e, counts)
            return
        counts.deletes += len(result.deleted)
        counts.problems += len(result.double_deletes) + len(result.unknown)
        failed = [r for r in refs if r.uri in result.failed]
        if failed:
            self._failed_release(step, failed, result.failed[failed[0].uri], counts)
            return
        self.ledger.record("release", step=step, dp_rank=self.dp_rank)
        self.ledger.flush()

    def _failed_release(self, step: int, refs: list[PayloadRef], error: StorageError, counts: ReleaseCounts) -> None:
        """Record and keep for a retry the refs of step ``step`` whose delete failed (unfinished deletes)."""
        log.error("step %d dp_rank=%d release: %d deletes failed (retried later): %s", step, self.dp_rank,
                  len(refs), error)
        self.ledger.record("delete_failed", step=step, dp_rank=self.dp_rank, chunks=len(refs), error=str(error))
        self.ledger.flush()
        self._failed.append((step, refs))
        counts.failures += len(refs)

    def shutdown(self) -> None:
        """Wait for every pending release, retry failed deletes once, stop the thread."""
        try:
            self.wait(retry=True)
        finally:
            self._pool.shutdown(wait=True)
