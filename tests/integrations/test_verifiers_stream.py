"""RefDeltaStreamer against verifiers' own DeltaStreamer, on traces built offline through
verifiers' data model: the same stream minus the arrays, refs that fetch the same bytes,
stale and discarded keeps deleted exactly once, abandoned runs leave nothing."""

from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

pytest.importorskip("verifiers", minversion="0.4", reason="the verifiers extra is not installed "
                    "(pip install 'refpipe[verifiers]'): skipping the verifiers integration tests")

from verifiers.v1.serve.delta import DeltaStreamer, pack  # noqa: E402

from refpipe.integrations.verifiers_branches import (  # noqa: E402
    INFO_KEY,
    read_refs,
    side_channels,
    trainable_branches,
)
from refpipe.integrations.verifiers_server import RefDeltaStreamer, RunKeeps  # noqa: E402
from refpipe.integrations.verifiers_turns import path_ids  # noqa: E402
from refpipe.pipeline import open_branch  # noqa: E402
from refpipe.pipeline.audit import audit  # noqa: E402
from refpipe.pipeline.fields import FieldsConfig  # noqa: E402
from refpipe.pipeline.keep import Keeper  # noqa: E402
from refpipe.pipeline.segment_write import LifeWriter  # noqa: E402
from refpipe.storage.backends import open_store  # noqa: E402
from refpipe.storage.chunk_read import fetch_arrays  # noqa: E402
from refpipe.storage.errors import FieldError  # noqa: E402
from refpipe.storage.ledger import Ledger  # noqa: E402
from tests.integrations.vf_serving import (  # noqa: E402
    Stream,
    byte_leaves,
    chunk_ids,
    payload_nodes,
    same_bytes,
    tombstones,
)
from tests.integrations.vf_traces import Engine, complete, inline_arrays, multi_turn, multi_turn_steps, new_trace  # noqa: E402

FIELDS = FieldsConfig(num_layers=3, top_k=2, num_experts=16, sampling_mask=True)
BIG = dict(layers=16, top_k=8, num_experts=64, completion_scale=16)
BIG_FIELDS = FieldsConfig(num_layers=16, top_k=8, num_experts=64, sampling_mask=True)


class Refpipe:
    """A keeper (ledger actor ``env_worker_0``) and a keep pool for RefDeltaStreamers."""

    def __init__(self, config, fields=FIELDS):
        self.store = open_store(config)
        self.ledger = Ledger(self.store, "env_worker_0")
        self.keeper = Keeper(self.store, self.ledger, fields, config)
        self.pool = ThreadPoolExecutor(2)

    def stream(self) -> Stream:
        return Stream(lambda traces, send: RefDeltaStreamer(traces, send, RunKeeps(self.keeper), self.pool))

    def nodes(self) -> set[str]:
        """``payload_nodes`` once the ledger's reaper removed the deleted chunks' bytes."""
        self.ledger.wait_freed()
        return payload_nodes(self.store)

    def all_refs(self, episode):
        return [ref for t in episode.traces for ref in read_refs(t.info, t.id).values()]


async def play(stream: Stream, seeds, engine_kw=None) -> None:
    """Each seed's trace streamed turn by turn (a flush per turn), completed, then the run ends."""
    async with stream.streamer:
        for seed in seeds:
            trace = new_trace(f"t{seed}")
            stream.traces.append(trace)
            for _ in multi_turn_steps(trace, Engine(seed, **(engine_kw or {}))):
                await stream.streamer.flush()
            complete(trace, reward=float(seed))
            await stream.streamer.flush()


def strip_arrays(delta: dict) -> dict:
    d = copy.deepcopy(delta)
    d.pop("routing_repairs", None)
    for node in d.get("nodes", ()):
        node.pop("routed_experts", None)
        node.pop("sampling_mask", None)
    return d


def strip_refs(delta: dict) -> dict:
    d = copy.deepcopy(delta)
    info = d.get("set", {}).get("info")
    if info is not None and info.pop(INFO_KEY, None) is not None and not info:
        del d["set"]["info"]
    return d


def test_refs_replace_arrays_byte_for_byte(storage_config):
    rp = Refpipe(storage_config)
    vanilla = Stream(DeltaStreamer)
    refpipe = rp.stream()
    asyncio.run(play(vanilla, [1, 2]))
    asyncio.run(play(refpipe, [1, 2]))
    inline_ep, ref_ep = vanilla.episode(), refpipe.episode()

    # verifiers' own stream repaired placeholder rows in flight (turns 2 and 3 of each trace; the
    # fork's prefill routes a1's last token as turn 2's did); refpipe's carries no bytes at all
    assert sum(len(d.get("routing_repairs", {})) for d in vanilla.deltas) == 4
    assert byte_leaves(refpipe.deltas) == []
    nodes = [node for d in refpipe.deltas for node in d.get("nodes", ())]
    assert len(nodes) == 16 and not any("routed_experts" in n or "sampling_mask" in n for n in nodes)
    # and is otherwise the same stream, delta for delta
    assert len(vanilla.deltas) == len(refpipe.deltas) == 10
    assert [pack(strip_arrays(d)) for d in vanilla.deltas] == [pack(strip_refs(d)) for d in refpipe.deltas]

    # the refs fetch exactly the arrays verifiers' client assembled from the inline stream
    fetched = 0
    for vt, rt in zip(inline_ep.traces, ref_ep.traces, strict=True):
        refs = read_refs(rt.info, rt.id)
        inline = inline_arrays(vt)
        assert sorted(refs) == sorted(inline) == [5, 7]
        for leaf, (prompt, routed, mask) in inline.items():
            got = fetch_arrays(rp.store, refs[leaf])
            assert same_bytes(got["routed_experts"], routed)
            assert same_bytes(np.concatenate([np.zeros(prompt, np.int32), got["sampling_mask.counts"]]), mask.counts)
            assert same_bytes(got["sampling_mask.ids"], mask.ids)
            fetched += 1
    assert fetched == 4
    assert rp.nodes() == chunk_ids(rp.all_refs(ref_ep))


def test_stream_size_before_and_after(local_config):
    rp = Refpipe(local_config, BIG_FIELDS)
    vanilla, refpipe = Stream(DeltaStreamer), rp.stream()
    asyncio.run(play(vanilla, [3, 4], BIG))
    asyncio.run(play(refpipe, [3, 4], BIG))
    before, after = sum(vanilla.sizes), sum(refpipe.sizes)
    side_channel = sum(len(b) for b in byte_leaves(vanilla.deltas))
    # verifiers sends each node's arrays once, plus one routing row per repair
    repairs = sum(len(d.get("routing_repairs", {})) for d in vanilla.deltas)
    nodes = [n for t in vanilla.traces for n in t.nodes]
    assert side_channel == (sum(n.routed_experts.nbytes for n in nodes) + repairs * 16 * 8
                            + sum(n.sampling_mask.ids.nbytes + n.sampling_mask.counts.nbytes
                                  for n in nodes if n.sampling_mask is not None))
    refs_json = sum(len(pack(d)) - len(pack(strip_refs(d))) for d in refpipe.deltas)
    # every side-channel byte is gone; what replaced them is 4 refs (two branches per trace)
    assert byte_leaves(refpipe.deltas) == []
    assert side_channel > 50_000 and 0 < refs_json < 4 * 1024  # 4 refs, whatever the token count
    assert after < before - side_channel + refs_json
    assert after * 5 < before  # 16 layers x top-8 routing: ~6.8x smaller (48 x 8 would be ~25x)


def test_repair_after_completion_rekeeps_and_deletes_stale_chunk(local_config):
    rp = Refpipe(local_config)
    stream = rp.stream()

    async def go():
        async with stream.streamer:
            trace = new_trace("late")
            stream.traces.append(trace)
            steps = multi_turn_steps(trace, Engine(7))
            next(steps)
            trace.stop("agent_timeout")  # completed while a turn is still in flight
            await stream.streamer.flush()
            (stale,) = read_refs(trace.info, "late").values()
            stale_rows = fetch_arrays(rp.store, stale)["routed_experts"].copy()
            for _ in steps:  # the in-flight turn lands: repairs a1's placeholder row, adds nodes
                pass
        return trace, stale, stale_rows

    trace, stale, stale_rows = asyncio.run(go())
    final = read_refs(stream.episode().traces[0].info, "late")
    assert sorted(final) == [5, 7]
    assert tombstones(rp.store, [stale])[stale.branch_id]["reason"] == "stale: trace late changed after keep"
    assert rp.nodes() == chunk_ids(final.values())
    for leaf, (prompt, routed, mask) in inline_arrays(trace).items():
        got = fetch_arrays(rp.store, final[leaf])
        assert same_bytes(got["routed_experts"], routed)
        assert same_bytes(np.concatenate([np.zeros(prompt, np.int32), got["sampling_mask.counts"]]), mask.counts)
        # the first keep shipped a1's placeholder last row; the final keep has the repaired one
        n = stale.num_tokens
        assert same_bytes(got["routed_experts"][: n - 1], stale_rows[:-1])
        assert not np.array_equal(got["routed_experts"][n - 1], stale_rows[-1])


def test_discarded_attempt_deleted_once_and_stream_says_so(local_config):
    rp = Refpipe(local_config)
    stream = rp.stream()

    async def go():
        async with stream.streamer:
            first = new_trace("attempt1")
            stream.traces.append(first)
            multi_turn(first, Engine(1))
            complete(first, reward=0.0)
            await stream.streamer.flush()
            refs = list(read_refs(first.info, "attempt1").values())
            stream.traces.remove(first)  # the agent retries: verifiers drops the attempt from the live view
            second = new_trace("attempt2")
            stream.traces.append(second)
            multi_turn(second, Engine(2))
            complete(second)
            await stream.streamer.flush()
        return refs

    discarded = asyncio.run(go())
    assert {"trace": "attempt1", "discard": True} in stream.deltas
    kept = list(read_refs(stream.episode().traces[0].info, "attempt2").values())
    records = tombstones(rp.store, discarded + kept)
    assert sorted(records) == sorted(r.branch_id for r in discarded)
    assert {r["holder"] for r in records.values()} == {"env_worker_0"}
    assert {r["reason"] for r in records.values()} == {"discarded attempt: trace attempt1 left the run (retried)"}
    assert rp.nodes() == chunk_ids(kept)
    rp.ledger.delete(kept, reason="test: trained")
    rp.ledger.close()
    report = audit(rp.store, finished=True)
    assert report.clean and (report.kept, report.deleted, report.present, report.double_deletes) == (4, 4, 0, 0)


def test_cancelled_run_leaves_nothing(local_config):
    rp = Refpipe(local_config)
    stream = rp.stream()
    kept = asyncio.Event()

    async def go():
        async with stream.streamer:
            trace = new_trace("t")
            stream.traces.append(trace)
            multi_turn(trace, Engine(1))
            complete(trace)
            await stream.streamer.flush()
            kept.set()
            await asyncio.Event().wait()

    async def cancel():
        task = asyncio.create_task(go())
        await kept.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel())
    refs = list(read_refs(stream.traces[0].info, "t").values())
    assert len(refs) == 2 and rp.nodes() == set()
    assert {r["reason"] for r in tombstones(rp.store, refs).values()} == {"run abandoned: cancelled"}
    rp.ledger.close()
    assert audit(rp.store, finished=True).clean


def test_keep_failure_fails_the_run_and_deletes_what_was_kept(local_config):
    rp = Refpipe(local_config, FieldsConfig(num_layers=3, top_k=2, num_experts=16, sampling_mask=True))
    stream = rp.stream()

    async def go():
        async with stream.streamer:
            good = new_trace("good")
            stream.traces.append(good)
            multi_turn(good, Engine(1))
            complete(good)
            await stream.streamer.flush()
            bad = new_trace("bad")
            stream.traces.append(bad)
            multi_turn(bad, Engine(2, num_experts=200))  # expert ids past num_experts=16
            complete(bad)

    with pytest.raises(FieldError, match=r"field .routed_experts.: row .* value .*: expected >= 0, < num_experts=16"):
        asyncio.run(go())
    kept = list(read_refs(stream.traces[0].info, "good").values())
    assert len(kept) == 2 and rp.nodes() == set()
    assert {r["reason"] for r in tombstones(rp.store, kept).values()} == {"run abandoned: failed: FieldError"}
    assert INFO_KEY not in stream.traces[1].info


def test_untrainable_traces_keep_nothing_and_stream_no_arrays(local_config):
    rp = Refpipe(local_config)
    stream = rp.stream()

    async def go():
        async with stream.streamer:
            judge = new_trace("judge", trainable=False)
            stream.traces.append(judge)
            multi_turn(judge, Engine(1))
            complete(judge)

    asyncio.run(go())
    assert byte_leaves(stream.deltas) == []
    assert INFO_KEY not in stream.episode().traces[0].info
    assert rp.nodes() == set()


def test_a_path_node_without_routing_is_refused_not_dropped_for_the_whole_branch():
    """Issue 14 input 2 (verifiers): one node of a path without routing made verifiers' ``Branch.routed_experts``
    None, so the whole branch was kept without routing and trained (or crashed) without it."""
    trace = new_trace("t7")
    multi_turn(trace, Engine(7))
    complete(trace)
    (leaf, branch), *_ = trainable_branches(trace)
    nodes = [n for n in branch.nodes if n.token_ids]
    assert side_channels(trace.id, leaf, branch).fields["routed_experts"].shape[0] == len(branch.sampled_mask)
    nodes[1].routed_experts = None
    with pytest.raises(FieldError) as info:
        side_channels(trace.id, leaf, branch)
    assert str(info.value) == (
        f"trace t7 leaf {leaf}: path nodes (index, tokens, routing rows) [(1, {len(nodes[1].token_ids)}, None)] lack "
        f"routing rows that the other {len(nodes) - 1} nodes carry: expected one routing row per token on every node "
        "(keeping the branch without routing would drop it for the whole branch)")


class Writes:
    """Every segment an open branch writes (``LifeWriter.write``), as ``(segment id, tokens)``, and its ref (on a
    filesystem, the segments of one writer life share one object: the ref's ``branch_id``)."""

    def __init__(self, monkeypatch):
        self.log: list[tuple[str, int]] = []
        self.refs = []
        write = LifeWriter.write

        def recorded(life, segment_id, arrays, specs, num_prompt_tokens, num_completion_tokens):
            ref = write(life, segment_id, arrays, specs, num_prompt_tokens, num_completion_tokens)
            self.log.append((segment_id, num_prompt_tokens + num_completion_tokens))
            self.refs.append(ref)
            return ref

        monkeypatch.setattr(LifeWriter, "write", recorded)


def path_tokens(trace, leaf) -> int:
    return len(dict(trainable_branches(trace))[leaf].sampled_mask)


def test_multi_turn_appends_store_the_whole_keep_rows_turn_by_turn(local_config, monkeypatch):
    """Each turn writes exactly its final rows (a segment per append, coalescing off), a turn's placeholder
    last routing row is never written (held back until the next prefill repairs it), and the closed refs
    fetch the bytes a whole keep of the finished trace stores."""
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    rp = Refpipe(local_config)
    writes = Writes(monkeypatch)
    stream = rp.stream()
    per_flush: list[list[tuple[str, int]]] = []
    marks = []  # after each turn, of every trainable branch: (leaf, position and row of its placeholder)

    async def go():
        async with stream.streamer:
            trace = new_trace("mt")
            stream.traces.append(trace)
            for _ in multi_turn_steps(trace, Engine(5)):
                marks.extend((leaf, len(b.sampled_mask) - 1, b.routed_experts[-1].copy())
                             for leaf, b in trainable_branches(trace))
                before = len(writes.log)
                await stream.streamer.flush()
                per_flush.append([(cid.rsplit(".", 2)[0].rsplit(".", 1)[-1], n) for cid, n in writes.log[before:]])
            complete(trace)
            before = len(writes.log)
            await stream.streamer.flush()
            per_flush.append([(cid.rsplit(".", 2)[0].rsplit(".", 1)[-1], n) for cid, n in writes.log[before:]])
        return trace

    trace = asyncio.run(go())
    refs = read_refs(trace.info, "mt")
    assert sorted(refs) == [5, 7]
    # turn lengths, as multi_turn_steps builds them (branch 5 grows over turns 1-3; branch 7 forks from node 1)
    t1, t2 = (sum(len(trace.nodes[n].token_ids) for n in range(k)) for k in (2, 4))
    t3, t4 = path_tokens(trace, 5), path_tokens(trace, 7)
    # branch 5 opened at leaf 1 (its id names it), the fork at leaf 7: each flush writes the new final rows only
    assert per_flush == [[("1", t1 - 1)], [("1", t2 - t1)], [("1", t3 - t2)], [("7", t4 - 1)], [("1", 1), ("7", 1)]]
    assert [s.num_tokens for s in refs[5].segments] == [t1 - 1, t2 - t1, t3 - t2, 1]
    assert [s.num_tokens for s in refs[7].segments] == [t4 - 1, 1]
    assert rp.nodes() == chunk_ids(refs.values()) == {r.branch_id for r in writes.refs}
    segment_bytes = sum(r.nbytes for r in writes.refs)
    assert segment_bytes == sum(r.nbytes for r in refs.values())

    # the same rows, byte for byte, as a whole keep of each finished branch
    repaired = 0
    for leaf, branch in trainable_branches(trace):
        whole = rp.keeper.keep(side_channels(trace.id, leaf, branch))
        got, want = fetch_arrays(rp.store, refs[leaf]), fetch_arrays(rp.store, whole)
        assert sorted(got) == sorted(want) == ["routed_experts", "sampling_mask.counts", "sampling_mask.ids"]
        assert all(same_bytes(got[k], want[k]) for k in want)
        # a turn's placeholder row on this path was stored as the next prefill repaired it (the last
        # token's stays the placeholder, as in verifiers' arrays)
        path = set(path_ids(trace, leaf))
        for mark_leaf, position, placeholder in marks:
            if mark_leaf in path and position < len(branch.sampled_mask) - 1:
                assert not np.array_equal(got["routed_experts"][position], placeholder)
                repaired += 1
        assert same_bytes(got["routed_experts"][-1], marks[-1 if leaf == 7 else -2][2])
        rp.keeper.discard([whole])
    assert repaired == 3  # branch 5: a1's and a2's placeholders; branch 7: a1's
    rp.ledger.delete(list(refs.values()), reason="test: trained")
    rp.ledger.close()
    report = audit(rp.store, finished=True)
    assert report.clean and (report.present, report.double_deletes) == (0, 0)


def test_an_open_trace_that_leaves_the_run_leaves_nothing(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    rp = Refpipe(local_config)
    writes = Writes(monkeypatch)
    stream = rp.stream()

    async def go():
        async with stream.streamer:
            first = new_trace("attempt1")
            stream.traces.append(first)
            steps = multi_turn_steps(first, Engine(1))
            for _ in range(2):  # two turns appended, the trace still open
                next(steps)
                await stream.streamer.flush()
            segments = list(writes.refs)
            stream.traces.remove(first)  # the agent retries
            second = new_trace("attempt2")
            stream.traces.append(second)
            multi_turn(second, Engine(2))
            complete(second)
            await stream.streamer.flush()
        return first, segments

    first, segments = asyncio.run(go())
    assert len(segments) == 2 and INFO_KEY not in first.info
    records = tombstones(rp.store, segments)
    assert sorted(records) == sorted({s.branch_id for s in segments})  # one object per writer life
    assert {r["reason"] for r in records.values()} == {"discarded attempt: trace attempt1 left the run (retried)"}
    kept = list(read_refs(stream.episode().traces[0].info, "attempt2").values())
    assert rp.nodes() == chunk_ids(kept)
    rp.ledger.delete(kept, reason="test: trained")
    rp.ledger.close()
    report = audit(rp.store, finished=True)
    assert report.clean and (report.present, report.double_deletes) == (0, 0)


def test_a_cancelled_run_discards_its_open_branches(local_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    rp = Refpipe(local_config)
    writes = Writes(monkeypatch)
    stream = rp.stream()
    appended = asyncio.Event()

    async def go():
        async with stream.streamer:
            trace = new_trace("t")
            stream.traces.append(trace)
            steps = multi_turn_steps(trace, Engine(1))
            for _ in range(3):
                next(steps)
                await stream.streamer.flush()
            appended.set()
            await asyncio.Event().wait()

    async def cancel():
        task = asyncio.create_task(go())
        await appended.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel())
    assert len(writes.refs) == 3 and INFO_KEY not in stream.traces[0].info  # three turns' segments, never closed
    assert rp.nodes() == set()
    assert {r["reason"] for r in tombstones(rp.store, writes.refs).values()} == {"run abandoned: cancelled"}
    assert len(tombstones(rp.store, writes.refs)) == 1  # the three segments' object
    rp.ledger.close()
    report = audit(rp.store, finished=True)
    assert report.clean and (report.kept, report.deleted, report.present, report.double_deletes) == (1, 1, 0, 0)


def test_a_turn_node_without_routing_fails_the_run_and_discards_its_open_branch(local_config, monkeypatch):
    """As for a whole branch (issue 14 input 2): a turn's node lacking the routing the path's other nodes carry is
    refused, never appended without routing; the run fails and its open branch's segments are deleted."""
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)
    rp = Refpipe(local_config)
    writes = Writes(monkeypatch)
    stream = rp.stream()
    sizes = []

    async def go():
        async with stream.streamer:
            trace = new_trace("t9")
            stream.traces.append(trace)
            steps = multi_turn_steps(trace, Engine(9))
            next(steps)
            await stream.streamer.flush()
            next(steps)
            trace.nodes[2].routed_experts = None  # turn 2's tool-result node
            sizes.append(len(trace.nodes[2].token_ids))
            await stream.streamer.flush()

    with pytest.raises(FieldError) as info:
        asyncio.run(go())
    assert str(info.value) == (
        f"trace t9 leaf 3: path nodes (index, tokens, routing rows) [(2, {sizes[0]}, None)] lack routing rows that "
        "the other nodes carry: expected one routing row per token on every node (keeping the branch without "
        "routing would drop it for the whole branch)")
    assert len(writes.refs) == 1 and rp.nodes() == set()  # turn 1's segment, deleted
    assert {r["reason"] for r in tombstones(rp.store, writes.refs).values()} == {"run abandoned: failed: FieldError"}
    rp.ledger.close()
    assert audit(rp.store, finished=True).clean
