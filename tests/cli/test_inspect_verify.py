"""``refpipe verify``: intact steps pass; deleted, corrupted, truncated and mistyped refs are flagged."""

from __future__ import annotations

import io
import json
import zipfile

import crc32c
import pytest

from refpipe.pipeline.step_file import HEADER_MEMBER, StepFile
from refpipe.storage.errors import StepFileError
from refpipe.storage.layout import chunk_keys, step_key
from refpipe.storage.ledger import Ledger
from tests.cli.test_inspect import invoke, snapshot
from tests.helpers.step_file import forge_header


def test_verify_passes_an_intact_step(run):
    before = snapshot(run.store)
    result = invoke(["verify", run.step_uris[0], *run.cli_args()])
    nbytes = sum(ref.nbytes for ref in run.refs.values())
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout == f"step 0: 7 chunks ({nbytes} bytes), 4 micro batches: all intact\n"
    assert snapshot(run.store) == before


def test_verify_flags_every_problem_once(run):
    store, refs = run.store, run.refs
    ledger = Ledger(store, "trainer_dp0")
    ledger.delete([refs["a"]], reason="step 0 trained")
    ledger.close()  # its reaper has removed the chunk's bytes
    data_key, meta_key = chunk_keys(refs["b"].key)
    store.put(data_key, store.get(data_key)[:-9])  # truncated
    data_key, _ = chunk_keys(refs["c"].key)
    flipped = bytearray(store.get(data_key))
    flipped[10] ^= 0xFF
    store.put(data_key, bytes(flipped))  # corrupted
    _, meta_key = chunk_keys(refs["f"].key)
    meta = json.loads(store.get(meta_key))
    meta["attributes"]["refpipe"]["arrays"]["topk_ids"]["dtype"] = "<u4"
    store.put(meta_key, json.dumps(meta).encode())  # zarr.json disagrees with the reference
    store.delete_keys(list(chunk_keys(refs["g"].key)))  # gone without a delete record
    relocated = refs["d"].uri.replace("/run_1/", "/run_10/")  # provenance only: d is still read in this run

    def point_d_elsewhere(header):
        header["refs"][3]["uri"] = relocated
    forge_header(store, 1, point_d_elsewhere)
    before = snapshot(store)

    result = invoke(["verify", run.step_uris[1], *run.cli_args()])
    assert result.exit_code == 1
    f_layout = {lay.name: lay for lay in refs["f"].layout()}["topk_ids"]
    f_spec = ("<i4", f_layout.shape, "completion", f_layout.offset)
    c = refs["c"]
    lines = result.stdout.splitlines()
    assert lines[:2] == [f"missing {refs['a'].uri}: deleted by trainer_dp0 (step 0 trained)",
                         f"corrupt {refs['b'].uri}: chunk {refs['b'].uri}: expected {refs['b'].nbytes} bytes, got "
                         f"{refs['b'].nbytes - 9} (truncated or replaced)"]
    assert lines[2].startswith(f"corrupt {c.uri}: chunk {c.uri}: crc32c mismatch: reference {c.checksum:#010x}, "
                               f"stored {c.checksum:#010x}, computed ")
    assert lines[3:-1] == [
        f"mismatch {refs['f'].uri}: array topk_ids is {('<u4', *f_spec[1:])} (dtype, shape, domain, offset) in "
        f"zarr.json, {f_spec} in the reference",
        f"missing {refs['g'].uri}: no delete record",
    ]
    assert lines[-1].endswith(": 5 problems") and result.stderr == ""
    assert snapshot(store) == before


def _member_crcs(store, step: int, member: str) -> tuple[int, int]:
    """(crc32c of ``member``'s stored bytes now, the crc32c its step file's header records for it)."""
    data = store.get(step_key(step))
    info = zipfile.ZipFile(io.BytesIO(data)).getinfo(member)
    start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    header = json.loads(zipfile.ZipFile(io.BytesIO(data)).read(HEADER_MEMBER))
    return crc32c.crc32c(data[start:start + info.compress_size]), header["stream_crc32c"][member]


def _change_element(store, step: int, member: str, element: int, in_place: bool) -> None:
    """Flip the low bit of one array element of a stream member: in place in the file (its zip CRC-32 then
    disagrees too), or rewritten through zipfile (a zip whose CRC-32 matches: what a tool rewriting the .npz
    writes)."""
    if in_place:
        data = bytearray(store.get(step_key(step)))
        info = zipfile.ZipFile(io.BytesIO(bytes(data))).getinfo(member)
        data[info.header_offset + 30 + len(info.filename.encode()) + len(info.extra) + 128 + 4 * element] ^= 1
        store.put(step_key(step), bytes(data))
        return
    src, buf = zipfile.ZipFile(io.BytesIO(store.get(step_key(step)))), io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            body = bytearray(src.read(info.filename))
            if info.filename == member:
                body[128 + (1 if "loss_mask" in member else 4) * element] ^= 1
            dst.writestr(info.filename, bytes(body))
    store.put(step_key(step), buf.getvalue())


@pytest.mark.parametrize("member, element", [("dp0.mb1.loss_mask.npy", 3), ("dp1.mb0.input_ids.npy", 0)])
@pytest.mark.parametrize("in_place", [True, False], ids=["in place", "rewritten"])
def test_a_changed_stream_member_is_named_by_its_crc32c_and_refused(local_run, member, element, in_place):
    """A flipped ``loss_mask`` or ``input_ids`` inside a published step file: rewritten with a matching zip CRC-32,
    ``refpipe verify`` printed ``all intact`` and exited 0, and the trainer trained on it. Each stream member's
    crc32c is in the header now: verify names the member (exit 1), every reader refuses the file, nothing is
    deleted."""
    store = local_run.store
    _change_element(store, 0, member, element, in_place)
    now, recorded = _member_crcs(store, 0, member)
    assert now != recorded
    damage = (f"step file {local_run.step_uris[0]}: member {member}: crc32c {now:#010x}, the header records "
              f"{recorded:#010x} (corrupted step file)")
    before = snapshot(store)
    result = invoke(["verify", local_run.step_uris[0]])
    nbytes = sum(ref.nbytes for ref in local_run.refs.values())
    assert (result.exit_code, result.stderr) == (1, "")
    assert result.stdout == (f"corrupt step file: {damage}\n"
                             f"step 0: 7 chunks ({nbytes} bytes), 4 micro batches: 1 problem\n")
    for command in (["inspect"], ["show", "--micro-batch", "0"]):
        refused = invoke([command[0], local_run.step_uris[0], *command[1:]])
        assert (refused.exit_code, refused.stdout, refused.stderr) == (2, "", f"error: {damage}\n")
    with pytest.raises(StepFileError) as info:
        StepFile.read(store, 0)
    assert str(info.value) == damage
    assert snapshot(store) == before


def test_verify_names_a_corrupt_zarr_json(local_run):
    store, f, g = local_run.store, local_run.refs["f"], local_run.refs["g"]
    store.put(chunk_keys(f.key)[1], b"{garbage")
    meta = json.loads(store.get(chunk_keys(g.key)[1]))
    del meta["attributes"]
    store.put(chunk_keys(g.key)[1], json.dumps(meta).encode())
    result = invoke(["verify", local_run.step_uris[0]])
    assert result.exit_code == 1
    assert result.stdout.splitlines()[:-1] == [
        f"corrupt {f.uri}: zarr.json unreadable: Expecting property name enclosed in double quotes: line 1 column 2 "
        "(char 1)",
        f"corrupt {g.uri}: zarr.json unreadable: no key 'attributes'"]
