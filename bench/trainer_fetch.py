"""Trainer data path per rank against the physical limit, and how much of it training hides (2 ranks, gloo).

Steps of ``--branches`` branches as in ``bench/keep_fetch.py``: ``routed_experts`` [4096, 48, 8]
uint8 (1,024 prompt + 3,072 completion tokens), a top-128 head (``topk_ids`` int32 and
``topk_logprobs`` float32 [3072, 128]) and ``sample_support`` [3072, 20] int32, about 4.7 MiB
per branch, kept through the real keep path on a local directory. Two branches per micro
batch (seq_len 8,704: 512 padding tokens), micro batches alternating over 2 DP ranks.

Three worlds of 2 ranks, one after the other (each its own processes, so peak RSS is its own):

``limit``  on step 0, ``--rounds`` paired rounds, both ranks at once (barriers between phases):
           the physical limit -- ``os.preadv`` of the rank's chunk files into buffers allocated
           (and touched) once, on the threads ``TrainerRank.fetch`` runs on (``TrainerRank.fetch_threads``:
           ``StorageConfig.fetch_threads()``: one per CPU from this local directory by default), no checksum,
           no layout -- then refpipe: ``TrainerRank.fetch`` (same threads; each micro batch
           assembled into its padded layout and hashed as its chunks arrive, into the rank's
           ``BufferPool``: from the second round on, the previous round's memory) +
           ``TrainerRank.stand_in_dropped``. ``fetch_assemble_vs_limit`` = median over rounds
           of limit seconds / refpipe seconds, scaled to the same bytes, min over ranks. Between
           the two, the limit's reads again in 256 KiB pieces, each checksummed (refpipe's crc32c,
           ``storage.checksum``) right after its read on the same thread (refpipe's fetch reads a chunk
           with one ``preadv``, then checksums it: as cheap, docs/benchmarks.md):
           ``read_crc32c_vs_limit``, the most a fetch that verifies every byte read could reach.
``no_prefetch`` / ``prefetch``  ``--steps`` full ``TrainerRank.run_step`` calls each
           (``TrainerConfig.prefetch_next_step`` off / on) whose ``train`` sleeps
           ``--train-seconds`` S (simulated GPU time: the CPU stays free for the data path;
           default: twice the slowest rank's median refpipe fetch of the ``limit`` world).
           ``exposed_data_seconds_per_step`` = a step's wall time minus S (max over ranks, mean
           over the steps after the first, which nothing can prefetch); ``exposed_data_ratio`` =
           that over the step's wall time. Each world deletes its steps' chunks. Each step's row
           also prints ``main_thread_data_s``: the trainer's own ``exposed_data_seconds_max`` (the
           data path's seconds on the rank's main thread, without the metrics all-gather), so the
           rest of the exposed seconds is that all-gather and the step loop itself.

On a shared 2-core VM wall times swing by 2-3x between runs, hence pairing and medians.

Usage: ``.venv/bin/python bench/trainer_fetch.py [--branches 128] [--steps 4] [--rounds 3]
[--train-seconds S] [--tmp /tmp]``. Last line: one JSON object with ``fetch_assemble_vs_limit``
(target >= 0.8), ``exposed_data_seconds_per_step`` and ``exposed_data_ratio`` with and without
prefetch (target <= 0.05 with), and ``peak_rss_MiB`` per world (max over ranks).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from _args import positive_int  # noqa: E402  (bench/ is sys.path[0] when run as a script)

from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.pipeline.step_file import StepFile, publish_step_file
from refpipe.pipeline.step_header import SCHEMA_VERSION, MicroBatchRecord, SequenceRecord, StepHeader
from refpipe.storage.backends import open_store
from refpipe.storage.checksum import crc32c
from refpipe.storage.config import StorageConfig
from refpipe.storage.layout import chunk_keys
from refpipe.storage.ledger import Ledger

PROMPT, COMPLETION, LAYERS, TOP_K, EXPERTS, HEAD, SUPPORT = 1024, 3072, 48, 8, 128, 128, 20
SEQ_LEN = 2 * (PROMPT + COMPLETION) + 512
FIELDS = FieldsConfig(num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS, logprobs_k=HEAD, support_width=SUPPORT)
WORLD_SIZE = 2
PIECE_BYTES = 256 << 10
"""Bytes per read of the checksummed limit (each piece checksummed while it is in cache)."""
BRANCH_NBYTES = (PROMPT + COMPLETION) * LAYERS * TOP_K + COMPLETION * (2 * HEAD + SUPPORT) * 4


def branch_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One branch's arrays, generated once and kept for every branch of every step."""
    return {
        "routed_experts": ((rng.integers(0, EXPERTS, (PROMPT + COMPLETION, LAYERS, 1)) + np.arange(TOP_K))
                           % EXPERTS).astype(np.uint8),  # distinct top-k ids
        "topk_ids": rng.integers(0, 150_000, (COMPLETION, HEAD), dtype=np.int32),
        "topk_logprobs": -rng.random((COMPLETION, HEAD), dtype=np.float32),
        "sample_support": rng.integers(-1, 150_000, (COMPLETION, SUPPORT), dtype=np.int32),
    }


def make_steps(storage: StorageConfig, num_branches: int, num_steps: int) -> None:
    """Keep ``num_branches`` branches per step and publish steps ``0 .. num_steps - 1``."""
    store = open_store(storage)
    rng = np.random.default_rng(0)
    arrays = branch_arrays(rng)
    ledger = Ledger(store, "env_worker_0")
    keeper = Keeper(store, ledger, FIELDS, storage)
    tokens = 2 * (PROMPT + COMPLETION)
    streams = {"input_ids": rng.integers(0, 150_000, tokens, dtype=np.int32), "loss_mask": np.ones(tokens, bool),
               "advantages": rng.standard_normal(tokens, dtype=np.float32),
               "inference_logprobs": -rng.random(tokens, dtype=np.float32),
               "position_ids": np.tile(np.arange(PROMPT + COMPLETION, dtype=np.int32), 2),
               "temperatures": np.ones(tokens, np.float32)}
    for step in range(num_steps):
        refs = [keeper.keep(Branch(PROMPT, COMPLETION, arrays, branch_id=f"s{step}_b{i:05d}"))
                for i in range(num_branches)]
        records, owners = [], []
        for m in range(num_branches // 2):
            dp, index = m % WORLD_SIZE, m // WORLD_SIZE
            seqs = [SequenceRecord(num_tokens=PROMPT + COMPLETION, env_name="bench", ref=2 * m + j) for j in range(2)]
            records.append(MicroBatchRecord(dp_rank=dp, index=index, sequences=seqs,
                                            num_padding_tokens=SEQ_LEN - tokens, has_routing=True))
            owners += [dp, dp]
        records.sort(key=lambda r: (r.dp_rank, r.index))
        header = StepHeader(schema_version=SCHEMA_VERSION, run_uri=store.prefix.uri, step=step, seq_len=SEQ_LEN,
                            dp_world_size=WORLD_SIZE, micro_batches=records, refs=refs, owners=owners, fields=FIELDS)
        publish_step_file(store, header, {(r.dp_rank, r.index): streams for r in records})
    ledger.close()


def read_limit(paths: list[str], buffers: list[np.ndarray], threads: int, *, checksum: bool = False) -> int:
    """``preadv`` each file into its buffer (allocated once by the caller) on ``threads`` threads; bytes read.
    ``checksum``: read in pieces of ``PIECE_BYTES`` instead, each checksummed (crc32c) on the same thread right
    after its read, while in cache (what verifying every byte read adds, alone)."""
    def one(item: tuple[str, np.ndarray]) -> int:
        path, buf = item
        fd = os.open(path, os.O_RDONLY)
        try:
            if not checksum:
                return os.preadv(fd, [buf], 0)
            n, crc = 0, 0
            for start in range(0, buf.nbytes, PIECE_BYTES):
                piece = buf[start : start + PIECE_BYTES]
                n += os.preadv(fd, [piece], start)
                crc = crc32c(piece, crc)
            return n
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        return sum(pool.map(one, zip(paths, buffers)))


@contextlib.contextmanager
def timed(wall_s: list[float]):
    """Append the block's wall seconds."""
    started = time.perf_counter()
    yield
    wall_s.append(time.perf_counter() - started)


def peak_rss_mib() -> float:
    """This process's peak resident set size so far (``VmHWM``), in MiB."""
    from refpipe.job.report import peak_rss_bytes  # ranks only: matplotlib is slow to import

    return peak_rss_bytes() / 2**20


def limit_world(trainer, store, rounds: int) -> dict:
    """Paired rounds on step 0: the physical limit, then refpipe's fetch + assembly (no deletes)."""
    import torch.distributed as dist

    from refpipe.trainer.fetch import own_requests

    step_file = StepFile.read(store, 0)
    header, dp = step_file.header, trainer.topology.dp_rank
    paths = [store.path(chunk_keys(header.refs[i].key)[0]) for i in sorted(own_requests(header, dp))]
    buffers = [np.ones(os.path.getsize(p), np.uint8) for p in paths]
    not_dropped = np.zeros(len(header.micro_batches_of(dp)), bool)
    limit_s, verified_s, ours_s = [], [], []
    for _ in range(rounds):
        dist.barrier()
        with timed(limit_s):
            limit_nbytes = read_limit(paths, buffers, trainer.fetch_threads)
        dist.barrier()
        with timed(verified_s):
            read_limit(paths, buffers, trainer.fetch_threads, checksum=True)
        dist.barrier()
        with timed(ours_s):
            fetched = trainer.fetch(step_file)
            batches = trainer.stand_in_dropped(step_file, fetched, not_dropped)
        nbytes = fetched.nbytes
        del fetched, batches
    return {"limit_s": limit_s, "read_crc_s": verified_s, "fetch_assemble_s": ours_s, "nbytes": nbytes,
            "limit_nbytes": limit_nbytes}


def steps_world(trainer, steps: list[int], train_s: float) -> dict:
    """``run_step`` for each step with a ``train`` that sleeps ``train_s``; wall seconds per step."""
    wall_s, metrics = [], []
    for step in steps:
        with timed(wall_s):
            metrics.append(trainer.run_step(step, lambda batches: time.sleep(train_s)).model_dump())
    deletes = sum(m["deletes"] for m in metrics) + trainer.finish().deletes
    return {"wall_s": wall_s, "metrics": metrics, "deletes": deletes}


def rank_main(spec: dict, rank: int) -> None:
    """One trainer rank of one world (``spec["world"]``)."""
    from refpipe.trainer.config import TrainerConfig
    from refpipe.trainer.dist import init_process_group
    from refpipe.trainer.step import TrainerRank

    config = TrainerConfig(collective_timeout_s=600, step_poll_s=0.05, release="after_step",  # no checkpoints
                           prefetch_next_step=spec["world"] == "prefetch")
    storage = StorageConfig(**spec["storage"])
    init_process_group(config, rank=rank, world_size=WORLD_SIZE, init_method=spec["init_method"])
    store = open_store(storage)
    trainer = TrainerRank(store, FIELDS, storage, config)
    if spec["world"] == "limit":
        result = limit_world(trainer, store, spec["rounds"])
    else:
        result = steps_world(trainer, spec["steps"], spec["train_s"])
    trainer.close()
    result.update(rank=rank, peak_rss_MiB=peak_rss_mib())
    Path(spec["out"], f"{spec['world']}_rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def run_world(storage: StorageConfig, out: Path, world: str, **spec) -> list[dict]:
    """Start the 2 ranks of ``world``, wait for them, return their results."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = {**spec, "world": world, "storage": storage.model_dump(), "out": str(out),
            "init_method": f"tcp://127.0.0.1:{port}"}
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--spec", json.dumps(spec)], env=env)
             for r in range(WORLD_SIZE)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"{world} ranks exited with {codes}")
    return [json.loads((out / f"{world}_rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def check_space(tmp: str, num_branches: int) -> None:
    """Print ``df -h`` of ``tmp`` and refuse to start without room for the step (plus 2 GiB)."""
    print(subprocess.run(["df", "-h", tmp], capture_output=True, text=True).stdout, flush=True)
    need = num_branches * BRANCH_NBYTES * 1.1 + 2 * 2**30
    free = shutil.disk_usage(tmp).free
    if free < need:
        raise SystemExit(f"{tmp}: {free / 2**30:.1f} GiB free, this bench needs {need / 2**30:.1f} GiB")


def limit_report(results: list[dict]) -> dict:
    """Per rank: limit and refpipe GiB/s and the paired ratio; the min ratio over ranks."""
    per_rank = []
    for r in results:
        paired = [limit / ours for limit, ours in zip(r["limit_s"], r["fetch_assemble_s"])]
        per_rank.append({"rank": r["rank"], "GiB": round(r["nbytes"] / 2**30, 3),
                         "limit_GiB_per_s": round(r["limit_nbytes"] / statistics.median(r["limit_s"]) / 2**30, 3),
                         "fetch_assemble_GiB_per_s": round(
                             r["nbytes"] / statistics.median(r["fetch_assemble_s"]) / 2**30, 3),
                         "limit_s": [round(t, 3) for t in r["limit_s"]],
                         "fetch_assemble_s": [round(t, 3) for t in r["fetch_assemble_s"]],
                         "vs_limit": round(statistics.median(paired) * r["nbytes"] / r["limit_nbytes"], 3),
                         "read_crc_vs_limit": round(statistics.median(
                             [limit / crc for limit, crc in zip(r["limit_s"], r["read_crc_s"])]), 3)})
        print(json.dumps(per_rank[-1]), flush=True)
    return {"fetch_assemble_vs_limit": min(p["vs_limit"] for p in per_rank),
            "read_crc32c_vs_limit": min(p["read_crc_vs_limit"] for p in per_rank),
            "fetch_seconds_per_rank": round(max(statistics.median(r["fetch_assemble_s"]) for r in results), 3),
            "limit_peak_rss_MiB": round(max(r["peak_rss_MiB"] for r in results))}


def steps_report(world: str, results: list[dict], train_s: float) -> dict:
    """Exposed data seconds per step (max over ranks, mean over steps after the first) and the ratio."""
    walls = np.max([r["wall_s"] for r in results], axis=0)
    exposed = walls - train_s
    later = slice(1, None) if len(walls) > 1 else slice(None)
    row = {"world": world, "wall_s": [round(w, 3) for w in walls], "exposed_s": [round(e, 3) for e in exposed],
           "fetch_s": [round(m["fetch_seconds_max"], 3) for m in results[0]["metrics"]],
           "main_thread_data_s": [round(m["exposed_data_seconds_max"], 3) for m in results[0]["metrics"]],
           "prefetched_ranks": [m["prefetched_ranks"] for m in results[0]["metrics"]],
           "deletes": results[0]["deletes"]}
    print(json.dumps(row), flush=True)
    return {"exposed_data_seconds_per_step": round(float(exposed[later].mean()), 3),
            "exposed_data_ratio": round(float((exposed[later] / walls[later]).mean()), 4),
            "first_step_exposed_seconds": round(float(exposed[0]), 3),
            "peak_rss_MiB": round(max(r["peak_rss_MiB"] for r in results))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--branches", type=positive_int, default=128, help="branches per step")
    parser.add_argument("--steps", type=positive_int, default=4, help="steps per world (with and without prefetch)")
    parser.add_argument("--rounds", type=positive_int, default=3)
    parser.add_argument("--train-seconds", type=float, default=None,
                        help="simulated GPU seconds per step (default: 2x the slowest rank's median fetch)")
    parser.add_argument("--tmp", default="/tmp")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        return rank_main(json.loads(args.spec), args.rank)
    if args.branches % (2 * WORLD_SIZE):
        raise SystemExit(f"--branches {args.branches}: expected a multiple of {2 * WORLD_SIZE}")
    if args.train_seconds is not None and args.train_seconds < 0:
        raise SystemExit(f"--train-seconds {args.train_seconds}: expected seconds >= 0")
    check_space(args.tmp, 2 * args.steps * args.branches)
    run_dir = Path(tempfile.mkdtemp(prefix="refpipe-bench-trainer-", dir=args.tmp))
    try:
        storage = StorageConfig(root=str(run_dir / "root"), run_id="bench")
        started = time.perf_counter()
        make_steps(storage, args.branches, 2 * args.steps)
        print(f"kept {2 * args.steps} steps of {args.branches} branches in {time.perf_counter() - started:.1f} s",
              flush=True)
        out = limit_report(run_world(storage, run_dir, "limit", rounds=args.rounds))
        train_s = args.train_seconds if args.train_seconds is not None else round(2 * out["fetch_seconds_per_rank"], 2)
        summary = {"bench": "trainer_fetch", "branches_per_step": args.branches, "steps": args.steps,
                   "ranks": WORLD_SIZE, "train_seconds": train_s, **out}
        for world, first in (("no_prefetch", 0), ("prefetch", args.steps)):
            steps = list(range(first, first + args.steps))
            rows = steps_report(world, run_world(storage, run_dir, world, steps=steps, train_s=train_s), train_s)
            summary.update({f"{key}_{world}" if world == "no_prefetch" else key: value
                            for key, value in rows.items()})
        print(json.dumps(summary))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
