"""Env-server keep path: bad input is a typed error with nothing written; valid edge inputs round trip; no growth."""

from __future__ import annotations

import gc
import json
import os
import weakref

import boto3
import numpy as np
import psutil
import pytest

from refpipe.pipeline.fields import FieldsConfig, Ragged
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.errors import ArgumentTypeError, ConfigError, DoubleDeleteError, FieldError, KeyExistsError
from refpipe.storage.layout import DATA_NAME, META_NAME, node_key
from refpipe.storage.ledger import Ledger

CFG = FieldsConfig(num_layers=3, top_k=2, num_experts=8, logprobs_k=4, support_width=5, sampling_mask=True)
P, C = 4, 6


def fields_of(num_prompt_tokens: int = P, num_completion_tokens: int = C, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    t, c = num_prompt_tokens + num_completion_tokens, num_completion_tokens
    logprobs = -rng.exponential(1.0, (c, 4)).astype(np.float32)
    logprobs[:, 3] = -np.inf
    counts = rng.integers(0, 3, c).astype(np.int32)
    return {
        "routed_experts": ((rng.integers(0, 8, (t, 3, 1)) + np.arange(2)) % 8).astype(np.uint8),
        "topk_ids": rng.integers(0, 1000, (c, 4)).astype(np.int32),
        "topk_logprobs": logprobs,
        "sample_support": np.where(rng.random((c, 5)) < 0.3, -1, rng.integers(0, 1000, (c, 5))).astype(np.int32),
        "sampling_mask": Ragged(rng.integers(0, 1000, int(counts.sum())).astype(np.int32), counts),
    }


def listing(config) -> list[str]:
    """Every object under the run root (all runs), read without the store."""
    if config.root.startswith("s3://"):
        bucket = config.root[5:].partition("/")[0]
        client = boto3.client("s3", endpoint_url=config.s3_endpoint_url, region_name="us-east-1")
        return sorted(o["Key"] for o in client.list_objects_v2(Bucket=bucket).get("Contents", []))
    root = open_store(config).prefix.path.rpartition("/")[0]
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, _, files in os.walk(root) for f in files)


@pytest.fixture
def keeper(storage_config) -> Keeper:
    store = open_store(storage_config)
    return Keeper(store, Ledger(store, "env_worker_0"), CFG, storage_config)


def stored(fields: dict) -> dict[str, np.ndarray]:
    out = {}
    for name, value in fields.items():
        if isinstance(value, Ragged):
            out[f"{name}.counts"], out[f"{name}.ids"] = value.counts, value.ids
        else:
            out[name] = value
    return out


def assert_fetch_equals(keeper: Keeper, ref, fields: dict) -> None:
    got = fetch_arrays(keeper.store, ref)
    expected = stored(fields)
    assert list(got) == list(expected)
    for name, a in expected.items():
        assert got[name].dtype == a.dtype.newbyteorder("<") and got[name].shape == a.shape, name
        assert got[name].tobytes() == np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes(), name


def _u8_minus_one() -> np.ndarray:
    routing = fields_of()["routed_experts"]
    routing[2, 1, 0] = np.array(-1).astype(np.uint8)  # a -1 "no expert" sentinel, wrapped to 255
    return routing


BAD = {
    "wrong_dtype": ("topk_logprobs", lambda: fields_of()["topk_logprobs"].astype(np.float64),
                    r"field 'topk_logprobs' has dtype float64: expected one of \['float32'\]"),
    "wrong_trailing_shape": ("routed_experts", lambda: np.zeros((P + C, 3, 3), np.uint8),
                             r"field 'routed_experts' has shape \[10, 3, 3\]: expected \[10, 3, 2\]"),
    "rows_not_matching_domain": ("topk_ids", lambda: np.zeros((P + C, 4), np.int32),
                                 r"field 'topk_ids' has shape \[10, 4\]: expected \[6, 4\] \(completion domain rows"),
    "routing_rows_not_matching_domain": ("routed_experts", lambda: np.zeros((C, 3, 2), np.uint8),
                                         r"shape \[6, 3, 2\]: expected \[10, 3, 2\] \(tokens domain rows"),
    "expert_id_out_of_range": ("routed_experts", lambda: np.full((P + C, 3, 2), 8, np.uint8),
                               r"field 'routed_experts': row 0 \[num_layers 0, top_k 0\] value 8: "
                               r"expected >= 0, < num_experts=8$"),
    "nan_logprob": ("topk_logprobs", lambda: np.where(np.eye(C, 4, dtype=bool), np.nan, -1.0).astype(np.float32),
                    r"field 'topk_logprobs': row 0 \[logprobs_k 0\] value nan: "
                    r"expected finite, <= 0.0, or the sentinel -inf$"),
    "minus_one_in_unsigned_routing": ("routed_experts", _u8_minus_one,
                                      r"row 2 \[num_layers 1, top_k 0\] value 255: "
                                      r"expected >= 0, < num_experts=8 \(a -1 sentinel"),
    "unknown_field": ("logits", lambda: np.zeros((C, 4), np.float32),
                      r"unknown field 'logits': expected one of \['routed_experts', 'sample_support', "),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_is_a_field_error_and_nothing_is_written(keeper, storage_config, case):
    name, make, message = BAD[case]
    fields = fields_of()
    fields[name] = make()
    before = listing(storage_config)
    with pytest.raises(FieldError, match=message) as info:
        keeper.keep(Branch(P, C, fields, "b1"))
    assert str(info.value).startswith("branch b1 (env worker env_worker_0): ")
    keeper.ledger.flush()  # a failed keep records no event either
    assert listing(storage_config) == before


def test_bad_branch_id_is_refused_before_any_write(keeper, storage_config):
    before = listing(storage_config)
    for branch_id in ("../escape", "a/b", ".hidden"):
        with pytest.raises(ConfigError, match="branch_id"):
            keeper.keep(Branch(P, C, fields_of(), branch_id))
    keeper.ledger.flush()
    assert listing(storage_config) == before


def test_an_empty_id_is_refused_not_taken_for_no_id(keeper, storage_config):
    """``open_branch(branch_id="")`` (and ``keep`` of ``Branch(branch_id="")``, ``keep_prefix(prefix_id="")``) drew
    a new id as if none were given; an empty id is an invalid one: ``ConfigError``, nothing written."""
    keeper.ledger.flush()
    before = listing(storage_config)
    rule = "expected 1-128 of [A-Za-z0-9._-], not starting with . - or _"
    cases = [
        (lambda: keeper.open_branch(2, branch_id=""), f"branch_id '': {rule}"),
        (lambda: keeper.keep(Branch(P, C, fields_of(), "")), f"branch_id '': {rule}"),
        (lambda: keeper.keep_prefix(2, {}, holders=["h0"], prefix_id=""), f"prefix_id '': {rule}"),
    ]
    for call, message in cases:
        with pytest.raises(ConfigError) as info:
            call()
        assert str(info.value) == message
    keeper.ledger.flush()
    assert listing(storage_config) == before


def test_zero_completion_tokens_keep_empty_completion_fields(keeper):
    fields = fields_of(P, 0)
    assert fields["topk_ids"].shape == (0, 4) and fields["sampling_mask"].ids.shape == (0,)
    ref = keeper.keep(Branch(P, 0, fields, "b0"))
    assert ref.arrays["topk_logprobs"].shape == (0, 4) and ref.arrays["sampling_mask.counts"].shape == (0,)
    assert_fetch_equals(keeper, ref, fields)
    assert fetch_arrays(keeper.store, ref, 2)["routed_experts"].tobytes() == fields["routed_experts"][:2].tobytes()


def test_numpy_integer_token_counts_are_kept_as_ints(keeper):
    fields = fields_of()
    ref = keeper.keep(Branch(np.int64(P), np.int32(C), fields, "np-counts"))  # a TypeError in the chunk's JSON
    assert (type(ref.num_prompt_tokens), ref.num_prompt_tokens, ref.num_completion_tokens) == (int, P, C)
    assert_fetch_equals(keeper, ref, fields)


def test_read_only_non_contiguous_and_big_endian_inputs_are_valid(keeper):
    base = fields_of()
    wide = np.zeros((P + C, 3, 4), np.uint8)
    wide[:, :, ::2] = base["routed_experts"]
    fields = {
        "routed_experts": wide[:, :, ::2],  # strided view
        "topk_ids": np.asfortranarray(base["topk_ids"]),
        "topk_logprobs": base["topk_logprobs"].astype(">f4"),
        "sample_support": base["sample_support"].copy(),
        "sampling_mask": base["sampling_mask"],
    }
    for a in (wide, fields["topk_ids"], fields["topk_logprobs"], fields["sample_support"]):
        a.flags.writeable = False
    assert not fields["routed_experts"].flags.c_contiguous and not fields["topk_ids"].flags.c_contiguous
    ref = keeper.keep(Branch(P, C, fields, "b1"))
    assert ref.arrays["topk_logprobs"].dtype == "<f4"
    assert_fetch_equals(keeper, ref, fields)
    assert fetch_arrays(keeper.store, ref)["topk_logprobs"].tolist() == base["topk_logprobs"].tolist()


def test_duplicate_branch_id_raises_and_the_first_chunk_is_unchanged(keeper, storage_config):
    first = fields_of(seed=1)
    ref = keeper.keep(Branch(P, C, first, "dup"))
    store = keeper.store
    node = node_key("dup")
    before = {key: store.get(key) for key in (f"{node}/{DATA_NAME}", f"{node}/{META_NAME}")}
    listed = listing(storage_config)
    with pytest.raises(KeyExistsError) as info:
        keeper.keep(Branch(P, C, fields_of(seed=2), "dup"))
    assert str(info.value) == (f"branch 'dup' was already kept in run {store.prefix.uri} ({store.uri(node)}/c.0 "
                               f"already exists): branch ids are unique per run; keep a new branch under a new id")
    assert {key: store.get(key) for key in before} == before
    assert listing(storage_config) == listed
    assert_fetch_equals(keeper, ref, first)


def test_a_second_keep_of_the_same_bytes_by_the_same_keeper_raises(keeper, storage_config):
    """A later call with identical arrays is not a retry of the first (the write token is per call): it raises,
    one keep event and one ref, and the chunk is deleted exactly once."""
    ref = keeper.keep(Branch(P, C, fields_of(seed=1), "p0"))
    listed = listing(storage_config)
    with pytest.raises(KeyExistsError, match="^branch 'p0' was already kept in run .*/c.0 already exists"):
        keeper.keep(Branch(P, C, fields_of(seed=1), "p0"))
    assert listing(storage_config) == listed and keeper.store.idempotent_puts == 0
    keeper.ledger.flush()
    events = [json.loads(line)["event"] for key in keeper.store.list_prefix("ledger/events")
              for line in keeper.store.get(key).splitlines()]
    assert events.count("keep") == 1
    assert keeper.discard([ref]).deleted == [ref.uri]


def test_default_branch_ids_are_unique_and_name_the_worker(keeper):
    refs = [keeper.keep(Branch(P, C, fields_of())) for _ in range(2)]
    assert refs[0].branch_id != refs[1].branch_id
    assert all(r.branch_id.startswith("env_worker_0-") for r in refs)


def test_discard_deletes_exactly_once(keeper, storage_config):
    refs = [keeper.keep(Branch(P, C, fields_of(seed=i), f"b{i}")) for i in range(3)]
    result = keeper.discard(refs[:2], reason="episode dropped")
    assert result.deleted == [refs[0].uri, refs[1].uri]
    keeper.ledger.wait_freed()
    payloads = [k for k in keeper.store.list_prefix("payloads")]
    assert payloads == [f"{node_key('b2')}/{DATA_NAME}", f"{node_key('b2')}/{META_NAME}"]
    with pytest.raises(DoubleDeleteError, match="already deleted by env_worker_0"):
        keeper.discard(refs[:1])


def test_an_argument_of_another_type_is_an_argument_type_error_at_the_call_and_nothing_changes(keeper,
                                                                                              storage_config):
    """``keep({...})`` (a dict for a Branch) and ``discard(["abc"])`` (strings for refs) raised AttributeError from
    inside the ledger; each public call of the keeper now refuses such an argument first, naming it and the type."""
    ref = keeper.keep(Branch(P, C, fields_of(), "b0"))
    keeper.ledger.flush()
    before = listing(storage_config)
    cases = [
        (lambda: keeper.keep({"num_prompt_tokens": 4}),
         "Keeper.keep(branch): expected a Branch, got dict {'num_prompt_tokens': 4}"),
        (lambda: keeper.discard(["abc"]), "Keeper.discard(refs)[0]: expected a PayloadRef, got str 'abc'"),
        (lambda: keeper.discard([ref, ref.model_dump()]),
         f"Keeper.discard(refs)[1]: expected a PayloadRef, got dict {repr(ref.model_dump())[:57]}..."),
        (lambda: keeper.discard(ref),
         f"Keeper.discard(refs): expected a sequence of PayloadRef, got PayloadRef {repr(ref)[:57]}..."),
        (lambda: keeper.discard("b0"), "Keeper.discard(refs): expected a sequence of PayloadRef, got str 'b0'"),
        (lambda: keeper.open_branch(2, branch_id=7), "Keeper.open_branch(branch_id): expected a str, got int 7"),
        (lambda: keeper.open_branch(2, prefix="b0"), "Keeper.open_branch(prefix): expected a PayloadRef, got str 'b0'"),
        (lambda: keeper.release_holders("b0", ["h"]),
         "Keeper.release_holders(prefix): expected a PayloadRef, got str 'b0'"),
        (lambda: keeper.release_holders(ref, [3]), "Keeper.release_holders(holders)[0]: expected a str, got int 3"),
    ]
    for call, message in cases:
        with pytest.raises(ArgumentTypeError) as info:
            call()
        assert (str(info.value), isinstance(info.value, TypeError)) == (message, True)
    keeper.ledger.flush()
    assert listing(storage_config) == before
    assert fetch_arrays(keeper.store, ref).keys() == stored(fields_of()).keys()


def test_keep_holds_no_reference_to_the_arrays(keeper):
    fields = fields_of()
    arrays = list(stored(fields).values())
    alive = [weakref.ref(a) for a in arrays]
    ref = keeper.keep(Branch(P, C, fields, "b1"))
    del fields, arrays
    gc.collect()
    assert [r() for r in alive] == [None] * len(alive)
    assert ref.num_tokens == P + C


def test_env_worker_keeping_5000_branches_does_not_grow(local_config):
    """RSS after 4,500 more keeps (past a 500-keep warm-up) grows < 4 MiB; measured ~0.3 MiB. Keeping each
    branch's arrays (~3.5 KiB) would add ~32 MiB, keeping just the refs ~14 MiB."""
    store = open_store(local_config)
    cfg = FieldsConfig(num_layers=4, top_k=4, num_experts=16, logprobs_k=8, support_width=8, sampling_mask=True)
    keeper = Keeper(store, Ledger(store, "env_worker_0"), cfg, local_config)
    template = {
        "routed_experts": np.tile(np.arange(4, dtype=np.uint8), (64, 4, 1)), "topk_ids": np.ones((48, 8), np.int32),
        "topk_logprobs": np.full((48, 8), -1.0, np.float32), "sample_support": np.ones((48, 8), np.int32),
        "sampling_mask": Ragged(np.ones(96, np.int32), np.full(48, 2, np.int32)),
    }

    def keep_one() -> None:
        fields = {k: Ragged(v.ids.copy(), v.counts.copy()) if isinstance(v, Ragged) else v.copy()
                  for k, v in template.items()}
        keeper.keep(Branch(16, 48, fields))

    for _ in range(500):
        keep_one()
    gc.collect()
    process = psutil.Process()
    start = process.memory_info().rss
    for _ in range(4500):
        keep_one()
    gc.collect()
    growth = process.memory_info().rss - start
    assert growth < 4 << 20, f"RSS grew {growth} bytes over 4,500 keeps"
    assert len(store.list_prefix("payloads")) == 2 * 5000


def test_a_keep_in_a_shard_seen_before_is_five_filesystem_calls(local_config):
    """bench/keep_fetch.py's ``fs_ops_per_branch.keep`` floor (docs/benchmarks.md): the branch directory's ``mkdir``
    and ``O_PATH`` open (the anchor no symlink is followed below), ``c.0`` created in place, ``zarr.json`` as an
    ``O_TMPFILE`` linked whole; the ledger's keep event is buffered."""
    from tests.storage.storage_helpers import FsOps
    store = open_store(local_config)
    keeper = Keeper(store, Ledger(store, "env_worker_0"), CFG, local_config)
    shard = node_key("b0").rpartition("/")[0]
    second = next(f"b{i}" for i in range(1, 10_000) if node_key(f"b{i}").rpartition("/")[0] == shard)
    keeper.keep(Branch(P, C, fields_of(), "b0"))  # reaches (and caches) the run prefix, payloads and the shard
    with FsOps(store.prefix.path) as ops:
        ref = keeper.keep(Branch(P, C, fields_of(seed=1), second))
    assert ops.ops == [("os.mkdir", second), ("open", second), ("open", DATA_NAME), ("open", "."),
                       ("os.link", META_NAME)]
    assert fetch_arrays(store, ref)["topk_ids"].tobytes() == fields_of(seed=1)["topk_ids"].tobytes()
