"""Run-relative refs: a run opens through any path (a symlink, a copy) and one ref never names two chunks.

A ref's chunk is named by its branch id (``PayloadRef.key``); the URI a writer recorded is
provenance. So a run read through a symlink, or a copied run directory, is inspected,
verified, audited and swept like the original, and whatever is deleted is deleted in the run
as opened, never in the original.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from pydantic import ValidationError

from refpipe.integrations.verifiers_branches import INFO_KEY, read_refs
from refpipe.pipeline.step_file import StepFile
from refpipe.pipeline.step_header import StepHeader
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import EpisodeError, OutsideRunError
from refpipe.storage.layout import chunk_keys, step_key
from refpipe.storage.ledger import Ledger
from tests.cli.test_inspect import Run, invoke, snapshot


def _reopen(run: Run, root: str) -> Run:
    """The same run opened under another root path."""
    config = run.config.model_copy(update={"root": root})
    store = open_store(config)
    return Run(config, store, run.branches, run.refs, run.discarded,
               [store.uri(step_key(step)) for step in (0, 1)])


def test_one_ref_one_chunk_a_uri_naming_another_branch_is_refused_everywhere(local_run):
    """Issue 14 item 7: a ref whose branch_id names chunk a and whose uri names chunk b."""
    store, a, b = local_run.store, local_run.refs["a"], local_run.refs["b"]
    message = (f"ref uri '{b.uri}' does not name branch '{a.branch_id}': expected a URI ending in /{a.key} "
               "(the key is derived from the branch id), without . or .. segments")
    with pytest.raises(ValidationError, match=re.escape(message)):
        PayloadRef.model_validate({**a.model_dump(), "uri": b.uri})
    with pytest.raises(EpisodeError, match=re.escape(message)):
        read_refs({INFO_KEY: {"branches": [{"leaf": 0, "ref": {**a.model_dump(), "uri": b.uri}}]}}, "trace 0")
    header = json.loads(StepFile.read(store, 0).header.model_dump_json())
    header["refs"][0]["uri"] = b.uri
    with pytest.raises(ValidationError, match=re.escape(message)):
        StepHeader.model_validate(header)
    forged = a.model_copy(update={"uri": b.uri})  # built without validation
    before, deletes = snapshot(store), store.list_prefix("ledger/deletes")
    with pytest.raises(OutsideRunError, match=re.escape(f"ref '{a.branch_id}': {message}")):
        Ledger(store, "trainer_dp0").delete([forged], reason="step 0 trained")
    with pytest.raises(OutsideRunError):
        fetch_arrays(store, forged)
    assert {k: v for k, v in snapshot(store).items() if "/ledger/events/" not in k} == \
           {k: v for k, v in before.items() if "/ledger/events/" not in k}  # the refusal is recorded, nothing else
    assert store.list_prefix("ledger/deletes") == deletes


def test_a_run_read_through_a_symlink(local_run, tmp_path):
    """inspect, verify, ls and audit through ``<link>/run_1`` give what they give through the real path."""
    link = tmp_path / "link"
    os.symlink(local_run.config.root, link)
    linked = _reopen(local_run, str(link))
    for command in (["inspect", "--json"], ["verify"]):
        via_link = invoke([command[0], linked.step_uris[1], *command[1:]])
        direct = invoke([command[0], local_run.step_uris[1], *command[1:]])
        assert (via_link.exit_code, direct.exit_code) == (0, 0), via_link.output
        assert via_link.stdout.replace(str(link), local_run.config.root) == direct.stdout
    audit = json.loads(invoke(["audit", linked.store.prefix.path, "--json"]).stdout)
    assert (audit["kept"], audit["shipped"], audit["unreadable_step_files"], audit["clean"]) == (8, 7, [], True)
    assert audit["run_uri"] == f"file://{link}/run_1"
    assert invoke(["ls", linked.store.prefix.path]).exit_code == 0


def test_a_copied_run_is_audited_swept_and_deleted_in_the_copy_only(local_run, tmp_path):
    """A copy of the run directory is a run of its own: its deletes and its sweep touch only the copy."""
    copy_root = tmp_path / "copy"
    shutil.copytree(local_run.config.root, copy_root, symlinks=True)
    copy = _reopen(local_run, str(copy_root))
    original = snapshot(local_run.store)
    ledger = Ledger(copy.store, "trainer_dp0")
    result = ledger.delete([local_run.refs["a"]], reason="step 0 trained")
    ledger.close()  # its reaper has removed the chunk's bytes
    assert result.deleted == [copy.store.uri(local_run.refs["a"].key)]
    assert not copy.store.exists(chunk_keys(local_run.refs["a"].key)[1])
    stopped = json.loads(invoke(["audit", copy.store.prefix.path, "--json", "--stopped"]).stdout)
    assert (stopped["deleted"], stopped["leaked"], stopped["unreadable_step_files"]) == (2, 0, [])
    # --force: the sessions recorded in the copy were opened by this test's pid, which is alive
    abandon = invoke(["sweep", copy.store.prefix.path, "--abandon", "--force", "--json"])
    assert abandon.exit_code == 0, abandon.output
    assert len(json.loads(abandon.stdout)["deleted"]) == 6
    assert json.loads(invoke(["audit", copy.store.prefix.path, "--json", "--finished"]).stdout)["clean"]
    assert snapshot(local_run.store) == original
    assert fetch_arrays(local_run.store, local_run.refs["a"])["topk_ids"].shape == local_run.refs["a"].arrays[
        "topk_ids"].shape



def test_a_corrupt_chunk_of_a_copied_run_is_named_in_the_copy(local_run, tmp_path):
    """verify (exit 1: a problem found) and show (exit 2: an error) name the chunk they read (in the run as opened),
    never the path its writer recorded."""
    copy_root = tmp_path / "copy"
    shutil.copytree(local_run.config.root, copy_root, symlinks=True)
    copy = _reopen(local_run, str(copy_root))
    header = StepFile.read(copy.store, 1).header
    ref = header.refs[0]
    mb = next(mb for mb in header.micro_batches if any(seq.ref == 0 for seq in mb.sequences))
    data_key = chunk_keys(ref.key)[0]
    corrupted = bytearray(copy.store.get(data_key))
    corrupted[0] ^= 0xFF
    copy.store.put(data_key, bytes(corrupted))
    for command, code in ((["verify"], 1), (["show", "--dp-rank", str(mb.dp_rank), "--micro-batch", str(mb.index)], 2)):
        result = invoke([command[0], copy.step_uris[1], *command[1:]])
        assert result.exit_code == code and f"chunk {copy.store.uri(ref.key)}: " in result.output, result.output
        assert local_run.config.root not in result.output.replace(str(copy_root), "<copy>")


def test_inspect_of_a_copied_run_prints_the_chunks_it_looked_at_in_the_copy(local_run, tmp_path):
    """On a copied run, inspect resolved chunks in the copy but printed the URIs its writer recorded (the original
    run's): ``missing file://<original>/run_1/payloads/...``. It prints what it looked at now, ``run_uri`` too."""
    copy_root = tmp_path / "copy"
    shutil.copytree(local_run.config.root, copy_root, symlinks=True)
    copy = _reopen(local_run, str(copy_root))
    b = local_run.refs["b"]
    for run in (local_run, copy):
        run.store.delete_keys(list(chunk_keys(b.key)))  # gone from both, without a delete record
    for args in (["--json"], []):
        original = invoke(["inspect", local_run.step_uris[1], *args])
        copied = invoke(["inspect", copy.step_uris[1], *args])
        assert (original.exit_code, copied.exit_code) == (0, 0), copied.output
        assert copied.stdout == original.stdout.replace(local_run.config.root, str(copy_root))
        assert f"{copy.store.uri(b.key)}" in copied.stdout and local_run.config.root not in copied.stdout
    summary = json.loads(invoke(["inspect", copy.step_uris[1], "--json"]).stdout)
    assert summary["run_uri"] == copy.store.prefix.uri
    assert [m["uri"] for m in summary["missing"]] == [copy.store.uri(b.key)]
