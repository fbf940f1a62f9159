"""A trainer rank's reads: wait for a step file, fetch its own micro batches' chunks.

Every rank fetches for itself (model-parallel peers of one DP rank each fetch the same
chunks): only the refs its DP rank's micro batches use, each once, cut to the most
tokens any of its sequences keeps, so a truncated slice reads only its kept rows
(``storage.fetch.fetch_arrays``). Fetches run in parallel on at most
``StorageConfig.max_concurrent_fetches`` threads; transient store errors are retried
inside the store (``StorageConfig.max_retries``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from pipeline.step_file import StepFile, StepHeader, step_key
from storage.errors import ChunkNotFoundError, StepFileError
from storage.fetch import FetchStats, fetch_many
from storage.store import Store

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
        except ChunkNotFoundError:
            waited_s = time.monotonic() - started
            if waited_s >= timeout_s:
                raise StepFileError(f"step file {store.uri(step_key(step))} did not appear: waited {waited_s:.1f} s "
                                    f"(step_timeout_s={timeout_s}, polled every {poll_s} s)") from None
            time.sleep(min(poll_s, max(0.0, timeout_s - waited_s)))


@dataclass
class FetchedStep:
    """What one rank fetched for its DP rank's micro batches of one step."""

    arrays: dict[int, dict[str, np.ndarray]] = field(default_factory=dict)
    """ref index -> arrays (read-only), cut to the most tokens this DP rank keeps of that ref."""
    failed: set[int] = field(default_factory=set)
    """Indices (within the DP rank) of micro batches with at least one chunk that could not be fetched."""
    errors: list[str] = field(default_factory=list)
    """One line per failed fetch (or one for an exception that ended the whole fetch)."""
    chunks: int = 0
    """Chunks fetched."""
    nbytes: int = 0
    """Bytes of the arrays fetched (kept rows only)."""
    seconds: float = 0.0
    """Wall time of the fetch."""


def own_requests(header: StepHeader, dp_rank: int) -> dict[int, int]:
    """ref index -> tokens to fetch: the most any sequence of ``dp_rank``'s micro batches keeps of it."""
    need: dict[int, int] = {}
    for mb in header.micro_batches_of(dp_rank):
        for seq in mb.sequences:
            if seq.ref is not None:
                need[seq.ref] = max(need.get(seq.ref, 0), seq.num_tokens)
    return need


def fetch_own(store: Store, header: StepHeader, dp_rank: int, *, max_concurrency: int) -> FetchedStep:
    """Fetch the chunks of DP rank ``dp_rank``'s micro batches; never raises for a failed fetch.

    A fetch that ends in a typed error (missing, corrupt, still failing after retries)
    fails the micro batches that use that ref. Any other exception out of the fetch (an
    I/O error the store does not classify, a bug) is logged with its traceback and fails
    every micro batch of the DP rank, so this rank still joins the failure all-reduce
    instead of leaving its peers waiting.

    Returns:
        ``FetchedStep`` with the arrays of every ref that was fetched.
    """
    started = time.monotonic()
    need = own_requests(header, dp_rank)
    order = sorted(need)
    out, stats = FetchedStep(), FetchStats()
    try:
        results = fetch_many(store, [(header.refs[i], need[i]) for i in order],
                             max_concurrency=max_concurrency, stats=stats)
    except Exception as e:  # noqa: BLE001 -- the documented boundary: any failure becomes failure flags
        log.exception("step %d dp_rank=%d: fetch raised; every micro batch of this DP rank fails", header.step, dp_rank)
        out.failed = {mb.index for mb in header.micro_batches_of(dp_rank)}
        out.errors.append(f"fetch raised {type(e).__name__}: {e}")
        out.seconds = time.monotonic() - started
        return out
    bad = set()
    for i, result in zip(order, results):
        if isinstance(result, dict):
            out.arrays[i] = result
        else:
            bad.add(i)
            out.errors.append(f"ref {i} ({header.refs[i].uri}): {type(result).__name__}: {result}")
    out.failed = {mb.index for mb in header.micro_batches_of(dp_rank) if any(s.ref in bad for s in mb.sequences)}
    out.chunks, out.nbytes, out.seconds = stats.chunks, stats.nbytes, time.monotonic() - started
    for line in out.errors:
        log.warning("step %d dp_rank=%d: %s", header.step, dp_rank, line)
    return out
