"""The field registry (DESIGN.md, Fields), validate_branch's flattening and messages, and the padding rule."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import numpy as np
import pytest
from pydantic import ValidationError

from refpipe.pipeline.field_decl import FieldDecl, ValueChecks
from refpipe.pipeline.fields import FIELDS, FieldsConfig, Ragged, spread_expert_rows, trailing_shape, validate_branch
from refpipe.storage.errors import FieldError, validation_problems

CFG = FieldsConfig(num_layers=3, top_k=2, num_experts=8, logprobs_k=4, support_width=5, sampling_mask=True)


def test_registry_declares_every_field_once_with_its_rules():
    table = {name: (f.dtypes, trailing_shape(f, CFG), f.domain, f.padding, f.ragged) for name, f in FIELDS.items()}
    assert table == {
        "routed_experts": (("|u1", "<u2"), (3, 2), "tokens", "strided_ids", False),
        "topk_ids": (("<i4",), (4,), "completion", "empty_rows", False),
        "topk_logprobs": (("<f4",), (4,), "completion", "empty_rows", False),
        "sample_support": (("<i4",), (5,), "completion", "empty_rows", False),
        "sampling_mask": (("<i4",), (), "completion", "empty_rows", True),
    }
    assert all(name == f.name for name, f in FIELDS.items())


def test_unconfigured_fields_have_no_trailing_shape():
    empty = FieldsConfig()
    assert {name: trailing_shape(f, empty) for name, f in FIELDS.items()} == dict.fromkeys(FIELDS)
    assert trailing_shape(FIELDS["routed_experts"], FieldsConfig(num_layers=3, top_k=2)) is None  # needs num_experts


def test_validate_branch_flattens_ragged_fields_and_stores_little_endian():
    counts = np.array([2, 0, 1], np.int32)
    fields = {
        "routed_experts": np.tile(np.arange(2, dtype=np.uint8), (5, 3, 1)),
        "topk_ids": np.arange(12, dtype=">i4").reshape(3, 4),
        "sampling_mask": Ragged(np.array([7, 8, 9], np.int32), counts),
    }
    arrays, specs = validate_branch(fields, CFG, num_prompt_tokens=2, num_completion_tokens=3, what="branch b")
    assert list(arrays) == ["routed_experts", "topk_ids", "sampling_mask.counts", "sampling_mask.ids"]
    assert {n: tuple(s) for n, s in specs.items()} == {
        "routed_experts": ("|u1", (5, 3, 2), "tokens", ()),
        "topk_ids": ("<i4", (3, 4), "completion", ()),
        "sampling_mask.counts": ("<i4", (3,), "completion", ()),
        "sampling_mask.ids": ("<i4", (3,), "values:sampling_mask.counts", ()),
    }
    assert arrays["topk_ids"] is fields["topk_ids"]  # no copy here; the codec converts once when it writes


@pytest.mark.parametrize("fields,message", [
    ({"topk_ids": np.zeros((3, 4), np.float64)}, r"field 'topk_ids' has dtype float64: expected one of \['int32'\] "
                                                r"\(or any integer dtype"),
    ({"routed_experts": np.zeros((5, 3, 2), np.float32)}, r"has dtype float32: expected one of \['uint8', 'uint16'\]"),
    ({"topk_logprobs": np.zeros((3, 5), np.float32)}, r"'topk_logprobs' has shape \[3, 5\]: expected \[3, 4\]"),
    ({"topk_ids": np.zeros((5, 4), np.int32)}, r"'topk_ids' has shape \[5, 4\]: expected \[3, 4\] \(completion domain"),
    ({"routed_experts": np.zeros((3, 3, 2), np.uint8)}, r"shape \[3, 3, 2\]: expected \[5, 3, 2\] \(tokens domain"),
    ({"routed_experts": np.full((5, 3, 2), 8, np.uint8)},
     r"'routed_experts': row 0 \[num_layers 0, top_k 0\] value 8: expected >= 0, < num_experts=8$"),
    ({"routed_experts": np.full((5, 3, 2), 255, np.uint8)}, r"value 255: expected .*\(a -1 sentinel wrapped"),
    ({"topk_logprobs": np.array([[0, np.nan, -1, np.nan]] * 3, np.float32)},
     r"'topk_logprobs': row 0 \[logprobs_k 1\] value nan: expected finite, <= 0.0, or the sentinel -inf$"),
    ({"topk_logprobs": np.full((3, 4), np.inf, np.float32)}, r"row 0 \[logprobs_k 0\] value inf: expected finite"),
    ({"topk_logprobs": np.full((3, 4), 3.0, np.float32)}, r"row 0 \[logprobs_k 0\] value 3.0: expected finite, <= 0.0"),
    ({"sample_support": np.full((3, 5), -2, np.int32)}, r"'sample_support': row 0 \[support_width 0\] value -2: "
                                                        r"expected >= -1$"),
    ({"topk_ids": np.full((3, 4), -1, np.int32)}, r"row 0 \[logprobs_k 0\] value -1: expected >= 0$"),
    ({"routing": np.zeros((5, 3, 2), np.uint8)}, r"unknown field 'routing': expected one of \['routed_experts', "),
    ({"topk_ids": [[0] * 4] * 3}, r"field 'topk_ids' is list: expected a numpy array or a CPU tensor"),
    ({"sampling_mask": np.zeros(3, np.int32)}, r"'sampling_mask' is ndarray: expected Ragged\(ids, counts\)"),
    ({"sampling_mask": Ragged(np.zeros(2, np.int32), np.ones(4, np.int32))}, r"'sampling_mask.counts' has shape \[4\]"),
    ({"sampling_mask": Ragged(np.zeros(2, np.int32), np.ones(3, np.int32))},
     r"'sampling_mask.ids' has shape \[2\]: expected \[3\]"),
    ({"sampling_mask": Ragged(np.zeros(0, np.int32), np.array([1, -1, 0], np.int32))},
     r"'sampling_mask.counts': row 1 value -1: expected >= 0$"),
])
def test_bad_fields_name_the_branch_the_field_and_the_expectation(fields, message):
    with pytest.raises(FieldError, match=message) as info:
        validate_branch(fields, CFG, num_prompt_tokens=2, num_completion_tokens=3, what="branch b7 (env worker w)")
    assert str(info.value).startswith("branch b7 (env worker w): ")


def test_unconfigured_field_is_refused():
    with pytest.raises(FieldError, match="field 'sampling_mask' is not configured for this run"):
        validate_branch({"sampling_mask": Ragged(np.zeros(0, np.int32), np.zeros(3, np.int32))},
                        CFG.model_copy(update={"sampling_mask": False}), num_prompt_tokens=2,
                        num_completion_tokens=3, what="branch b")


@pytest.mark.parametrize("prompt,completion", [(-1, 3), (2, -1), (2.0, 3), (True, 3), ("2", 3)])
def test_bad_token_counts(prompt, completion):
    with pytest.raises(FieldError, match="expected an integer >= 0"):
        validate_branch({}, CFG, num_prompt_tokens=prompt, num_completion_tokens=completion, what="branch b")


def test_spread_expert_rows_route_padding_over_every_expert():
    rows = spread_expert_rows(6, 3, 2, 8, np.dtype(np.uint8))
    assert rows.dtype == np.uint8 and rows.shape == (6, 3, 2)
    assert rows[:, 0, :].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 1], [2, 3]]
    assert rows[1].tolist() == [[2, 3], [3, 4], [4, 5]]
    assert (np.sort(rows, axis=-1)[..., 1:] != np.sort(rows, axis=-1)[..., :-1]).all()  # distinct per (token, layer)
    assert set(rows.ravel().tolist()) == set(range(8))
    wide = spread_expert_rows(200, 2, 4, 300, np.dtype(np.uint16))
    assert wide.dtype == np.uint16 and int(wide.max()) == 299 and int(wide.min()) == 0


def test_repeated_expert_within_a_token_is_refused_naming_the_row():
    """Issue 14 input 4: a top-2 row [3, 3] was kept and replayed; no router produces it."""
    routing = np.tile(np.arange(2, dtype=np.uint8), (5, 3, 1))
    routing[3, 2] = [3, 3]
    with pytest.raises(FieldError) as info:
        validate_branch({"routed_experts": routing}, CFG, num_prompt_tokens=2, num_completion_tokens=3, what="branch b")
    assert str(info.value) == ("branch b: field 'routed_experts': row 3 [num_layers 2] holds [3, 3]: "
                               "expected 2 distinct ids (no router picks one id twice for a token)")


def test_repeats_are_found_in_any_pair_of_slots():
    cfg = FieldsConfig(num_layers=1, top_k=4, num_experts=8)
    for i, j in [(0, 1), (0, 3), (1, 2), (2, 3)]:
        routing = np.tile(np.arange(4, dtype="<u2"), (2, 1, 1))
        routing[1, 0, j] = routing[1, 0, i]
        with pytest.raises(FieldError, match=r"row 1 \[num_layers 0\] holds "):
            validate_branch({"routed_experts": routing}, cfg, num_prompt_tokens=1, num_completion_tokens=1, what="b")


def test_a_repeat_in_any_slot_pair_of_a_full_size_routing_array_is_named_exactly():
    """The distinct-expert check at bench/peers.py's shape ([4096, 48, 8] uint8, 128 experts): every one of the
    28 slot pairs, in the first, a middle and the last (token, layer) row, is found and named."""
    cfg = FieldsConfig(num_layers=48, top_k=8, num_experts=128)
    rng = np.random.default_rng(0)
    routing = ((rng.integers(0, 128, (4096, 48, 1)) + np.arange(8)) % 128).astype(np.uint8)
    validate_branch({"routed_experts": routing}, cfg, num_prompt_tokens=1024, num_completion_tokens=3072, what="b")
    for token, layer in [(0, 0), (2049, 17), (4095, 47)]:
        for i in range(8):
            for j in range(i + 1, 8):
                bad = routing.copy()
                bad[token, layer, j] = bad[token, layer, i]
                with pytest.raises(FieldError) as info:
                    validate_branch({"routed_experts": bad}, cfg, num_prompt_tokens=1024, num_completion_tokens=3072,
                                    what="b")
                assert str(info.value) == (f"b: field 'routed_experts': row {token} [num_layers {layer}] holds "
                                           f"{bad[token, layer].tolist()}: expected 8 distinct ids (no router picks "
                                           "one id twice for a token)")


@pytest.mark.parametrize("dtype,repeat", [
    ("int32", [-7, 5, -7]),       # signed integers: compared as their bits
    ("<i2", [0, -32768, -32768]),
    ("float32", [0.5, -1.0, 0.5]),  # not integers: compared with ==
    ("float32", [0.0, -0.0, 1.0]),  # ... so 0.0 and -0.0 repeat, as == says
])
def test_a_declared_distinct_field_of_any_dtype_names_its_first_repeated_row(dtype, repeat):
    from refpipe.pipeline.field_decl import FieldDecl
    decl = FieldDecl.model_validate({"name": "ids", "dtypes": [dtype], "shape": [3], "checks": {"distinct": True}})
    rows = np.array([[-1, 5, 2]] * 4, dtype)
    validate_branch({"ids": rows}, FieldsConfig(declare=[decl]), num_prompt_tokens=1, num_completion_tokens=4, what="b")
    rows[2] = repeat
    with pytest.raises(FieldError) as info:
        validate_branch({"ids": rows}, FieldsConfig(declare=[decl]), num_prompt_tokens=1, num_completion_tokens=4,
                        what="b")
    assert str(info.value) == (f"b: field 'ids': row 2 holds {rows[2].tolist()}: expected 3 distinct ids (no router "
                               "picks one id twice for a token)")


ALL_BUT_LAST = CFG.model_copy(update={"routing_rows": "all_but_last"})


def test_all_but_last_routing_rows_get_a_spread_last_row():
    """Issue 14 input 3: vLLM returns P + C - 1 routing rows; ``routing_rows='all_but_last'`` fills row P + C - 1."""
    given = np.tile(np.arange(2, dtype=np.uint8), (4, 3, 1))
    arrays, specs = validate_branch({"routed_experts": given}, ALL_BUT_LAST, num_prompt_tokens=2,
                                    num_completion_tokens=3, what="branch b")
    assert arrays["routed_experts"][:4].tobytes() == given.tobytes()
    assert arrays["routed_experts"][4].tolist() == [[0, 1], [1, 2], [2, 3]]  # (4 * top_k + layer + slot) % 8
    assert specs["routed_experts"].shape == (5, 3, 2)


@pytest.mark.parametrize("cfg,rows,expected", [
    (ALL_BUT_LAST, 5, "has shape [5, 3, 2]: expected [4, 3, 2] (rows \"all_but_last\": P + C - 1 rows;"),
    (ALL_BUT_LAST, 3, "has shape [3, 3, 2]: expected [4, 3, 2] (rows \"all_but_last\": P + C - 1 rows;"),
    (CFG, 4, "has shape [4, 3, 2]: expected [5, 3, 2] (tokens domain rows; P + C - 1 rows, as engines return "
             "routing, need routing_rows = \"all_but_last\" (a declared field: rows = \"all_but_last\"); "
             "trailing shape ['num_layers', 'top_k'])"),
    (CFG, 6, "has shape [6, 3, 2]: expected [5, 3, 2] (tokens domain rows"),
])
def test_routing_rows_off_by_one_in_either_direction_is_refused(cfg, rows, expected):
    routing = np.tile(np.arange(2, dtype=np.uint8), (rows, 3, 1))
    with pytest.raises(FieldError) as info:
        validate_branch({"routed_experts": routing}, cfg, num_prompt_tokens=2, num_completion_tokens=3, what="b")
    assert expected in str(info.value)


def test_required_fields_must_be_configured():
    assert FieldsConfig(num_layers=3, top_k=2, num_experts=8, required=["routed_experts"]).required == (
        "routed_experts",)
    with pytest.raises(ValueError, match=r"required field 'topk_ids': expected a field configured for this run "
                                         r"\(one of \['routed_experts'\]\)"):
        FieldsConfig(num_layers=3, top_k=2, num_experts=8, required=("topk_ids",))
    with pytest.raises(ValueError, match="top_k=9: expected <= num_experts=8"):
        FieldsConfig(num_layers=3, top_k=9, num_experts=8)


def test_routing_dtype_is_sized_from_num_experts():
    assert [FieldsConfig(num_experts=n).routing_dtype.str for n in (8, 256, 257, 384)] == ["|u1", "|u1", "<u2", "<u2"]


@pytest.mark.parametrize("decl,message", [
    ({"dtypes": ["object"]}, "dtype 'object': expected a numpy name of one of"),
    ({"domain": "tokens"}, "padding 'empty_rows' in the tokens domain: expected zeros, repeat_rows or strided_ids"),
    ({"padding": "zeros"}, "padding 'zeros' in the completion domain"),
    ({"domain": "prompt", "rows": "all_but_last", "padding": "empty_rows"}, "rows 'all_but_last' in the prompt domain"),
    ({"domain": "tokens", "padding": "strided_ids", "shape": [2]}, "padding 'strided_ids': expected integer dtypes"),
    ({"ragged": True, "shape": [2]}, "ragged with shape [2] in the completion domain"),
    ({"checks": {"distinct": True}}, "checks.distinct: expected a trailing dimension"),
    ({"name": "Bad.Name"}, "String should match pattern"),
])
def test_a_declaration_with_inconsistent_rules_is_refused(decl, message):
    from refpipe.pipeline.field_decl import FieldDecl
    with pytest.raises(ValueError, match=re.escape(message)):
        FieldDecl.model_validate({"name": "x", "dtypes": ["float32"]} | decl)


@pytest.mark.parametrize("make,problems", [
    (lambda: FieldDecl(name="x", dtypes=["float32"], shape=[-3]),
     "field 'x': shape [-3]: expected sizes >= 1 or names of FieldsConfig settings"),
    (lambda: FieldDecl(name="x", dtypes=["float32"], shape=["num_layers", 0]),
     "field 'x': shape ['num_layers', 0]: expected sizes >= 1 or names of FieldsConfig settings"),
    (lambda: ValueChecks(low=5.0, high=1.0), "low=5.0 above high=1.0: expected low <= high (no value could pass both)"),
    (lambda: FieldDecl.model_validate({"name": "x", "dtypes": ["float32"], "checks": {"low": 5, "high": 1}}),
     "checks: low=5 above high=1: expected low <= high (no value could pass both)"),
])
def test_an_impossible_declaration_is_refused_where_it_is_declared(make, problems):
    """``FieldDecl(shape=[-3])`` and ``ValueChecks(low=5, high=1)`` were accepted (no array could ever be kept)."""
    with pytest.raises(ValidationError) as info:
        make()
    assert validation_problems(info.value) == problems


@pytest.mark.parametrize("declare,message", [
    ([{"name": "topk_ids", "dtypes": ["int32"]}], "field 'topk_ids' is declared twice or is a built-in field"),
    ([{"name": "x", "dtypes": ["int32"], "shape": ["hidden"]}], "field 'x' names ['hidden']: expected settings"),
    ([{"name": "x", "dtypes": ["int32"], "shape": ["logprobs_k"]}], "field 'x' names ['logprobs_k']"),
])
def test_fields_config_refuses_a_declaration_it_cannot_shape(declare, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        FieldsConfig(declare=declare)


def test_declared_fields_join_the_registry_and_required():
    cfg = FieldsConfig(num_layers=3, top_k=2, num_experts=8, declare=[
        {"name": "teacher_logprobs", "dtypes": ["float32"], "required": True, "checks": {"finite": True}}])
    assert list(cfg.registry()) == ["routed_experts", "teacher_logprobs"]
    assert cfg.required == ("teacher_logprobs",)
    assert FieldsConfig.model_validate_json(cfg.model_dump_json()) == cfg  # as a step header carries it


def test_a_sentinel_passes_the_bounds_and_nothing_else_does():
    from refpipe.pipeline.field_checks import check_bounds
    from refpipe.pipeline.field_decl import ValueChecks
    ids = ValueChecks(low=0, high=9, sentinel=-1)
    assert check_bounds(np.array([[-1, 3], [9, -1]], np.int32), ids, {}) is None
    assert check_bounds(np.array([[-1, 3], [-2, 10]], np.int32), ids, {}) == (
        "row 1 [index 0] value -2: expected >= 0, <= 9, or the sentinel -1")
    logprobs = FIELDS["topk_logprobs"].checks
    assert check_bounds(np.array([[-np.inf, -1.0]], np.float32), logprobs, {}) is None
    assert check_bounds(np.full((1, 2), -np.inf, np.float32), logprobs, {}) is None
    assert check_bounds(np.array([[-np.inf, np.nan]], np.float32), logprobs, {}) == (
        "row 0 [index 1] value nan: expected finite, <= 0.0, or the sentinel -inf")
    assert check_bounds(np.array([[np.nan]], np.float32), ValueChecks(), {}) == (
        "row 0 [index 0] value nan: expected not NaN")


def test_the_declarations_in_docs_fields_md_are_valid():
    import tomllib
    from pathlib import Path

    from refpipe.job.config import RunFieldsConfig
    text = (Path(__file__).resolve().parents[2] / "docs" / "fields.md").read_text()
    python, toml = (text.split(f"```{lang}\n")[1].split("```")[0] for lang in ("python", "toml"))
    scope: dict = {}
    exec(python, scope)  # noqa: S102 -- the doc's own example
    assert [d.name for d in scope["fields"].declare] == ["teacher_logprobs", "token_rewards", "image_features"]
    table = RunFieldsConfig.model_validate(tomllib.loads(toml)["fields"])
    assert [d.name for d in table.declare] == ["teacher_logprobs", "image_features"] and table.vocab_size == 151936


@pytest.mark.parametrize("dtype", ["uint8", "int8"])
def test_rows_of_eight_one_byte_ids_name_the_same_first_repeat_as_the_pairwise_check(dtype):
    """The compiled check of eight one-byte ids per row agrees with the pairwise comparison row for row: random rows
    with one repeat planted in every 7th row (any slot pair), also read unaligned and through a strided view."""
    from refpipe.pipeline.field_checks import repeated_rows
    rng = np.random.default_rng(1)
    rows = np.stack([rng.permutation(256)[:8] for _ in range(700)]).astype(np.uint8).view(dtype)
    assert repeated_rows(rows) is None
    for at in range(3, 700, 7):
        i, j = rng.choice(8, 2, replace=False)
        bad = rows.copy()
        bad[at:, j] = bad[at:, i]  # rows from ``at`` on repeat a value
        unaligned = np.frombuffer(b"\0" + bad.tobytes(), dtype, offset=1).reshape(bad.shape)
        strided = np.repeat(bad, 2, axis=0)[::2]
        assert [repeated_rows(bad), repeated_rows(unaligned), repeated_rows(strided)] == [at, at, at]
    padded = np.zeros((4, 16), dtype)  # eight ids as a slice of wider rows: not contiguous per row
    padded[:, :8] = rows[:4]
    padded[2, 5] = padded[2, 0]
    assert repeated_rows(padded[:, :8]) == 2


def test_the_compiled_check_is_compiled_once_then_loaded_from_its_cache_by_every_later_process(tmp_path):
    """numba's on-disk cache (here under ``NUMBA_CACHE_DIR``) serves every process after the first: one compile,
    then cache hits and no new cache file (a kernel defined per call, as a closure, missed in every process)."""
    code = ("import numpy as np; from refpipe.pipeline.octet_kernel import first_repeated_octet as k; "
            "k(np.zeros(4, np.uint64)); print(sum(k.stats.cache_hits.values()), sum(k.stats.cache_misses.values()))")
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = []
    for _ in range(3):
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        runs.append((out.stdout.split(), len(list(tmp_path.rglob("*.nbc")))))
    assert runs == [(["0", "1"], 2), (["1", "0"], 2), (["1", "0"], 2)]  # the kernel and its row test
