"""The value checks of a field declaration (``pipeline.field_decl.ValueChecks``), on numpy arrays.

Each check returns None or one line naming the first bad element: its row, its index within the row and its
value. They read each array a few times at memory speed (min and max; the distinct check compares the slots
of every row), so validation stays a small part of a keep (``bench/keep_fetch.py``, docs/fields.md).
"""

from __future__ import annotations

import math

import numpy as np

from refpipe.pipeline.field_decl import Dims, ValueChecks, value_bounds


def check_values(a: np.ndarray, checks: ValueChecks, dims: Dims, axes: tuple[int | str, ...] = ()) -> str | None:
    """The first problem of ``a`` [rows, *trailing] under ``checks``, or None. ``axes``: the declared trailing
    shape, whose dimension names label the index in the message (``row 3 [num_layers 2, top_k 1]``)."""
    problem = check_bounds(a, checks, dims, axes)
    if problem is None and checks.distinct:
        problem = check_distinct(a, axes)
    return problem


def check_bounds(a: np.ndarray, checks: ValueChecks, dims: Dims, axes: tuple[int | str, ...] = ()) -> str | None:
    """``finite``, ``low``, ``high`` and ``below`` (the sentinel passes them), or None.

    At most one pass each for min and max, only those a bound needs (NaN propagates into either, so a float
    array always gets one); a sentinel at an extreme costs one masked pass; the index is searched only
    once a bound is broken.
    """
    if not a.size:
        return None
    lo, hi = value_bounds(checks, dims)
    sentinel = checks.sentinel_value
    strict_float = a.dtype.kind == "f" and checks.finite
    need_min = lo > _dtype_min(a) or (strict_float and sentinel != -math.inf)
    need_max = hi < _dtype_max(a) or strict_float or (a.dtype.kind == "f" and not need_min)
    extremes = [float(v) for v in ((a.max(),) if need_max else ()) + ((a.min(),) if need_min else ())]
    if all(_within(v, lo, hi, checks.finite, sentinel) for v in extremes) and (
            sentinel is None or sentinel not in extremes or _all_within(a, lo, hi, checks)):
        return None
    bad = ~_elementwise_ok(a, lo, hi, checks)
    index = [int(i) for i in np.unravel_index(int(np.argmax(bad)), a.shape)]
    return f"{_where(index, axes)} value {a[tuple(index)].item()!r}: {_expectation(checks, dims, hi, a)}"


def check_distinct(a: np.ndarray, axes: tuple[int | str, ...] = ()) -> str | None:
    """The first row of ``a`` [rows, ..., K] whose last axis repeats a value, or None."""
    repeated = repeated_rows(a)
    if repeated is None:
        return None
    top_k = a.shape[-1]
    index = [int(i) for i in np.unravel_index(repeated * top_k, a.shape)][:-1]
    return (f"{_where(index, axes)} holds {a.reshape(-1, top_k)[repeated].tolist()}: expected {top_k} distinct "
            f"ids (no router picks one id twice for a token)")


def repeated_rows(a: np.ndarray) -> int | None:
    """Flat index (over every axis but the last) of the first ``[..., K]`` row of ``a`` that repeats a value, or None.

    Rows of eight one-byte ids (router replay's usual top-8 of at most 256 experts) are checked by a compiled kernel
    (``pipeline.octet_kernel``), about 2.4x faster than the general path here ([4096, 48, 8] uint8: 0.29 ms against
    0.70, docs/benchmarks.md); any other row compares its K slots pairwise on a transposed copy (contiguous columns).
    """
    top_k = a.shape[-1]
    if top_k == 8 and a.dtype.itemsize == 1 and a.size:
        rows = np.ascontiguousarray(a).reshape(-1).view(np.uint64)
        from refpipe.pipeline.octet_kernel import first_repeated_octet  # noqa: PLC0415  (numba: only where needed)

        first = first_repeated_octet(rows if rows.flags.aligned else rows.copy())
        return None if first < 0 else int(first)
    columns = np.ascontiguousarray(a.reshape(-1, top_k).T)
    equal, repeated = np.empty(columns.shape[1], np.bool_), np.zeros(columns.shape[1], np.bool_)
    for i in range(top_k):
        for j in range(i + 1, top_k):
            repeated |= np.equal(columns[i], columns[j], out=equal)
    return int(np.argmax(repeated)) if repeated.any() else None


def _dtype_min(a: np.ndarray) -> float:
    return np.iinfo(a.dtype).min if a.dtype.kind in "iu" else -math.inf


def _dtype_max(a: np.ndarray) -> float:
    return np.iinfo(a.dtype).max if a.dtype.kind in "iu" else math.inf


def _within(v: float, lo: float, hi: float, finite: bool, sentinel: float | None) -> bool:
    v = float(v)
    if sentinel is not None and v == sentinel:
        return True
    return not math.isnan(v) and lo <= v <= hi and not (finite and math.isinf(v))


def _all_within(a: np.ndarray, lo: float, hi: float, checks: ValueChecks) -> bool:
    """The extremes hit the sentinel: check the rest (one masked pass)."""
    return bool(_elementwise_ok(a, lo, hi, checks).all())


def _elementwise_ok(a: np.ndarray, lo: float, hi: float, checks: ValueChecks) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        ok = (a >= lo) & (a <= hi)
        if checks.finite and a.dtype.kind == "f":
            ok &= np.isfinite(a)
    if checks.sentinel_value is not None:
        ok |= a == checks.sentinel_value
    return ok


def _expectation(checks: ValueChecks, dims: Dims, hi: float, a: np.ndarray) -> str:
    parts = ["finite"] if checks.finite else []
    if checks.low is not None:
        parts.append(f">= {checks.low}")
    if checks.high is not None:
        parts.append(f"<= {checks.high}")
    if checks.below is not None and dims.get(checks.below) is not None:
        parts.append(f"< {checks.below}={dims[checks.below]}")
    if checks.sentinel is not None:
        parts.append(f"or the sentinel {checks.sentinel}")
    if not parts:
        parts.append("not NaN")
    hint = ""
    if a.dtype.kind == "u" and float(a.max()) == np.iinfo(a.dtype).max and hi < np.iinfo(a.dtype).max:
        hint = " (a -1 sentinel wrapped to the dtype's maximum?)"
    return "expected " + ", ".join(parts) + hint


def _where(index: list[int], axes: tuple[int | str, ...]) -> str:
    """``row 3 [num_layers 2, top_k 1]``: the row, then each trailing index labelled by its declared dimension."""
    labels = [a if isinstance(a, str) else "index" for a in axes] or ["index"] * (len(index) - 1)
    inner = ", ".join(f"{label} {i}" for label, i in zip(labels, index[1:]))
    return f"row {index[0]}" + (f" [{inner}]" if inner else "")
