"""Open branches: appends write only their rows as segments; the closed ref reads back byte-identical to the
same rows kept whole, cut anywhere; bad use is a typed error naming the input; nothing leaks."""

from __future__ import annotations

import numpy as np
import pytest

from refpipe.pipeline import open_branch
from refpipe.pipeline.audit import audit
from refpipe.pipeline.fields import FieldsConfig, Ragged
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_arrays, fetch_into
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import (
    ChunkNotFoundError,
    FieldError,
    KeyExistsError,
    LedgerClosedError,
    OpenBranchError,
    StorageError,
)
from refpipe.storage.layout import chunk_keys, node_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.store import byte_view
from tests.pipeline.test_keep import CFG, fields_of, stored

P, C = 4, 26
TURNS = [(0, 7), (7, 8), (8, 19), (19, 30)]


def rows_of(fields: dict, start: int, end: int, lag: bool = False, num_prompt: int = P) -> dict:
    """The rows of tokens [start, end) of a whole branch's fields (``num_prompt`` prompt tokens); ``lag``: routing
    rows of positions [start - 1, end - 1) (the first turn: [0, end - 1)), as engines return them."""
    cut: dict = {}
    c0, c1 = max(0, start - num_prompt), max(0, end - num_prompt)
    for name, value in fields.items():
        if isinstance(value, Ragged):
            cu = np.concatenate([[0], np.cumsum(value.counts)])
            cut[name] = Ragged(value.ids[cu[c0] : cu[c1]], value.counts[c0:c1])
        elif name == "routed_experts":
            cut[name] = value[max(0, start - 1) : end - 1] if lag else value[start:end]
        else:
            cut[name] = value[c0:c1]
    return cut


def keeper_of(config, fields: FieldsConfig = CFG) -> Keeper:
    store = open_store(config)
    return Keeper(store, Ledger(store, "env_worker_0"), fields, config)


def kept_both(keeper: Keeper, fields: dict, turns=TURNS) -> tuple[PayloadRef, PayloadRef]:
    """(segmented ref of ``fields`` appended turn by turn, ref of the same rows kept whole)."""
    branch = keeper.open_branch(P, branch_id="seg")
    for start, end in turns:
        branch.append(start, end, rows_of(fields, start, end))
    return branch.close(), keeper.keep(Branch(P, turns[-1][1] - P, fields, branch_id="whole"))


def assert_same(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert got[name].tobytes() == want[name].tobytes(), name


def test_appended_turns_read_back_as_the_whole_branch(storage_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)  # a segment per append
    keeper = keeper_of(storage_config)
    fields = fields_of(P, C, seed=3)
    seg, whole = kept_both(keeper, fields)
    appends = keeper.store.appends  # a filesystem: the segments of one writer life in one object, at their offsets
    sizes = [s.nbytes for s in seg.segments]
    assert [(s.branch_id, s.offset, s.num_prompt_tokens, s.num_completion_tokens) for s in seg.segments] == [
        ("seg.0" if appends else f"seg.{i}", sum(sizes[:i]) if appends else None, p, c)
        for i, (p, c) in enumerate([(4, 3), (0, 1), (0, 11), (0, 11)])]
    assert (seg.num_prompt_tokens, seg.num_completion_tokens) == (P, C)
    assert {n: s.shape for n, s in seg.arrays.items()} == {n: s.shape for n, s in whole.arrays.items()}
    assert seg.nodes == ((node_key("seg.0"),) if appends else tuple(node_key(f"seg.{i}") for i in range(4)))
    assert PayloadRef.model_validate_json(seg.model_dump_json()) == seg
    assert "segments" not in whole.model_dump()
    assert_same(fetch_arrays(keeper.store, seg), fetch_arrays(keeper.store, whole))
    for n in range(P + C + 1):  # every cut, through a segment or at its edge
        assert_same(fetch_arrays(keeper.store, seg, n), fetch_arrays(keeper.store, whole, n))


def test_fetch_into_reads_each_segment_straight_into_the_destination(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    keeper = keeper_of(local_config)
    fields = fields_of(P, C, seed=4)
    seg, whole = kept_both(keeper, fields)
    for n in (P + C, 12):
        out = {"routed_experts": np.empty((n, 3, 2), np.uint8), "topk_ids": np.empty((n - P, 4), np.int32),
               "topk_logprobs": np.empty((n - P, 4), np.float32), "sample_support": np.empty((n - P, 5), np.int32)}
        fetched = fetch_into(keeper.store, seg, n, out)
        assert fetched.in_place is (n == P + C)
        assert fetched.arrays["routed_experts"] is out["routed_experts"]
        assert_same(fetched.arrays, fetch_arrays(keeper.store, whole, n))


def test_small_appends_are_coalesced_and_every_row_is_written_once(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 200)
    keeper = keeper_of(local_config)
    fields = fields_of(P, C, seed=5)
    turns = [(t, t + 1) for t in range(P + C)]
    seg, whole = kept_both(keeper, fields, turns)
    sizes = [s.num_tokens for s in seg.segments]
    assert sum(sizes) == P + C and len(sizes) < P + C
    payload = {n: sum(np.prod(s.arrays[n].shape) * np.dtype(s.arrays[n].dtype).itemsize for s in seg.segments)
               for n in seg.arrays}
    assert payload == {n: a.nbytes for n, a in stored(fields).items()}
    assert_same(fetch_arrays(keeper.store, seg), fetch_arrays(keeper.store, whole))


def test_routing_rows_of_all_but_last_lag_one_token_and_close_fills_the_last(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    keeper = keeper_of(local_config, CFG.model_copy(update={"routing_rows": "all_but_last"}))
    fields = fields_of(P, C, seed=6)
    engine = dict(fields, routed_experts=fields["routed_experts"][:-1])  # P + C - 1 rows, as vLLM returns them
    branch = keeper.open_branch(P, branch_id="lag")
    for start, end in TURNS:
        branch.append(start, end, rows_of(fields, start, end, lag=True))
    assert [s.num_tokens for s in branch.segments] == [6, 1, 11, 11]  # each turn's last token waits for its row
    seg = branch.close()
    assert [s.num_tokens for s in seg.segments] == [6, 1, 11, 11, 1]
    again = keeper.open_branch(P, branch_id="lag-short")
    again.append(0, 7, rows_of(fields, 0, 7, lag=True))
    with pytest.raises(FieldError, match=r"rows \[7, 12\): field 'routed_experts' has shape \[4, 3, 2\]: expected "
                                         r"\[5, 3, 2\] .*; in an open branch, an append after the first gives an "
                                         r"all_but_last field's rows of positions \[6, 11\): 5 rows$"):
        again.append(7, 12, rows_of(fields, 8, 12, lag=True))
    again.discard()
    whole = keeper.keep(Branch(P, C, engine, branch_id="whole"))
    assert_same(fetch_arrays(keeper.store, seg), fetch_arrays(keeper.store, whole))


def test_bad_use_is_a_typed_error_naming_the_input_and_nothing_leaks(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    keeper = keeper_of(local_config)
    fields = fields_of(P, C, seed=7)
    branch = keeper.open_branch(P, branch_id="bad")
    with pytest.raises(OpenBranchError, match=r"^branch bad: close with no rows appended"):
        branch.close()
    with pytest.raises(OpenBranchError, match=r"^branch bad \(env worker env_worker_0\) rows \[3, 7\): expected "
                                              r"rows \[0, end > 0\)"):
        branch.append(3, 7, rows_of(fields, 3, 7))
    branch.append(0, 7, rows_of(fields, 0, 7))
    wrong = rows_of(fields, 7, 8)
    wrong["topk_ids"] = np.zeros((2, 4), np.int32)
    with pytest.raises(FieldError, match=r"^branch bad \(env worker env_worker_0\) rows \[7, 8\): field 'topk_ids' "
                                         r"has shape \[2, 4\]: expected \[1, 4\]"):
        branch.append(7, 8, wrong)
    missing = rows_of(fields, 7, 8)
    del missing["topk_logprobs"]
    with pytest.raises(FieldError, match=r"rows \[7, 8\): stores arrays \{'routed_experts': '\|u1', 'topk_ids': "
                                         r"'<i4', 'sample_support'.*: expected \{'routed_experts': '\|u1', 'topk_ids': "
                                         r"'<i4', 'topk_logprobs': '<f4', .*\(as the branch's first append\)"):
        branch.append(7, 8, missing)
    assert branch.num_tokens == 7 and len(branch.segments) == 1
    for start, end in TURNS[1:]:
        branch.append(start, end, rows_of(fields, start, end))
    ref = branch.close()
    with pytest.raises(OpenBranchError, match=r"^branch bad: close: the branch was closed after 30 tokens: expected "
                                              r"an open branch; open a new branch$"):
        branch.close()
    with pytest.raises(OpenBranchError, match=r"^branch bad: append rows \[30, 31\): the branch was closed"):
        branch.append(30, 31, rows_of(fields, 29, 30))
    assert_same(fetch_arrays(keeper.store, ref), stored_le(fields))
    result = keeper.discard([ref])
    assert result.deleted == [keeper.store.uri(node_key("bad.0"))]  # the one object of its writer life
    keeper.ledger.wait_freed()
    assert not any(keeper.store.exists(k) for n in ref.nodes for k in chunk_keys(n))
    keeper.ledger.close()
    report = audit(keeper.store, finished=True)
    assert (report.kept, report.deleted, report.present) == (1, 1, 0) and report.clean


def test_a_failed_segment_write_keeps_the_rows_buffered_and_nothing_leaks(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    keeper = keeper_of(local_config)
    fields = fields_of(P, C, seed=11)
    clash = keeper.keep(Branch(P, C, fields, branch_id="clash.0"))  # takes the id of the branch's first segment
    branch = keeper.open_branch(P, branch_id="clash")
    with pytest.raises(KeyExistsError, match=r"^branch 'clash.0' was already kept in run"):
        branch.append(0, 7, rows_of(fields, 0, 7))
    with pytest.raises(KeyExistsError, match=r"^branch 'clash.0' was already kept in run"):
        branch.close()
    assert (branch.num_tokens, branch.segments, branch.closed) == (7, [], False)
    assert branch.discard().deleted == []
    keeper.discard([clash])
    keeper.ledger.close()
    report = audit(keeper.store, finished=True)
    assert (report.kept, report.deleted, report.present) == (1, 1, 0) and report.clean


def test_a_failed_append_is_written_again_at_the_same_offset(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    keeper = keeper_of(local_config)
    fields = fields_of(P, C, seed=12)
    branch = keeper.open_branch(P, branch_id="torn")
    branch.append(0, 7, rows_of(fields, 0, 7))
    write_at = keeper.store.write_at

    def torn(key, buffers, offset):  # half the segment lands, then the write fails
        write_at(key, [bytes(byte_view(buffers[0])[: len(byte_view(buffers[0])) // 2])], offset)
        raise StorageError("test: the disk filled up")

    monkeypatch.setattr(keeper.store, "write_at", torn)
    with pytest.raises(StorageError, match="the disk filled up"):
        branch.append(7, 8, rows_of(fields, 7, 8))
    monkeypatch.setattr(keeper.store, "write_at", write_at)
    for start, end in TURNS[2:]:
        branch.append(start, end, rows_of(fields, start, end))
    ref = branch.close()
    assert [(s.num_tokens, s.offset) for s in ref.segments] == [
        (7, 0), (12, ref.segments[0].nbytes), (11, ref.segments[0].nbytes + ref.segments[1].nbytes)]
    assert_same(fetch_arrays(keeper.store, ref), stored_le(fields))


def test_discarding_an_open_branch_deletes_its_segments_once(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    keeper = keeper_of(local_config)
    fields = fields_of(P, C, seed=8)
    branch = keeper.open_branch(P, branch_id="gone")
    branch.append(0, 7, rows_of(fields, 0, 7))
    branch.append(7, 8, rows_of(fields, 7, 8))
    assert not keeper.store.exists(chunk_keys(node_key("gone.0"))[1])  # the writer life's object is not committed
    result = branch.discard(reason="episode abandoned")
    assert result.deleted == [keeper.store.uri(node_key("gone.0"))]  # its two segments' object, committed then
    keeper.ledger.wait_freed()
    assert keeper.store.list_prefix("payloads") == []
    with pytest.raises(OpenBranchError, match=r"^branch gone: append rows \[8, 9\): the branch was discarded after 8 "
                                              r"tokens"):
        branch.append(8, 9, rows_of(fields, 8, 9))


def test_a_missing_segment_fails_the_read_naming_it(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    keeper = keeper_of(local_config)
    seg, _ = kept_both(keeper, fields_of(P, C, seed=9))
    keeper.ledger.delete([seg.segments[2]], reason="test: lose one segment")  # and its writer life's object
    keeper.ledger.wait_freed()
    with pytest.raises(ChunkNotFoundError, match=r"payloads/../seg\.0/c\.0 does not exist: chunk .*seg\.0 was "
                                                 r"deleted by env_worker_0 .*\(test: lose one segment\)"):
        fetch_arrays(keeper.store, seg, 9)


def test_a_segmented_ref_whose_segments_disagree_is_refused(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    keeper = keeper_of(local_config)
    seg, _ = kept_both(keeper, fields_of(P, C, seed=10))
    doc = seg.model_dump()
    doc["segments"] = doc["segments"][:3]
    with pytest.raises(ValueError, match=r"segments cover 19 tokens: expected 30; array 'routed_experts': 19 rows "
                                         r"in segments, 30 declared"):
        PayloadRef.model_validate(doc)


def stored_le(fields: dict) -> dict[str, np.ndarray]:
    return {n: np.ascontiguousarray(a, a.dtype.newbyteorder("<")) for n, a in stored(fields).items()}


def test_a_branch_id_is_claimed_when_the_branch_is_opened(local_config):
    keeper = keeper_of(local_config)
    other = Keeper(keeper.store, Ledger(keeper.store, "env_worker_1"), CFG, local_config)
    fields = fields_of(P, C, seed=13)
    first = keeper.open_branch(P, branch_id="twice")
    for opener in (keeper, other):  # before any row is appended, in this process or another
        with pytest.raises(OpenBranchError, match=rf"^branch twice: already opened in run .* by env worker "
                                                  rf"env_worker_0 \(ledger session {keeper.ledger.session}\) \(claim "
                                                  rf".*/twice\.opened\): branch ids are unique per run; open the "
                                                  rf"branch under a new id$"):
            opener.open_branch(P, branch_id="twice")
    first.append(0, P + C, rows_of(fields, 0, P + C))
    ref = first.close()
    with pytest.raises(OpenBranchError, match=r"^branch twice: already opened"):
        other.open_branch(P, branch_id="twice")  # closed, the id stays taken for the run
    assert_same(fetch_arrays(keeper.store, ref), stored_le(fields))
    keeper.discard([ref])
    keeper.ledger.close()
    other.ledger.close()
    report = audit(keeper.store, finished=True)
    assert (report.kept, report.deleted, report.present) == (1, 1, 0) and report.clean


def test_a_closed_or_suspended_branch_is_not_discarded_by_its_old_object(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    keeper = keeper_of(local_config)
    fields = fields_of(P, C, seed=12)
    done = keeper.open_branch(P, branch_id="done")
    done.append(0, 7, rows_of(fields, 0, 7))
    ref = done.close()
    with pytest.raises(OpenBranchError, match=r"^branch done: discard: the branch was closed after 7 tokens"):
        done.discard(reason="late discard")
    assert_same(fetch_arrays(keeper.store, ref), fetch_arrays(keeper.store, keeper.keep(
        Branch(P, 7 - P, rows_of(fields, 0, 7), branch_id="done-whole"))))  # nothing deleted
    cut = keeper.open_branch(P, branch_id="cut")
    cut.append(0, 7, rows_of(fields, 0, 7))
    cut.suspend()
    with pytest.raises(OpenBranchError, match=r"^branch cut: discard: the branch was suspended after 7 tokens: "
                                              r"expected an open branch; resume it"):
        cut.discard(reason="stale discard")
    store = keeper.store
    resumer = Keeper(store, Ledger(store, "env_worker_1"), CFG, local_config)
    resumed = resumer.resume_branch("cut")  # another worker continues it: nothing was deleted
    resumed.append(7, 9, rows_of(fields, 7, 9))
    assert_same(fetch_arrays(store, resumed.close()), fetch_arrays(store, keeper.keep(
        Branch(P, 9 - P, rows_of(fields, 0, 9), branch_id="cut-whole"))))


def test_positions_are_integers_and_an_append_needs_an_open_ledger(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    keeper = keeper_of(local_config)
    fields = fields_of(P, C, seed=13)
    branch = keeper.open_branch(P, branch_id="np")
    branch.append(np.int64(0), np.int64(7), rows_of(fields, 0, 7))  # numpy integers: taken as int
    assert type(branch.num_tokens) is int and branch.num_tokens == 7
    with pytest.raises(OpenBranchError, match=r"^branch np \(env worker env_worker_0\) rows \[7, 9.0\): end=9.0: "
                                              r"expected an integer token position$"):
        branch.append(7, 9.0, rows_of(fields, 7, 9))
    with pytest.raises(FieldError, match=r"^branch np \(env worker env_worker_0\) rows \[7, 9\): fields=NoneType: "
                                         r"expected a mapping of field name -> array$"):
        branch.append(7, 9, None)
    assert branch.num_tokens == 7
    ref = branch.close()
    assert ref.num_tokens == 7 and PayloadRef.model_validate_json(ref.model_dump_json()) == ref
    late = keeper.open_branch(P, branch_id="late")
    keeper.ledger.close()
    with pytest.raises(LedgerClosedError, match=r"'append rows \[0, 5\) of open branch late' refused, nothing done"):
        late.append(0, 5, rows_of(fields, 0, 5))
    assert late.num_tokens == 0 and keeper.store.list_prefix(node_key("late.0")) == []


def test_a_shared_prefix_is_not_written_once_its_ledger_session_is_closed(local_config):
    keeper = keeper_of(local_config)
    fields = fields_of(P, C, seed=14)
    keeper.ledger.close()
    with pytest.raises(LedgerClosedError, match=r"'keep of group-prompt' refused, nothing done"):
        keeper.keep_prefix(P, {"routed_experts": fields["routed_experts"][:P]}, holders=["a"],
                           prefix_id="group-prompt")
    assert keeper.store.list_prefix("payloads") == []  # it wrote the chunk, then refused to record it


def test_closing_the_ledger_with_branches_still_open_warns_naming_them(local_config, caplog):
    """``Ledger.close`` while open branches of it were still open closed silently (their rows leaked until a sweep);
    it still closes (a shutdown path must end the session), and a warning names the branches still open and what
    to do. A branch closed, suspended, discarded or resumed-and-closed is not named; a ledger with none left warns
    nothing."""
    keeper = keeper_of(local_config)
    fields = fields_of(P, C, seed=5)
    branches = {name: keeper.open_branch(P, branch_id=name) for name in ("closed", "suspended", "discarded", "resumed",
                                                                        "left-b", "left-a")}
    for branch in branches.values():
        branch.append(0, 7, rows_of(fields, 0, 7))
    branches["closed"].close()
    branches["suspended"].suspend()
    branches["discarded"].discard()
    branches["resumed"].suspend()
    resumed = keeper.resume_branch("resumed")
    resumed.append(7, 12, rows_of(fields, 7, 12))
    resumed.close()
    with caplog.at_level("WARNING", logger="refpipe.storage.ledger_session"):
        keeper.ledger.close()
    assert caplog.messages == [
        f"ledger session {keeper.ledger.session} of actor 'env_worker_0' closed with open branches ['left-a', "
        f"'left-b'] still open: they can be closed, suspended or discarded no more, and their rows are leaked until "
        f"`refpipe sweep` removes them; close, suspend or discard each open branch before Ledger.close"]
    assert keeper.ledger.closed
    caplog.clear()
    other = keeper_of(local_config)
    other.open_branch(P, branch_id="done").discard()
    with caplog.at_level("WARNING", logger="refpipe.storage.ledger_session"):
        other.ledger.close()
    assert caplog.messages == []
