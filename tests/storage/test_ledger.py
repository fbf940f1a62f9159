"""The ledger on both backends: event segments per session, deletes exactly once, typed refusals."""

from __future__ import annotations

import os

import google_crc32c
import numpy as np
import pytest

from refpipe.storage.chunk_codec import encode_chunk
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.chunk_ref import ArraySpec, PayloadRef
from refpipe.storage.chunk_write import put_chunk
from refpipe.storage.errors import (
    ArgumentTypeError,
    ChunkNotFoundError,
    ConfigError,
    DoubleDeleteError,
    LedgerClosedError,
    OutsideRunError,
    StorageError,
    UnknownRefError,
)
from refpipe.storage.layout import (
    SEGMENTS_PER_DIRECTORY,
    node_key,
    parse_segment_key,
    parse_tombstone_key,
    segment_key,
    tombstone_key,
)
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_records import delete_record_of, encode_record, read_segment
from refpipe.storage.ledger_session import SEGMENT_MAX_EVENTS
from refpipe.storage.local_store import LocalStore
from refpipe.storage.s3_store import S3Store
from refpipe.storage.store import Store
from refpipe.storage.uri import RunPrefix


def kept(store: Store, branch_id: str, num_tokens: int = 4) -> PayloadRef:
    """Keep one chunk holding ``x = arange(num_tokens) + len(branch_id)`` int32 [num_tokens]."""
    spec = {"x": ArraySpec("<i4", (num_tokens,), "tokens")}
    x = np.arange(num_tokens, dtype=np.int32) + len(branch_id)
    chunk = encode_chunk(branch_id, {"x": x}, spec, num_prompt_tokens=num_tokens, num_completion_tokens=0,
                         writer="test")
    uri = put_chunk(store, branch_id, chunk)
    return PayloadRef(uri=uri, branch_id=branch_id, num_prompt_tokens=num_tokens, num_completion_tokens=0,
                      arrays=chunk.arrays, nbytes=chunk.nbytes, checksum=chunk.checksum)


def events_of(store: Store, actor: str) -> list[list[dict]]:
    """Every segment of ``actor``, in order, as lists of events."""
    keys = store.list_prefix(f"ledger/events/{actor}")
    return [[event for _, event in read_segment(store.get(k))] for k in keys]


def test_open_is_written_at_once_and_events_are_buffered_into_segments(store, monkeypatch):
    monkeypatch.setattr("refpipe.storage.ledger_session.SEGMENT_MAX_AGE_S", 3600.0)  # no age flush on a slow machine
    ledger = Ledger(store, "env_worker_0")
    [[opened]] = events_of(store, "env_worker_0")
    assert opened["event"] == "open" and opened["actor"] == "env_worker_0"
    [key] = store.list_prefix("ledger/events")
    assert parse_segment_key(key) == ("env_worker_0", ledger.session, 0)

    ledger.record("receive", branch_ids=["a", "b"])
    ledger.record("release", step=3, dp_rank=1)
    assert len(events_of(store, "env_worker_0")) == 1  # buffered: no I/O per record
    ledger.flush()
    ledger.flush()  # nothing buffered: no empty segment
    ledger.close()
    segments = events_of(store, "env_worker_0")
    assert [[e["event"] for e in s] for s in segments] == [["open"], ["receive", "release"], ["close"]]
    assert segments[1][0]["branch_ids"] == ["a", "b"] and segments[1][1]["step"] == 3
    assert [parse_segment_key(k)[2] for k in store.list_prefix("ledger/events")] == [0, 1, 2]


def test_each_line_carries_the_crc32c_of_its_content_and_a_changed_line_is_a_bad_record():
    """A ledger line is compact JSON ending in ``"crc"``: crc32c (8 hex digits) of the event as compact JSON with
    sorted keys. 40 bytes overwritten inside a line that stays valid JSON, or a line without a crc, is a
    ``ValueError`` record of ``read_segment``, never an event."""
    event = {"event": "retain", "actor": "trainer_dp0", "t": 1.5, "step": 1, "dp_rank": 0,
             "branch_ids": ["env_worker_0-" + "ab" * 16]}
    crc = google_crc32c.value(b'{"actor":"trainer_dp0","branch_ids":["env_worker_0-' + b"ab" * 16
                              + b'"],"dp_rank":0,"event":"retain","step":1,"t":1.5}')
    line = encode_record(event)
    assert line == (b'{"event":"retain","actor":"trainer_dp0","t":1.5,"step":1,"dp_rank":0,"branch_ids":'
                    b'["env_worker_0-' + b"ab" * 16 + f'"],"crc":"{crc:08x}"}}\n'.encode())
    start = line.index(b"env_worker_0-")
    overwritten = line[:start] + b"f" * 40 + line[start + 40:]
    bogus_id = b"f" * 40 + (b"env_worker_0-" + b"ab" * 16)[40:]
    bogus_crc = google_crc32c.value(b'{"actor":"trainer_dp0","branch_ids":["' + bogus_id
                                    + b'"],"dp_rank":0,"event":"retain","step":1,"t":1.5}')
    plain = b'{"event":"release","step":2,"dp_rank":0}\n'
    records = read_segment(line + overwritten + plain + line)
    assert [n for n, _ in records] == [1, 2, 3, 4] and records[0][1] == records[3][1] == event
    assert [str(e) for _, e in records[1:3]] == [
        f"crc32c {bogus_crc:08x} of the record, the line says '{crc:08x}' (changed after it was written)",
        "b'{\"event\":\"release\",\"step\":2,\"dp_rank\":0}': no 'crc' field"]
    with pytest.raises(ValueError, match="the field name 'crc' is the line's own"):
        encode_record({"event": "x", "crc": 1})


def test_a_segment_is_written_every_512_events(store, monkeypatch):
    monkeypatch.setattr("refpipe.storage.ledger_session.SEGMENT_MAX_AGE_S", 3600.0)  # only the count may flush here
    ledger = Ledger(store, "a")
    for i in range(SEGMENT_MAX_EVENTS + 1):
        ledger.record("x", i=i)
    sizes = [len(s) for s in events_of(store, "a")]
    assert sizes == [1, SEGMENT_MAX_EVENTS]
    assert ledger.ledger_seconds > 0


def test_sessions_of_one_actor_never_share_segments(store):
    sessions = [Ledger(store, "trainer_dp0").session for _ in range(4)]
    assert len(set(sessions)) == 4
    assert len(store.list_prefix("ledger/events/trainer_dp0")) == 4


@pytest.mark.parametrize("actor", ["", "a/b", "..", "-x", "a" * 129])
def test_bad_actor_names_are_refused(store, actor):
    with pytest.raises(ConfigError, match="ledger actor"):
        Ledger(store, actor)
    assert store.list_prefix("ledger") == []


def test_delete_is_exactly_once_and_a_second_delete_names_both_holders(store):
    refs = [kept(store, f"b{i}") for i in range(3)]
    first = Ledger(store, "trainer_dp3")
    result = first.delete(refs[:2], reason="step 7")
    assert result.deleted == [refs[0].uri, refs[1].uri] and not result.double_deletes and not result.unknown
    first.wait_freed()  # a filesystem removes the chunks' bytes after the call returns
    record = delete_record_of(store, "b0")  # its own delete record, or (a filesystem) the call's batch record
    assert (record.holder, record.reason, record.uri) == ("trainer_dp3", "step 7", refs[0].uri)
    with pytest.raises(ChunkNotFoundError):
        fetch_arrays(store, refs[0])
    with pytest.raises(ChunkNotFoundError):
        fetch_arrays(store, refs[0], 2)  # a ranged read of the first 2 tokens

    second = Ledger(store, "orchestrator")
    with pytest.raises(DoubleDeleteError, match="already deleted by trainer_dp3 \\(step 7\\); second delete "
                                                "from orchestrator \\(filtered\\)") as info:
        second.delete([refs[1], refs[2]], reason="filtered")
    assert info.value.result.deleted == [refs[2].uri]
    second.wait_freed()
    [double] = info.value.result.double_deletes.values()
    assert (double.first_holder, double.second_holder) == ("trainer_dp3", "orchestrator")
    assert delete_record_of(store, "b1").holder == "trainer_dp3"
    assert store.list_prefix("payloads") == []
    # the double delete is on record at once, before any close
    problems = [e for s in events_of(store, "orchestrator") for e in s if e["event"] == "double_delete"]
    assert problems == [{"event": "double_delete", "actor": "orchestrator", "t": problems[0]["t"], "branch_id": "b1",
                         "uri": refs[1].uri, "reason": "filtered", "first": "trainer_dp3",
                         "first_reason": "step 7"}]


def test_a_double_delete_deletes_nothing_else(store):
    refs = [kept(store, f"c{i}") for i in range(2)]
    ledger = Ledger(store, "a")
    ledger.delete(refs[:1], reason="first")
    kept_bytes = store.get(f"{store.prefix.key_of(refs[1].uri)}/c.0")
    with pytest.raises(DoubleDeleteError) as info:
        ledger.delete([refs[0], refs[0]], reason="again")
    assert info.value.result.deleted == [] and list(info.value.result.double_deletes) == [refs[0].uri]
    doubles = [e["reason"] for seg in events_of(store, "a") for e in seg if e["event"] == "double_delete"]
    assert doubles == ["again", "again"]  # the result is keyed by URI; each refused delete is an event
    assert store.get(f"{store.prefix.key_of(refs[1].uri)}/c.0") == kept_bytes
    np.testing.assert_array_equal(fetch_arrays(store, refs[1])["x"], np.arange(4, dtype=np.int32) + 2)


def test_the_same_ref_twice_in_one_call_is_deleted_once(store):
    ref = kept(store, "d0")
    with pytest.raises(DoubleDeleteError) as info:
        Ledger(store, "a").delete([ref, ref], reason="twice")
    assert info.value.result.deleted == [ref.uri] and len(info.value.result.double_deletes) == 1
    assert len(store.list_prefix("ledger/deletes")) == 1 and delete_record_of(store, "d0").holder == "a"


def test_outcomes_are_keyed_by_uri_never_found_in_a_message(store):
    """A ref never kept whose URI is a prefix of a double-deleted ref's URI (``payloads/a2/f4`` in
    ``payloads/a2/f45``, one shard) is ``unknown``; finding the URI in the double delete's message called it
    ``double_delete``."""
    gone = kept(store, "f45")
    ghost = gone.model_copy(update={"uri": store.uri(node_key("f4")), "branch_id": "f4"})
    assert gone.uri.startswith(ghost.uri)
    ledger = Ledger(store, "a")
    ledger.delete([gone], reason="first")
    with pytest.raises(DoubleDeleteError) as info:
        ledger.delete([ghost, gone], reason="again")
    result = info.value.result
    assert [result.outcome(ghost.uri), result.outcome(gone.uri)] == ["unknown", "double_delete"]
    assert (list(result.unknown), list(result.double_deletes)) == ([ghost.uri], [gone.uri])
    with pytest.raises(KeyError, match="not the URI of a ref of this delete call"):
        result.outcome(store.uri(node_key("f")))


def test_a_ref_never_kept_is_refused_and_recorded(store):
    real = kept(store, "e0")
    ghost = real.model_copy(update={"uri": store.uri(node_key("ghost")), "branch_id": "ghost"})
    ledger = Ledger(store, "orchestrator")
    with pytest.raises(UnknownRefError, match="was never kept") as info:
        ledger.delete([ghost, real], reason="shutdown")
    assert info.value.result.deleted == [real.uri] and len(info.value.result.unknown) == 1
    assert len(store.list_prefix("ledger/deletes")) == 1 and delete_record_of(store, "e0").reason == "shutdown"
    unknown = [e for s in events_of(store, "orchestrator") for e in s if e["event"] == "unknown_delete"]
    assert [(e["branch_id"], e["reason"]) for e in unknown] == [("ghost", "shutdown")]


@pytest.mark.parametrize("uri", ["{run}0/payloads/00/f0", "{run}/../run_1/payloads/00/f0", "file:///etc/passwd"])
def test_a_ref_outside_the_run_deletes_nothing(store, uri):
    ref = kept(store, "f0")
    outside = ref.model_copy(update={"uri": uri.format(run=store.prefix.uri)})
    before = store.list_prefix("")
    with pytest.raises(OutsideRunError):
        Ledger(store, "a").delete([ref, outside], reason="x")
    assert [k for k in store.list_prefix("") if not k.startswith(("ledger/events/", "ledger/heartbeats/"))] == \
           [k for k in before if not k.startswith(("ledger/events/", "ledger/heartbeats/"))]
    np.testing.assert_array_equal(fetch_arrays(store, ref)["x"], np.arange(4, dtype=np.int32) + 2)


def test_refs_of_another_type_are_an_argument_type_error_before_anything_is_deleted(store):
    """``Ledger.delete(["abc"])`` raised AttributeError from inside the ledger (``ref.chunks``), ``fetch_arrays`` of a
    dict too; each call refuses such an argument first, naming it and the expected type."""
    ref = kept(store, "f0")
    ledger = Ledger(store, "a")
    ledger.flush()
    before = sorted(store.list_prefix(""))
    cases = [
        (lambda: ledger.delete([ref, "abc"], reason="x"),
         "Ledger.delete(refs)[1]: expected a PayloadRef, got str 'abc'"),
        (lambda: ledger.delete(None, reason="x"),
         "Ledger.delete(refs): expected a sequence of PayloadRef, got NoneType None"),
        (lambda: ledger.release(0, [{"branch_id": "f0"}], reason="x"),
         "Ledger.release(refs)[0]: expected a PayloadRef, got dict {'branch_id': 'f0'}"),
        (lambda: fetch_arrays(store, "f0"), "fetch_arrays(ref): expected a PayloadRef, got str 'f0'"),
    ]
    for call, message in cases:
        with pytest.raises(ArgumentTypeError) as info:
            call()
        assert (str(info.value), isinstance(info.value, TypeError)) == (message, True)
    ledger.flush()
    assert sorted(store.list_prefix("")) == before
    np.testing.assert_array_equal(fetch_arrays(store, ref)["x"], np.arange(4, dtype=np.int32) + 2)


def test_ledger_seconds_counts_claims_and_segment_puts(store, monkeypatch):
    monkeypatch.setattr("refpipe.storage.ledger_session.SEGMENT_MAX_AGE_S", 3600.0)  # no age-due flush on a slow host
    refs = [kept(store, f"g{i}") for i in range(4)]
    ledger = Ledger(store, "a")
    after_open = ledger.ledger_seconds
    assert after_open > 0
    ledger.delete(refs, reason="x")
    after_delete = ledger.ledger_seconds
    assert after_delete > after_open
    ledger.record_keep(refs[0])
    assert ledger.ledger_seconds == after_delete  # recording is in memory
    ledger.flush()
    assert ledger.ledger_seconds > after_delete
    [keep_event] = events_of(store, "a")[1]
    assert (keep_event["event"], keep_event["branch_id"], keep_event["nbytes"]) == ("keep", "g0", refs[0].nbytes)


def test_a_store_that_ignores_exclusive_puts_is_refused(storage_config):
    """A proxy that drops ``If-None-Match`` (here: the backend's store with exclusivity switched off)."""
    prefix = RunPrefix.from_root(storage_config.root, storage_config.run_id)
    base = S3Store if prefix.scheme == "s3" else LocalStore

    class DroppingStore(base):
        def put(self, key, data, *, exclusive=False):
            super().put(key, data)

    with pytest.raises(StorageError, match="does not honour exclusive puts"):
        Ledger(DroppingStore(prefix, storage_config), "env_worker_0")


def test_an_actors_earlier_life_delete_is_already_released_anothers_is_a_double_delete(store):
    """Issue 12: a restarted DP rank releasing again what its earlier session deleted (and half-deleted)."""
    refs = [kept(store, f"b{i}") for i in range(3)]
    first_life = Ledger(store, "trainer_dp0")
    first_life.delete(refs[:2], reason="trained step 0")
    first_life.wait_freed()
    store.put(f"{store.prefix.key_of(refs[1].uri)}/c.0", b"left behind")  # died between claim and delete
    first_session = first_life.session
    del first_life  # the first life is gone (its session is dead), so the actor may start again
    second_life = Ledger(store, "trainer_dp0")
    result = second_life.delete(refs, reason="trained step 0, resumed")
    second_life.wait_freed()
    assert (result.deleted, result.already_released) == ([refs[2].uri], [refs[0].uri, refs[1].uri])
    assert store.list_prefix("payloads") == []  # the earlier life's leftovers are gone too
    assert delete_record_of(store, "b0").session == first_session
    with pytest.raises(DoubleDeleteError, match="already deleted by trainer_dp0"):
        Ledger(store, "trainer_dp1").delete(refs[:1], reason="trained step 0")
    with pytest.raises(DoubleDeleteError, match="second delete from trainer_dp0"):
        second_life.delete(refs[2:], reason="again in the same session")


def test_delete_records_fan_out_over_two_levels_of_256():
    """At 10M chunks one level of 256 directories would hold ~39,000 records each; two levels hold ~150."""
    assert tombstone_key("b00000001") == "ledger/deletes/54/ba/b00000001.json"
    assert parse_tombstone_key("ledger/deletes/54/ba/b00000001.json") == node_key("b00000001")
    assert parse_tombstone_key("ledger/deletes/54/b00000001.json") is None  # the one-level layout: a stray key
    leaves = {tombstone_key(f"b{i:08d}").rpartition("/")[0] for i in range(20_000)}
    assert len(leaves) > 16_000 and len({leaf.rpartition("/")[0] for leaf in leaves}) == 256


def test_a_long_session_puts_at_most_1000_segments_in_any_directory(local_config):
    """A session flushes at least every 2 s (~43,000 segments a day): its segments fan out into buckets of 1,000,
    so no directory under ``ledger/events/`` grows with its length (the flat layout held all 2,501 in one)."""
    store = LocalStore(RunPrefix.from_root(local_config.root, local_config.run_id), local_config)
    ledger = Ledger(store, "env_worker_0")
    for i in range(2_500):
        ledger.record("x", i=i)
        ledger.flush()
    events = store.path("ledger/events")
    entries = {os.path.relpath(d, events): len(dirs) + len(files) for d, dirs, files in os.walk(events)}
    assert entries == {".": 1, "env_worker_0": 1, f"env_worker_0/{ledger.session}": 3,
                       f"env_worker_0/{ledger.session}/0000": 1000, f"env_worker_0/{ledger.session}/0001": 1000,
                       f"env_worker_0/{ledger.session}/0002": 501}
    assert SEGMENTS_PER_DIRECTORY == 1000
    assert segment_key("a", "12-34", 1000) == "ledger/events/a/12-34/0001/001000.jsonl"
    segments = events_of(store, "env_worker_0")  # listed in key order = segment order
    assert [s[0]["i"] for s in segments[1:]] == list(range(2_500))
    assert [parse_segment_key(k)[2] for k in store.list_prefix("ledger/events")] == list(range(2_501))


def test_segment_keys_parse_whole_and_the_flat_layout_of_earlier_runs_is_read():
    assert parse_segment_key("ledger/events/a/12-34/0001/001234.jsonl") == ("a", "12-34", 1234)
    assert parse_segment_key("ledger/events/a/12-34/0000/001234.jsonl") is None  # not seq 1234's bucket
    assert parse_segment_key("ledger/events/a/12-34/0001/1234.jsonl") is None  # not as segment_key writes it
    assert parse_segment_key("ledger/events/a/12-34/0001/001234.jsonl\n") is None
    assert parse_segment_key("ledger/events/a/12-34-001234.jsonl") == ("a", "12-34", 1234)  # before the buckets


def test_a_closed_ledger_refuses_every_act_and_does_nothing(store):
    """After ``close`` the session's log ends with its ``close`` event: a record, a delete, or a keep through it is a
    ``LedgerClosedError`` and nothing happens (the chunk stays, no event or record is written); closing again is
    a no-op."""
    from refpipe.pipeline.fields import FieldsConfig
    from refpipe.pipeline.keep import Branch, Keeper
    from refpipe.storage.config import StorageConfig

    ref = kept(store, "b0")
    ledger = Ledger(store, "env_worker_0")
    ledger.close()
    ledger.close()
    before = sorted(store.list_prefix(""))
    with pytest.raises(LedgerClosedError) as deleted:
        ledger.delete([ref], reason="discarded")
    with pytest.raises(LedgerClosedError):
        ledger.record("ship", branch_id="b0")
    keeper = Keeper(store, ledger, FieldsConfig(), StorageConfig(root="unused"))
    with pytest.raises(LedgerClosedError) as keep:
        keeper.keep(Branch(num_prompt_tokens=1, num_completion_tokens=1, fields={}, branch_id="b1"))
    assert sorted(store.list_prefix("")) == before
    assert [e["event"] for segment in events_of(store, "env_worker_0") for e in segment] == ["open", "close"]
    assert str(deleted.value) == (f"ledger session {ledger.session} of actor 'env_worker_0' of run "
                                  f"{store.prefix.uri} is closed: 'delete (discarded)' refused, nothing done (open a "
                                  f"new Ledger for the actor)")
    assert "is closed: 'keep' refused" in str(keep.value)
