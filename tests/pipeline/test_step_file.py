"""Step files: round trip of what was packed, byte for byte; bad files are typed errors naming the file."""

from __future__ import annotations

import io
import json
import tracemalloc
import zipfile

import crc32c
import numpy as np
import pytest

from refpipe.pipeline.packing import pack_step, step_contents
from refpipe.pipeline.samples import build_sample
from refpipe.pipeline.step_file import HEADER_MEMBER, StepFile, publish_step_file, read_step_file
from refpipe.pipeline.step_header import STREAMS
from refpipe.storage.backends import open_store
from refpipe.storage.errors import ConfigError, KeyNotFoundError, StepFileError
from refpipe.storage.layout import step_key
from tests.pipeline.orchestrator_helpers import FIELDS, chunks, episode, make_keeper, tombstones

SEQ_LEN, DP = 24, 3


@pytest.fixture
def published(storage_config):
    """(store, packed micro batches, header, streams) of one published step 7 with real kept chunks."""
    store = open_store(storage_config)
    keeper, rng = make_keeper(store, storage_config), np.random.default_rng(0)
    samples = []
    for i, (p, c, routing, topk) in enumerate([(4, 6, True, True), (5, 20, True, False), (3, 2, False, True),
                                               (6, 9, False, False), (2, 30, True, True)]):
        e = episode(keeper, rng, f"e{i}", "g0", float(i), num_prompt=p, num_completion=c, routing=routing, topk=topk)
        samples.append(build_sample(e, e.branches[0], reward=float(i), advantage=i - 2.0, seq_len=SEQ_LEN))
    packed = pack_step(samples, seq_len=SEQ_LEN, dp_world_size=DP)
    header, streams = step_contents(packed, step=7, run_uri=store.prefix.uri, seq_len=SEQ_LEN,
                                    dp_world_size=DP, fields=FIELDS, metrics={"num_samples": 5.0})
    publish_step_file(store, header, streams)
    return store, packed, header, streams


def test_round_trip_equals_what_was_packed_byte_for_byte(published):
    store, packed, header, _ = published
    step = StepFile.read(store, 7)
    with zipfile.ZipFile(io.BytesIO(store.get(step_key(7)))) as zf:
        members = {name: crc32c.crc32c(zf.read(name)) for name in zf.namelist() if name != HEADER_MEMBER}
    assert step.header.stream_crc32c == members and len(members) == len(header.micro_batches) * len(STREAMS)
    assert header.stream_crc32c == {}  # set by encode_step_file when it is published
    unpublished = step.header.model_copy(update={"stream_crc32c": {}})
    assert unpublished == header and unpublished.model_dump_json() == header.model_dump_json()
    assert step.header.fields == FIELDS
    assert [(m.dp_rank, m.index) for m in step.header.micro_batches] == [(m.dp_rank, m.index) for m in packed]
    for mb, record in zip(packed, step.header.micro_batches):
        got = step.streams(mb.dp_rank, mb.index)
        cu = record.cu_seqlens()
        assert cu.tolist() == np.cumsum([0] + [s.num_tokens for s in mb.samples]).tolist()
        for name, dtype in STREAMS.items():
            assert got[name].dtype.str == dtype
            for j, sample in enumerate(mb.samples):
                assert got[name][cu[j]:cu[j + 1]].tobytes() == getattr(sample, name).tobytes()
    assert chunks(store) == {f"e{i}-b0" for i in range(5) if i != 3}


def test_readable_with_numpy_alone(published):
    store, packed, header, streams = published
    with np.load(io.BytesIO(store.get(step_key(7)))) as npz:
        assert {**json.loads(npz[HEADER_MEMBER]), "stream_crc32c": {}} == json.loads(header.model_dump_json())
        for (rank, index), arrays in streams.items():
            for name in STREAMS:
                assert npz[f"dp{rank}.mb{index}.{name}"].tobytes() == arrays[name].tobytes()


def _rewrite(data: bytes, edit) -> bytes:
    """A copy of a step file whose header.json is replaced by ``edit(header dict)``."""
    src, out = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            body = src.read(info)
            dst.writestr(info, json.dumps(edit(json.loads(body))) if info.filename == HEADER_MEMBER else body)
    return out.getvalue()


def _ref_naming_another_branch(h: dict) -> dict:
    h["refs"][0]["uri"] = h["refs"][1]["uri"]
    return h


@pytest.mark.parametrize("corrupt, message", [
    (lambda d: d[: len(d) // 2], "not a readable step file"),
    (lambda d: d[:-10], "not a readable step file"),
    (lambda d: _rewrite(d, lambda h: {**h, "schema_version": 2}), "schema_version 2, expected 3"),
    (lambda d: _rewrite(d, lambda h: {k: v for k, v in h.items() if k != "fields"}), "invalid header"),
    (lambda d: _rewrite(d, _ref_naming_another_branch), r"invalid header[\s\S]*ref uri '[^']*' does not name branch"),
    (lambda d: _rewrite(d, lambda h: {**h, "owners": h["owners"][:-1]}), "invalid header"),
])
def test_bad_step_files_are_typed_errors_naming_the_file(published, corrupt, message):
    store, *_ = published
    store.put(step_key(8), corrupt(store.get(step_key(7))))
    with pytest.raises(StepFileError, match=rf"step file {store.uri(step_key(8))}: .*{message}"):
        StepFile.read(store, 8)
    assert chunks(store) == {f"e{i}-b0" for i in range(5) if i != 3} and tombstones(store) == set()


def test_a_step_file_written_under_another_run_path_is_read_in_the_run_as_opened(published):
    """The header's run_uri is provenance (a symlink, another mount path, a copied run): never compared."""
    store, _, header, _ = published
    store.put(step_key(8), _rewrite(store.get(step_key(7)), lambda h: {**h, "step": 8, "run_uri": "s3://b/old/run_9"}))
    step = StepFile.read(store, 8)
    assert (step.header.run_uri, step.header.refs) == ("s3://b/old/run_9", header.refs)


@pytest.mark.parametrize("fields, array, message", [
    ({"logprobs_k": 4}, "topk_ids", "has trailing shape [3]: expected [4] from fields"),
    ({"num_layers": 3}, "routed_experts", "has trailing shape [2, 2]: expected [3, 2] from fields"),
    ({"num_experts": None}, "routed_experts", "is not a field configured in fields"),
])
def test_refs_disagreeing_with_the_header_fields_are_typed_errors(published, fields, array, message):
    store, _, header, _ = published
    store.put(step_key(8), _rewrite(store.get(step_key(7)), lambda h: {**h, "fields": {**h["fields"], **fields}}))
    with pytest.raises(StepFileError) as e:
        StepFile.read(store, 8)
    first = next(i for i, ref in enumerate(header.refs) if array in ref.arrays)
    assert str(e.value).startswith(f"step file {store.uri(step_key(8))}: invalid header")
    assert f"ref {first} ({header.refs[first].uri}): array {array!r} {message}" in str(e.value)
    assert chunks(store) == {f"e{i}-b0" for i in range(5) if i != 3} and tombstones(store) == set()


def test_missing_step_and_stream_mismatch(published):
    store, packed, header, streams = published
    with pytest.raises(KeyNotFoundError, match="step_00000009.npz does not exist"):
        StepFile.read(store, 9)
    bad = {k: dict(v) for k, v in streams.items()}
    bad[(0, 0)]["advantages"] = bad[(0, 0)]["advantages"].astype(np.float64)
    with pytest.raises(StepFileError, match=r"dp_rank=0 micro batch 0: stream 'advantages' is <f8"):
        publish_step_file(store, header.model_copy(update={"step": 9}), bad)
    assert not store.exists(step_key(9))


def test_a_file_holding_another_step_is_refused(published):
    store, *_ = published
    store.put(step_key(2), store.get(step_key(7)))
    with pytest.raises(StepFileError) as e:
        StepFile.read(store, 2)
    assert str(e.value) == f"step file {store.uri(step_key(2))}: header says step 7, expected step 2"


def _with_member(data: bytes, member: str, body: bytes, compression: int = zipfile.ZIP_STORED,
                 recorded: bool = True) -> bytes:
    """A copy of a step file with ``member``'s bytes replaced by ``body``, every member written with ``compression``;
    ``recorded``: the header's ``stream_crc32c`` records the new body's crc32c (as its writer would have)."""
    src, out = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(out, "w", compression) as dst:
        for info in src.infolist():
            got = body if info.filename == member else src.read(info)
            if info.filename == HEADER_MEMBER and recorded and member:
                header = json.loads(got)
                header["stream_crc32c"][member] = crc32c.crc32c(body)
                got = json.dumps(header).encode()
            dst.writestr(info.filename, got)
    return out.getvalue()


def _npy(shape: tuple[int, ...], data: bytes) -> bytes:
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": "<i4", "fortran_order": False, "shape": shape})
    return f.getvalue() + data


@pytest.mark.parametrize("storage_config", ["local"], indirect=True)
def test_a_stream_with_a_header_numpy_writes_otherwise_still_reads(published):
    """The reader compares a member's header with the exact bytes ``encode_step_file`` writes (the fast path);
    a valid ``.npy`` 2.0 header of the same dtype and shape is parsed instead and reads the same stream."""
    store, *_ = published
    original = StepFile.read(store, 7)
    expected = original.streams(0, 0)["input_ids"]
    f = io.BytesIO()
    np.lib.format.write_array_header_2_0(f, {"descr": "<i4", "fortran_order": False, "shape": expected.shape})
    store.put(step_key(7), _with_member(store.get(step_key(7)), "dp0.mb0.input_ids.npy",
                                        f.getvalue() + expected.tobytes()))
    got = StepFile.read(store, 7).streams(0, 0)["input_ids"]
    assert got.dtype == np.dtype("<i4") and got.tolist() == expected.tolist()


@pytest.mark.parametrize("storage_config", ["local"], indirect=True)
@pytest.mark.parametrize("declared, keep_bytes, message", [
    (2**40, None, "dp0.mb0.input_ids.npy is <i4 [1099511627776], expected <i4 [{n}]"),
    (None, -4, "member dp0.mb0.input_ids.npy holds {short} bytes of data, expected {full} (<i4 [{n}])"),
])
def test_a_stream_declaring_more_than_it_holds_is_refused_before_allocating(published, declared, keep_bytes,
                                                                             message):
    """A member's .npy header declaring 2**40 int32 (4 TiB) in a step file of a few KiB: numpy's ``read_array``
    allocated the declared array before reading (``MemoryError`` out of ``StepFile.streams``: a trainer rank
    crashed, ``refpipe verify`` printed ``error: MemoryError``); a header declaring the right shape over 4 bytes
    too few was ``EOF: reading array data``. The declared size is now checked against the bytes held first."""
    store, *_ = published
    original = StepFile.read(store, 7)
    n = original.header.micro_batches[0].num_tokens
    data = original.streams(0, 0)["input_ids"].tobytes()
    body = _npy((declared or n,), data[:keep_bytes])
    store.put(step_key(7), _with_member(store.get(step_key(7)), "dp0.mb0.input_ids.npy", body))
    tracemalloc.start()
    try:
        with pytest.raises(StepFileError) as info:
            StepFile.read(store, 7)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    expected = message.format(n=n, short=4 * n + (keep_bytes or 0), full=4 * n)
    assert str(info.value) == f"step file {store.uri(step_key(7))}: {expected}"
    assert peak < 256 * 1024, peak  # the step file (~10 KiB), its header and small change; not the declared 4 TiB


@pytest.mark.parametrize("storage_config", ["local"], indirect=True)
def test_a_step_file_with_a_compressed_member_is_refused(published):
    """A deflated member decompresses to the size its zip entry declares, not the file's; our writer stores every
    member. Before: read as any zip."""
    store, *_ = published
    step_file = store.get(step_key(7))
    store.put(step_key(7), _with_member(step_file, "", b"", zipfile.ZIP_DEFLATED))
    with pytest.raises(StepFileError) as info:
        StepFile.read(store, 7)
    assert str(info.value) == (f"step file {store.uri(step_key(7))}: not a readable step file (truncated or foreign): "
                               f"member {HEADER_MEMBER} is compressed: expected every member stored")


def test_a_step_files_zip_end_records_say_whether_it_is_whole():
    """``damage_from_tail`` on zipfile's own output: whole (and zip64, 65,536 members), cut by one byte, or with a
    comment (``encode_step_file`` writes none)."""
    import io
    import zipfile

    from refpipe.pipeline.step_zip import TAIL_NBYTES, damage_from_tail

    def whole_and_cut(members: int, comment: bytes = b"") -> tuple:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as zf:
            for i in range(members):
                zf.writestr(zipfile.ZipInfo(f"m{i}"), b"x")
            zf.comment = comment
        data = buf.getvalue()
        return len(data), damage_from_tail(data[-TAIL_NBYTES:], len(data)), \
            damage_from_tail(data[:-1][-TAIL_NBYTES:], len(data) - 1)

    assert whole_and_cut(3) == (265, None, "no zip end record in its last 22 bytes (264 bytes: truncated or foreign)")
    assert whole_and_cut(65_536) == (
        5_810_582, None, "no zip end record in its last 22 bytes (5810581 bytes: truncated or foreign)")  # zip64
    assert whole_and_cut(1, b"hi")[1] == "no zip end record in its last 22 bytes (105 bytes: truncated or foreign)"
    assert damage_from_tail(b"", 0) == "no zip end record in its last 22 bytes (0 bytes: truncated or foreign)"


def test_the_public_reader_opens_a_step_file_by_path_or_uri_read_only_without_torch(published, storage_config):
    """``refpipe.read_step_file``: a user found only ``StepHeader.model_validate_json(np.load(f)["header.json"])``
    with ``dir()``. The documented reader opens a step file by a relative path, ``file://`` or ``s3://`` URI,
    validates it, and gives its header, stream names and streams, without importing torch or writing anything."""
    import os
    import subprocess
    import sys

    store, _, header, streams = published
    uri = store.uri(step_key(7))
    cwd = os.path.dirname(storage_config.root) if storage_config.s3_endpoint_url is None else None
    where = [os.path.relpath(store.path(step_key(7)), cwd), uri] if cwd else [uri]
    code = ("import json, sys, refpipe\n"
            "sf = refpipe.read_step_file(sys.argv[1], s3_endpoint_url=sys.argv[2] or None)\n"
            "print(json.dumps({'torch': 'torch' in sys.modules, 'uri': sf.uri, 'step': sf.header.step,\n"
            "                  'names': list(sf.stream_names), 'ids': sf.streams(1, 0)['input_ids'].tolist()}))\n")
    for path in where:
        out = subprocess.run([sys.executable, "-c", code, path, storage_config.s3_endpoint_url or ""],
                             cwd=cwd, capture_output=True, text=True, check=True).stdout
        assert json.loads(out) == {"torch": False, "uri": uri, "step": 7, "names": list(STREAMS),
                                   "ids": streams[(1, 0)]["input_ids"].tolist()}
    with pytest.raises(ConfigError) as info:
        read_step_file("runs/run_1/step_00000007.npz")
    assert str(info.value) == ("step URI 'runs/run_1/step_00000007.npz': expected "
                               "<root>/<run_id>/steps/step_<N:08d>.npz")


@pytest.mark.parametrize("storage_config", ["local"], indirect=True)
def test_the_step_files_page_lists_every_stream_and_its_python_block_runs(published):
    """docs/step-files.md: its stream table is ``STREAMS`` (name and dtype), and its Python block runs as written
    against a published step file (the path is the one thing substituted)."""
    import contextlib
    import pathlib
    import re

    page = (pathlib.Path(__file__).parents[2] / "docs" / "step-files.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| `([^`]+)` \w+ \|", page, re.M)
    assert [(name, dtype.replace("\\|", "|")) for name, dtype in rows] == list(STREAMS.items())
    store, packed, header, streams = published
    block, = re.findall(r"```python\n(.*?)```", page, re.S)
    code = block.replace("runs/run_0/steps/step_00000000.npz", store.path(step_key(7)))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {})
    lines = out.getvalue().splitlines()
    assert lines[0] == f"7 {SEQ_LEN} {DP} {tuple(STREAMS)}"
    mbs = header.micro_batches_of(0)
    assert lines[1:] == [f"micro batch {mb.index}: {mb.num_tokens} tokens "
                         f"({int(streams[(0, mb.index)]['loss_mask'].sum())} trained), "
                         f"cu_seqlens {mb.cu_seqlens().tolist()}" for mb in mbs]
