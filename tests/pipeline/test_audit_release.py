"""Release policies and retention in the ledger (issue 12): held chunks, retained chunks, ``sweep --retained``;
steps a resume replays are never swept, whatever the ledger says (issue 14).

DP ranks release published steps through ``trainer.release.ReleasePolicy`` in one process;
the audit is read after each move.
"""

from __future__ import annotations

import json

import google_crc32c
import pytest
from typer.testing import CliRunner

from refpipe.cli.main import app
from refpipe.pipeline.audit import audit
from refpipe.pipeline.sweep import sweep
from refpipe.storage.backends import open_store
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_records import encode_record
from refpipe.storage.store import Store
from refpipe.trainer.background import BackgroundRelease, ReleaseCounts
from refpipe.trainer.config import TrainerConfig
from refpipe.trainer.release import ReleasePolicy
from tests.pipeline.audit_helpers import keep, make_keeper, publish

AWAITING = "trainer_dp{} (trained, awaiting checkpoint)"
REPLAYED = "trainer step {} (after the newest checkpoint: a resume replays it)"


def commit_checkpoint(store: Store, step: int) -> list[str]:
    """The two files that make checkpoint ``step`` complete for a reader (DCP's ``.metadata``, refpipe's marker), as
    ``trainer.checkpoint.save_checkpoint`` leaves them before any rank calls ``checkpointed(step)``; their keys."""
    keys = [f"checkpoints/step_{step:08d}/.metadata", f"checkpoints/step_{step:08d}/commit.json"]
    store.put(keys[0], b"dcp")
    store.put(keys[1], json.dumps({"step": step, "policy_version": step + 1, "world_size": 1}).encode())
    return keys


def released(rank: ReleasePolicy, step: int) -> ReleaseCounts:
    """A checkpoint covering ``step`` is durable: release what it covers and wait for the background deletes and
    their bytes' removal (the audits below are ``stopped``: a live deleter's reaper backlog would be unfinished)."""
    rank.checkpointed(step)
    rank.background.wait()
    rank.background.ledger.wait_freed()
    return rank.background.take_counts()


def test_after_checkpoint_holds_then_deletes_and_retained_steps_are_swept_once(storage_config):
    store = open_store(storage_config)
    keeper = make_keeper(store, storage_config)
    refs = [keep(keeper, seed) for seed in range(4)]
    keeper.ledger.close()
    headers = [publish(store, 0, refs[:2], [0, 1]), publish(store, 1, refs[2:], [0, 1])]
    config = TrainerConfig(release="after_checkpoint", retain_steps=[1])
    ranks = [ReleasePolicy(BackgroundRelease(Ledger(store, f"trainer_dp{r}"), r, 2), config) for r in range(2)]
    for header in headers:
        for rank in ranks:
            rank.trained(header)
    assert [rank.background.take_counts() for rank in ranks] == [ReleaseCounts(), ReleaseCounts()]
    report = audit(store, stopped=True)
    assert report.outstanding_by_holder == {AWAITING.format(0): 2, AWAITING.format(1): 2}
    assert (report.deleted, report.retained, report.leaked) == (0, 0, 0) and report.clean

    commit_checkpoint(store, 1)
    assert released(ranks[0], 1) == ReleaseCounts(deletes=1)  # step 0 deleted, step 1 retained
    report = audit(store, stopped=True)
    # step 1 stays held whole until every owner released it (a replaying rank may borrow rows)
    assert report.outstanding_by_holder == {AWAITING.format(1): 2, "trainer step 1": 1}
    assert (report.deleted, report.retained, report.leaked) == (1, 0, 0) and report.clean
    assert released(ranks[1], 1) == ReleaseCounts(deletes=1)
    for rank in ranks:
        rank.background.shutdown()
        rank.ledger.close()
    report = audit(store, finished=True)
    assert (report.kept, report.deleted, report.retained, report.outstanding) == (4, 2, 2, 0) and report.clean
    step1 = store.uri("steps/step_00000001.npz")
    endpoint = ["--s3-endpoint-url", storage_config.s3_endpoint_url] if storage_config.s3_endpoint_url else []
    assert CliRunner().invoke(app, ["verify", step1, *endpoint]).exit_code == 0  # the retained arrays are all there

    result = CliRunner().invoke(app, ["sweep", "--retained", store.prefix.uri, *endpoint])
    assert result.exit_code == 0 and "deleted 2 chunks" in result.output, result.output
    report = audit(store, finished=True)
    assert (report.kept, report.deleted, report.retained, report.double_deletes) == (4, 4, 0, 0) and report.clean
    assert store.list_prefix("payloads") == []
    assert sweep(store, retained=True).retained == []  # exactly once: a second sweep finds nothing
    assert CliRunner().invoke(app, ["verify", step1, *endpoint]).exit_code == 1


def test_retain_every_nth_step_and_bad_values():
    config = TrainerConfig(retain_steps=3)
    assert [s for s in range(8) if config.retains(s)] == [0, 3, 6]
    assert not TrainerConfig().retains(0)
    for bad, expected in ((0, "retain_steps=0: expected a list of steps or every N-th step with N >= 1"),
                          ([2, -1], "retain_steps=[2, -1]: expected steps >= 0")):
        try:
            TrainerConfig(retain_steps=bad)
        except ValueError as e:
            assert expected in str(e)
        else:
            raise AssertionError(f"retain_steps={bad} was accepted")


def _corrupt_retain_record(store: Store, how: str) -> str | None:
    """Change the first branch id of trainer_dp0's ``retain`` record: ``overwritten``: 40 bytes inside it
    overwritten in place (the line stays valid JSON, its crc no longer matches); ``forged``: the same change
    with a matching crc (as the ledger's own encoder writes it). Returns the audit's bad-record line, if any."""
    key, number, line = next((k, n, line) for k in store.list_prefix("ledger/events/trainer_dp0")
                             for n, line in enumerate(store.get(k).split(b"\n"), 1) if b'"event":"retain"' in line)
    start = line.index(b'"branch_ids":["') + len(b'"branch_ids":["')
    bogus = line[:start] + b"f" * 40 + line[start + 40:]
    if how == "forged":
        event = json.loads(bogus)
        del event["crc"]
        bogus = encode_record(event)[:-1]
    lines = store.get(key).split(b"\n")
    lines[number - 1] = bogus
    store.put(key, b"\n".join(lines))
    if how == "forged":
        return None
    event = json.loads(bogus)
    stored = event.pop("crc")
    content = f"{google_crc32c.value(json.dumps(event, separators=(',', ':'), sort_keys=True).encode()):08x}"
    return (f"{store.uri(key)} line {number}: ValueError: crc32c {content} of the record, the line says "
            f"'{stored}' (changed after it was written)")


@pytest.mark.parametrize("how", ["intact", "overwritten", "forged"])
def test_retained_and_held_steps_a_resume_replays_are_never_swept_whatever_the_ledger_says(local_config, how):
    """An ``after_checkpoint`` run (one DP rank, steps 0-2, step 1 retained): the checkpoint of step 1 commits,
    steps 0 and 1 are released (0 deleted, 1 retained), step 2 is held; then the checkpoint of step 1 is removed
    (it would not load), so a resume restarts from the warm start and replays steps 1 and 2 (step 0 is skipped:
    its chunks have delete records). 40 bytes of trainer_dp0's ``retain`` record are overwritten (caught by the
    line's crc32c: one violation naming the segment and line; the sweep refuses, exit 2), or forged with a valid
    crc; either way, and with the record intact, ``sweep --stopped --retained`` deletes nothing of steps 1 and 2."""
    store = open_store(local_config)
    keeper = make_keeper(store, local_config)
    refs = [keep(keeper, seed) for seed in range(6)]
    keeper.ledger.close()
    headers = [publish(store, step, refs[2 * step: 2 * step + 2], [0, 0], dp_world_size=1) for step in range(3)]
    rank = ReleasePolicy(BackgroundRelease(Ledger(store, "trainer_dp0"), 0, 2),
                         TrainerConfig(release="after_checkpoint", retain_steps=[1]))
    for header in headers:
        rank.trained(header)
    checkpoint = commit_checkpoint(store, 1)
    assert released(rank, 1) == ReleaseCounts(deletes=2)  # step 0 deleted, step 1 retained, step 2 held
    rank.background.shutdown()
    rank.ledger.close()
    store.delete_keys(checkpoint)
    bad = None if how == "intact" else _corrupt_retain_record(store, how)

    report = audit(store, stopped=True)
    assert report.bad_records == ([bad] if bad else [])
    assert report.violations == ([f"1 unreadable ledger records ({bad}); `refpipe sweep` refuses to delete until "
                                  f"each is repaired or its line removed"] if bad else [])
    assert report.outstanding_by_holder == {REPLAYED.format(1): 2, AWAITING.format(0): 2}
    assert (report.leaked, report.retained, report.deleted) == (0, 0, 2)
    before = store.list_prefix("")
    swept = CliRunner().invoke(app, ["sweep", "--stopped", "--retained", store.prefix.uri])
    if bad:
        assert swept.exit_code == 2
        assert swept.output == (f"error: refusing to sweep {store.prefix.uri}: 1 unreadable ledger records may be the "
                                f"only evidence of a holder; first: {bad} (repair the record or remove its line, then "
                                f"sweep again)\n")
    else:
        assert swept.exit_code == 0 and swept.output.startswith("deleted 0 chunks") and "already" not in swept.output
    assert [k for k in store.list_prefix("") if not k.startswith("ledger/")] == \
           [k for k in before if not k.startswith("ledger/")]  # every chunk of steps 1 and 2 is still there


def test_a_retained_chunk_without_its_zarr_json_is_still_retained_and_only_sweep_retained_deletes_it(local_config):
    """Before: the missing commit marker made it an "incomplete keep" with no holder, so a plain `refpipe sweep`
    removed its intact ``c.0`` (``remove_incomplete``) although a step file names it and the user retained it."""
    store = open_store(local_config)
    keeper = make_keeper(store, local_config)
    refs = [keep(keeper, seed) for seed in range(2)]
    keeper.ledger.close()
    header = publish(store, 0, refs, [0, 0])
    rank = ReleasePolicy(BackgroundRelease(Ledger(store, "trainer_dp0"), 0, 2), TrainerConfig(release="after_step",
                                                                                             retain_steps=[0]))
    rank.trained(header)
    rank.background.shutdown()
    rank.ledger.close()
    store.delete_key(f"{refs[0].key}/zarr.json")
    report = audit(store, finished=True)
    assert (report.retained, report.leaked, report.outstanding, report.deleted) == (2, 0, 0, 0) and report.clean
    plain = sweep(store, stopped=True)
    assert (plain.deleted, plain.removed_incomplete, plain.retained) == ([], [], [])
    assert store.exists(f"{refs[0].key}/c.0")
    gone = sweep(store, retained=True)
    assert sorted(gone.retained) == sorted(r.uri for r in refs) and store.list_prefix("payloads") == []
    report = audit(store, finished=True)
    assert (report.deleted, report.retained, report.double_deletes, report.leaked) == (2, 0, 0, 0) and report.clean
