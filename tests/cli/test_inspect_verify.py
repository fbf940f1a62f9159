"""``refpipe verify``: intact steps pass; deleted, corrupted, truncated and mistyped refs are flagged."""

from __future__ import annotations

import io
import json
import zipfile

from refpipe.pipeline.step_file import HEADER_MEMBER
from refpipe.storage.chunks import chunk_keys
from refpipe.storage.layout import step_key
from refpipe.storage.ledger import Ledger
from test_inspect import invoke, snapshot


def rewrite_step_file(store, step: int, edit_header=None, edit_member=None) -> None:
    """Overwrite a step file in place with its header and/or one member's bytes edited."""
    src = zipfile.ZipFile(io.BytesIO(store.get(step_key(step))))
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename == HEADER_MEMBER and edit_header:
                header = json.loads(data)
                edit_header(header)
                data = json.dumps(header).encode()
            dst.writestr(info.filename, data)
    data = bytearray(buf.getvalue())
    if edit_member:  # flip a byte inside a member's stored bytes, after the zip wrote its CRC
        info = zipfile.ZipFile(io.BytesIO(bytes(data))).getinfo(edit_member)
        start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
        data[start + info.compress_size // 2] ^= 0xFF
    store.put(step_key(step), bytes(data))


def test_verify_passes_an_intact_step(run):
    before = snapshot(run.store)
    result = invoke(["verify", run.step_uris[0], *run.cli_args()])
    nbytes = sum(ref.nbytes for ref in run.refs.values())
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout == f"step 0: 7 chunks ({nbytes} bytes), 4 micro batches: all intact\n"
    assert snapshot(run.store) == before


def test_verify_flags_every_problem_once(run):
    store, refs = run.store, run.refs
    Ledger(store, "trainer_dp0").delete([refs["a"]], reason="step 0 trained")
    data_key, meta_key = chunk_keys(store, refs["b"])
    store.put(data_key, store.get(data_key)[:-9])  # truncated
    data_key, _ = chunk_keys(store, refs["c"])
    flipped = bytearray(store.get(data_key))
    flipped[10] ^= 0xFF
    store.put(data_key, bytes(flipped))  # corrupted
    _, meta_key = chunk_keys(store, refs["f"])
    meta = json.loads(store.get(meta_key))
    meta["attributes"]["refpipe"]["arrays"]["topk_ids"]["dtype"] = "<u4"
    store.put(meta_key, json.dumps(meta).encode())  # zarr.json disagrees with the reference
    store.delete_keys(list(chunk_keys(store, refs["g"])))  # gone without a delete record
    relocated = refs["d"].uri.replace("/run_1/", "/run_10/")  # provenance only: d is still read in this run

    def point_d_elsewhere(header):
        header["refs"][3]["uri"] = relocated
    rewrite_step_file(store, 1, point_d_elsewhere)
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


def test_verify_flags_a_corrupted_stream_of_the_step_file(local_run):
    rewrite_step_file(local_run.store, 0, edit_member="dp1.mb0.advantages.npy")
    result = invoke(["verify", local_run.step_uris[0]])
    assert result.exit_code == 1
    nbytes = sum(ref.nbytes for ref in local_run.refs.values())
    assert result.stdout == (f"corrupt step file: step file {local_run.step_uris[0]}: member dp1.mb0.advantages.npy "
                             "unreadable: Bad CRC-32 for file 'dp1.mb0.advantages.npy'\n"
                             f"step 0: 7 chunks ({nbytes} bytes), 4 micro batches: 1 problem\n")
    assert result.stderr == ""


def test_verify_names_a_corrupt_zarr_json(local_run):
    store, f, g = local_run.store, local_run.refs["f"], local_run.refs["g"]
    store.put(chunk_keys(store, f)[1], b"{garbage")
    meta = json.loads(store.get(chunk_keys(store, g)[1]))
    del meta["attributes"]
    store.put(chunk_keys(store, g)[1], json.dumps(meta).encode())
    result = invoke(["verify", local_run.step_uris[0]])
    assert result.exit_code == 1
    assert result.stdout.splitlines()[:-1] == [
        f"corrupt {f.uri}: zarr.json unreadable: Expecting property name enclosed in double quotes: line 1 column 2 "
        "(char 1)",
        f"corrupt {g.uri}: zarr.json unreadable: no key 'attributes'"]
