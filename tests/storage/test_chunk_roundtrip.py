"""Chunk round trips on both backends: keep, fetch (whole and first-n tokens), and offline reads with zarr.

Every comparison is byte for byte, with the dtype and shape the field table declares.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import zarr
from zarr.codecs import BytesCodec, Crc32cCodec, ZstdCodec
from zarr.core.buffer import default_buffer_prototype
from zarr.core.dtype import parse_dtype
from zarr.core.metadata.v3 import ArrayV3Metadata

from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.chunk_codec import read_attributes
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.chunk_ref import BLOCK_ROWS, PayloadRef, layout_arrays
from refpipe.storage.layout import DATA_NAME, META_NAME, node_key
from refpipe.storage.ledger import Ledger
from tests.storage.storage_helpers import (
    FIELDS_CFG,
    Backend,
    FsOps,
    S3Requests,
    assert_same_bytes,
    make_backend,
    make_fields,
    stored_cut,
)

P, C = 5, 7
WIDE_CFG = FieldsConfig(num_layers=2, top_k=3, num_experts=300, logprobs_k=3, support_width=4, sampling_mask=True)


@pytest.fixture(params=["local", "s3"])
def backend(request) -> Backend:
    return make_backend(request.param, request.getfixturevalue(f"{request.param}_config"))


def keep(backend: Backend, fields: dict, *, num_prompt_tokens=P, num_completion_tokens=C, cfg=FIELDS_CFG,
         compression="none", branch_id="b1") -> PayloadRef:
    config = backend.config.model_copy(update={"compression": compression})
    keeper = Keeper(backend.store, Ledger(backend.store, "env_worker_0"), cfg, config)
    return keeper.keep(Branch(num_prompt_tokens, num_completion_tokens, fields, branch_id))


def zarr_storage_options(backend: Backend) -> dict | None:
    if backend.name == "s3":
        return {"client_kwargs": {"endpoint_url": backend.config.s3_endpoint_url}, "skip_instance_cache": True}
    return None


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("routing_dtype,cfg", [(np.uint8, FIELDS_CFG), (np.uint16, WIDE_CFG)])
@pytest.mark.parametrize("num_prompt_tokens,num_completion_tokens", [(P, C), (3, 0), (1, 40)])
def test_every_field_round_trips_byte_identical(backend, compression, routing_dtype, cfg, num_prompt_tokens,
                                                num_completion_tokens):
    fields = make_fields(1, num_prompt_tokens, num_completion_tokens, cfg, routing_dtype)
    if routing_dtype == np.uint16:
        fields["routed_experts"][0, 0, :] = [299, 256, 0]  # ids above 255 need uint16
    ref = keep(backend, fields, num_prompt_tokens=num_prompt_tokens, num_completion_tokens=num_completion_tokens,
               cfg=cfg, compression=compression)
    got = fetch_arrays(backend.store, ref)
    assert_same_bytes(got, stored_cut(fields, num_prompt_tokens, num_prompt_tokens + num_completion_tokens))
    assert all(not a.flags.writeable for a in got.values())
    assert np.isneginf(got["topk_logprobs"][:, -1]).all() and (got["sample_support"][:, -1] == -1).all()
    assert ref.arrays["routed_experts"].dtype == np.dtype(routing_dtype).str
    payload_keys = [k for k in backend.raw.keys() if k.startswith("payloads/")]
    assert payload_keys == [f"{node_key('b1')}/{DATA_NAME}", f"{node_key('b1')}/{META_NAME}"]


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("num_tokens", [0, 1, P - 1, P, P + 1, P + C - 1, P + C])
def test_fetch_first_n_tokens_equals_the_input_cut(backend, compression, num_tokens):
    fields = make_fields(2, P, C)
    ref = keep(backend, fields, compression=compression)
    got = fetch_arrays(backend.store, ref, num_tokens)
    assert_same_bytes(got, stored_cut(fields, P, num_tokens))
    assert all(not a.flags.writeable for a in got.values())


def test_fetch_reads_only_the_chunk_and_only_needed_ranges(backend):
    """Whole fetch: one read of c.0. First-n fetch of an uncompressed chunk: one ranged read per non-empty array,
    of the array's first crc block (here the whole array: every array has fewer than BLOCK_ROWS rows)."""
    fields = make_fields(3, P, C)
    ref = keep(backend, fields)
    cut = stored_cut(fields, P, P + 2)
    layouts = {lay.name: lay for lay in ref.layout()}
    assert all(lay.shape[0] < BLOCK_ROWS for lay in layouts.values())
    ranges = [f"bytes={layouts[n].offset}-{layouts[n].offset + layouts[n].nbytes - 1}" for n, a in cut.items()
              if a.size]
    if backend.name == "s3":
        requests = S3Requests(backend.store)
        fetch_arrays(backend.store, ref)
        assert requests.log == [("GET", None)]
        requests.clear()
        fetch_arrays(backend.store, ref, P + 2)
        assert requests.log == [("GET", r) for r in sorted(ranges, key=lambda r: int(r[6:].split("-")[0]))]
    else:
        with FsOps(backend.store.prefix.path) as ops:
            fetch_arrays(backend.store, ref)
            fetch_arrays(backend.store, ref, P + 2)
        assert ops.ops == [("open", DATA_NAME)] * (1 + len(ranges))  # each read: one open (the keep cached its
        # directory's handle)


def test_a_whole_fetch_returns_views_of_the_chunk_read_into_one_array(backend):
    """``Store.get_array``: on a filesystem one fresh numpy array of the chunk's bytes (numpy's allocator advises huge
    pages for large ones), on S3 the GET's bytes; every fetched array is a read-only view into it."""
    ref = keep(backend, make_fields(4, P, C))
    roots = []
    for a in fetch_arrays(backend.store, ref).values():
        assert not a.flags.writeable
        while isinstance(a.base, np.ndarray):
            a = a.base
        roots.append(a)
    assert all(root is roots[0] for root in roots)
    if backend.name == "local":
        assert (roots[0].base, roots[0].nbytes, roots[0].flags.owndata) == (None, ref.nbytes, True)
    else:
        assert isinstance(roots[0].base, bytes) and len(roots[0].base) == ref.nbytes


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_zarr_open_reads_the_branch_and_the_field_table_recovers_every_array(backend, compression):
    fields = make_fields(4, P, C)
    ref = keep(backend, fields, compression=compression)
    array = zarr.open(ref.uri, zarr_format=3, mode="r", storage_options=zarr_storage_options(backend))
    _, payload_nbytes = layout_arrays(ref.arrays)
    assert array.shape == (payload_nbytes,) and array.dtype == np.uint8 and array.chunks == (payload_nbytes,)
    meta = json.loads(backend.raw.get(f"{node_key('b1')}/{META_NAME}"))
    codecs = [c["name"] for c in meta["codecs"]]
    assert codecs == (["bytes", "zstd", "crc32c"] if compression == "zstd" else ["bytes", "crc32c"])
    table = array.attrs["refpipe"]
    assert table == read_attributes(backend.raw.get(f"{node_key('b1')}/{META_NAME}"))
    assert (table["branch_id"], table["num_prompt_tokens"], table["num_completion_tokens"]) == ("b1", P, C)
    payload = array[:]
    recovered = {
        name: np.frombuffer(payload, np.dtype(entry["dtype"]), int(np.prod(entry["shape"])),
                            entry["offset"]).reshape(entry["shape"])
        for name, entry in table["arrays"].items()
    }
    assert_same_bytes(recovered, stored_cut(fields, P, P + C))
    assert {n: e["domain"] for n, e in table["arrays"].items()} == {n: s.domain for n, s in ref.arrays.items()}


def test_payload_ref_is_small_and_round_trips_as_json(backend):
    fields = make_fields(5, 1024, 3072)
    del fields["sampling_mask"]
    branch_id = "env_worker_12-" + "f" * 32
    ref = keep(backend, fields, num_prompt_tokens=1024, num_completion_tokens=3072, branch_id=branch_id)
    text = ref.model_dump_json()
    assert len(text.encode()) < 1024
    assert PayloadRef.model_validate_json(text) == ref
    assert ref.uri == backend.store.uri(node_key(branch_id))
    assert ref.nbytes == len(backend.raw.get(f"{node_key(branch_id)}/{DATA_NAME}"))


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_metadata_document_is_what_zarr_writes(backend, compression):
    ref = keep(backend, make_fields(6, P, C), compression=compression)
    written = json.loads(backend.raw.get(f"{node_key('b1')}/{META_NAME}"))
    _, payload_nbytes = layout_arrays(ref.arrays)
    codecs = [BytesCodec()] + ([ZstdCodec(level=1, checksum=False)] if compression == "zstd" else []) + [Crc32cCodec()]
    expected = ArrayV3Metadata(
        shape=(payload_nbytes,), data_type=parse_dtype(np.dtype("uint8"), zarr_format=3),
        chunk_grid={"name": "regular", "configuration": {"chunk_shape": [payload_nbytes]}},
        chunk_key_encoding={"name": "default", "configuration": {"separator": "."}},
        fill_value=0, codecs=codecs, attributes=written["attributes"], dimension_names=None, storage_transformers=None,
    ).to_buffer_dict(default_buffer_prototype())["zarr.json"].to_bytes()
    assert written == json.loads(expected)
