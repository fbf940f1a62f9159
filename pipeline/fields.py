"""The field registry: every side-channel array kind, declared once.

Each field declares its allowed dtypes, trailing shape (from ``FieldsConfig``),
token domain (every token, or completion tokens only) and padding rule
(DESIGN.md, Fields). A new field gets its own entry; nothing is inherited.

Alignment (DESIGN.md): completion row ``r`` belongs to the model position whose
logits predict completion token ``r``; prompt-only positions have no row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np
from pydantic import BaseModel, Field, model_validator
from refpipe.storage.chunk import ArraySpec
from refpipe.storage.config import CONFIG
from refpipe.storage.errors import FieldError


class FieldsConfig(BaseModel):
    """Trailing shapes of the side-channel fields a run carries; None = field not carried."""

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
    required: tuple[str, ...] = Field(default=(), strict=False)
    """Fields every trainable sample must carry (each one configured above). The orchestrator filters a
    branch missing one at submit (deleting its chunk); the trainer refuses a micro batch where a sequence
    with loss tokens lacks one (``trainer.assemble``)."""
    routing_rows: Literal["all_tokens", "all_but_last"] = "all_tokens"
    """Rows of ``routed_experts`` an env server hands to keep: one per token (P + C), or P + C - 1 as
    vLLM returns them (the last sampled token never went through a forward pass); keep then appends
    the last row by the padding rule (in range, distinct, spread), which feeds no loss position."""

    @model_validator(mode="after")
    def _required_configured(self) -> "FieldsConfig":
        if self.top_k and self.num_experts and self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k}: expected <= num_experts={self.num_experts} (distinct experts "
                             "per token)")
        for name in self.required:
            fdef = FIELDS.get(name)
            if fdef is None or trailing_shape(fdef, self) is None:
                raise ValueError(f"required field {name!r}: expected a field configured for this run "
                                 f"(one of {[f for f, d in FIELDS.items() if trailing_shape(d, self) is not None]})")
        return self

    @property
    def routing_dtype(self) -> np.dtype:
        """dtype of assembled routing rows and their padding: uint8 when ``num_experts <= 256``, else uint16.

        Sized from ``num_experts``, never from the dtypes the refs happen to carry (a run of 384
        experts whose kept ids all fall below 256 still pads with ids up to 383).
        """
        return np.dtype(np.uint8 if (self.num_experts or 0) <= 256 else "<u2")


class Ragged(NamedTuple):
    """A ragged per-token field in CSR form: ``ids`` int32 [sum(counts)], ``counts`` int32 [rows]."""

    ids: np.ndarray
    counts: np.ndarray


@dataclass(frozen=True)
class FieldDef:
    """One field's rules. ``trailing`` maps a config to the trailing shape (None: not configured)."""

    name: str
    dtypes: tuple[str, ...]
    trailing: Callable[[FieldsConfig], tuple[int, ...] | None]
    domain: Literal["tokens", "completion"]
    padding: Literal["spread_experts", "empty_rows", "zero_count"]
    check_values: Callable[[np.ndarray, FieldsConfig], str | None]
    ragged: bool = False


def _check_experts(a: np.ndarray, cfg: FieldsConfig) -> str | None:
    if a.size and int(a.max()) >= cfg.num_experts:
        hint = " (a -1 sentinel wrapped to the dtype's maximum?)" if int(a.max()) == np.iinfo(a.dtype).max else ""
        return f"expert id {int(a.max())} out of range: expected < num_experts={cfg.num_experts}{hint}"
    repeated = _repeated_experts(a)
    if repeated is not None:
        row, layer = divmod(repeated, a.shape[1])
        return (f"token row {row} layer {layer} routes to experts {a[row, layer].tolist()}: expected top_k="
                f"{a.shape[2]} distinct ids (no router picks one expert twice for a token)")
    return None


def _repeated_experts(a: np.ndarray) -> int | None:
    """Flat ``(row, layer)`` index of the first top-k row of ``a`` [rows, layers, top_k] that repeats an id, or None.

    Compares the top_k columns pairwise on a transposed copy (contiguous columns): ~1.5 ms for
    [4096, 48, 8] uint8 here, against ~25 ms for a sort along the last axis.
    """
    top_k = a.shape[-1]
    columns = np.ascontiguousarray(a.reshape(-1, top_k).T)
    equal, repeated = np.empty(columns.shape[1], np.bool_), np.zeros(columns.shape[1], np.bool_)
    for i in range(top_k):
        for j in range(i + 1, top_k):
            repeated |= np.equal(columns[i], columns[j], out=equal)
    return int(np.argmax(repeated)) if repeated.any() else None


def _check_logprobs(a: np.ndarray, cfg: FieldsConfig) -> str | None:
    top = a.max() if a.size else 0.0  # one pass: max is NaN if any value is NaN, +inf if any is +inf
    if np.isnan(top):
        return f"{int(np.isnan(a).sum())} NaN values: expected finite logprobs or -inf"
    if np.isposinf(top):
        return "+inf values: expected finite logprobs or -inf"
    return None


def _check_min(low: int) -> Callable[[np.ndarray, FieldsConfig], str | None]:
    def check(a: np.ndarray, cfg: FieldsConfig) -> str | None:
        if a.size and int(a.min()) < low:
            return f"value {int(a.min())} below {low}: expected ids >= {low}"
        return None

    return check


def _shape_if(*names: str) -> Callable[[FieldsConfig], tuple[int, ...] | None]:
    def trailing(cfg: FieldsConfig) -> tuple[int, ...] | None:
        dims = tuple(getattr(cfg, n) for n in names)
        return None if any(d is None for d in dims) else dims

    return trailing


FIELDS: dict[str, FieldDef] = {
    f.name: f
    for f in (
        FieldDef("routed_experts", ("|u1", "<u2"), _shape_if("num_layers", "top_k", "num_experts"), "tokens",
                 "spread_experts", _check_experts),
        FieldDef("topk_ids", ("<i4",), _shape_if("logprobs_k"), "completion", "empty_rows", _check_min(0)),
        FieldDef("topk_logprobs", ("<f4",), _shape_if("logprobs_k"), "completion", "empty_rows", _check_logprobs),
        FieldDef("sample_support", ("<i4",), _shape_if("support_width"), "completion", "empty_rows", _check_min(-1)),
        FieldDef("sampling_mask", ("<i4",), lambda cfg: () if cfg.sampling_mask else None, "completion",
                 "zero_count", _check_min(0), ragged=True),
    )
}
"""The registry (DESIGN.md, Fields). For ``routed_experts`` the trailing shape is [num_layers, top_k]."""


def trailing_shape(fdef: FieldDef, cfg: FieldsConfig) -> tuple[int, ...] | None:
    """Trailing shape of a field's rows under ``cfg`` (routed_experts drops num_experts)."""
    dims = fdef.trailing(cfg)
    return dims[:2] if dims is not None and fdef.name == "routed_experts" else dims


def validate_branch(
    fields: Mapping[str, np.ndarray | Ragged],
    cfg: FieldsConfig,
    *,
    num_prompt_tokens: int,
    num_completion_tokens: int,
    what: str,
) -> tuple[dict[str, np.ndarray], dict[str, ArraySpec]]:
    """Check a branch's arrays against the registry and flatten them into stored arrays.

    Args:
        fields: field name -> array, or ``Ragged`` for ragged fields. Read-only and
            non-contiguous arrays are accepted (copied once when written).
        cfg: the run's trailing shapes.
        what: names the branch in error messages.

    Returns:
        ``(arrays, specs)`` keyed by stored array name (``sampling_mask.counts`` and
        ``sampling_mask.ids`` for the ragged field). With ``cfg.routing_rows == "all_but_last"``,
        ``routed_experts`` is a new [P + C, num_layers, top_k] array: the given rows, then row
        ``P + C - 1`` of ``spread_expert_rows``.

    Raises:
        FieldError: negative token counts, unknown or unconfigured field, wrong dtype,
            trailing shape or row count, or a bad value (expert id out of range, an expert
            repeated within one token's top-k row, NaN logprob, id < -1).
    """
    for count_name, count in (("num_prompt_tokens", num_prompt_tokens),
                              ("num_completion_tokens", num_completion_tokens)):
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 0:
            raise FieldError(f"{what}: {count_name}={count!r}: expected an integer >= 0")
    arrays: dict[str, np.ndarray] = {}
    specs: dict[str, ArraySpec] = {}
    for name, value in fields.items():
        fdef = FIELDS.get(name)
        if fdef is None:
            raise FieldError(f"{what}: unknown field {name!r}: expected one of {sorted(FIELDS)}")
        trailing = trailing_shape(fdef, cfg)
        if trailing is None:
            raise FieldError(f"{what}: field {name!r} is not configured for this run (FieldsConfig)")
        rows = num_prompt_tokens + num_completion_tokens if fdef.domain == "tokens" else num_completion_tokens
        if fdef.ragged:
            _add_ragged(fdef, value, rows, cfg, what, arrays, specs)
        elif fdef.padding == "spread_experts" and cfg.routing_rows == "all_but_last" and rows:
            given = _check_array(fdef, name, value, (rows - 1, *trailing), cfg, what,
                                 rule="routing_rows='all_but_last': P + C - 1 rows")
            arrays[name] = a = np.concatenate([given, spread_expert_rows(rows, *trailing, cfg.num_experts,
                                                                         given.dtype)[rows - 1:]])
            specs[name] = ArraySpec(_stored_dtype(a), a.shape, fdef.domain)
        else:
            a = _check_array(fdef, name, value, (rows, *trailing), cfg, what)
            arrays[name] = a
            specs[name] = ArraySpec(_stored_dtype(a), a.shape, fdef.domain)
    return arrays, specs


def _check_array(fdef: FieldDef, name: str, a, shape: tuple[int, ...], cfg: FieldsConfig, what: str,
                 rule: str = "") -> np.ndarray:
    if not isinstance(a, np.ndarray):
        raise FieldError(f"{what}: field {name!r} is {type(a).__name__}: expected a numpy array")
    if _stored_dtype(a) not in fdef.dtypes:
        raise FieldError(f"{what}: field {name!r} has dtype {a.dtype}: "
                         f"expected one of {[str(np.dtype(d)) for d in fdef.dtypes]}")
    if a.shape != shape:
        raise FieldError(f"{what}: field {name!r} has shape {list(a.shape)}: expected {list(shape)} "
                         f"({rule or f'{fdef.domain} domain rows'}, trailing shape from FieldsConfig)")
    problem = fdef.check_values(a, cfg)
    if problem:
        raise FieldError(f"{what}: field {name!r}: {problem}")
    return a


def _add_ragged(fdef, value, rows, cfg, what, arrays, specs) -> None:
    if not isinstance(value, Ragged):
        raise FieldError(f"{what}: field {fdef.name!r} is {type(value).__name__}: expected Ragged(ids, counts)")
    counts = _check_array(fdef, f"{fdef.name}.counts", value.counts, (rows,), cfg, what)
    total = int(counts.sum(dtype=np.int64))
    ids = _check_array(fdef, f"{fdef.name}.ids", value.ids, (total,), cfg, what)
    counts_name, ids_name = f"{fdef.name}.counts", f"{fdef.name}.ids"
    arrays[counts_name], arrays[ids_name] = counts, ids
    specs[counts_name] = ArraySpec(_stored_dtype(counts), counts.shape, fdef.domain)
    specs[ids_name] = ArraySpec(_stored_dtype(ids), ids.shape, f"values:{counts_name}")


def _stored_dtype(a: np.ndarray) -> str:
    """The little-endian ``dtype.str`` an array is stored as (big-endian inputs are byte-swapped on write)."""
    return a.dtype.newbyteorder("<").str


def spread_expert_rows(num_rows: int, num_layers: int, top_k: int, num_experts: int, dtype: np.dtype) -> np.ndarray:
    """[num_rows, num_layers, top_k] routing rows for padding tokens (the ``spread_experts`` rule).

    Row ``t``, layer ``l``, slot ``k`` routes to ``(t * top_k + l + k) % num_experts``:
    ids are in range, distinct within each (token, layer) when ``top_k <= num_experts``,
    and padding tokens cycle through every expert instead of piling onto one.
    """
    t = np.arange(num_rows, dtype=np.int64)[:, None, None] * top_k
    l = np.arange(num_layers, dtype=np.int64)[None, :, None]
    k = np.arange(top_k, dtype=np.int64)[None, None, :]
    return ((t + l + k) % num_experts).astype(dtype)
