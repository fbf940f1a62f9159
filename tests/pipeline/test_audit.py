"""The audit and the sweep in one process: holders, liveness, leaks, bad records, exact counts."""

from __future__ import annotations

import io
import json
import zipfile

import pytest

from refpipe.pipeline.audit import audit
from refpipe.pipeline.step_file import StepFile
from refpipe.pipeline.sweep import sweep
from refpipe.storage.backends import open_store
from refpipe.storage.errors import DoubleDeleteError, LedgerRecordError, StepFileError, UnknownRefError
from refpipe.storage.layout import EVENTS_PREFIX, node_key, parse_segment_key, step_key, tombstone_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.local_store import LocalStore
from tests.pipeline.audit_helpers import chunks, fetch_step, keep, make_keeper, publish, release_step, snapshot, train

LEAKED = "{} leaked chunks (present, no live holder; `refpipe sweep` deletes them)"
LEAKED_STOPPED = "{} leaked chunks (present, no live holder; `refpipe sweep --stopped` deletes them)"


@pytest.fixture
def run(storage_config):
    """(store, env worker keeper, orchestrator ledger, [trainer_dp0, trainer_dp1] ledgers)."""
    store = open_store(storage_config)
    keeper = make_keeper(store, storage_config)
    trainers = [Ledger(store, f"trainer_dp{r}") for r in range(2)]
    return store, keeper, Ledger(store, "orchestrator"), trainers


def close_all(keeper, orchestrator, trainers):
    for ledger in [keeper.ledger, orchestrator, *trainers]:
        ledger.close()


def test_a_clean_run_ends_with_nothing_outstanding(run):
    store, keeper, orchestrator, trainers = run
    refs = [keep(keeper, seed) for seed in range(6)]
    orchestrator.record("receive", episode_id="e", group_id="g", branch_ids=[r.branch_id for r in refs])
    publish(store, 0, refs[:3], [0, 1, 0], borrow=(1, 0))
    orchestrator.delete(refs[3:5], reason="orchestrator filtered_group")
    train(store, trainers, 0)
    publish(store, 1, refs[5:], [1])
    train(store, trainers, 1)
    close_all(keeper, orchestrator, trainers)

    report = audit(store, finished=True)
    assert (report.kept, report.shipped, report.borrowed, report.deleted, report.present) == (6, 4, 1, 6, 0)
    assert (report.outstanding, report.leaked, report.double_deletes, report.unknown_deletes) == (0, 0, 0, 0)
    assert report.violations == [] and report.clean and report.live_sessions == []
    assert report.bad_records == report.missing == report.stray_keys == []


def test_outstanding_chunks_by_holder_while_the_run_is_live(run):
    store, keeper, orchestrator, trainers = run
    refs = [keep(keeper, seed) for seed in range(5)]
    orchestrator.record("receive", episode_id="e", group_id="g", branch_ids=[r.branch_id for r in refs[:4]])
    orchestrator.flush()
    publish(store, 0, refs[:2], [0, 1])

    report = audit(store)
    assert report.outstanding_by_holder == {"trainer step 0": 2, "orchestrator": 2, "env_worker_0": 1}
    assert report.outstanding == 5 and report.leaked == 0 and report.clean
    assert len(report.live_sessions) == 4

    ended = audit(store, finished=True)  # declared over now: queued chunks are leaks, step 0 still outstanding
    assert ended.outstanding_by_holder == {"trainer step 0": 2}
    assert sorted(ended.leaked_chunks) == sorted(r.uri for r in refs[2:])
    assert ended.violations == [LEAKED_STOPPED.format(3), "2 chunks still outstanding at the declared end of the run"]


def test_a_closed_keeper_hands_its_chunks_to_a_live_orchestrator(run):
    store, keeper, orchestrator, trainers = run
    refs = [keep(keeper, seed) for seed in range(2)]
    keeper.ledger.close()
    assert audit(store).outstanding_by_holder == {"orchestrator": 2}
    orchestrator.close()
    report = audit(store)
    assert sorted(report.leaked_chunks) == sorted(r.uri for r in refs) and report.outstanding == 0


def test_a_restarted_actor_after_a_crash(storage_config):
    store = open_store(storage_config)
    crashed = make_keeper(store, storage_config)  # never closes: as after SIGKILL
    lost = [keep(crashed, seed) for seed in range(2)]
    crashed.ledger.flush()
    unrecorded = keep(crashed, 2)  # its keep event died in the buffer: only zarr.json names the writer
    assert audit(store).outstanding_by_holder == {"env_worker_0": 3}
    del crashed  # the process is gone: its heartbeat stopped, so its session is dead and a restart is allowed
    restarted = make_keeper(store, storage_config)
    fresh = keep(restarted, 7)
    report = audit(store)
    assert sorted(report.leaked_chunks) == sorted(r.uri for r in lost)
    # conservative: a chunk without its keep event counts as the writer's latest session's
    assert report.outstanding_by_holder == {"env_worker_0": 2}
    assert report.live_sessions == [f"env_worker_0/{restarted.ledger.session}"]
    assert sorted(sweep(store).deleted) == sorted(r.uri for r in lost)
    assert chunks(store) == {fresh.uri, unrecorded.uri} and audit(store).clean
    restarted.ledger.close()
    assert sorted(audit(store).leaked_chunks) == sorted([fresh.uri, unrecorded.uri])


def test_a_release_of_a_later_step_frees_the_earlier_steps(run):
    store, keeper, orchestrator, trainers = run
    refs = [keep(keeper, seed) for seed in range(6)]
    for step in range(3):
        publish(store, step, refs[2 * step: 2 * step + 2], [0, 1])
    close_all(keeper, orchestrator, [])
    fetch_step(store, 1, 0)
    release_step(store, trainers[0], 1, 0)  # rank 0 resumed after step 0 and trained step 1
    held = audit(store)
    assert held.outstanding_by_holder == {"trainer step 0": 2, "trainer step 1": 1, "trainer step 2": 2}
    assert held.leaked == 0

    release_step(store, trainers[1], 1, 1)
    report = audit(store)
    assert sorted(report.leaked_chunks) == sorted(r.uri for r in refs[:2])
    assert report.outstanding_by_holder == {"trainer step 2": 2}
    step2 = snapshot(store, refs[4:])
    assert sorted(sweep(store).deleted) == sorted(r.uri for r in refs[:2])
    assert chunks(store) == {r.uri for r in refs[4:]} and snapshot(store, refs[4:]) == step2
    assert audit(store).clean


def test_incomplete_keeps_and_unfinished_deletes_are_swept(run):
    store, keeper, orchestrator, trainers = run
    refs = [keep(keeper, seed) for seed in range(2)]
    half = "env_worker_0-" + "ab" * 16  # its writer died between the chunk and its zarr.json
    store.put(f"{node_key(half)}/c.0", b"partial")
    anonymous = "custom-id"  # a writer the branch id does not name
    store.put(f"{node_key(anonymous)}/c.0", b"partial")
    store.put(tombstone_key(refs[0].branch_id), json.dumps({"holder": "trainer_dp0", "reason": "died"}).encode())

    live = audit(store)
    assert live.outstanding_by_holder == {"env_worker_0": 2, "incomplete keep": 1}
    assert live.unfinished_deletes == [refs[0].uri] and live.incomplete_keeps == sorted(
        [store.uri(node_key(half)), store.uri(node_key(anonymous))])
    close_all(keeper, orchestrator, trainers)
    report = audit(store)
    assert sorted(report.leaked_chunks) == sorted([refs[1].uri, store.uri(node_key(half)),
                                                   store.uri(node_key(anonymous))])
    assert report.kept == 2 and report.deleted == 1
    assert report.violations == [LEAKED.format(3),
                                 "1 unfinished deletes (objects still present; `refpipe sweep` finishes them)"]

    result = sweep(store)
    assert result.deleted == [refs[1].uri] and result.finished_deletes == [refs[0].uri]
    assert sorted(result.removed_incomplete) == sorted([store.uri(node_key(half)), store.uri(node_key(anonymous))])
    assert chunks(store) == set() and audit(store).clean
    sweeps = [json.loads(line) for k in store.list_prefix("ledger/events/sweep") for line in store.get(k).splitlines()]
    assert [e["event"] for e in sweeps] == ["open", "finish_delete", "remove_incomplete", "remove_incomplete", "close"]


def test_a_truncated_or_unparseable_ledger_record_is_a_violation_and_blocks_the_sweep(run, monkeypatch):
    monkeypatch.setattr("refpipe.storage.ledger_session.SEGMENT_MAX_AGE_S", 3600.0)  # the 3 keeps in one segment
    store, keeper, orchestrator, trainers = run
    refs = [keep(keeper, seed) for seed in range(3)]
    keeper.ledger.flush()
    close_all(keeper, orchestrator, trainers)
    key = store.list_prefix("ledger/events/env_worker_0")[1]  # the segment of the 3 keep events
    data = store.get(key)
    store.put(key, data[: len(data) - 20])  # the last record lost its end
    garbage = store.list_prefix("ledger/events/orchestrator")[0]
    store.put(garbage, store.get(garbage) + b"{not json\n")

    report = audit(store)
    bad = [f"{store.uri(key)} line 3: ValueError: truncated record (no line end)",
           f"{store.uri(garbage)} line 2: JSONDecodeError: Expecting property name enclosed in double quotes: line 1 "
           "column 2 (char 1)"]
    assert report.bad_records == bad
    assert sorted(report.leaked_chunks) == sorted(r.uri for r in refs)
    assert report.violations == [LEAKED.format(3), f"2 unreadable ledger records ({bad[0]}; {bad[1]}); `refpipe sweep` "
                                                   "refuses to delete until each is repaired or its line removed"]
    before = store.list_prefix("")
    with pytest.raises(LedgerRecordError, match="refusing to sweep .*: 2 unreadable ledger records may be the only "
                                                "evidence of a holder; first: .* line 3: ValueError: truncated record"):
        sweep(store, stopped=True, abandon=True)
    assert store.list_prefix("") == before  # nothing deleted, no sweep session opened


def test_an_unreadable_step_file_is_a_violation_and_blocks_the_sweep(run):
    store, keeper, orchestrator, trainers = run
    for seed in range(2):
        keep(keeper, seed)
    close_all(keeper, orchestrator, trainers)
    store.put("steps/step_00000004.npz", b"PK\x03\x04 truncated")
    report = audit(store)
    assert len(report.unreadable_step_files) == 1 and report.leaked == 2
    assert report.violations == [LEAKED.format(2), "1 unreadable step files"]
    before = store.list_prefix("")
    with pytest.raises(StepFileError) as info:
        sweep(store)
    assert str(info.value) == (
        f"refusing to sweep {store.prefix.uri}: 1 unreadable step files may reference chunks; first: "
        f"{report.unreadable_step_files[0]} (restore it, or move it out of the run once no trainer will read it: its "
        f"chunks then count as never shipped, and the sweep deletes those no one holds)")
    assert store.list_prefix("") == before


def test_a_step_file_with_a_damaged_stream_still_holds_its_chunks(run):
    """A flipped byte in a stream member fails the step file's crc32c (every trainer rank and ``refpipe verify``
    refuse it), but its header still says which chunks it holds: the audit counts them held by the step, not
    leaked, and names no unreadable step file."""
    store, keeper, orchestrator, trainers = run
    refs = [keep(keeper, seed) for seed in range(2)]
    orchestrator.record("receive", episode_id="e", group_id="g", branch_ids=[r.branch_id for r in refs])
    publish(store, 0, refs, [0, 1])
    close_all(keeper, orchestrator, trainers)
    data = bytearray(store.get(step_key(0)))
    info = zipfile.ZipFile(io.BytesIO(bytes(data))).getinfo("dp0.mb0.loss_mask.npy")
    data[info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size - 1] ^= 0x01
    store.put(step_key(0), bytes(data))
    with pytest.raises(StepFileError, match=r"member dp0.mb0.loss_mask.npy: crc32c 0x[0-9a-f]{8}, the header "
                                            r"records 0x[0-9a-f]{8} \(corrupted step file\)$"):
        StepFile.read(store, 0)
    report = audit(store)
    assert (report.unreadable_step_files, report.leaked, report.outstanding_by_holder) == (
        [], 0, {"trainer step 0": 2})


def test_a_chunk_deleted_outside_the_ledger_is_missing(run):
    store, keeper, orchestrator, trainers = run
    refs = [keep(keeper, seed) for seed in range(2)]
    keeper.ledger.flush()
    publish(store, 0, refs[1:], [0])
    for ref in refs:
        node = store.prefix.key_of(ref.uri)
        store.delete_keys([f"{node}/zarr.json", f"{node}/c.0"])
    report = audit(store)
    assert sorted(report.missing) == sorted(r.uri for r in refs)
    assert report.violations == ["2 chunks missing without a delete record"]


def test_a_committed_chunk_whose_data_was_deleted_outside_the_ledger_is_missing(run):
    """Its commit marker stays, its ``c.0`` is gone (removed by hand, a filesystem's repair): the rows are lost."""
    store, keeper, orchestrator, trainers = run
    refs = [keep(keeper, seed) for seed in range(3)]
    keeper.ledger.flush()
    publish(store, 0, refs[1:], [0, 1])
    for ref in refs[:2]:
        store.delete_keys([f"{store.prefix.key_of(ref.uri)}/c.0"])
    report = audit(store, stopped=True)
    assert sorted(report.missing) == sorted(r.uri for r in refs[:2])
    assert (report.present, report.leaked_chunks, report.outstanding) == (1, [], 1)
    assert report.violations == ["2 chunks missing without a delete record"]


def test_double_and_unknown_deletes_are_violations(run):
    store, keeper, orchestrator, trainers = run
    ref = keep(keeper, 0)
    trainers[0].delete([ref], reason="step 0")
    with pytest.raises(DoubleDeleteError):
        orchestrator.delete([ref], reason="shutdown")
    ghost = ref.model_copy(update={"uri": store.uri(node_key("ghost")), "branch_id": "ghost"})
    with pytest.raises(UnknownRefError):
        orchestrator.delete([ghost], reason="shutdown")
    report = audit(store)
    assert (report.double_deletes, report.unknown_deletes) == (1, 1)
    assert report.delete_problems == [
        f"double_delete of {ref.uri} by orchestrator (shutdown), first deleted by trainer_dp0 (step 0)",
        f"unknown_delete of {ghost.uri} by orchestrator (shutdown)"]
    assert report.violations == ["1 double deletes", "1 deletes of unknown refs"]


def test_a_dry_run_writes_nothing_and_a_second_sweep_finds_nothing(run):
    store, keeper, orchestrator, trainers = run
    refs = [keep(keeper, seed) for seed in range(3)]
    close_all(keeper, orchestrator, trainers)
    before = {k: store.get(k) for k in store.list_prefix("")}
    dry = sweep(store, dry_run=True)
    assert dry.dry_run and sorted(dry.deleted) == sorted(r.uri for r in refs)
    assert {k: store.get(k) for k in store.list_prefix("")} == before
    assert sorted(sweep(store).deleted) == sorted(r.uri for r in refs)
    again = sweep(store)
    assert (again.deleted, again.finished_deletes, again.removed_incomplete) == ([], [], [])
    holders = {json.loads(store.get(tombstone_key(r.branch_id)))["holder"] for r in refs}
    assert holders == {"sweep"}


def test_deletes_racing_the_audit_raise_no_false_alarm(local_config):
    """A trainer deletes one chunk just before and one just after the audit lists ``payloads/``."""
    store = open_store(local_config)
    keeper = make_keeper(store, local_config)
    refs = [keep(keeper, seed) for seed in range(2)]
    publish(store, 0, refs, [0, 0], dp_world_size=1)
    trainer = Ledger(store, "trainer_dp0")

    class RacingStore(LocalStore):
        def list_prefix(self, key_prefix):
            if key_prefix == "payloads":
                trainer.delete(refs[:1], reason="step 0")
                trainer.wait_freed()  # removed before the listing (claimed only, it is listed present: outstanding)
            keys = super().list_prefix(key_prefix)
            if key_prefix == "payloads":
                trainer.delete(refs[1:], reason="step 0")
            return keys

    report = audit(RacingStore(store.prefix, local_config))
    assert report.outstanding_by_holder == {"trainer step 0": 1}  # listed present; its delete record came later
    assert report.deleted == 1 and report.missing == [] and report.unfinished_deletes == []
    assert report.violations == []


def _empty_directories(path) -> list[str]:
    return sorted(str(d.relative_to(path)) for d in path.rglob("*") if d.is_dir() and not d.is_symlink()
                  and not any(d.iterdir()))


def test_a_stopped_sweep_removes_the_empty_directories_of_a_finished_run_and_nothing_outside(local_config, tmp_path):
    store = open_store(local_config)  # local only: S3 has no directories (Store.remove_empty_directories is 0)
    keeper, orchestrator = make_keeper(store, local_config), Ledger(store, "orchestrator")
    trainers = [Ledger(store, f"trainer_dp{r}") for r in range(2)]
    refs = [keep(keeper, seed) for seed in range(4)]
    publish(store, 0, refs, [0, 1, 0, 1])
    train(store, trainers, 0)
    close_all(keeper, orchestrator, trainers)
    run_dir = tmp_path / "root" / "run_1"
    outside = [tmp_path / "root" / "run_10" / "payloads" / "aa", tmp_path / "elsewhere" / "empty"]
    for directory in outside:
        directory.mkdir(parents=True)
    (run_dir / "ledger" / "link").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    shards = sorted({f"payloads/{node_key(r.branch_id).split('/')[1]}" for r in refs})
    assert _empty_directories(run_dir) == shards
    assert sweep(store).removed_directories == 0  # a plain sweep: the run may still be running
    assert _empty_directories(run_dir) == shards

    assert sweep(store, stopped=True).removed_directories == len(shards) + 1  # the shards, then payloads/
    assert _empty_directories(run_dir) == [] and not (run_dir / "payloads").exists()
    assert all(d.is_dir() for d in outside) and (run_dir / "ledger" / "link").is_symlink()
    assert audit(store, finished=True).clean


def test_a_run_with_the_flat_segment_layout_is_read_as_before(run):
    """Runs written before the bucket level kept ``ledger/events/<actor>/<session>-<seq>.jsonl``: the audit reads
    their sessions and events (a run that looked empty would lose its keeps' holders)."""
    store, keeper, orchestrator, trainers = run
    refs = [keep(keeper, seed) for seed in range(3)]
    publish(store, 0, refs[:2], [0, 1])
    keeper.ledger.flush()
    before = audit(store, stopped=True)
    for key in store.list_prefix(EVENTS_PREFIX):
        actor, session, seq = parse_segment_key(key)
        store.put(f"{EVENTS_PREFIX}/{actor}/{session}-{seq:06d}.jsonl", store.get(key), exclusive=True)
        store.delete_key(key)
    after = audit(store, stopped=True)
    assert after == before and after.stray_keys == [] and after.bad_records == []
    assert (after.kept, after.shipped, after.leaked) == (3, 2, 1)
    assert after.outstanding_by_holder == {"trainer step 0": 2}
