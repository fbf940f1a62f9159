"""Trainer fetch + assembly throughput per rank against raw reads of the same bytes (2 ranks, gloo).

One step of 1,024 branches as in ``bench/keep_fetch.py``: ``routed_experts`` [4096, 48, 8] uint8
(1,024 prompt + 3,072 completion tokens), a top-128 head (``topk_ids`` int32 and
``topk_logprobs`` float32 [3072, 128]) and ``sample_support`` [3072, 20] int32, about 4.7 MiB
per branch, kept through the real keep path on a local directory. Two branches per micro
batch (seq_len 8,704: 512 padding tokens), 512 micro batches over 2 DP ranks.

Each rank, for ``--rounds`` rounds, both ranks at once (barriers between phases):
  raw      read the chunk files of its own refs (``open``/``read``, whole files) on
           ``StorageConfig.max_concurrent_fetches`` threads, keeping the bytes;
  refpipe  ``trainer.fetch.fetch_own`` (same threads; each micro batch assembled into its
           padded layout as its chunks arrive) + ``TrainerRank.stand_in_dropped``, i.e. what
           ``run_step`` does before the failure all-reduce and training.
Rounds are paired (raw, then refpipe, back to back): ratio = median over rounds of raw seconds /
refpipe seconds, scaled to the same bytes (refpipe throughput / raw throughput), reported per rank
and as the minimum over ranks; ``cpu_ratio`` is the same with process CPU seconds. On a shared
2-core VM wall times swing by 2-3x between runs, hence pairing and medians.
Then one full ``TrainerRank.run_step`` (fetch, all-reduce, assembly, tensors, release) gives
``fetch_seconds_per_step`` (its ``fetch_seconds_max``), and deletes the chunks.

Usage: ``.venv/bin/python bench/trainer_fetch.py [--branches 1024] [--rounds 5] [--tmp /tmp]``.
Last line: one JSON object with ``fetch_assemble_throughput_ratio`` (target >= 0.7) and
``fetch_seconds_per_step``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
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
from refpipe.pipeline.step_file import (
    SCHEMA_VERSION,
    MicroBatchRecord,
    SequenceRecord,
    StepFile,
    StepHeader,
    publish_step_file,
)
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.fetch import chunk_keys
from refpipe.storage.ledger import Ledger

PROMPT, COMPLETION, LAYERS, TOP_K, EXPERTS, HEAD, SUPPORT = 1024, 3072, 48, 8, 128, 128, 20
SEQ_LEN = 2 * (PROMPT + COMPLETION) + 512
FIELDS = FieldsConfig(num_layers=LAYERS, top_k=TOP_K, num_experts=EXPERTS, logprobs_k=HEAD, support_width=SUPPORT)
WORLD_SIZE = 2
BRANCH_NBYTES = (PROMPT + COMPLETION) * LAYERS * TOP_K + COMPLETION * (2 * HEAD + SUPPORT) * 4


def branch_arrays(rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One branch's arrays, generated once and kept for every branch of the step."""
    return {
        "routed_experts": ((rng.integers(0, EXPERTS, (PROMPT + COMPLETION, LAYERS, 1)) + np.arange(TOP_K))
                           % EXPERTS).astype(np.uint8),  # distinct top-k ids
        "topk_ids": rng.integers(0, 150_000, (COMPLETION, HEAD), dtype=np.int32),
        "topk_logprobs": -rng.random((COMPLETION, HEAD), dtype=np.float32),
        "sample_support": rng.integers(-1, 150_000, (COMPLETION, SUPPORT), dtype=np.int32),
    }


def make_step(storage: StorageConfig, num_branches: int) -> None:
    """Keep ``num_branches`` branches and publish step 0: 2 branches per micro batch, alternating DP ranks."""
    store = open_store(storage)
    rng = np.random.default_rng(0)
    arrays = branch_arrays(rng)
    ledger = Ledger(store, "env_worker_0")
    keeper = Keeper(store, ledger, FIELDS, storage)
    refs = [keeper.keep(Branch(PROMPT, COMPLETION, arrays, branch_id=f"b{i:05d}")) for i in range(num_branches)]
    ledger.close()
    tokens = 2 * (PROMPT + COMPLETION)
    streams = {"input_ids": rng.integers(0, 150_000, tokens, dtype=np.int32), "loss_mask": np.ones(tokens, bool),
               "advantages": rng.standard_normal(tokens, dtype=np.float32),
               "inference_logprobs": -rng.random(tokens, dtype=np.float32),
               "position_ids": np.tile(np.arange(PROMPT + COMPLETION, dtype=np.int32), 2),
               "temperatures": np.ones(tokens, np.float32)}
    records, owners = [], []
    for m in range(num_branches // 2):
        dp, index = m % WORLD_SIZE, m // WORLD_SIZE
        seqs = [SequenceRecord(num_tokens=PROMPT + COMPLETION, env_name="bench", ref=2 * m + j) for j in range(2)]
        records.append(MicroBatchRecord(dp_rank=dp, index=index, sequences=seqs, num_padding_tokens=SEQ_LEN - tokens,
                                        has_routing=True))
        owners += [dp, dp]
    records.sort(key=lambda r: (r.dp_rank, r.index))
    header = StepHeader(schema_version=SCHEMA_VERSION, run_uri=store.prefix.uri, step=0, seq_len=SEQ_LEN,
                        dp_world_size=WORLD_SIZE, micro_batches=records, refs=refs, owners=owners, fields=FIELDS)
    publish_step_file(store, header, {(r.dp_rank, r.index): streams for r in records})


def read_raw(paths: list[str], threads: int) -> int:
    """Read whole files on ``threads`` threads, keeping the bytes until all are read; return bytes read."""
    def one(path: str) -> bytes:
        with open(path, "rb", buffering=0) as f:
            return f.read()

    with ThreadPoolExecutor(max_workers=threads) as pool:
        data = list(pool.map(one, paths))
    return sum(len(d) for d in data)


@contextlib.contextmanager
def timed(wall_s: list[float], cpu_s: list[float]):
    """Append the block's wall seconds and this process's CPU seconds (user + system, all threads)."""
    cpu = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    yield
    wall_s.append(time.perf_counter() - started)
    end = resource.getrusage(resource.RUSAGE_SELF)
    cpu_s.append(end.ru_utime + end.ru_stime - cpu.ru_utime - cpu.ru_stime)


def rank_main(spec: dict, rank: int) -> None:
    """One trainer rank: timed rounds of raw reads and fetch + assembly, then one full step."""
    import torch.distributed as dist
    from refpipe.trainer.config import TrainerConfig
    from refpipe.trainer.dist import init_process_group
    from refpipe.trainer.fetch import fetch_own, own_requests
    from refpipe.trainer.step import TrainerRank

    config = TrainerConfig(collective_timeout_s=600)
    storage = StorageConfig(**spec["storage"])
    init_process_group(config, rank=rank, world_size=WORLD_SIZE, init_method=spec["init_method"])
    store = open_store(storage)
    trainer = TrainerRank(store, FIELDS, storage, config)
    step_file = StepFile.read(store, 0)
    header, dp = step_file.header, trainer.topology.dp_rank
    paths = [store.path(chunk_keys(store, header.refs[i])[0]) for i in sorted(own_requests(header, dp))]
    not_dropped = np.zeros(len(header.micro_batches_of(dp)), bool)
    raw_s, ours_s, raw_cpu_s, ours_cpu_s = [], [], [], []
    for _ in range(spec["rounds"]):
        dist.barrier()
        with timed(raw_s, raw_cpu_s):
            raw_nbytes = read_raw(paths, storage.max_concurrent_fetches)
        dist.barrier()
        with timed(ours_s, ours_cpu_s):
            fetched = fetch_own(store, step_file, dp, FIELDS, max_concurrency=storage.max_concurrent_fetches)
            batches = trainer.stand_in_dropped(step_file, fetched, not_dropped)
        nbytes = fetched.nbytes
        del fetched, batches
    dist.barrier()
    metrics = trainer.run_step(0, lambda batches: None).model_dump()
    metrics["deletes"] = trainer.finish().deletes
    trainer.close()
    result = {"rank": rank, "raw_s": raw_s, "fetch_assemble_s": ours_s, "raw_cpu_s": raw_cpu_s,
              "fetch_assemble_cpu_s": ours_cpu_s, "nbytes": nbytes,
              "raw_nbytes": raw_nbytes, "metrics": metrics}
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


def run_ranks(storage: StorageConfig, rounds: int, out: Path) -> list[dict]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = {"storage": storage.model_dump(), "rounds": rounds, "out": str(out),
            "init_method": f"tcp://127.0.0.1:{port}"}
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--spec", json.dumps(spec)], env=env)
             for r in range(WORLD_SIZE)]
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD_SIZE)]


def check_space(tmp: str, num_branches: int) -> None:
    """Print ``df -h`` of ``tmp`` and refuse to start without room for the step (plus 2 GiB)."""
    print(subprocess.run(["df", "-h", tmp], capture_output=True, text=True).stdout, flush=True)
    need = num_branches * BRANCH_NBYTES * 1.1 + 2 * 2**30
    free = shutil.disk_usage(tmp).free
    if free < need:
        raise SystemExit(f"{tmp}: {free / 2**30:.1f} GiB free, this bench needs {need / 2**30:.1f} GiB")


def report(results: list[dict], num_branches: int) -> dict:
    per_rank = []
    for r in results:
        paired = [raw / ours for raw, ours in zip(r["raw_s"], r["fetch_assemble_s"])]
        paired_cpu = [raw / ours for raw, ours in zip(r["raw_cpu_s"], r["fetch_assemble_cpu_s"])]
        per_rank.append({"rank": r["rank"], "GiB": round(r["nbytes"] / 2**30, 3),
                         "raw_GiB_per_s": round(r["raw_nbytes"] / statistics.median(r["raw_s"]) / 2**30, 3),
                         "fetch_assemble_GiB_per_s": round(
                             r["nbytes"] / statistics.median(r["fetch_assemble_s"]) / 2**30, 3),
                         "raw_s": [round(t, 2) for t in r["raw_s"]],
                         "fetch_assemble_s": [round(t, 2) for t in r["fetch_assemble_s"]],
                         "ratio": round(statistics.median(paired) * r["nbytes"] / r["raw_nbytes"], 3),
                         "cpu_ratio": round(statistics.median(paired_cpu) * r["nbytes"] / r["raw_nbytes"], 3)})
        print(json.dumps(per_rank[-1]), flush=True)
    metrics = results[0]["metrics"]
    return {"bench": "trainer_fetch", "branches": num_branches, "ranks": WORLD_SIZE,
            "fetch_assemble_throughput_ratio": min(p["ratio"] for p in per_rank),
            "fetch_assemble_cpu_ratio": min(p["cpu_ratio"] for p in per_rank),
            "fetch_seconds_per_step": round(metrics["fetch_seconds_max"], 3),
            "fetch_seconds_mean_over_ranks": round(metrics["fetch_seconds_mean"], 3),
            "fetched_GiB_per_step": round(metrics["fetched_bytes"] / 2**30, 3), "deletes": metrics["deletes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--branches", type=positive_int, default=1024)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--tmp", default="/tmp")
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank is not None:
        return rank_main(json.loads(args.spec), args.rank)
    if args.branches % (2 * WORLD_SIZE):
        raise SystemExit(f"--branches {args.branches}: expected a multiple of {2 * WORLD_SIZE}")
    check_space(args.tmp, args.branches)
    run_dir = Path(tempfile.mkdtemp(prefix="refpipe-bench-trainer-", dir=args.tmp))
    try:
        storage = StorageConfig(root=str(run_dir / "root"), run_id="bench")
        started = time.perf_counter()
        make_step(storage, args.branches)
        print(f"kept {args.branches} branches and published the step in {time.perf_counter() - started:.1f} s",
              flush=True)
        results = run_ranks(storage, args.rounds, run_dir)
        print(json.dumps(report(results, args.branches)))
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
