"""A field's declaration: what its arrays look like, which rows they have, how they pad, what values they may hold.

A declaration is data (a frozen pydantic model, declared in Python or as ``[[fields.declare]]`` in a run's
TOML); every consumer (keep, step files, fetch, assembly, the CLI) reads it, never a field's name.
Dimensions may name ``FieldsConfig`` settings (``"num_layers"``, ``"top_k"``, ...), resolved per run
(``Dims``). The built-in fields are declarations of the same kind (``pipeline.fields.FIELDS``).
docs/fields.md is the contract in prose.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Literal, cast

import numpy as np
from pydantic import BaseModel, Field, field_validator, model_validator

from refpipe.storage.chunk_ref import STORED_DTYPES
from refpipe.storage.config import CONFIG

Dims = Mapping[str, int | None]
"""A run's named dimensions (``FieldsConfig.dims``): name -> size, None = not set."""


class ValueChecks(BaseModel):
    """What values a field's arrays may hold; every check runs at keep (``pipeline.fields.validate_branch``).

    The bounds (``finite``, ``low``, ``high``, ``below``) also run on every fetched row before a trainer
    rank trains from it (``trainer.assemble``); ``distinct`` runs at keep only.

    Raises:
        ValueError (pydantic ``ValidationError``): ``low`` above ``high``.
    """

    model_config = CONFIG

    finite: bool = False
    """No NaN, +inf or -inf (except the ``sentinel``)."""
    low: int | float | None = None
    """Every value >= low (except the ``sentinel``)."""
    high: int | float | None = None
    """Every value <= high (except the ``sentinel``)."""
    below: str | None = None
    """A ``FieldsConfig`` dimension every value is below (ids: ``"num_experts"``, ``"vocab_size"``); a dimension
    the run leaves unset checks nothing."""
    distinct: bool = False
    """The values along the last axis of each row are distinct (top-k ids: no router picks one expert twice)."""
    sentinel: int | float | Literal["-inf"] | None = None
    """One value that means "none" and passes ``finite``/``low``/``high`` (``-1`` = no id, ``"-inf"`` = no logprob)."""

    @model_validator(mode="after")
    def _satisfiable(self) -> "ValueChecks":
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low={self.low} above high={self.high}: expected low <= high (no value could pass "
                             "both)")
        return self

    @property
    def sentinel_value(self) -> float | None:
        """``sentinel`` as a number (``"-inf"`` -> ``-inf``)."""
        return -math.inf if self.sentinel == "-inf" else self.sentinel


class FieldDecl(BaseModel):
    """One field's rules. Arrays are ``[rows, *shape]``; rows follow ``domain`` and ``rows``.

    Raises:
        ValueError (pydantic ``ValidationError``): an unknown dtype, a size < 1 in ``shape``, a padding rule the
            domain cannot use,
            ``all_but_last`` outside the token domain, ``strided_ids`` without ``checks.below``, a ragged
            field with a shape or in the token domain, ``distinct`` without a trailing dimension.
    """

    model_config = CONFIG

    name: str = Field(pattern=r"^[a-z][a-z0-9_]{0,63}$")
    """The field's name (lower case, digits, ``_``); the name of its stored array (ragged: ``<name>.ids`` and
    ``<name>.counts``)."""
    dtypes: tuple[str, ...] = Field(min_length=1, strict=False)
    """Stored dtypes (numpy names, ``"float32"`` or ``"<f4"``; kept as little-endian ``dtype.str``). An integer
    input of another integer dtype is narrowed to the first one that holds the declared bounds, once its
    values are checked (``narrow_dtype``)."""
    shape: tuple[int | str, ...] = Field(default=(), strict=False)
    """Trailing shape of each row: sizes (>= 1), or names of ``FieldsConfig`` dimensions
    (``["num_layers", "top_k"]``)."""
    domain: Literal["tokens", "completion", "prompt"] = "completion"
    """Which tokens have a row: every token (P + C rows), completion tokens (C) or prompt tokens (P)."""
    rows: Literal["all", "all_but_last"] = "all"
    """Row contract of the input: one row per domain token, or (token domain) all but the last, as inference
    engines return routing (the last sampled token never went through a forward pass); keep then appends the
    last row by the padding rule."""
    padding: Literal["zeros", "empty_rows", "repeat_rows", "strided_ids"] = "empty_rows"
    """Rows of padding tokens. Token domain: ``zeros``, ``repeat_rows`` (the micro batch's real rows, cyclically)
    or ``strided_ids`` (row ``t`` slot ``k`` of middle index ``l`` holds ``(t * K + l + k) % below``: in range,
    distinct along the last axis, spread over every id). Completion and prompt domains: ``empty_rows``
    (padding has no row; ragged: count 0)."""
    checks: ValueChecks = ValueChecks()
    required: bool = False
    """Every trainable sample must carry it (added to ``FieldsConfig.required``)."""
    ragged: bool = False
    """CSR form (``pipeline.fields.Ragged``): ``counts`` int32 [rows] >= 0 and ``ids`` [sum(counts)] of ``dtypes``."""

    @field_validator("dtypes")
    @classmethod
    def _stored(cls, dtypes: tuple[str, ...]) -> tuple[str, ...]:
        out = []
        for d in dtypes:
            try:
                stored = np.dtype(d).newbyteorder("<").str
            except TypeError:
                stored = None
            if stored not in STORED_DTYPES:
                raise ValueError(f"dtype {d!r}: expected a numpy name of one of {sorted(STORED_DTYPES)}")
            out.append(stored)
        return tuple(out)

    @model_validator(mode="after")
    def _consistent(self) -> "FieldDecl":
        what = f"field {self.name!r}"
        if any(isinstance(d, int) and d < 1 for d in self.shape):
            raise ValueError(f"{what}: shape {list(self.shape)}: expected sizes >= 1 or names of FieldsConfig "
                             "settings")
        if (self.domain == "tokens") != (self.padding != "empty_rows"):
            raise ValueError(f"{what}: padding {self.padding!r} in the {self.domain} domain: expected "
                             "zeros, repeat_rows or strided_ids for the token domain, empty_rows otherwise")
        if self.rows == "all_but_last" and self.domain != "tokens":
            raise ValueError(f"{what}: rows 'all_but_last' in the {self.domain} domain: expected the token domain")
        if self.padding == "strided_ids" and (self.checks.below is None or not self.shape
                                              or not all(np.dtype(d).kind in "iu" for d in self.dtypes)):
            raise ValueError(f"{what}: padding 'strided_ids': expected integer dtypes, a trailing shape and "
                             "checks.below (the number of ids)")
        if self.ragged and (self.shape or self.domain == "tokens"):
            raise ValueError(f"{what}: ragged with shape {list(self.shape)} in the {self.domain} domain: expected "
                             "shape [] in the completion or prompt domain")
        if self.checks.distinct and not self.shape:
            raise ValueError(f"{what}: checks.distinct: expected a trailing dimension to be distinct along")
        return self

    def trailing(self, dims: Dims) -> tuple[int, ...] | None:
        """The resolved trailing shape, or None when it names a dimension ``dims`` leaves unset (or unknown)."""
        out = tuple(d if isinstance(d, int) else dims.get(d) for d in self.shape)
        return None if any(d is None for d in out) else cast(tuple[int, ...], out)

    def names(self) -> tuple[str, ...]:
        """Stored array names: ``(name,)``, ragged ``(name.counts, name.ids)``."""
        return (f"{self.name}.counts", f"{self.name}.ids") if self.ragged else (self.name,)


def value_bounds(checks: ValueChecks, dims: Dims) -> tuple[float, float]:
    """``(lowest, highest)`` value ``checks`` allow, sentinel aside (``below=n``: highest ``n - 1``)."""
    lo = -math.inf if checks.low is None else checks.low
    hi = math.inf if checks.high is None else checks.high
    below = None if checks.below is None else dims.get(checks.below)
    return lo, (hi if below is None else min(hi, below - 1))


def narrow_dtype(decl: FieldDecl, dims: Dims) -> np.dtype:
    """The stored dtype of an integer input outside ``decl.dtypes``: the first declared dtype holding every
    value the bounds allow (routing: uint8 up to 256 experts, uint16 above), else the first declared."""
    lo, hi = value_bounds(decl.checks, dims)
    for d in decl.dtypes:
        dt = np.dtype(d)
        if dt.kind in "iu" and np.iinfo(dt).min <= lo and hi <= np.iinfo(dt).max:
            return dt
    return np.dtype(decl.dtypes[0])


def strided_rows(num_rows: int, trailing: tuple[int, ...], num_ids: int, dtype: np.dtype,
                 first_row: int = 0) -> np.ndarray:
    """[num_rows, *trailing] rows of the ``strided_ids`` padding rule, rows ``first_row..``.

    Row ``t``, middle index ``l`` (the trailing dims but the last, flattened), slot ``k`` (last axis of size
    ``K``) holds ``(t * K + l + k) % num_ids``: in range, distinct within a row when ``K <= num_ids``,
    and padding cycles through every id instead of piling onto ids ``0..K-1``.
    """
    top_k, middle = trailing[-1], math.prod(trailing[:-1])
    t = np.arange(first_row, first_row + num_rows, dtype=np.int64)[:, None, None] * top_k
    l = np.arange(middle, dtype=np.int64)[None, :, None]
    k = np.arange(top_k, dtype=np.int64)[None, None, :]
    return ((t + l + k) % num_ids).astype(dtype).reshape(num_rows, *trailing)


def padding_rows(decl: FieldDecl, num_rows: int, trailing: tuple[int, ...], dims: Dims, dtype: np.dtype,
                 first_row: int = 0) -> np.ndarray:
    """[num_rows, *trailing] rows for padding tokens by ``decl.padding`` (``zeros``/``strided_ids``;
    ``repeat_rows`` without real rows to repeat pads with zeros)."""
    if decl.padding == "strided_ids":
        num_ids = dims[decl.checks.below] if decl.checks.below is not None else None
        assert num_ids is not None  # validated: strided_ids padding names checks.below, a dimension the run sets
        return strided_rows(num_rows, trailing, num_ids, dtype, first_row)
    return np.zeros((num_rows, *trailing), dtype)
