"""RefpipeEnvServer over ZMQ on 127.0.0.1 with verifiers' own EnvClient, episodes built offline:
through the orchestrator and the trainer's assembly the rows equal what verifiers' own
server sends inline; retried attempts and abandoned runs leave no chunk behind."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

pytest.importorskip("verifiers", minversion="0.4", reason="the verifiers extra is not installed "
                    "(pip install 'refpipe[verifiers]'): skipping the verifiers integration tests")

from verifiers.v1.serve.delta import pack  # noqa: E402

from refpipe.integrations.verifiers_branches import INFO_KEY, num_prompt_tokens, read_refs, trainable_branches  # noqa: E402
from refpipe.integrations.verifiers_client import episode_refs, orchestrator_episode  # noqa: E402
from refpipe.integrations.verifiers_server import RefpipeServeConfig  # noqa: E402
from refpipe.pipeline import open_branch  # noqa: E402
from refpipe.pipeline.audit import audit  # noqa: E402
from refpipe.pipeline.fields import FieldsConfig  # noqa: E402
from refpipe.pipeline.orchestrator import Orchestrator, OrchestratorConfig  # noqa: E402
from refpipe.pipeline.step_file import StepFile  # noqa: E402
from refpipe.storage.backends import open_store  # noqa: E402
from refpipe.storage.errors import EpisodeError  # noqa: E402
from refpipe.storage.ledger import Ledger  # noqa: E402
from refpipe.trainer.fetch import fetch_own  # noqa: E402
from tests.integrations.vf_serving import (  # noqa: E402
    TEMPERATURE,
    byte_leaves,
    chunk_ids,
    payload_nodes,
    run,
    same_bytes,
    serving,
    tombstones,
)

FIELDS = FieldsConfig(num_layers=3, top_k=2, num_experts=16, sampling_mask=True)


def refpipe_config(storage_config) -> RefpipeServeConfig:
    return RefpipeServeConfig(storage=storage_config, fields=FIELDS, actor="env_worker_0")


def test_trainer_rows_equal_inline_rows_through_the_orchestrator(storage_config, monkeypatch):
    monkeypatch.setattr(open_branch, "COALESCE_BYTES", 1)  # a segment per append: trainers read turn segments
    store = open_store(storage_config)
    sizes = {"inline": 0, "refpipe": 0}
    deltas = []

    def counter(kind):
        def on_delta(delta):
            sizes[kind] += len(pack(delta))
            if kind == "refpipe":
                deltas.append(delta)
        return on_delta

    async def go():
        async with serving(None) as (_, vanilla), serving(refpipe_config(storage_config)) as (_, refpipe):
            inline = [await run(vanilla, s, reward=r, on_delta=counter("inline")) for s, r in ((1, 1.0), (2, 0.0))]
            served = [await run(refpipe, s, reward=r, on_delta=counter("refpipe")) for s, r in ((1, 1.0), (2, 0.0))]
        return inline, served

    inline_eps, served = asyncio.run(go())
    # no array bytes on the wire; without its refs the stream is smaller than the inline one (at this 3 x top-2
    # routing a segmented branch's ref weighs about what its arrays did: test_verifiers_stream's
    # test_stream_size_before_and_after measures a realistic shape)
    refs_bytes = sum(len(pack(d["set"]["info"][INFO_KEY])) for d in deltas
                     if INFO_KEY in ((d.get("set") or {}).get("info") or {}))
    assert byte_leaves(deltas) == [] and 0 < sizes["refpipe"] - refs_bytes < sizes["inline"]
    refs = [ref for e in served for ref in episode_refs(e)]
    # closed open branches: how many segments each has depends on how many turns one flush of the stream saw
    assert len(refs) == 4 and all(r.segments for r in refs)
    episodes = [orchestrator_episode(e, temperature=TEMPERATURE, policy_version=0, group_id="g") for e in served]
    assert [len(e.branches) for e in episodes] == [2, 2] and [e.reward for e in episodes] == [[1.0, 1.0], [0.0, 0.0]]
    orchestrator = Orchestrator(OrchestratorConfig(seq_len=30, group_size=2, groups_per_step=1), store, fields=FIELDS)
    for episode in episodes:
        orchestrator.submit(episode)
    header = orchestrator.build_step(0)
    orchestrator.shutdown()

    # the trainer's side: fetch its micro batches' chunks, assemble, compare with verifiers' inline arrays
    leaf_of = {ref.branch_id: (t.id, leaf) for e in served for t in e.traces
               for leaf, ref in read_refs(t.info, t.id).items()}
    inline = {(t.id, leaf): (np.asarray(b.token_ids, np.int32), num_prompt_tokens(b), b.routed_experts, b.sampling_mask)
              for e in inline_eps for t in e.traces for leaf, b in trainable_branches(t)}
    step = StepFile.read(store, 0)
    fetched = fetch_own(store, step, 0, FIELDS, max_concurrency=4)  # fetches and assembles, as a trainer rank
    assert not fetched.failed and fetched.chunks == 4
    checked = truncated = 0
    for mb in header.micro_batches_of(0):
        batch = fetched.assembled[mb.index]
        routed, mask = batch.fields["routed_experts"], batch.fields["sampling_mask"]
        ids_start = np.concatenate([[0], np.cumsum(mask.counts)])
        start = 0
        for s, seq in enumerate(mb.sequences):
            ref = header.refs[seq.ref]
            tokens, prompt, inline_routed, inline_mask = inline[leaf_of[ref.branch_id]]
            n, c = seq.num_tokens, seq.num_tokens - prompt
            assert np.array_equal(batch.streams["input_ids"][start:start + n], tokens[:n])
            assert same_bytes(routed.values[routed.cu_seqlens[s]:routed.cu_seqlens[s + 1]], inline_routed[:n])
            rows = slice(mask.cu_seqlens[s], mask.cu_seqlens[s + 1])
            assert same_bytes(mask.counts[rows], inline_mask.counts[prompt:prompt + c])
            kept_ids = int(inline_mask.counts[prompt:prompt + c].sum())
            assert same_bytes(mask.values[ids_start[rows.start]:ids_start[rows.stop]], inline_mask.ids[:kept_ids])
            start += n
            checked += 1
            truncated += n < ref.num_tokens
    assert checked == 4 and truncated == 2  # the 34-token branches keep their first 30 tokens

    trainer = Ledger(store, "trainer_dp0")
    trainer.delete(header.owned_refs(0), reason="trained step 0")
    trainer.record("release", step=0, dp_rank=0)
    trainer.close()
    report = audit(store, finished=True)
    n = len(chunk_ids(refs))  # the audit counts chunks: each segment of the four branches
    assert report.clean and (report.kept, report.shipped, report.deleted, report.present) == (n, n, n, 0)


def test_retried_attempts_are_deleted_once(local_config):
    store = open_store(local_config)
    streamed = {}

    def on_delta(delta):
        info = (delta.get("set") or {}).get("info") or {}
        if INFO_KEY in info:
            streamed[delta["trace"]] = list(read_refs(info, delta["trace"]).values())

    async def go():
        async with serving(refpipe_config(local_config), retries=1) as (_, client):
            return [await run(client, 3, "agent_retry", on_delta=on_delta),
                    await run(client, 4, "episode_retry", on_delta=on_delta)]

    episodes = asyncio.run(go())
    assert [t.id for e in episodes for t in e.traces] == ["s3-a1-retry", "s4-a2"]
    assert sorted(streamed) == ["s3-a1", "s3-a1-retry", "s4-a1", "s4-a2"]
    discarded = streamed["s3-a1"] + streamed["s4-a1"]
    final = [ref for e in episodes for ref in episode_refs(e)]
    assert final == streamed["s3-a1-retry"] + streamed["s4-a2"] and len(final) == len(discarded) == 4
    records = tombstones(store, discarded + final)
    assert sorted(records) == sorted(r.branch_id for r in discarded)
    assert sorted(r["reason"] for r in records.values()) == (
        ["discarded attempt: trace s3-a1 left the run (retried)"] * 2
        + ["discarded attempt: trace s4-a1 left the run (retried)"] * 2)
    assert payload_nodes(store) == chunk_ids(final)
    client = Ledger(store, "orchestrator")
    client.delete(final, reason="test: trained")
    client.close()
    report = audit(store, finished=True)
    assert report.clean and (report.kept, report.deleted, report.present, report.double_deletes) == (8, 8, 0, 0)


def test_cancelled_run_leaves_nothing(local_config):
    store = open_store(local_config)
    seen = asyncio.Event()
    streamed = []

    def on_delta(delta):
        info = (delta.get("set") or {}).get("info") or {}
        if INFO_KEY in info:
            streamed.extend(read_refs(info, delta["trace"]).values())
            seen.set()

    async def go():
        async with serving(refpipe_config(local_config)) as (_, client):
            task = asyncio.create_task(run(client, 5, "hang", on_delta=on_delta))
            await seen.wait()
            task.cancel()  # EnvClient asks the server to abort the run
            with pytest.raises(asyncio.CancelledError):
                await task
            async with asyncio.timeout(30):
                while payload_nodes(store):
                    await asyncio.sleep(0.05)

    asyncio.run(go())
    assert len(streamed) == 2 and payload_nodes(store) == set()
    assert {r["reason"] for r in tombstones(store, streamed).values()} == {"run abandoned: cancelled"}
    report = audit(store, finished=True)
    assert report.clean and (report.kept, report.deleted, report.present) == (2, 2, 0)


def test_failed_run_leaves_nothing(local_config):
    store = open_store(local_config)
    streamed = []

    def on_delta(delta):
        info = (delta.get("set") or {}).get("info") or {}
        streamed.extend(read_refs(info, delta["trace"]).values())

    async def go():
        async with serving(refpipe_config(local_config)) as (_, client):
            with pytest.raises(RuntimeError, match="env crashed after a trace completed"):
                await run(client, 6, "fail", on_delta=on_delta)
            claimed = tombstones(store, streamed)  # the reply came after the deletes (claimed)
            async with asyncio.timeout(30):  # the server's reaper removes their bytes after
                while payload_nodes(store):
                    await asyncio.sleep(0.05)
            return claimed

    claimed = asyncio.run(go())
    assert len(streamed) == 2 and sorted(claimed) == sorted(r.branch_id for r in streamed)
    assert {r["reason"] for r in claimed.values()} == {"run abandoned: failed: RuntimeError"}
    assert audit(store, finished=True).clean


def test_client_keeps_judges_out_and_refuses_inline_arrays(local_config):
    async def go():
        async with serving(None) as (_, vanilla), serving(refpipe_config(local_config)) as (_, refpipe):
            return await run(vanilla, 7), await run(refpipe, 7, "judged")

    inline_ep, judged = asyncio.run(go())
    with pytest.raises(EpisodeError, match="carry side channels inline.*RefpipeEnvServer"):
        orchestrator_episode(inline_ep, temperature=TEMPERATURE, policy_version=0)
    episode = orchestrator_episode(judged, temperature=TEMPERATURE, policy_version=3)
    assert [t.agent.trainable for t in judged.traces] == [False, True]
    assert INFO_KEY not in judged.traces[0].info
    refs = episode_refs(judged)
    assert [b.ref for b in episode.branches] == refs and len(refs) == 2
    assert {(b.temperature, b.policy_version) for b in episode.branches} == {(TEMPERATURE, 3)}
    assert [(len(b.prompt_ids), len(b.completion_ids)) for b in episode.branches] == [
        (r.num_prompt_tokens, r.num_completion_tokens) for r in refs]
