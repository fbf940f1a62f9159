"""The one bounded-concurrency helper of refpipe's I/O fan-out: fetches, delete claims, deletes, listings, audits.

Threads, not processes: every call it runs waits on storage (``preadv``, ``link(2)``, HTTP) with the
GIL released, and crc32c and numpy copies release it too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def bounded_map(fn: Callable[[T], R], items: Iterable[T], max_concurrency: int, *,
                on_result: Callable[[R], None] | None = None) -> list[R]:
    """``[fn(x) for x in items]`` with at most ``max_concurrency`` calls in flight.

    Args:
        fn: called once per item, on a worker thread (on the calling thread when there is at most one item).
        items: the inputs, in order.
        max_concurrency: threads, at least 1.
        on_result: called on the calling thread with each result, in item order, as it is collected
            (progress bars).

    Returns:
        The results in the order of ``items``.

    Raises:
        ValueError: ``max_concurrency < 1``.
        Exception: the first exception of ``fn`` in item order, once every call has returned (a failing
            item never stops the others).
    """
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency={max_concurrency}: expected at least 1")
    items = list(items)
    if len(items) <= 1:
        out = [fn(x) for x in items]
        for result in out:
            if on_result is not None:
                on_result(result)
        return out
    with ThreadPoolExecutor(min(max_concurrency, len(items))) as pool:
        return _collect([pool.submit(fn, x) for x in items], on_result)


def _collect(futures: list[Future[R]], on_result: Callable[[R], None] | None) -> list[R]:
    """Every future's result in order; the first exception in order is raised once all have finished."""
    out, first_error = [], None
    for future in futures:
        try:
            result = future.result()
        except Exception as e:  # noqa: BLE001 -- raised below, after the rest have finished
            first_error = first_error or e
            continue
        out.append(result)
        if on_result is not None:
            on_result(result)
    if first_error is not None:
        raise first_error
    return out
