"""A missing, truncated or corrupted chunk is a typed error, never data; refs resolve by branch id inside the run."""

from __future__ import annotations

import datetime
import re

import google_crc32c
import numpy as np
import pytest
import zarr
from pydantic import ValidationError

from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import ChunkCorruptError, ChunkNotFoundError, OutsideRunError
from refpipe.storage.layout import DATA_NAME, META_NAME, node_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_records import delete_record_of
from tests.storage.storage_helpers import FIELDS_CFG, Backend, FsOps, S3Requests, make_backend, make_fields

P, C = 4, 6


@pytest.fixture(params=["local", "s3"])
def backend(request) -> Backend:
    return make_backend(request.param, request.getfixturevalue(f"{request.param}_config"))


def keep(backend: Backend, branch_id: str = "b1", compression: str = "none", seed: int = 0) -> PayloadRef:
    config = backend.config.model_copy(update={"compression": compression})
    keeper = Keeper(backend.store, Ledger(backend.store, "env_worker_0"), FIELDS_CFG, config)
    return keeper.keep(Branch(P, C, make_fields(seed, P, C), branch_id))


def data_key(ref: PayloadRef) -> str:
    return f"{node_key(ref.branch_id)}/{DATA_NAME}"


@pytest.mark.parametrize("num_tokens", [None, P + 1, P - 1])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_missing_chunk_is_chunk_not_found_never_zeros(backend, num_tokens, compression):
    ref = keep(backend, compression=compression)
    backend.raw.remove(data_key(ref))
    with pytest.raises(ChunkNotFoundError, match="does not exist") as info:
        fetch_arrays(backend.store, ref, num_tokens)
    assert backend.store.uri(data_key(ref)) in str(info.value)
    storage_options = ({"client_kwargs": {"endpoint_url": backend.config.s3_endpoint_url}}
                       if backend.name == "s3" else None)
    zeros = zarr.open(ref.uri, zarr_format=3, mode="r", storage_options=storage_options)[:]
    assert not zeros.any()  # what a plain zarr reader returns for the missing chunk: fill values


def test_missing_node_is_chunk_not_found(backend):
    ref = keep(backend)
    backend.raw.remove(data_key(ref))
    backend.raw.remove(f"{node_key(ref.branch_id)}/{META_NAME}")
    with pytest.raises(ChunkNotFoundError):
        fetch_arrays(backend.store, ref)


@pytest.mark.parametrize("keep_bytes", [-1, -4, -5, 100, 1, 0])
def test_truncated_chunk_is_corrupt(backend, keep_bytes):
    ref = keep(backend)
    stored = backend.raw.get(data_key(ref))
    backend.raw.put(data_key(ref), stored[:keep_bytes])
    with pytest.raises(ChunkCorruptError, match=f"expected {ref.nbytes} bytes, got {len(stored[:keep_bytes])}"):
        fetch_arrays(backend.store, ref)


def test_truncated_chunk_is_corrupt_for_a_first_n_fetch_that_reaches_past_the_end(backend):
    ref = keep(backend)
    end_of_routing = ref.layout()[1].offset  # the next array starts here
    backend.raw.put(data_key(ref), backend.raw.get(data_key(ref))[: end_of_routing + 8])
    with pytest.raises(ChunkCorruptError, match="truncated chunk"):
        fetch_arrays(backend.store, ref, P + 2)


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("where", ["first", "each_array", "last_payload", "checksum"])
def test_flipped_byte_is_corrupt(backend, compression, where):
    ref = keep(backend, compression=compression)
    stored = backend.raw.get(data_key(ref))
    positions = {"first": [0], "last_payload": [len(stored) - 5], "checksum": [len(stored) - 1],
                 "each_array": [lay.offset + lay.nbytes // 2 for lay in ref.layout()]}[where]
    for pos in positions:
        if pos >= len(stored):
            continue  # compressed chunks are shorter than the payload
        corrupted = bytearray(stored)
        corrupted[pos] ^= 0x01
        backend.raw.put(data_key(ref), bytes(corrupted))
        with pytest.raises(ChunkCorruptError, match="crc32c mismatch"):
            fetch_arrays(backend.store, ref)


def test_another_valid_chunk_of_the_same_size_is_corrupt(backend):
    ref = keep(backend, "b1", seed=1)
    other = keep(backend, "b2", seed=2)
    assert ref.nbytes == other.nbytes and ref.checksum != other.checksum
    backend.raw.put(data_key(ref), backend.raw.get(data_key(other)))
    with pytest.raises(ChunkCorruptError, match=f"reference {ref.checksum:#010x}"):
        fetch_arrays(backend.store, ref)


def test_zstd_frame_that_does_not_decode_is_corrupt(backend):
    ref = keep(backend, compression="zstd")
    body = b"\x28\xb5\x2f\xfd\x60" + (576 - 256).to_bytes(2, "little") + b"not a zstd frame" * 4  # declares 576
    crc = google_crc32c.value(body)
    backend.raw.put(data_key(ref), body + np.array([crc], "<u4").tobytes())
    forged = ref.model_copy(update={"nbytes": len(body) + 4, "checksum": crc})
    with pytest.raises(ChunkCorruptError, match="zstd frame does not decode"):
        fetch_arrays(backend.store, forged)


def test_num_tokens_out_of_range(backend):
    ref = keep(backend)
    for bad in (-1, P + C + 1):
        with pytest.raises(ValueError, match=f"num_tokens={bad}.*expected 0..{P + C}"):
            fetch_arrays(backend.store, ref, bad)


def _misnamed_uris(backend: Backend) -> list[str]:
    """URIs that do not name branch b1's chunk: ``..`` segments, the run itself, another branch's node."""
    node, run = node_key("b1"), backend.store.prefix
    return [f"{run.uri}/../run_10/{node}", f"{run.uri}/payloads/../../run_10/{node}",
            f"{run.uri}/{node}/../../../../run_10/{node}", f"{run.uri}", f"{run.uri}/{node_key('b2')}"]


def _other_run_uris(backend: Backend, sibling_ref: PayloadRef) -> list[str]:
    """URIs that name branch b1 under another run, bucket, host, scheme or root: provenance only."""
    node, run = node_key("b1"), backend.store.prefix
    if backend.name == "s3":
        rest = run.path.partition("/")[2]
        return [sibling_ref.uri, f"s3://other-bucket/{rest}/{node}", f"file:///{run.path}/{node}"]
    return [sibling_ref.uri, f"s3://bucket{run.path}/{node}", f"file://otherhost{run.path}/{node}",
            f"{run.path.rpartition('/')[0]}/other_root/run_1/{node}"]


def _sibling_with_b1(backend: Backend) -> tuple[Backend, PayloadRef]:
    sibling = make_backend(backend.name, backend.config.model_copy(update={"run_id": "run_10"}))
    return sibling, keep(sibling, "b1")


def test_refs_whose_uri_names_another_chunk_are_refused_before_any_io(backend):
    """A ref's URI must end in its branch id's node key (issue 14 item 7): otherwise it is refused
    before any I/O, whether it would lead out of the run or to another branch's chunk."""
    sibling, sibling_ref = _sibling_with_b1(backend)
    before = sibling.raw.keys()
    other = keep(backend, "b2")
    ledger = Ledger(backend.store, "trainer_dp0")
    refs = [sibling_ref.model_copy(update={"uri": uri}) for uri in _misnamed_uris(backend)]
    requests = S3Requests(backend.store) if backend.name == "s3" else None
    with FsOps(backend.raw.root) as ops:
        for ref in refs:
            with pytest.raises(OutsideRunError, match=f"ref 'b1': ref uri '{re.escape(ref.uri)}' does not name "
                                                      f"branch 'b1': expected a URI ending in /{node_key('b1')}"):
                fetch_arrays(backend.store, ref)
            with pytest.raises(OutsideRunError, match="does not name branch 'b1'"):
                ledger.delete([ref], reason="test")
    assert ops.ops == [] and (requests is None or requests.log == [])
    assert sibling.raw.keys() == before
    assert fetch_arrays(sibling.store, sibling_ref)["routed_experts"].shape == (P + C, 3, 2)
    assert fetch_arrays(backend.store, other)["routed_experts"].shape == (P + C, 3, 2)


def test_refs_naming_other_runs_resolve_in_the_run_as_opened(backend):
    """Run-relative refs: whatever run, bucket, host or root a ref's URI names, a reader reads and
    deletes only the chunk its branch id names under the run it opened; the sibling run holding a
    real b1 is never read or deleted."""
    sibling, sibling_ref = _sibling_with_b1(backend)
    before = sibling.raw.keys()
    refs = [sibling_ref.model_copy(update={"uri": uri}) for uri in _other_run_uris(backend, sibling_ref)]
    own_node = backend.store.uri(node_key("b1"))
    for ref in refs:
        with pytest.raises(ChunkNotFoundError, match=re.escape(own_node)):
            fetch_arrays(backend.store, ref)
    own = keep(backend, "b1")  # the same bytes as the sibling's b1, so the refs' checksum holds
    for ref in refs:
        np.testing.assert_array_equal(fetch_arrays(backend.store, ref)["routed_experts"],
                                      make_fields(0, P, C)["routed_experts"])
    result = Ledger(backend.store, "trainer_dp0").delete(refs[:1], reason="test")
    assert result.deleted == [own.uri]
    assert sibling.raw.keys() == before
    np.testing.assert_array_equal(fetch_arrays(sibling.store, sibling_ref)["routed_experts"],
                                  make_fields(0, P, C)["routed_experts"])


@pytest.mark.parametrize("cut", [P + C - 5, 1])
def test_a_cut_read_of_a_zeroed_chunk_is_corrupt_never_zeros(backend, cut):
    """Issue 14 input 1: c.0 overwritten with zeros of its length; a first-n fetch returned all-zero routing."""
    ref = keep(backend)
    backend.raw.put(data_key(ref), bytes(ref.nbytes))
    routing = ref.layout()[0]
    zero_block = google_crc32c.value(bytes(routing.nbytes))  # the routing array's one block, all zeros
    with pytest.raises(ChunkCorruptError) as info:
        fetch_arrays(backend.store, ref, cut)
    assert str(info.value) == (f"chunk {ref.uri}: array routed_experts rows [0, {P + C}): crc32c {zero_block:#010x}, "
                               f"reference {routing.block_crcs[0]:#010x} (corrupted chunk)")


def test_a_cut_read_checks_every_block_it_reads_and_reads_only_those(local_config):
    """600 tokens: routing has 2 blocks of BLOCK_ROWS=512 rows; a cut at 100 tokens reads and checks block 0 only."""
    backend = make_backend("local", local_config)
    num_prompt, num_completion = 300, 300
    keeper = Keeper(backend.store, Ledger(backend.store, "env_worker_0"), FIELDS_CFG, backend.config)
    fields = make_fields(3, num_prompt, num_completion)
    ref = keeper.keep(Branch(num_prompt, num_completion, fields, "long"))
    routing = ref.layout()[0]
    assert len(routing.block_crcs) == 2 and routing.block_crcs[0] == google_crc32c.value(
        fields["routed_experts"][:512].tobytes())
    stored = bytearray(backend.raw.get(data_key(ref)))
    stored[routing.offset + 512 * 6] ^= 0x01  # first byte of routing block 1 (rows 512..599, 6 bytes a row)
    backend.raw.put(data_key(ref), bytes(stored))
    assert fetch_arrays(backend.store, ref, 100)["routed_experts"].tobytes() == fields["routed_experts"][:100].tobytes()
    with pytest.raises(ChunkCorruptError, match=r"array routed_experts rows \[512, 600\): crc32c 0x"):
        fetch_arrays(backend.store, ref, 513)


def test_a_ref_declaring_2e9_rows_is_bounded_by_the_object_not_the_ref(backend):
    """Issue 14 input 8: 2e9 declared rows with a matching nbytes; the fetch allocated 12 GB before reading 644 bytes.
    A ref must carry one crc per 512-row block, so the forged one carries 3,906,250 of them: it validates, and the
    fetch allocates only what the store returns."""
    ref = keep(backend)
    raw = ref.model_dump(mode="json")
    rows = 2_000_000_000
    raw.update(num_prompt_tokens=rows - C)
    spec = raw["arrays"]["routed_experts"]
    spec[1], spec[3] = [rows, 3, 2], [0] * (rows // 512)
    raw["nbytes"] = ref.nbytes + rows * 6 - 64  # routing grows from 60 bytes (padded to 64) to 12e9
    forged = PayloadRef.model_validate(raw)
    assert forged.nbytes == 12_000_000_516
    with pytest.raises(ChunkCorruptError, match=f"expected {forged.nbytes} bytes, got {ref.nbytes}"):
        fetch_arrays(backend.store, forged)
    with pytest.raises(ChunkCorruptError, match="truncated chunk"):
        fetch_arrays(backend.store, forged, 1000)


@pytest.mark.parametrize("change,message", [
    ({"arrays.routed_experts.1": [-5, 3, 2]}, "array 'routed_experts': shape [-5, 3, 2]: expected at least one "
                                              "dimension, none negative"),
    ({"arrays.topk_ids.1": [7, 4]}, "array 'topk_ids': 7 rows: expected 6 (completion domain)"),
    ({"arrays.topk_ids.0": "|O"}, "array 'topk_ids': dtype '|O': expected one of"),
    ({"arrays.topk_ids.2": "tokens"}, "array 'topk_ids': 6 rows: expected 10 (tokens domain)"),
    ({"arrays.sampling_mask.ids.2": "values:nothing"}, "array 'sampling_mask.ids': domain 'values:nothing': expected"),
    ({"arrays.topk_ids.3": [2**32]}, "array 'topk_ids': 1 block crcs: expected 1 uint32"),
    ({"nbytes": 10**12}, "nbytes=1000000000000: expected 580 for the declared arrays"),
])
def test_untrusted_ref_shapes_are_refused_at_validation(local_config, change, message):
    """Issue 14 input 8: a ref with shape [-5, 3] passed validation and crashed ``refpipe show``."""
    raw = keep(make_backend("local", local_config)).model_dump(mode="json")
    (path, value), = change.items()
    *parents, leaf = path.replace("sampling_mask.ids", "sampling_mask\0ids").split(".")
    target = raw
    for p in parents:
        target = target[p.replace("\0", ".")]
    target[int(leaf) if leaf.isdigit() else leaf.replace("\0", ".")] = value
    with pytest.raises(ValidationError) as info:
        PayloadRef.model_validate(raw)
    assert message in str(info.value)


@pytest.mark.parametrize("num_tokens", [None, P + 1, 0])
def test_a_deleted_chunk_is_answered_at_once_naming_its_deleter(backend, num_tokens):
    """A fetch of a chunk whose delete record exists read it 5 times with backoff (~0.6 s a chunk) and said only
    ``.../c.0 does not exist (read 5 times)``. Deleted is final: one read, then the delete record's word."""
    store = backend.store
    ref = keep(backend)
    ledger = Ledger(store, "trainer_dp3")
    ledger.delete([ref], reason="step 4 trained")
    ledger.wait_freed()  # a filesystem's reaper removes the chunk after the call returns
    record = delete_record_of(store, ref.branch_id)  # its own delete record, or (a filesystem) the batch record
    when = datetime.datetime.fromtimestamp(record.t, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")
    retries = store.retries
    with pytest.raises(ChunkNotFoundError) as info:
        fetch_arrays(store, ref, num_tokens)
    assert str(info.value) == (f"{store.uri(data_key(ref))} does not exist: chunk {store.uri(ref.key)} was deleted "
                               f"by trainer_dp3 at {when} UTC (step 4 trained)")
    assert store.retries == retries  # not read again


def test_a_missing_chunk_without_a_delete_record_is_read_again_first(backend):
    store = backend.store
    ref = keep(backend)
    backend.raw.remove(data_key(ref))
    retries = store.retries
    with pytest.raises(ChunkNotFoundError) as info:
        fetch_arrays(store, ref)
    assert str(info.value) == (f"{store.uri(data_key(ref))} does not exist (read {store.config.max_retries + 1} "
                               "times; no delete record)")
    assert store.retries == retries + store.config.max_retries


def test_a_fetch_of_no_tokens_checks_the_chunk_is_there(backend):
    """``fetch_arrays(store, ref, 0)`` returned empty arrays without touching the store, for a missing chunk too.
    It reads the chunk's last 4 bytes (its crc32c) and compares them with the ref's now."""
    store = backend.store
    ref = keep(backend)
    got = fetch_arrays(store, ref, 0)
    assert {name: a.shape for name, a in got.items()} == {
        name: (0, *spec.shape[1:]) for name, spec in ref.arrays.items()}
    stored = bytearray(backend.raw.get(data_key(ref)))
    stored[-1] ^= 0x01  # the last byte of the chunk's crc32c
    backend.raw.put(data_key(ref), bytes(stored))
    with pytest.raises(ChunkCorruptError) as info:
        fetch_arrays(store, ref, 0)
    crc = int.from_bytes(stored[-4:], "little")
    assert str(info.value) == (f"chunk {store.uri(ref.key)}: stored crc32c {crc:#010x}, reference "
                               f"{ref.checksum:#010x} (another or a corrupted chunk)")
    backend.raw.remove(data_key(ref))
    with pytest.raises(ChunkNotFoundError) as info:
        fetch_arrays(store, ref, 0)
    assert str(info.value) == (f"{store.uri(data_key(ref))} does not exist (read {store.config.max_retries + 1} "
                               "times; no delete record)")
