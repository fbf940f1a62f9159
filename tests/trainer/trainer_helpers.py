"""Build real steps for trainer tests (kept chunks + a published step file) and their expected layout.

The expected layout is computed here independently of ``trainer.assemble``: token by token,
from the arrays the test kept, following DESIGN.md (Fields, Alignment).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from refpipe.pipeline.fields import FieldsConfig, Ragged, spread_expert_rows
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.pipeline.step_file import publish_step_file
from refpipe.pipeline.step_header import SCHEMA_VERSION, STREAMS, MicroBatchRecord, SequenceRecord, StepHeader
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.config import StorageConfig
from refpipe.storage.ledger import Ledger
from refpipe.storage.store import Store

FIELDS = FieldsConfig(num_layers=2, top_k=2, num_experts=8, logprobs_k=3, support_width=2, sampling_mask=True)


def make_branch(rng: np.random.Generator, num_prompt: int, num_completion: int, branch_id: str, *,
                routing: bool = True, completion: bool = True, cfg: FieldsConfig = FIELDS) -> Branch:
    """A branch with random arrays: routing (optional) and every completion field (optional)."""
    fields = {}
    if routing:
        base = rng.integers(0, cfg.num_experts, (num_prompt + num_completion, cfg.num_layers, 1))
        fields["routed_experts"] = ((base + np.arange(cfg.top_k)) % cfg.num_experts).astype(np.uint8)  # distinct
    if completion:
        c = num_completion
        fields["topk_ids"] = rng.integers(0, 1000, (c, cfg.logprobs_k), dtype=np.int32)
        fields["topk_logprobs"] = -rng.random((c, cfg.logprobs_k), dtype=np.float32)
        fields["sample_support"] = rng.integers(-1, 1000, (c, cfg.support_width), dtype=np.int32)
        counts = rng.integers(0, 4, c, dtype=np.int32)
        fields["sampling_mask"] = Ragged(rng.integers(0, 1000, int(counts.sum()), dtype=np.int32), counts)
    return Branch(num_prompt, num_completion, fields, branch_id=branch_id)


@dataclass(frozen=True)
class Seq:
    """One sequence of a test micro batch: a branch (by name) or None, kept tokens, borrowed dummy."""

    branch: str | None
    num_tokens: int
    borrowed: bool = False


@dataclass
class BuiltStep:
    header: StepHeader
    streams: dict[tuple[int, int], dict[str, np.ndarray]]
    branches: dict[str, Branch]
    refs: dict[str, PayloadRef]


def keep_all(store: Store, storage: StorageConfig, branches: dict[str, Branch], cfg: FieldsConfig = FIELDS,
             actor: str = "env_worker_0") -> dict[str, PayloadRef]:
    """Keep every branch through the real keep path; return name -> ref."""
    ledger = Ledger(store, actor)
    keeper = Keeper(store, ledger, cfg, storage)
    refs = {name: keeper.keep(b) for name, b in branches.items()}
    ledger.close()
    return refs


def build_step(store: Store, step: int, seq_len: int, layout: list[list[list[Seq]]], branches: dict[str, Branch],
               refs: dict[str, PayloadRef], rng: np.random.Generator, *, publish: bool = True,
               cfg: FieldsConfig = FIELDS) -> BuiltStep:
    """Publish step ``step``: ``layout[dp_rank][index]`` lists the sequences of each micro batch.

    The owner of a ref is the DP rank of its first non-borrowed use.
    """
    order: list[str] = []
    owners: dict[str, int] = {}
    for dp, mbs in enumerate(layout):
        for mb in mbs:
            for s in mb:
                if s.branch is not None and s.branch not in order:
                    order.append(s.branch)
                if s.branch is not None and not s.borrowed:
                    owners.setdefault(s.branch, dp)
    records, streams = [], {}
    for dp, mbs in enumerate(layout):
        for i, mb in enumerate(mbs):
            seqs = [SequenceRecord(num_tokens=s.num_tokens, env_name="test",
                                   ref=None if s.branch is None else order.index(s.branch), borrowed=s.borrowed)
                    for s in mb]
            has_routing = all(s.branch is not None and "routed_experts" in branches[s.branch].fields for s in mb)
            total = sum(s.num_tokens for s in mb)
            records.append(MicroBatchRecord(dp_rank=dp, index=i, sequences=seqs, num_padding_tokens=seq_len - total,
                                            has_routing=has_routing))
            streams[(dp, i)] = random_streams(rng, mb)
    header = StepHeader(schema_version=SCHEMA_VERSION, run_uri=store.prefix.uri, step=step, seq_len=seq_len,
                        dp_world_size=len(layout), micro_batches=records, refs=[refs[n] for n in order],
                        owners=[owners.get(n, 0) for n in order], fields=cfg)
    if publish:
        publish_step_file(store, header, streams)
    return BuiltStep(header, streams, branches, refs)


def random_streams(rng: np.random.Generator, mb: list[Seq]) -> dict[str, np.ndarray]:
    total = sum(s.num_tokens for s in mb)
    loss = rng.random(total) < 0.7
    pos, start = [], 0
    for s in mb:
        pos.append(np.arange(s.num_tokens))
        if s.borrowed:
            loss[start:start + s.num_tokens] = False
        start += s.num_tokens
    return {"input_ids": rng.integers(0, 50000, total, dtype=np.int32), "loss_mask": loss,
            "advantages": rng.standard_normal(total, dtype=np.float32),
            "inference_logprobs": -rng.random(total, dtype=np.float32),
            "position_ids": np.concatenate(pos).astype(np.int32),
            "temperatures": rng.uniform(0.5, 1.5, total).astype(np.float32)}


def expected_micro_batch(built: BuiltStep, dp: int, index: int, cfg: FieldsConfig = FIELDS) -> dict[str, np.ndarray]:
    """Flat name -> array of what the trainer must build for a micro batch that was fetched.

    Keys: ``stream.<name>``, ``cu_seqlens``, ``field.<name>.<values|cu_seqlens|counts|padded|row_ids>``.
    """
    header = built.header
    mb = header.micro_batches_of(dp)[index]
    seq_len, T = header.seq_len, mb.num_tokens
    out = {}
    for name, dtype in STREAMS.items():
        real = built.streams[(dp, index)][name]
        pad = {"input_ids": 0, "loss_mask": False, "advantages": 0, "inference_logprobs": 0, "temperatures": 1}
        tail = [pad[name]] * (seq_len - T) if name != "position_ids" else list(range(seq_len - T))
        out[f"stream.{name}"] = np.array(list(real) + tail, dtype)
    bounds = [0]
    for s in mb.sequences:
        bounds.append(bounds[-1] + s.num_tokens)
    out["cu_seqlens"] = np.array(bounds + ([seq_len] if T < seq_len else []), np.int32)
    branch_of = {ref.uri: name for name, ref in built.refs.items()}
    seq_branches = [None if s.ref is None else built.branches[branch_of[header.refs[s.ref].uri]] for s in mb.sequences]
    if mb.has_routing:
        rows = [b.fields["routed_experts"][t] for s, b in zip(mb.sequences, seq_branches) for t in range(s.num_tokens)]
        pad = spread_expert_rows(seq_len - T, cfg.num_layers, cfg.top_k, cfg.num_experts, np.uint8)
        padded = np.concatenate([np.array(rows, np.uint8).reshape(T, cfg.num_layers, cfg.top_k), pad])
        out["field.routed_experts.padded"] = padded
        out["field.routed_experts.values"] = padded[:T]
        out["field.routed_experts.cu_seqlens"] = np.array(bounds, np.int32)
    for name, width in (("topk_ids", 3), ("topk_logprobs", 3), ("sample_support", 2), ("sampling_mask", None)):
        _expected_completion(out, name, width, mb, seq_branches, bounds, seq_len)
    return out


def _expected_completion(out, name, width, mb, seq_branches, bounds, seq_len):
    values, counts, cu, row_ids = [], [], [0], [-1] * seq_len
    for s, b, start in zip(mb.sequences, seq_branches, bounds):
        has = b is not None and not s.borrowed and name in b.fields
        c = max(0, s.num_tokens - b.num_prompt_tokens) if has else 0
        for r in range(c):
            if name == "sampling_mask":
                ids, cnt = b.fields[name]
                first = int(cnt[:r].sum())
                values.extend(ids[first:first + cnt[r]])
                counts.append(cnt[r])
            else:
                values.append(b.fields[name][r])
        for j in range(s.num_tokens - 1):  # position start + j predicts token j + 1 of the sequence
            r = j + 1 - (b.num_prompt_tokens if has else 0)
            if has and 0 <= r < c:
                row_ids[start + j] = cu[-1] + r
        cu.append(cu[-1] + c)
    dtype = np.float32 if name == "topk_logprobs" else np.int32
    shape = (-1,) if width is None else (-1, width)
    out[f"field.{name}.values"] = np.array(values, dtype).reshape(shape)
    out[f"field.{name}.cu_seqlens"] = np.array(cu, np.int32)
    out[f"field.{name}.row_ids"] = np.array(row_ids, np.int64)
    if name == "sampling_mask":
        out[f"field.{name}.counts"] = np.array(counts, np.int32)


def flatten(streams, cu_seqlens, fields) -> dict[str, np.ndarray]:
    """Flat name -> numpy array of an assembled micro batch (numpy or torch), keys as ``expected_micro_batch``."""
    as_np = (lambda a: a.numpy() if hasattr(a, "numpy") else a)
    out = {f"stream.{k}": as_np(v) for k, v in streams.items()}
    out["cu_seqlens"] = as_np(cu_seqlens)
    for name, f in fields.items():
        for part in ("values", "cu_seqlens", "counts", "padded", "row_ids"):
            a = getattr(f, part)
            if a is not None:
                out[f"field.{name}.{part}"] = as_np(a)
    return out


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], widened: bool = False) -> None:
    """Same keys; arrays equal byte for byte (``widened``: streams compared by value, ints as int64)."""
    assert sorted(got) == sorted(want)
    for key, w in want.items():
        g = got[key]
        if widened and key in ("stream.input_ids", "stream.position_ids"):
            assert g.dtype == np.int64, key
            w = w.astype(np.int64)
        assert g.dtype == w.dtype and g.shape == w.shape, (key, g.dtype, g.shape, w.dtype, w.shape)
        assert g.tobytes() == w.tobytes(), key


def forge_rows(header: dict, ref: int, array: str, rows: int) -> None:
    """Make ``refs[ref]`` of a step header declare ``rows`` rows of ``array`` against its token counts (same bytes,
    block crcs and ``nbytes``: the tests pick rows that keep its 64-byte aligned size)."""
    header["refs"][ref]["arrays"][array][1][0] = rows
