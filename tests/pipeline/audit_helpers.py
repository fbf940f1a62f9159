"""Helpers of the audit tests: tiny kept chunks, step files, trainer ranks, and crash scenarios.

Imported by the ``test_audit*`` modules next to it and by ``tests/cli/test_ledger_cli.py``. Run as a script
it plays one crash scenario in a real process:

    python -m tests.pipeline.audit_helpers SCENARIO ROOT RUN_ID [S3_ENDPOINT]

It prints one JSON line ``{"ready": true, ...}`` naming the chunks it expects to be
orphaned and protected, then sleeps until it is killed (SIGKILL by the test).
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.pipeline.step_file import StepFile, publish_step_file
from refpipe.pipeline.step_header import SCHEMA_VERSION, STREAMS, MicroBatchRecord, SequenceRecord, StepHeader
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.config import StorageConfig
from refpipe.storage.ledger import Ledger
from refpipe.storage.store import Store

FIELDS = FieldsConfig(logprobs_k=2)
NUM_PROMPT, NUM_COMPLETION = 2, 3


def keep(keeper: Keeper, seed: int) -> PayloadRef:
    """Keep one tiny branch (2 prompt + 3 completion tokens, top-2 logprob head) with values from ``seed``."""
    rng = np.random.default_rng(seed)
    fields = {"topk_ids": rng.integers(0, 50, (NUM_COMPLETION, 2), dtype=np.int32),
              "topk_logprobs": -rng.random((NUM_COMPLETION, 2), dtype=np.float32)}
    return keeper.keep(Branch(NUM_PROMPT, NUM_COMPLETION, fields))


def make_keeper(store: Store, config: StorageConfig, actor: str = "env_worker_0") -> Keeper:
    """An env-server worker's keeper with its own ledger session."""
    return Keeper(store, Ledger(store, actor), FIELDS, config)


def publish(store: Store, step: int, refs: list[PayloadRef], owners: list[int], *, dp_world_size: int = 2,
            borrow: tuple[int, int] | None = None) -> StepHeader:
    """Publish step ``step``: DP rank r gets one micro batch with the refs it owns (whole).

    ``borrow=(ref_index, dp_rank)`` adds a 1-token padding dummy on ``dp_rank`` borrowing that ref's rows.
    """
    per_rank: list[list[SequenceRecord]] = [[] for _ in range(dp_world_size)]
    for i, (ref, owner) in enumerate(zip(refs, owners)):
        per_rank[owner].append(SequenceRecord(num_tokens=ref.num_tokens, env_name="t", ref=i))
    if borrow:
        per_rank[borrow[1]].append(SequenceRecord(num_tokens=1, env_name="t", ref=borrow[0], borrowed=True))
    seq_len = 1 + max(sum(s.num_tokens for s in seqs) for seqs in per_rank)
    mbs, streams = [], {}
    for rank, seqs in enumerate(per_rank):
        seqs = seqs or [SequenceRecord(num_tokens=1, env_name="t")]
        mb = MicroBatchRecord(dp_rank=rank, index=0, sequences=seqs, has_routing=False,
                              num_padding_tokens=seq_len - sum(s.num_tokens for s in seqs))
        mbs.append(mb)
        streams[(rank, 0)] = {name: np.zeros(mb.num_tokens, dtype) for name, dtype in STREAMS.items()}
    header = StepHeader(schema_version=SCHEMA_VERSION, run_uri=store.prefix.uri, step=step, seq_len=seq_len,
                        dp_world_size=dp_world_size, micro_batches=mbs, refs=refs, owners=owners, fields=FIELDS)
    publish_step_file(store, header, streams)
    return header


def fetch_step(store: Store, step: int, dp_rank: int) -> int:
    """What trainer rank ``dp_rank`` reads of step ``step``: every chunk of its micro batches; returns the count."""
    header = StepFile.read(store, step).header
    used = [s for mb in header.micro_batches_of(dp_rank) for s in mb.sequences if s.ref is not None]
    for seq in used:
        fetch_arrays(store, header.refs[seq.ref], seq.num_tokens)
    return len(used)


def release_step(store: Store, ledger: Ledger, step: int, dp_rank: int) -> None:
    """What trainer rank ``dp_rank`` does after training a step: delete its owned refs, record the release; then wait
    until its ledger's reaper removed their bytes, so what follows sees the run at rest."""
    refs = StepFile.read(store, step).header.owned_refs(dp_rank)
    if refs:
        ledger.release(step, refs, reason=f"trainer dp_rank={dp_rank} step {step}")
    ledger.record("release", step=step, dp_rank=dp_rank)
    ledger.flush()
    ledger.wait_freed()


def train(store: Store, ledgers: list[Ledger], step: int) -> None:
    """Every DP rank fetches step ``step``, then each deletes and releases its share."""
    for rank in range(len(ledgers)):
        fetch_step(store, step, rank)
    for rank, ledger in enumerate(ledgers):
        release_step(store, ledger, step, rank)


def chunks(store: Store) -> set[str]:
    """URIs of every chunk node present under ``payloads/`` (committed or not)."""
    return {store.uri(k.rpartition("/")[0]) for k in store.list_prefix("payloads")}


def snapshot(store: Store, refs: list[PayloadRef]) -> dict[str, bytes]:
    """Every stored byte of ``refs``' chunks (data and ``zarr.json``), by key."""
    keys = [f"{store.prefix.key_of(r.uri)}/{name}" for r in refs for name in ("c.0", "zarr.json")]
    return {k: store.get(k) for k in keys}


def _history(store: Store, config: StorageConfig) -> tuple[Keeper, Ledger, list[Ledger], list[PayloadRef]]:
    """A run's first step, done properly: keep a0..a3, receive them, ship a0 a1 as step 0
    (a1 borrowed by rank 0), delete a2 (filtered), train step 0. a3 stays queued."""
    keeper = make_keeper(store, config)
    orchestrator = Ledger(store, "orchestrator")
    trainers = [Ledger(store, f"trainer_dp{r}") for r in range(2)]
    a = [keep(keeper, seed) for seed in range(4)]
    orchestrator.record("receive", episode_id="e0", group_id="g0", branch_ids=[r.branch_id for r in a])
    publish(store, 0, a[:2], [0, 1], borrow=(1, 0))
    orchestrator.delete([a[2]], reason="orchestrator filtered_group")
    orchestrator.flush()
    train(store, trainers, 0)
    return keeper, orchestrator, trainers, a


def scenario(name: str, config: StorageConfig) -> dict:
    """Play ``name`` up to its crash point; return the chunk URIs it expects orphaned, and the
    refs (as JSON) of the chunks that untrained step files hold."""
    store = open_store(config)
    keeper, orchestrator, trainers, a = _history(store, config)
    b = [keep(keeper, 10 + seed) for seed in range(5)]
    if name == "keep-ship":  # b0..b4 kept, never shipped; a3 queued
        return {"orphans": [r.uri for r in [a[3], *b]], "protected": []}
    orchestrator.record("receive", episode_id="e1", group_id="g1", branch_ids=[r.branch_id for r in b])
    publish(store, 1, [a[3], b[0]], [1, 0], borrow=(0, 0))
    if name == "ship-fetch":  # step 1 published, no rank fetched it; b1..b4 queued
        return {"orphans": [r.uri for r in b[1:]], "protected": _dump([a[3], b[0]])}
    publish(store, 2, [b[1], b[2]], [0, 1])
    publish(store, 3, [b[3]], [1])
    for rank in range(2):
        fetch_step(store, 1, rank)
    # fetch-delete: both ranks fetched step 1 and died before deleting; steps 2, 3 published ahead; b4 queued
    return {"orphans": [b[4].uri], "protected": _dump([a[3], b[0], b[1], b[2], b[3]])}


def _dump(refs: list[PayloadRef]) -> list[dict]:
    return [json.loads(r.model_dump_json()) for r in refs]


if __name__ == "__main__":
    scenario_name, root, run_id = sys.argv[1:4]
    endpoint = sys.argv[4] if len(sys.argv) > 4 else None
    expected = scenario(scenario_name, StorageConfig(root=root, run_id=run_id, s3_endpoint_url=endpoint))
    print(json.dumps({"ready": True, **expected}), flush=True)
    while True:
        time.sleep(60)
