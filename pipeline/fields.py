"""The field registry: every side-channel array kind, declared once, and the checks of a branch at keep.

A field is a declaration (``pipeline.field_decl.FieldDecl``: dtypes, trailing shape, token domain, row
contract, padding rule, value checks, required or not). ``FIELDS`` holds the five built-in declarations,
switched on by ``FieldsConfig``'s settings (``num_layers``/``top_k``/``num_experts``, ``logprobs_k``,
``support_width``, ``sampling_mask``); a run adds its own with ``FieldsConfig.declare``. Every consumer
reads a field's declaration (``FieldsConfig.registry``), never its name (DESIGN.md, Fields; docs/fields.md).

Alignment (DESIGN.md): completion row ``r`` belongs to the model position whose logits predict completion
token ``r``; prompt row ``r`` to prompt position ``r``; prompt-only positions have no completion row.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import numpy as np
from pydantic import BaseModel, Field, model_validator

from refpipe.pipeline.field_checks import check_values
from refpipe.pipeline.field_decl import Dims, FieldDecl, ValueChecks, narrow_dtype, padding_rows, strided_rows
from refpipe.storage.chunk_ref import ArraySpec, domain_rows
from refpipe.storage.config import CONFIG
from refpipe.storage.errors import FieldError

FIELDS: dict[str, FieldDecl] = {d.name: d for d in (
    FieldDecl(name="routed_experts", dtypes=("uint8", "uint16"), shape=("num_layers", "top_k"), domain="tokens",
              padding="strided_ids", checks=ValueChecks(low=0, below="num_experts", distinct=True)),
    FieldDecl(name="topk_ids", dtypes=("int32",), shape=("logprobs_k",),
              checks=ValueChecks(low=0, below="vocab_size")),
    FieldDecl(name="topk_logprobs", dtypes=("float32",), shape=("logprobs_k",),
              checks=ValueChecks(finite=True, high=0.0, sentinel="-inf")),
    FieldDecl(name="sample_support", dtypes=("int32",), shape=("support_width",),
              checks=ValueChecks(low=-1, below="vocab_size")),
    FieldDecl(name="sampling_mask", dtypes=("int32",), ragged=True, checks=ValueChecks(low=0, below="vocab_size")),
)}
"""The built-in declarations (DESIGN.md, Fields). ``routed_experts`` takes its row contract from
``FieldsConfig.routing_rows``."""

_SWITCHES: dict[str, tuple[str, ...]] = {"routed_experts": ("num_layers", "top_k", "num_experts"),
                                         "topk_ids": ("logprobs_k",), "topk_logprobs": ("logprobs_k",),
                                         "sample_support": ("support_width",), "sampling_mask": ("sampling_mask",)}
"""The ``FieldsConfig`` settings that switch each built-in field on (all of them set)."""
DIMS = ("num_layers", "top_k", "num_experts", "logprobs_k", "support_width", "vocab_size")
"""``FieldsConfig`` settings a declaration's shape or ``checks.below`` may name."""


class FieldsConfig(BaseModel):
    """The side-channel fields a run carries: the built-in ones its settings switch on (None = not carried),
    and the ones it declares."""

    model_config = CONFIG

    num_layers: int | None = Field(default=None, ge=1)
    """MoE layers in ``routed_experts`` [tokens, num_layers, top_k]."""
    top_k: int | None = Field(default=None, ge=1)
    """Experts routed per token per layer."""
    num_experts: int | None = Field(default=None, ge=1, le=65536)
    """Experts per layer; expert ids must be < num_experts (uint8 when <= 256)."""
    logprobs_k: int | None = Field(default=None, ge=1)
    """Width of the top-k logprob head (``topk_ids``/``topk_logprobs`` [completion_tokens, k])."""
    support_width: int | None = Field(default=None, ge=1)
    """Width of ``sample_support`` [completion_tokens, width], -1 = no id."""
    sampling_mask: bool = False
    """Whether branches carry the ragged ``sampling_mask`` (ids + per-token counts)."""
    vocab_size: int | None = Field(default=None, ge=1)
    """Token ids (episodes' ``prompt_ids``/``completion_ids``, ``topk_ids``, ``sample_support``,
    ``sampling_mask`` ids) must be below it; None checks no upper bound."""
    declare: tuple[FieldDecl, ...] = Field(default=(), strict=False)
    """The run's own fields, beyond the built-in ones (``[[fields.declare]]`` in the run's TOML)."""
    required: tuple[str, ...] = Field(default=(), strict=False)
    """Fields every trainable sample must carry (each one configured; every declared field with
    ``required = true`` is added). The orchestrator filters a branch missing one at submit (deleting its
    chunk); the trainer refuses a micro batch where a sequence with loss tokens lacks one (``trainer.assemble``)."""
    routing_rows: Literal["all_tokens", "all_but_last"] = "all_tokens"
    """Rows of ``routed_experts`` an env server hands to keep: one per token (P + C), or P + C - 1 as
    vLLM returns them (the last sampled token never went through a forward pass); keep then appends
    the last row by the padding rule (in range, distinct, spread), which feeds no loss position."""

    @model_validator(mode="before")
    @classmethod
    def _declared_required(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("declare", ()), (list, tuple)):
            return data
        names = [d.name if isinstance(d, FieldDecl) else d.get("name") for d in data.get("declare", ())
                 if (d.required if isinstance(d, FieldDecl) else isinstance(d, dict) and d.get("required"))]
        given = tuple(data.get("required", ()))
        return {**data, "required": given + tuple(n for n in names if n not in given)}

    @model_validator(mode="after")
    def _required_configured(self) -> "FieldsConfig":
        if self.top_k and self.num_experts and self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k}: expected <= num_experts={self.num_experts} (distinct experts "
                             "per token)")
        for decl in self.declare:
            if decl.name in FIELDS or [d.name for d in self.declare].count(decl.name) > 1:
                raise ValueError(f"declare: field {decl.name!r} is declared twice or is a built-in field "
                                 f"({sorted(FIELDS)})")
            needed = [d for d in decl.shape if isinstance(d, str)] + (
                [decl.checks.below] if decl.padding == "strided_ids" else [])
            bad = [d for d in needed if d not in DIMS or getattr(self, d) is None]
            if bad or decl.checks.below not in (None, *DIMS):
                raise ValueError(f"declare: field {decl.name!r} names {bad or [decl.checks.below]}: expected "
                                 f"settings of this FieldsConfig that are set (of {list(DIMS)})")
        registry = self.registry()
        for name in self.required:
            if name not in registry:
                raise ValueError(f"required field {name!r}: expected a field configured for this run "
                                 f"(one of {list(registry)})")
        return self

    @property
    def dims(self) -> Dims:
        """The named dimensions declarations may use (``DIMS``): name -> size or None."""
        return {name: getattr(self, name) for name in DIMS}

    def registry(self) -> dict[str, FieldDecl]:
        """Every field this run carries, built-in (in ``FIELDS`` order) then declared: name -> declaration
        (a fresh dict over one cached table per config)."""
        return dict(_registry(self))

    @property
    def routing_dtype(self) -> np.dtype:
        """dtype of assembled routing rows and their padding: uint8 when ``num_experts <= 256``, else uint16.

        Sized from ``num_experts``, never from the dtypes the refs happen to carry (a run of 384
        experts whose kept ids all fall below 256 still pads with ids up to 383).
        """
        return narrow_dtype(FIELDS["routed_experts"], {"num_experts": self.num_experts or 1})


@functools.lru_cache(maxsize=64)
def _registry(cfg: FieldsConfig) -> dict[str, FieldDecl]:
    out = {}
    for name, decl in FIELDS.items():
        if all(getattr(cfg, s) for s in _SWITCHES[name]):
            out[name] = decl.model_copy(update={"rows": "all_but_last"}) if (
                decl.domain == "tokens" and cfg.routing_rows == "all_but_last") else decl
    return out | {d.name: d for d in cfg.declare}


class Ragged(NamedTuple):
    """A ragged per-token field in CSR form: ``ids`` [sum(counts)] (int32 for the built-in ``sampling_mask``),
    ``counts`` int32 [rows]."""

    ids: np.ndarray
    counts: np.ndarray


def trailing_shape(fdef: FieldDecl, cfg: FieldsConfig) -> tuple[int, ...] | None:
    """Trailing shape of a field's rows under ``cfg`` (None: the field is not configured for ``cfg``)."""
    return fdef.trailing(cfg.dims) if fdef.name in cfg.registry() else None


def validate_branch(
    fields: Mapping[str, object],
    cfg: FieldsConfig,
    *,
    num_prompt_tokens: int,
    num_completion_tokens: int,
    what: str,
) -> tuple[dict[str, np.ndarray], dict[str, ArraySpec]]:
    """Check a branch's arrays against their declarations and flatten them into stored arrays.

    Called by ``Keeper.keep`` in the env-server process, once per branch.

    Args:
        fields: field name -> numpy array or CPU tensor (anything with ``__dlpack__``, e.g. torch: taken
            without a copy), or ``Ragged`` for ragged fields. Read-only and non-contiguous arrays are accepted
            (copied once when written). An integer array of a dtype the field does not store is narrowed to
            one it does (``field_decl.narrow_dtype``) after its values are checked.
        cfg: the run's fields.
        what: names the branch in error messages.

    Returns:
        ``(arrays, specs)`` keyed by stored array name (``<name>.counts`` and ``<name>.ids`` for a ragged
        field). A field declared ``rows = "all_but_last"`` (``routed_experts`` with
        ``cfg.routing_rows == "all_but_last"``) gets a new array: the given P + C - 1 rows, then row
        ``P + C - 1`` by its padding rule.

    Raises:
        FieldError: one line naming the branch, the field and (for values) the row and index: ``fields`` not a
            mapping, negative token counts, an unknown or unconfigured field, a wrong dtype, trailing shape or row
            count (with the setting that would accept it), or a value its checks refuse.
    """
    for count_name, count in (("num_prompt_tokens", num_prompt_tokens),
                              ("num_completion_tokens", num_completion_tokens)):
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise FieldError(f"{what}: {count_name}={count!r}: expected an integer >= 0")
    if not isinstance(fields, Mapping):
        raise FieldError(f"{what}: fields={type(fields).__name__}: expected a mapping of field name -> array")
    registry, dims = cfg.registry(), cfg.dims
    arrays: dict[str, np.ndarray] = {}
    specs: dict[str, ArraySpec] = {}
    for name, value in fields.items():
        decl = registry.get(name)
        if decl is None:
            raise FieldError(f"{what}: " + (f"field {name!r} is not configured for this run (FieldsConfig)"
                             if name in FIELDS else f"unknown field {name!r}: expected one of {sorted(registry)} "
                             "(declare it: FieldsConfig(declare=[FieldDecl(...)]) or [[fields.declare]] in the "
                             "run's TOML)"))
        trailing = decl.trailing(dims)
        assert trailing is not None  # FieldsConfig validates that every configured field's dimensions are set
        rows = domain_rows(decl.domain, num_prompt_tokens, num_prompt_tokens + num_completion_tokens)
        if decl.ragged:
            _add_ragged(decl, value, rows, dims, what, arrays, specs)
            continue
        given = rows - 1 if decl.rows == "all_but_last" and rows else rows
        a = _check_array(decl, name, value, (given, *trailing), dims, what)
        if given != rows:
            last = (a[-1:] if decl.padding == "repeat_rows" and given else
                    padding_rows(decl, 1, trailing, dims, a.dtype, first_row=rows - 1))
            a = np.concatenate([a, last])
        arrays[name] = a
        specs[name] = ArraySpec(_stored_dtype(a), a.shape, decl.domain)
    return arrays, specs


def as_numpy(value: object, what: str) -> np.ndarray:
    """``value`` as a numpy array: itself, or a CPU tensor's memory without a copy (``np.from_dlpack``; torch
    tensors are detached first, so ``requires_grad`` is fine).

    Raises:
        FieldError: neither a numpy array nor a CPU tensor (a GPU tensor: move it with ``.cpu()`` first).
    """
    if isinstance(value, np.ndarray):
        return value
    if hasattr(value, "__dlpack__"):
        detach = getattr(value, "detach", None)
        try:
            return np.from_dlpack(detach() if callable(detach) else value)
        except (BufferError, RuntimeError, TypeError, ValueError) as e:
            raise FieldError(f"{what} is a {type(value).__name__} numpy cannot take ({e}): expected a numpy array "
                             "or a CPU tensor (.cpu() first)") from None
    raise FieldError(f"{what} is {type(value).__name__}: expected a numpy array or a CPU tensor")


def _check_array(decl: FieldDecl, name: str, value: object, shape: tuple[int, ...], dims: Dims, what: str,
                 checks: ValueChecks | None = None) -> np.ndarray:
    a = as_numpy(value, f"{what}: field {name!r}")
    allowed = [str(np.dtype(d)) for d in decl.dtypes]
    narrow = _stored_dtype(a) not in decl.dtypes
    if narrow and not (a.dtype.kind in "iu" and all(np.dtype(d).kind in "iu" for d in decl.dtypes)):
        raise FieldError(f"{what}: field {name!r} has dtype {a.dtype}: expected one of {allowed} (or any integer "
                         f"dtype for an integer field; declare dtypes to store another)")
    if a.shape != shape:
        raise FieldError(f"{what}: field {name!r} has shape {list(a.shape)}: expected {list(shape)} "
                         f"({_rows_rule(decl, a.shape, shape)}; trailing shape {list(decl.shape)})")
    problem = check_values(a, decl.checks if checks is None else checks, dims, decl.shape)
    if problem is None and narrow:
        target = narrow_dtype(decl, dims)
        problem = check_values(a, ValueChecks(low=int(np.iinfo(target).min), high=int(np.iinfo(target).max)),
                               dims, decl.shape)
        a = a if problem else a.astype(target)
    if problem:
        raise FieldError(f"{what}: field {name!r}: {problem}")
    return a


def _rows_rule(decl: FieldDecl, got: tuple[int, ...], want: tuple[int, ...]) -> str:
    """Which rows the field takes, and the setting that would accept ``got``'s rows."""
    if decl.rows == "all_but_last":
        return 'rows "all_but_last": P + C - 1 rows'
    if got and want and got[0] == want[0] - 1 and decl.domain == "tokens":
        return ('tokens domain rows; P + C - 1 rows, as engines return routing, need routing_rows = "all_but_last" '
                '(a declared field: rows = "all_but_last")')
    return f"{decl.domain} domain rows"


def _add_ragged(decl: FieldDecl, value: object, rows: int, dims: Dims, what: str, arrays: dict[str, np.ndarray],
                specs: dict[str, ArraySpec]) -> None:
    if not isinstance(value, Ragged):
        raise FieldError(f"{what}: field {decl.name!r} is {type(value).__name__}: expected Ragged(ids, counts)")
    counts_name, ids_name = decl.names()
    counts = _check_array(decl.model_copy(update={"dtypes": ("<i4",)}), counts_name, value.counts, (rows,), dims,
                          what, checks=ValueChecks(low=0))
    total = int(counts.sum(dtype=np.int64))
    ids = _check_array(decl, ids_name, value.ids, (total,), dims, what)
    arrays[counts_name], arrays[ids_name] = counts, ids
    specs[counts_name] = ArraySpec(_stored_dtype(counts), counts.shape, decl.domain)
    specs[ids_name] = ArraySpec(_stored_dtype(ids), ids.shape, f"values:{counts_name}")


def _stored_dtype(a: np.ndarray) -> str:
    """The little-endian ``dtype.str`` an array is stored as (big-endian inputs are byte-swapped on write)."""
    return a.dtype.newbyteorder("<").str


def spread_expert_rows(num_rows: int, num_layers: int, top_k: int, num_experts: int, dtype: np.dtype) -> np.ndarray:
    """[num_rows, num_layers, top_k] routing rows for padding tokens: ``routed_experts``' ``strided_ids`` rule.

    Row ``t``, layer ``l``, slot ``k`` routes to ``(t * top_k + l + k) % num_experts``
    (``field_decl.strided_rows``): ids are in range, distinct within each (token, layer) when
    ``top_k <= num_experts``, and padding tokens cycle through every expert instead of piling onto one.
    """
    return strided_rows(num_rows, (num_layers, top_k), num_experts, dtype)
