"""Trainer ranks as real processes (torch.distributed, gloo on 127.0.0.1): byte identity and faults.

Each test starts one world and runs several steps in it, each step a scenario prepared on
the store beforehand; the ranks write what they trained and what they measured, and the
test checks every rank's tensors, decisions and metrics, and exactly which chunks remain.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np

from refpipe.pipeline.fields import spread_expert_rows
from refpipe.pipeline.step_file import StepFile
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.layout import chunk_keys, release_key
from refpipe.storage.ledger_records import delete_record_of
from refpipe.trainer.fetch import fetch_own
from tests.helpers.children import module_argv, module_env
from tests.helpers.fault_proxy import Fault, FaultProxy
from tests.helpers.ports import free_port
from tests.helpers.step_file import forge_header
from tests.trainer.trainer_helpers import (
    FIELDS,
    Seq,
    assert_same,
    build_step,
    expected_micro_batch,
    forge_rows,
    keep_all,
    make_branch,
)

SEQ_LEN = 24
WORKER = "tests.trainer.dist_worker"
PULL_WORKER = "tests.trainer.pull_worker"


def _layout(s: int) -> list[list[list[Seq]]]:
    """Step ``s``: 2 DP ranks x 3 micro batches; branch names are ``s<s>_<x>``."""
    n = lambda x: f"s{s}_{x}"  # noqa: E731
    return [
        [[Seq(n("a"), 11), Seq(n("b"), 9), Seq(n("f"), 4)],             # a cut in its completion, f routing only
         [Seq(n("g"), 10), Seq(n("h"), 7)],                            # padding 7
         [Seq(n("c"), 8), Seq(None, 5), Seq(n("d"), 6), Seq(n("e"), 3)]],  # no routing: with and without arrays
        [[Seq(n("a"), 14, borrowed=True), Seq(n("i"), 6)],              # borrows a (owned by DP 0)
         [Seq(n("j"), 12)],                                             # j cut: ranged reads
         [Seq(n("k"), 11), Seq(None, 4)]],
    ]


def _branches(s: int, rng) -> dict:
    shapes = {"a": (5, 9, True), "b": (3, 6, True), "f": (2, 3, True), "g": (4, 8, True), "h": (3, 4, True),
              "c": (4, 7, False), "d": (1, 5, False), "e": (6, 4, False), "i": (2, 4, True), "j": (5, 9, True),
              "k": (4, 7, False)}
    return {f"s{s}_{x}": make_branch(rng, p, c, f"s{s}_{x}", routing=r, completion=(x != "f"))
            for x, (p, c, r) in shapes.items()}


def run_world(tmp_path: Path, storage: StorageConfig, world_size: int, model_parallel_size: int, steps: list[int],
              exit_before: dict[str, list[int]] | None = None, fetch_raises: dict[str, str] | None = None,
              default_backend: str = "gloo", worker: str = WORKER, **extra) -> dict:
    """Start ``world_size`` ranks of ``worker`` (``extra``: more of its spec), wait for all; return
    ``{(step, rank): (result, arrays)}``."""
    return collect_world(*start_world(tmp_path, storage, world_size, model_parallel_size, steps, exit_before,
                                      fetch_raises, default_backend, worker, **extra))


def start_world(tmp_path: Path, storage: StorageConfig, world_size: int, model_parallel_size: int, steps: list[int],
                exit_before: dict[str, list[int]] | None = None, fetch_raises: dict[str, str] | None = None,
                default_backend: str = "gloo", worker: str = WORKER, **extra) -> tuple[Path, list[subprocess.Popen]]:
    """Start ``world_size`` ranks of ``worker`` writing into ``tmp_path/ranks``; the directory and the processes."""
    out = tmp_path / "ranks"
    out.mkdir()
    spec = {"out_dir": str(out), "world_size": world_size, "init_method": f"tcp://127.0.0.1:{free_port()}",
            "storage": storage.model_dump(), "fields": FIELDS.model_dump(), "steps": steps,
            "exit_before": exit_before or {}, "fetch_raises": fetch_raises or {}, "default_backend": default_backend,
            "trainer": {"model_parallel_size": model_parallel_size, "step_timeout_s": 30, "step_poll_s": 0.1,
                        "collective_timeout_s": 20, "release": "after_step"}, **extra}
    (out / "spec.json").write_text(json.dumps(spec))
    env = module_env({**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"})
    return out, [subprocess.Popen(module_argv(worker, out / "spec.json", r), env=env,
                                  stderr=open(out / f"rank{r}.log", "w")) for r in range(world_size)]


def collect_world(out: Path, procs: list[subprocess.Popen]) -> dict:
    """Wait for every rank of ``start_world``; ``{(step, rank): (result, arrays)}`` of what they wrote."""
    world_size = len(procs)
    try:
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join((out / f"rank{r}.log").read_text()[-3000:] for r in range(world_size))
    assert all(c in (0, 3) for c in codes), f"exit codes {codes}\n{logs}"
    results = {}
    for path in out.glob("step*_rank*.json"):
        step, rank = (int(x) for x in path.stem.removeprefix("step").split("_rank"))
        with np.load(path.with_suffix(".npz")) as z:
            results[(step, rank)] = (json.loads(path.read_text()), dict(z))
    for path in out.glob("finish_rank*.json"):
        results[("finish", int(path.stem.removeprefix("finish_rank")))] = json.loads(path.read_text())
    return results


def _micro_batch(arrays: dict, index: int) -> dict:
    prefix = f"mb{index}."
    return {k[len(prefix):]: v for k, v in arrays.items() if k.startswith(prefix)}


def _check_trained(built, results, step: int, world_size: int, mp: int, dropped: set[tuple[int, int]],
                   stand_in_rows: dict[tuple[int, int], np.ndarray | None]) -> dict:
    """Every rank's tensors: fetched micro batches byte-identical, dropped ones shape-only; peers agree."""
    for rank in range(world_size):
        result, arrays = results[(step, rank)]
        dp = rank // mp
        assert result["dp_rank"] == dp and "error" not in result, result
        assert result["dropped"] == [(dp, i) in dropped for i in range(3)]
        for i in range(3):
            got = _micro_batch(arrays, i)
            if (dp, i) not in dropped:
                assert_same(got, expected_micro_batch(built, dp, i), widened=True)
                continue
            assert not got["stream.loss_mask"].any()
            assert got["stream.input_ids"][:built.header.micro_batches_of(dp)[i].num_tokens].tolist() == \
                built.streams[(dp, i)]["input_ids"].tolist()
            assert all(len(got[f"field.{f}.values"]) == 0 and (got[f"field.{f}.row_ids"] == -1).all()
                       for f in ("topk_ids", "topk_logprobs", "sample_support", "sampling_mask"))
            if (dp, i) in stand_in_rows:
                rows = stand_in_rows[(dp, i)]
                want = (spread_expert_rows(SEQ_LEN, 2, 2, 8, np.uint8) if rows is None
                        else np.resize(rows, (SEQ_LEN, 2, 2)))
                assert got["field.routed_experts.padded"].tobytes() == want.tobytes()
        peer = results[(step, rank - rank % mp)][1]
        assert sorted(arrays) == sorted(peer) and all(arrays[k].tobytes() == peer[k].tobytes() for k in arrays)
    metrics = [results[(step, r)][0]["metrics"] for r in range(world_size)]
    assert all(m == metrics[0] for m in metrics)
    return metrics[0]


def _routing(built, name: str, n: int) -> np.ndarray:
    return built.branches[name].fields["routed_experts"][:n]


def _release_events(store) -> list[tuple[int, int, str]]:
    events = []
    for key in store.list_prefix("ledger/events"):
        if key.startswith("ledger/events/trainer_dp"):
            for line in store.get(key).decode().splitlines():
                e = json.loads(line)
                if e["event"] == "release":
                    events.append((e["step"], e["dp_rank"], e["actor"]))
    return sorted(events)


def test_two_dp_ranks_of_two_peers_train_identical_bytes_and_survive_faults(tmp_path, local_config):
    """4 ranks (2 DP x 2 model-parallel): clean, missing, corrupt, a raising fetch, nothing fetchable, a dead rank."""
    store = open_store(local_config)
    rng = np.random.default_rng(11)
    built = {}
    for s in range(6):
        branches = _branches(s, rng)
        refs = keep_all(store, local_config, branches)
        built[s] = build_step(store, s, SEQ_LEN, _layout(s), branches, refs, rng)
    # step 0 (clean) as one process fetches it before the world starts: bytes read and replay hashes per DP rank
    alone = {dp: fetch_own(store, StepFile.read(store, 0), dp, FIELDS, max_concurrency=1) for dp in range(2)}
    ref_of = lambda s, x: built[s].refs[f"s{s}_{x}"]  # noqa: E731
    store.delete_keys(list(chunk_keys(ref_of(1, "g").key)))                       # step 1: g gone (DP 0 mb 1)
    k_data = chunk_keys(ref_of(2, "k").key)[0]                               # step 2: k bit-flipped (whole read)
    data = bytearray(store.get(k_data))
    data[40] ^= 0x01
    store.put(k_data, bytes(data))
    j_data = chunk_keys(ref_of(2, "j").key)[0]                               # step 2: j truncated (ranged read)
    store.put(j_data, store.get(j_data)[:30])
    store.delete_keys([chunk_keys(ref.key)[0] for ref in built[4].header.refs])   # step 4: every chunk's data gone

    # step 3: DP 1's fetch of ref i raises TypeError, as a bug would (no valid ref makes a store raise untyped)
    # No retries: a missing chunk would be retried (KeyNotFoundError) by the prefetch of the next step, and a
    # step's "retries" counts whatever retried in its window, so its split between steps would follow thread
    # timing. Retries are checked, summed over every step, by the S3 test below.
    started = time.monotonic()
    results = run_world(tmp_path, local_config.model_copy(update={"max_retries": 0}), 4, 2, list(range(6)),
                        exit_before={"3": [5]}, fetch_raises={"s3_i": "TypeError"})
    world_s = time.monotonic() - started

    # Every step file is there before the world starts, so steps 1-4 are fetched in the background while the
    # step before trains (prefetched_ranks == 4) and their faults are dropped exactly as step 0's would be.
    # A step's release runs while the next one trains (and may queue behind the one before it): step s's metrics
    # count step s-2's deletes. Every rank ran exactly two collectives on the data group per step (the failure
    # all-reduce and one metrics all-gather; step 4 stopped after its all-reduce).
    assert [[results[(s, r)][0]["collectives"] for r in range(4)] for s in range(5)] == [[2] * 4] * 4 + [[1] * 4]
    n_refs = len(built[0].header.refs)  # 11; DP 0 uses 8 (a b f g h c d e), DP 1 uses 4 (a i j k)
    m0 = _check_trained(built[0], results, 0, 4, 2, set(), {})
    timing = {k: m0.pop(k) for k in ("fetch_seconds_mean", "fetch_seconds_max", "exposed_data_seconds_mean",
                                      "exposed_data_seconds_max", "step_wait_seconds_max")}
    # each model-parallel peer reads its DP rank's rows (the bytes one process read alone), the hashes are the
    # micro batches as one process assembles them, [DP rank][micro batch]
    assert [[len(alone[dp].hashes), alone[dp].nbytes] for dp in range(2)] == [[3, 1448], [3, 1260]]
    assert m0 == {"step": 0, "micro_batches": 6, "dropped_micro_batches": 0, "fetched_chunks": 2 * (8 + 4),
                  "fetched_bytes": 2 * (1448 + 1260), "prefetched_ranks": 0, "failed_fetches": 0, "retries": 0,
                  "deletes": 0, "delete_problems": 0, "delete_failures": 0, "skipped": False,
                  "micro_batch_hashes": [[alone[dp].hashes[i] for i in range(3)] for dp in range(2)]}
    assert len({h for dp in m0["micro_batch_hashes"] for h in dp}) == 6
    # measured seconds of 4 ranks: a mean between a quarter of the max and the max, all within the world's life
    for name in ("fetch_seconds", "exposed_data_seconds"):
        mean, most = timing[f"{name}_mean"], timing[f"{name}_max"]
        assert 0 < most / 4 <= mean <= most < world_s, (name, timing, world_s)
    assert 0 <= timing["step_wait_seconds_max"] < world_s
    mb0_rows = np.concatenate([_routing(built[1], f"s1_{x}", n) for x, n in (("a", 11), ("b", 9), ("f", 4))])
    m1 = _check_trained(built[1], results, 1, 4, 2, {(0, 1)}, {(0, 1): mb0_rows})
    assert (m1["dropped_micro_batches"], m1["failed_fetches"], m1["fetched_chunks"]) == (1, 2, 2 * (7 + 4))
    assert (m1["prefetched_ranks"], m1["deletes"], m1["delete_problems"]) == (4, 0, 0)
    dp1_rows = np.concatenate([_routing(built[2], "s2_a", 14), _routing(built[2], "s2_i", 6)])
    m2 = _check_trained(built[2], results, 2, 4, 2, {(1, 1), (1, 2)}, {(1, 1): dp1_rows})
    assert (m2["dropped_micro_batches"], m2["failed_fetches"], m2["prefetched_ranks"]) == (2, 4, 4)
    assert (m2["deletes"], m2["delete_problems"]) == (n_refs, 0)  # step 0's
    m3 = _check_trained(built[3], results, 3, 4, 2, {(1, 0), (1, 1), (1, 2)}, {(1, 0): None, (1, 1): None})
    # DP 1's other 3 chunks were read before its fetch raised; the raise still fails all of DP 1's micro batches
    assert (m3["dropped_micro_batches"], m3["failed_fetches"], m3["fetched_chunks"]) == (3, 2, 22)
    # step 1's: its g was never there to delete
    assert (m3["prefetched_ranks"], m3["deletes"], m3["delete_problems"]) == (4, n_refs - 1, 1)
    assert m3["delete_failures"] == 0
    for rank in range(4):
        result = results[(4, rank)][0]
        assert result["error"] == "FetchError" and "step 4: none of its 6 micro batches" in result["message"]
    for rank in range(3):
        assert results[(5, rank)][0]["error"] in ("DistBackendError", "RuntimeError"), results[(5, rank)][0]
    assert (5, 3) not in results and not any(key[0] == "finish" for key in results)

    assert set(store.list_prefix("payloads")) == {chunk_keys(r.key)[1] for r in built[4].header.refs} | {
        k for r in built[5].header.refs for k in chunk_keys(r.key)}
    for s in range(6):  # a tombstone for every chunk released, except g (never there to claim)
        assert all((delete_record_of(store, r.branch_id) is not None) == (s < 4 and r.branch_id != "s1_g")
                   for r in built[s].header.refs), s
    assert _release_events(store) == [(s, dp, f"trainer_dp{dp}") for s in range(4) for dp in range(2)]


def test_two_ranks_on_s3_retry_throttled_reads_and_failed_background_deletes(tmp_path, s3_endpoint, s3_bucket):
    """2 ranks (2 DP x 1), 2 steps on S3 behind a proxy that answers 503 SlowDown to every chunk's first GET and
    reports a per-key AccessDenied (permanent: not retried by the store) for chunk s0_b's c.0 in the first
    DeleteObjects naming it (DP 0 owns s0_b; the batch's other keys are deleted): that one delete of DP 0's background
    release of step 0 fails, is recorded, and is retried with its own claim (no double delete) before step 1's
    release."""
    writer_cfg = StorageConfig(root=f"s3://{s3_bucket}/prefix", run_id="run_1", s3_endpoint_url=s3_endpoint)
    store = open_store(writer_cfg)
    rng = np.random.default_rng(5)
    built = _built_steps(store, writer_cfg, rng, 2)
    with FaultProxy(s3_endpoint, Fault("slowdown", "GET", r"/c\.0$"),
                    Fault("key_error", "POST", r"/s0_b/c\.0$", code="AccessDenied")) as proxy:
        trainer_cfg = writer_cfg.model_copy(update={"s3_endpoint_url": proxy.url, "retry_backoff_s": 0.01})
        results = run_world(tmp_path, trainer_cfg, 2, 1, [0, 1])
    m0 = _check_trained(built[0], results, 0, 2, 1, set(), {})
    m1 = _check_trained(built[1], results, 1, 2, 1, set(), {})
    final = results[("finish", 0)]
    assert results[("finish", 1)] == final
    # one 503 per chunk read: DP 0 and DP 1 both read a (only the first read is throttled); e is kept to 3 of its 6
    # prompt tokens and carries no routing, so it has no rows to read: its one GET is of its last 4 bytes, its crc32c
    # (a read of no rows still checks the chunk is there), one per step
    assert proxy.hits == {"slowdown": 22, "key_error": 1}
    assert all((m["dropped_micro_batches"], m["fetched_chunks"]) == (0, 12) for m in (m0, m1))
    assert m1["prefetched_ranks"] == 2
    # the 503s were retried by the store, in whichever step's window they fell: step 1's reads are prefetched
    # while step 0 trains; a permanent per-key DeleteObjects error is not retried by the store but by the release
    assert m0["retries"] + m1["retries"] + final["retries"] == 22
    assert (m0["deletes"], m0["delete_failures"]) == (0, 0)
    assert (m1["deletes"], m1["delete_failures"], m1["delete_problems"]) == (0, 0, 0)  # step 0's release: pending
    # step 0's release (10 deleted, 1 failed), then step 1's (step 0's failed one retried first, then its 11)
    assert (final["deletes"], final["delete_failures"], final["delete_problems"]) == (10 + 1 + 11, 1, 0)
    assert store.list_prefix("payloads") == []
    # on S3 each DP rank's release of a step is one release record (``Ledger.release``), the retry kept its claim
    assert store.list_prefix("ledger/deletes") == [release_key(s, f"trainer_dp{r}") for s in range(2) for r in range(2)]
    assert all(delete_record_of(store, r.branch_id, s) is not None for s in range(2) for r in built[s].header.refs)
    assert _release_events(store) == [(0, 0, "trainer_dp0"), (0, 1, "trainer_dp1"), (1, 0, "trainer_dp0"),
                                      (1, 1, "trainer_dp1")]
    failed = [json.loads(line) for key in store.list_prefix("ledger/events/trainer_dp0")
              for line in store.get(key).decode().splitlines() if '"delete_failed"' in line]
    assert [(e["step"], e["chunks"]) for e in failed] == [(0, 1)]


def test_the_data_path_runs_on_its_own_gloo_group_beside_the_default_group(tmp_path, local_config):
    """The default group is torch's ``fake`` backend (combines nothing, as an NCCL world cannot take the data
    path's CPU tensors); DP 0's missing chunk still drops its micro batch on DP 1's rank, which learns of it only
    through the failure all-reduce, and the metrics sum both ranks: both ran on ``TrainerRank``'s gloo group."""
    store = open_store(local_config)
    rng = np.random.default_rng(5)
    branches = _branches(0, rng)
    built = build_step(store, 0, SEQ_LEN, _layout(0), branches, keep_all(store, local_config, branches), rng)
    store.delete_key(chunk_keys(built.refs["s0_g"].key)[0])  # g: only DP 0's micro batch 1 uses it
    results = run_world(tmp_path, local_config, 2, 1, [0], default_backend="fake")
    m0 = _check_trained(built, results, 0, 2, 1, {(0, 1)}, {(0, 1): np.concatenate(
        [_routing(built, f"s0_{x}", n) for x, n in (("a", 11), ("b", 9), ("f", 4))])})
    assert (m0["dropped_micro_batches"], m0["failed_fetches"], m0["fetched_chunks"]) == (1, 1, 7 + 4)


def _built_steps(store, config: StorageConfig, rng, num_steps: int) -> dict:
    """Steps ``0..num_steps-1`` of ``_layout``, their branches kept and step files published: step -> built step."""
    built = {}
    for s in range(num_steps):
        branches = _branches(s, rng)
        built[s] = build_step(store, s, SEQ_LEN, _layout(s), branches, keep_all(store, config, branches), rng)
    return built


def _three_steps(store, config: StorageConfig, rng) -> dict:
    """Steps 0-2 of ``_layout``: step 1 without g's chunk (DP 0's micro batch 1), step 2 without any chunk's data."""
    built = _built_steps(store, config, rng, 3)
    store.delete_keys(list(chunk_keys(built[1].refs["s1_g"].key)))
    store.delete_keys([chunk_keys(ref.key)[0] for ref in built[2].header.refs])
    return built


def test_the_pull_loop_through_a_data_loader_trains_and_fails_as_run_step_does(tmp_path, local_config):
    """2 ranks pull steps 0-2 from ``DataLoader(StepDataset(rank, 3), batch_size=None)`` and release each after
    "training": the same bytes, drops, collectives (two per step), metrics and releases as ``run_step``'s; a second
    release is refused; step 2 (nothing fetchable) stops the loop with ``FetchError`` on both ranks."""
    store = open_store(local_config)
    built = _three_steps(store, local_config, np.random.default_rng(3))
    results = run_world(tmp_path, local_config.model_copy(update={"max_retries": 0}), 2, 1, [], worker=PULL_WORKER,
                        stop=3, data_loader=True)
    assert [[results[(s, r)][0]["collectives"] for r in range(2)] for s in range(3)] == [[2, 2], [2, 2], [1, 1]]
    m0 = _check_trained(built[0], results, 0, 2, 1, set(), {})
    assert (m0["dropped_micro_batches"], m0["fetched_chunks"], m0["prefetched_ranks"]) == (0, 8 + 4, 0)
    mb0_rows = np.concatenate([_routing(built[1], f"s1_{x}", n) for x, n in (("a", 11), ("b", 9), ("f", 4))])
    m1 = _check_trained(built[1], results, 1, 2, 1, {(0, 1)}, {(0, 1): mb0_rows})
    assert (m1["dropped_micro_batches"], m1["failed_fetches"], m1["prefetched_ranks"]) == (1, 1, 2)
    for rank in range(2):
        assert [results[(s, rank)][0]["replayed"] for s in (0, 1)] == [False, False]
        assert results[(1, rank)][0]["release_again"] == (
            f"StepOrderError: step 1 was already released on rank {rank}: release() is called once per step, after "
            f"the optimizer step")
        assert results[(2, rank)][0]["error"] == "FetchError"
        assert results[(2, rank)][0]["message"].startswith("step 2: none of its 6 micro batches could be fetched")
        assert results[(2, rank)][0]["then"] == (
            f"StepOrderError: the pull loop of rank {rank} ended at step 2, which failed to open (FetchError: "
            f"{results[(2, rank)][0]['message']}); restart the trainer (resume_plan) to go on")
    assert _release_events(store) == [(s, dp, f"trainer_dp{dp}") for s in range(2) for dp in range(2)]
    assert all((delete_record_of(store, r.branch_id) is not None) == (s < 2 and r.branch_id != "s1_g")
               for s in range(3) for r in built[s].header.refs)


def test_the_pull_loop_refuses_the_next_step_before_the_previous_one_is_released_and_goes_on(tmp_path,
                                                                                             local_config):
    """Each rank asks for step 1 before releasing step 0: refused with ``StepOrderError``, and the loop goes on once
    step 0 is released (before, the refusal ended the generator: the next ``next()`` was a bare StopIteration and
    training ended with no error). Step 2 (nothing fetchable) fails to open; every ``next()`` after it raises
    ``StepOrderError`` naming that failure, never a silent end."""
    store = open_store(local_config)
    built = _three_steps(store, local_config, np.random.default_rng(4))
    results = run_world(tmp_path, local_config, 2, 1, [], worker=PULL_WORKER, stop=3, data_loader=False,
                        next_before_release=0)
    for rank in range(2):
        assert results[(0, rank)][0]["next_before_release"] == (
            f"StepOrderError: step 0 was not released on rank {rank} before the next step was asked for: call "
            f"release() after the step's optimizer step, on every rank")
        assert [(results[(s, rank)][0]["dropped"], results[(s, rank)][0]["collectives"]) for s in (0, 1)] == [
            ([False] * 3, 2), ([False, True, False] if rank == 0 else [False] * 3, 2)]
        failed = results[(2, rank)][0]
        assert failed["error"] == "FetchError"
        assert failed["then"] == (
            f"StepOrderError: the pull loop of rank {rank} ended at step 2, which failed to open (FetchError: "
            f"{failed['message']}); restart the trainer (resume_plan) to go on")
    assert _release_events(store) == [(s, dp, f"trainer_dp{dp}") for s in range(2) for dp in range(2)]
    assert all((delete_record_of(store, r.branch_id) is not None) == (s < 2 and r.branch_id != "s1_g")
               for s in range(3) for r in built[s].header.refs)


def test_a_restart_after_one_dp_rank_released_a_step_trains_none_of_it_again(tmp_path, local_config):
    """Life 1 pulls steps 0-3 (step 0 retained, the others deleted after training) and is SIGKILLed once DP 0
    released step 1 and DP 1 had not. Life 2 restarts from the initial weights (``checkpoint_step=-1``) through
    ``resume_plan``: step 0 (chunks retained) is replayed; step 1 is skipped on both DP ranks, so DP 1's samples of
    it are not trained a second time and DP 0's missing chunks are never read: no ``ChunkNotFoundError``, and the
    prefetch after step 0 fetches step 2 (before, a restart re-ran step 1: ``ChunkNotFoundError ... (read 5
    times)`` for each of DP 0's chunks, DP 0's micro batches dropped, DP 1's trained again)."""
    store = open_store(local_config)
    rng = np.random.default_rng(8)
    built = _built_steps(store, local_config, rng, 4)
    trainer = {"step_timeout_s": 30, "step_poll_s": 0.1, "collective_timeout_s": 20, "retain_steps": [0],
               "release": "after_step"}
    (tmp_path / "life1").mkdir()
    out, procs = start_world(tmp_path / "life1", local_config, 2, 1, [], worker=PULL_WORKER, stop=4,
                             data_loader=False, pause=[1, 1], trainer=trainer)
    deadline = time.monotonic() + 120
    while not ((out / "paused").exists() and (1, 0, "trainer_dp0") in _release_events(store)):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, "life 1 never paused"
        time.sleep(0.1)
    for p in procs:
        p.kill()
        p.wait()
    assert _release_events(store) == [(0, 0, "trainer_dp0"), (0, 1, "trainer_dp1"), (1, 0, "trainer_dp0")]

    (tmp_path / "life2").mkdir()
    out, procs = start_world(tmp_path / "life2", local_config, 2, 1, [], worker=PULL_WORKER, stop=4,
                             data_loader=False, checkpoint_step=-1, trainer=trainer)
    results = collect_world(out, procs)
    for rank in range(2):
        plan = json.loads((out / f"plan_rank{rank}.json").read_text())
        assert plan == {"start_step": 0, "skipped": [1], "replayed": [0, 2, 3]}
        assert "ChunkNotFoundError" not in (out / f"rank{rank}.log").read_text()
    assert sorted(key for key in results) == [(s, r) for s in (0, 2, 3) for r in range(2)]
    assert all(results[key][0]["replayed"] for key in results)
    _check_trained(built[0], results, 0, 2, 1, set(), {})
    m2 = _check_trained(built[2], results, 2, 2, 1, set(), {})
    assert (m2["prefetched_ranks"], m2["dropped_micro_batches"], m2["failed_fetches"]) == (2, 0, 0)
    _check_trained(built[3], results, 3, 2, 1, set(), {})
    assert _release_events(store) == sorted([(0, 0, "trainer_dp0"), (0, 1, "trainer_dp1")] * 2 + [
        (s, dp, f"trainer_dp{dp}") for s in (1, 2, 3) for dp in range(2)])
    assert all((delete_record_of(store, r.branch_id) is not None) == (s > 0)
               for s in range(4) for r in built[s].header.refs)


def test_one_inconsistent_ref_drops_only_its_micro_batch_on_every_rank(tmp_path, local_config):
    """2 ranks (2 DP x 1). Step 0: DP 1's micro batch 2 keeps 12 tokens of k, which holds 11 (a slice longer than
    its chunk); step 1: h declares 6 routing rows against its 7 tokens (DP 0's micro batch 1). Each made its whole
    step file a ``StepFileError`` on every rank; now that micro batch alone is dropped on every rank and counted,
    the others train byte for byte, and every chunk (the inconsistent ones too) is released once."""
    store = open_store(local_config)
    rng = np.random.default_rng(13)
    built = {}
    for s in range(2):
        layout = _layout(s)
        if s == 0:
            layout[1][2] = [Seq("s0_k", 12), Seq(None, 4)]
        branches = _branches(s, rng)
        built[s] = build_step(store, s, SEQ_LEN, layout, branches, keep_all(store, local_config, branches), rng)
    h = next(i for i, ref in enumerate(built[1].header.refs) if ref.branch_id == "s1_h")
    forge_header(store, 1, lambda header: forge_rows(header, h, "routed_experts", 6))
    results = run_world(tmp_path, local_config, 2, 1, [0, 1])
    m0 = _check_trained(built[0], results, 0, 2, 1, {(1, 2)}, {})
    assert (m0["dropped_micro_batches"], m0["failed_fetches"], m0["fetched_chunks"]) == (1, 1, 8 + 3)  # k unread
    mb0_rows = np.concatenate([_routing(built[1], f"s1_{x}", n) for x, n in (("a", 11), ("b", 9), ("f", 4))])
    m1 = _check_trained(built[1], results, 1, 2, 1, {(0, 1)}, {(0, 1): mb0_rows})
    assert (m1["dropped_micro_batches"], m1["failed_fetches"], m1["fetched_chunks"]) == (1, 1, 6 + 4)  # g, h unread
    assert m1["micro_batch_hashes"][0][1] == "" and all(m1["micro_batch_hashes"][1])
    final = results[("finish", 0)]
    assert m0["deletes"] + m1["deletes"] + final["deletes"] == 2 * 11 and final["delete_problems"] == 0
    assert store.list_prefix("payloads") == []
    assert all((delete_record_of(store, r.branch_id) is not None) for s in range(2) for r in built[s].header.refs)
