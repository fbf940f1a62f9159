"""``fetch_into``: chunks read straight into the caller's arrays, byte for byte, or a typed error."""

from __future__ import annotations

import json

import numpy as np
import pytest
from pydantic import ValidationError

from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.chunk_read import fetch_arrays, fetch_into
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import ChunkCorruptError, ChunkNotFoundError
from refpipe.storage.layout import DATA_NAME, node_key
from refpipe.storage.ledger import Ledger
from tests.storage.storage_helpers import FIELDS_CFG, Backend, assert_same_bytes, make_backend, make_fields, stored_cut

P, C = 3, 7


@pytest.fixture(params=["local", "s3"])
def backend(request) -> Backend:
    return make_backend(request.param, request.getfixturevalue(f"{request.param}_config"))


def keep(backend: Backend, compression: str = "none") -> tuple[PayloadRef, dict]:
    config = backend.config.model_copy(update={"compression": compression})
    keeper = Keeper(backend.store, Ledger(backend.store, "env_worker_0"), FIELDS_CFG, config)
    fields = make_fields(5, P, C)
    return keeper.keep(Branch(P, C, fields, "b1")), fields


def data_key(ref: PayloadRef) -> str:
    return f"{node_key(ref.branch_id)}/{DATA_NAME}"


def destinations(ref: PayloadRef, num_tokens: int, names: list[str], fields: dict) -> dict[str, np.ndarray]:
    """Rows of a larger array, filled with 0xEE, for each of ``names`` (cut to ``num_tokens`` tokens)."""
    cut = stored_cut(fields, P, num_tokens)
    out = {}
    for name in names:
        big = np.full((len(cut[name]) + 3, *cut[name].shape[1:]), 0xEE, np.dtype(ref.arrays[name].dtype))
        out[name] = big[1 : 1 + len(cut[name])]
    return out


@pytest.mark.parametrize("compression,num_tokens", [("none", P + C), ("none", P + 2), ("zstd", P + C), ("zstd", P)])
def test_fetch_into_the_callers_arrays_is_byte_identical(backend, compression, num_tokens):
    ref, fields = keep(backend, compression)
    names = ["routed_experts", "topk_logprobs", "sampling_mask.counts"]
    out = destinations(ref, num_tokens, names, fields)
    got, in_place = fetch_into(backend.store, ref, num_tokens, out)
    if compression == "zstd" or num_tokens < P + C:
        assert not in_place  # read, then copied
    every = destinations(ref, num_tokens, list(ref.arrays), fields)
    assert fetch_into(backend.store, ref, num_tokens, every).in_place == (compression == "none" and num_tokens == P + C)
    assert_same_bytes(got, stored_cut(fields, P, num_tokens))
    assert all(got[name] is out[name] for name in names)
    assert_same_bytes({name: out[name] for name in names}, {n: stored_cut(fields, P, num_tokens)[n] for n in names})
    assert all(not got[name].flags.writeable for name in got if name not in names)
    assert_same_bytes(fetch_arrays(backend.store, ref, num_tokens), stored_cut(fields, P, num_tokens))


def test_whole_fetch_leaves_the_rest_of_the_callers_array_alone(backend):
    ref, fields = keep(backend)
    big = np.full((P + C + 2, 3, 2), 0xEE, np.uint8)
    fetch_into(backend.store, ref, None, {"routed_experts": big[1:-1]})
    assert (big[0] == 0xEE).all() and (big[-1] == 0xEE).all()
    assert big[1:-1].tobytes() == fields["routed_experts"].tobytes()


@pytest.mark.parametrize("change", ["truncated", "one_byte_short", "one_byte_longer", "doubled"])
def test_a_chunk_of_another_length_is_corrupt(backend, change):
    ref, fields = keep(backend)
    stored = backend.raw.get(data_key(ref))
    bad = {"truncated": stored[:100], "one_byte_short": stored[:-1], "one_byte_longer": stored + b"\x00",
           "doubled": stored + stored}[change]
    backend.raw.put(data_key(ref), bad)
    with pytest.raises(ChunkCorruptError, match=f"expected {ref.nbytes} bytes, got {len(bad)}"):
        fetch_into(backend.store, ref, None, destinations(ref, P + C, ["routed_experts"], fields))


@pytest.mark.parametrize("where", ["array", "alignment_padding", "checksum"])
def test_a_flipped_byte_is_corrupt(backend, where):
    ref, fields = keep(backend)
    stored = backend.raw.get(data_key(ref))
    lay = ref.layout()[0]  # routed_experts: 10 x 3 x 2 bytes, padded to 64
    assert lay.nbytes % 64
    pos = {"array": lay.offset + 7, "alignment_padding": lay.offset + lay.nbytes, "checksum": len(stored) - 2}[where]
    corrupted = bytearray(stored)
    corrupted[pos] ^= 0x10
    backend.raw.put(data_key(ref), bytes(corrupted))
    with pytest.raises(ChunkCorruptError, match="crc32c mismatch"):
        fetch_into(backend.store, ref, None, destinations(ref, P + C, ["routed_experts", "topk_ids"], fields))


def test_a_missing_chunk_is_not_found(backend):
    ref, fields = keep(backend)
    backend.raw.remove(data_key(ref))
    out = destinations(ref, P + C, ["routed_experts"], fields)
    with pytest.raises(ChunkNotFoundError, match="does not exist"):
        fetch_into(backend.store, ref, None, out)
    assert (out["routed_experts"] == 0xEE).all()


def test_a_ref_whose_arrays_do_not_fit_its_bytes_is_refused_before_any_read(backend):
    ref, _ = keep(backend)
    raw = json.loads(ref.model_dump_json())
    raw["arrays"]["routed_experts"][1] = [10_006, 3, 2]
    raw["num_prompt_tokens"] += 10_006 - (P + C)
    with pytest.raises(ValidationError, match=r"array 'routed_experts': 1 block crcs: expected 20 uint32"):
        PayloadRef.model_validate(raw)
    raw["arrays"]["routed_experts"][3] = [0] * 20
    with pytest.raises(ValidationError, match=f"nbytes={ref.nbytes}: expected 60676 for the declared arrays"):
        PayloadRef.model_validate(raw)


@pytest.mark.parametrize("num_tokens", [P + C, P + 2])
def test_a_wrong_destination_is_a_value_error(backend, num_tokens):
    ref, fields = keep(backend)
    rows = num_tokens
    read_only = np.empty((rows, 3, 2), np.uint8)
    read_only.flags.writeable = False
    bad_ones = [(np.empty((rows, 3, 2), "<u2"), "<u2"), (np.empty((rows + 1, 3, 2), np.uint8), f"{rows + 1}, 3, 2"),
                (read_only, "|u1"), (np.empty((rows, 3, 4), np.uint8)[:, :, :2], "|u1"),
                (bytearray(rows * 6), "bytearray")]
    for bad, what in bad_ones:
        with pytest.raises(ValueError, match=f"destination of routed_experts is .*{what}.*expected a writable "
                                             f"C-contiguous \\|u1 \\[{rows}, 3, 2\\]"):
            fetch_into(backend.store, ref, num_tokens, {"routed_experts": bad})
