"""A writer life's segments in one object (filesystem stores): one object per life, read with one open per object,
cut anywhere through a segment, a crashed life left to the audit and removed once by the sweep; S3 keeps a chunk per
segment."""

from __future__ import annotations

import numpy as np
import pytest

from refpipe.pipeline import open_branch
from refpipe.pipeline.audit import audit
from refpipe.pipeline.sweep import sweep
from refpipe.storage.chunk_codec import read_attributes
from refpipe.storage.chunk_read import fetch_arrays, fetch_into
from refpipe.storage.chunk_ref import PayloadRef, segments_checksum
from refpipe.storage.errors import ChunkCorruptError, OpenBranchError, StorageError
from refpipe.storage.layout import chunk_keys, node_key
from tests.helpers.children import killed_at_first_line, module_argv
from tests.pipeline.test_keep import CFG
from tests.pipeline.test_open_branch import keeper_of

TURNS, TURN, PROMPT = 50, 6, 8
LAYERS, TOP_K = 3, 2


def routing(n: int, seed: int) -> np.ndarray:
    """``n`` routing rows [n, LAYERS, TOP_K] uint8 of distinct ids per (token, layer)."""
    base = np.random.default_rng(seed).integers(0, 6, (n, LAYERS, 1), dtype=np.uint8)
    return base + np.arange(TOP_K, dtype=np.uint8)


def fifty_turns(keeper, branch_id: str = "b", seed: int = 1) -> tuple[PayloadRef, PayloadRef, np.ndarray]:
    """(shared prefix, branch of the prefix and ``TURNS`` appends of ``TURN`` tokens, the branch's rows)."""
    rows = routing(PROMPT + TURNS * TURN, seed)
    prefix = keeper.keep_prefix(PROMPT, {"routed_experts": rows[:PROMPT]}, holders=[branch_id],
                                prefix_id=f"{branch_id}-prompt")
    branch = keeper.open_branch(PROMPT, branch_id=branch_id, prefix=prefix)
    for t in range(TURNS):
        start = PROMPT + t * TURN
        branch.append(start, start + TURN, {"routed_experts": rows[start : start + TURN]})
    return prefix, branch.close(), rows


@pytest.fixture
def segment_per_append(monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)


def test_a_fifty_append_branch_is_one_object_and_its_prefix_read_with_two_opens(local_config, segment_per_append,
                                                                                 monkeypatch):
    keeper = keeper_of(local_config, CFG)
    prefix, ref, rows = fifty_turns(keeper)
    store = keeper.store
    assert len(ref.segments) == TURNS + 1 and ref.nodes == (prefix.key, node_key("b.1"))
    sizes = [s.nbytes for s in ref.segments[1:]]
    assert [s.offset for s in ref.segments] == [None, *np.cumsum([0, *sizes[:-1]]).tolist()]
    assert store.list_prefix("payloads") == sorted([*chunk_keys(prefix.key), *chunk_keys(node_key("b.1"))])
    assert store.list_sizes(node_key("b.1"))[chunk_keys(node_key("b.1"))[0]] == sum(sizes)
    attrs = read_attributes(store.get(chunk_keys(node_key("b.1"))[1]))
    assert (attrs["format"], attrs["branch_id"], attrs["nbytes"], attrs["num_prompt_tokens"],
            attrs["num_completion_tokens"]) == ("refpipe.segments", "b.1", sum(sizes), 0, TURNS * TURN)
    opens = []
    confined = store._confined()
    open_read = confined.open_read
    monkeypatch.setattr(confined, "open_read", lambda key: opens.append(key) or open_read(key))
    out = np.empty_like(rows)
    fetched = fetch_into(store, ref, None, {"routed_experts": out})
    assert fetched.in_place and out.tobytes() == rows.tobytes()
    assert opens == [chunk_keys(prefix.key)[0], chunk_keys(node_key("b.1"))[0]]
    keeper.discard([ref])
    keeper.ledger.close()
    report = audit(store, finished=True)
    assert (report.kept, report.deleted, report.present, report.double_deletes) == (2, 2, 0, 0) and report.clean


def test_a_cut_through_the_middle_of_a_segment_returns_the_exact_rows(local_config, segment_per_append):
    keeper = keeper_of(local_config, CFG)
    _, ref, rows = fifty_turns(keeper)
    for n in (0, 1, PROMPT, PROMPT + 1, PROMPT + 17 * TURN + 3, PROMPT + TURNS * TURN - 1, PROMPT + TURNS * TURN):
        assert fetch_arrays(keeper.store, ref, n)["routed_experts"].tobytes() == rows[:n].tobytes(), n
        out = np.full((n, LAYERS, TOP_K), 255, np.uint8)
        fetched = fetch_into(keeper.store, ref, n, {"routed_experts": out})
        assert fetched.arrays["routed_experts"] is out and out.tobytes() == rows[:n].tobytes(), n
    segment = ref.segments[18]  # one segment alone, at its offset in its life's object
    assert fetch_arrays(keeper.store, segment)["routed_experts"].tobytes() == \
        rows[PROMPT + 17 * TURN : PROMPT + 18 * TURN].tobytes()


def test_a_ref_whose_segments_do_not_follow_each_other_in_their_object_is_refused(local_config,
                                                                                  segment_per_append):
    keeper = keeper_of(local_config, CFG)
    _, ref, _ = fifty_turns(keeper)
    doc = ref.model_dump()
    expected = doc["segments"][2]["offset"]
    doc["segments"][2]["offset"] += 64  # a gap: bytes no ref vouches for
    with pytest.raises(ValueError, match=rf"segment 2 \(b\.1\): offset {expected + 64}: expected {expected} \(the "
                                         rf"segments of one object follow each other"):
        PayloadRef.model_validate(doc)
    doc = ref.model_dump()
    doc["segments"][1]["offset"] = None  # a segment of a shared object without its offset
    with pytest.raises(ValueError, match=r"segment 2 \(b\.1\): offset [0-9]+: expected 0"):
        PayloadRef.model_validate(doc)
    doc = ref.model_dump()
    doc["segments"][0]["offset"] = 0  # the prefix
    with pytest.raises(ValueError, match=r"offset=0: expected none on a ref with segments or holders"):
        PayloadRef.model_validate(doc)


def test_a_flipped_byte_in_a_middle_segment_names_its_bytes(local_config, segment_per_append):
    keeper = keeper_of(local_config, CFG)
    _, ref, _ = fifty_turns(keeper)
    seg = ref.segments[30]
    path = f"{keeper.store.prefix.path}/{chunk_keys(seg.key)[0]}"
    with open(path, "r+b") as f:
        f.seek(seg.offset + 5)
        byte = f.read(1)
        f.seek(seg.offset + 5)
        f.write(bytes([byte[0] ^ 1]))
    uri = keeper.store.uri(seg.key)
    with pytest.raises(ChunkCorruptError, match=rf"^chunk {uri} bytes \[{seg.offset}, {seg.offset + seg.nbytes}\): "
                                                rf"crc32c mismatch: reference {seg.checksum:#010x}"):
        fetch_into(keeper.store, ref, None, {"routed_experts": np.empty((ref.num_tokens, LAYERS, TOP_K), np.uint8)})
    assert fetch_arrays(keeper.store, ref, PROMPT + 29 * TURN)["routed_experts"].shape[0] == PROMPT + 29 * TURN


def test_a_fetch_plan_is_kept_with_its_ref_object_alone(local_config, segment_per_append):
    keeper = keeper_of(local_config, CFG)
    _, ref, rows = fifty_turns(keeper)
    store, out = keeper.store, np.empty_like(rows)
    for _ in range(2):  # planned by the first fetch, read by that plan in the second
        assert fetch_into(store, ref, None, {"routed_experts": out}).in_place and out.tobytes() == rows.tobytes()
    assert PayloadRef.model_validate_json(ref.model_dump_json()) == ref and "_fetch_plans" not in ref.model_dump_json()
    seg = ref.segments[30]  # a copy declaring another crc32c for segment 30 is planned afresh: refused
    segments = (*ref.segments[:30], seg.model_copy(update={"checksum": seg.checksum ^ 1}), *ref.segments[31:])
    forged = ref.model_copy(update={"segments": segments, "checksum": segments_checksum(segments)})
    with pytest.raises(ChunkCorruptError, match=rf"^chunk {store.uri(seg.key)} bytes \[{seg.offset}, "
                                                rf"{seg.offset + seg.nbytes}\): crc32c mismatch: reference "
                                                rf"{seg.checksum ^ 1:#010x}, stored {seg.checksum:#010x}, computed "
                                                rf"{seg.checksum:#010x}$"):
        fetch_into(store, forged, None, {"routed_experts": out})
    n = PROMPT + 17 * TURN + 3  # a plan per tokens fetched
    cut = np.full((n, LAYERS, TOP_K), 255, np.uint8)
    assert not fetch_into(store, ref, n, {"routed_experts": cut}).in_place and cut.tobytes() == rows[:n].tobytes()
    assert fetch_into(store, ref, None, {"routed_experts": out}).in_place and out.tobytes() == rows.tobytes()


def test_a_shared_prefix_object_of_another_length_fails_the_fetch_naming_it(local_config, segment_per_append):
    keeper = keeper_of(local_config, CFG)
    prefix, ref, rows = fifty_turns(keeper)
    path = f"{keeper.store.prefix.path}/{chunk_keys(prefix.key)[0]}"
    with open(path, "rb") as f:
        data = f.read()
    out = np.empty_like(rows)
    for changed in (data + b"\0", data[:-1]):  # the prefix is an object of its own: exactly its nbytes
        with open(path, "wb") as f:
            f.write(changed)
        with pytest.raises(ChunkCorruptError, match=rf"^chunk {keeper.store.uri(prefix.key)}: expected "
                                                    rf"{prefix.nbytes} bytes, got {len(changed)} \(truncated or "
                                                    rf"replaced\)$"):
            fetch_into(keeper.store, ref, None, {"routed_experts": out})
    with open(path, "wb") as f:
        f.write(data)
    assert fetch_into(keeper.store, ref, None, {"routed_experts": out}).in_place and out.tobytes() == rows.tobytes()


def test_a_close_whose_commit_marker_failed_closes_again_without_writing_rows_twice(local_config,
                                                                                    segment_per_append, monkeypatch):
    keeper = keeper_of(local_config, CFG)
    rows = routing(PROMPT + 2 * TURN, 3)
    branch = keeper.open_branch(PROMPT, branch_id="late")
    branch.append(0, PROMPT + TURN, {"routed_experts": rows[: PROMPT + TURN]})
    branch.append(PROMPT + TURN, PROMPT + 2 * TURN, {"routed_experts": rows[PROMPT + TURN :]})
    put = keeper.store.put

    def refuse_marker(key, data, **kw):
        if key == chunk_keys(node_key("late.0"))[1]:
            raise StorageError("test: the metadata server is away")
        return put(key, data, **kw)

    monkeypatch.setattr(keeper.store, "put", refuse_marker)
    with pytest.raises(StorageError, match="the metadata server is away"):
        branch.close()
    with pytest.raises(OpenBranchError, match=r"^branch late: append rows \[20, 21\): a close wrote the branch's last "
                                              r"rows and failed after; close again \(or discard it\)$"):
        branch.append(PROMPT + 2 * TURN, PROMPT + 2 * TURN + 1, {"routed_experts": rows[:1]})
    monkeypatch.setattr(keeper.store, "put", put)
    ref = branch.close()
    assert [(s.branch_id, s.offset) for s in ref.segments] == [("late.0", 0), ("late.0", ref.segments[0].nbytes)]
    assert fetch_arrays(keeper.store, ref)["routed_experts"].tobytes() == rows.tobytes()
    assert keeper.store.exists(chunk_keys(node_key("late.0"))[1])


def test_a_life_cut_by_a_crash_is_named_by_the_audit_and_removed_once_by_the_sweep(local_config):
    line, stderr, _ = killed_at_first_line(module_argv("tests.pipeline.test_segment_objects", local_config.root,
                                                        local_config.run_id))
    assert line == "appended\n", stderr
    store = keeper_of(local_config, CFG).store
    node = node_key("crash.0")
    assert store.list_prefix(node) == [chunk_keys(node)[0]]  # 20 segments in, no zarr.json: its life never ended
    report = audit(store, stopped=True)
    assert (report.incomplete_keeps, report.leaked_chunks, report.outstanding) == ([store.uri(node)],
                                                                                   [store.uri(node)], 0)
    swept = sweep(store, stopped=True)
    assert (swept.deleted, swept.removed_incomplete) == ([], [store.uri(node)])
    assert store.list_prefix(node) == []
    assert sweep(store, stopped=True).removed_incomplete == []  # once


def _crash_mid_life(root: str, run_id: str) -> None:
    """Append 20 turns to branch ``crash`` and report, then wait to be killed."""
    import sys
    import time

    from refpipe.storage.config import StorageConfig

    open_branch.COALESCE_BYTES = 1
    keeper = keeper_of(StorageConfig(root=root, run_id=run_id), CFG)
    rows = routing(PROMPT + 20 * TURN, 2)
    branch = keeper.open_branch(PROMPT, branch_id="crash")
    branch.append(0, PROMPT + TURN, {"routed_experts": rows[: PROMPT + TURN]})
    for t in range(1, 20):
        start = PROMPT + t * TURN
        branch.append(start, start + TURN, {"routed_experts": rows[start : start + TURN]})
    keeper.ledger.flush()
    sys.stdout.write("appended\n")
    sys.stdout.flush()
    time.sleep(600)


if __name__ == "__main__":
    import sys

    _crash_mid_life(*sys.argv[1:3])
