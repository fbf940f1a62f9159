"""Put, get and free of routing arrays in one run: refpipe, raw .npy files, Ray's object store, TransferQueue.

The peers' shape: ``--arrays`` (1,024) routing arrays ``routed_experts`` [4096, 48, 8] uint8 (1,024 prompt +
3,072 completion tokens, 1.5 MiB each, distinct expert ids per row), one array generated once and changed by
a few bytes per put. Each system through its public API, in the same process:

- refpipe: ``Keeper.keep`` of a routing-only branch (validate, one Zarr v3 chunk, a ledger event) on a local
  directory, ``fetch_arrays`` on ``--threads`` threads, ``Ledger.delete`` of each round's refs, timed until it
  returns: the chunks are claimed (batch record, commit-marker unlinks) and their bytes are removed after, by the
  ledger's reaper thread (``storage.ledger_reaper``), as Ray frees after ``del``. ``Ledger.wait_freed`` after each
  round's delete is timed apart (outside the free figure, before the next system's turn, so the reaper never runs
  during another system's timing): ``frees_per_s_drained`` counts both, the rate until the bytes are gone.
- raw: ``np.save`` of one ``.npy`` file per array in the same directory, ``np.load`` on ``--threads`` threads,
  ``os.remove``.
- ray: ``ray.put`` into a local Ray's object store, ``ray.get`` of ``--get-batch`` refs at once with a copy
  out of shared memory (``np.array``), free by dropping the last reference (``del``; the object store unlinks
  the objects asynchronously: Ray has no synchronous free).
- transferqueue: TransferQueue's key-value API on its default in-memory ``SimpleStorage`` backend (ZMQ), with
  one storage unit instead of its default two (2 cores): ``kv_put`` per array, ``kv_batch_get`` of
  ``--get-batch`` keys, ``kv_clear`` of each round's keys.

Puts go one array at a time (arrays arrive one branch at a time); gets go ``--get-batch`` arrays per call
(refpipe and raw: one per thread); frees take each round's arrays in one call where the API has one (raw and
ray: one call per array). Every get is checked against the array put. Ray runs as a fresh local instance
on 127.0.0.1 only (no dashboard; 2 logical CPUs, as TransferQueue's controller and storage unit each ask for
one). The arrays are split into ``--rounds`` rounds; in each round every system runs the phase in turn, the
order rotating between rounds, so page-cache, writeback and machine load favour none; each phase starts
after a ``sync`` (untimed).

Last line: one JSON object with ``keep_vs_ray_put``, ``fetch_vs_ray_get``, ``free_vs_ray_free``,
``keep_vs_transferqueue_put``, ``fetch_vs_transferqueue_get``, ``free_vs_transferqueue_clear``,
``keep_vs_np_save``, ``fetch_vs_np_load``, ``free_vs_os_remove`` (refpipe's throughput over the peer's), and
the raw figures: ``put_gib_per_s``, ``get_gib_per_s``, ``frees_per_s`` and ``seconds`` per system, and refpipe's
``frees_per_s_drained``, ``free_drained_vs_transferqueue_clear`` and ``seconds.refpipe_drain`` (the waits for
its reaper).
Targets: keep ahead of Ray's put (``keep_vs_ray_put`` >= 1), frees ahead of TransferQueue's
clear (``free_vs_transferqueue_clear`` >= 1).
"""

from __future__ import annotations

import os

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's node address: 127.0.0.1, not the host's IP
os.environ.setdefault("TQ_LOGGING_LEVEL", "ERROR")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from collections import Counter  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from importlib.metadata import version  # noqa: E402

import numpy as np  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from _args import positive_int  # noqa: E402  (bench/ is sys.path[0] when run as a script)

from refpipe import Branch, FieldsConfig, Keeper, Ledger, StorageConfig, fetch_arrays, open_store  # noqa: E402

PROMPT_TOKENS, COMPLETION_TOKENS = 1024, 3072
FIELDS = FieldsConfig(num_layers=48, top_k=8, num_experts=128)
PHASES = ("put", "get", "free")
SIDES = ("refpipe", "raw", "ray", "transferqueue")
RATIOS = {  # summary key -> (phase, peer): refpipe's throughput over the peer's
    "keep_vs_ray_put": ("put", "ray"), "fetch_vs_ray_get": ("get", "ray"), "free_vs_ray_free": ("free", "ray"),
    "keep_vs_transferqueue_put": ("put", "transferqueue"), "fetch_vs_transferqueue_get": ("get", "transferqueue"),
    "free_vs_transferqueue_clear": ("free", "transferqueue"),
    "keep_vs_np_save": ("put", "raw"), "fetch_vs_np_load": ("get", "raw"), "free_vs_os_remove": ("free", "raw"),
}


def routing() -> np.ndarray:
    """One routing array [4096, 48, 8] uint8: 8 distinct expert ids of 128 per token row and layer."""
    rng = np.random.default_rng(0)
    first = rng.integers(0, FIELDS.num_experts, (PROMPT_TOKENS + COMPLETION_TOKENS, FIELDS.num_layers, 1))
    return ((first + np.arange(FIELDS.top_k)) % FIELDS.num_experts).astype(np.uint8)


def vary(a: np.ndarray, i: int) -> None:
    """Make array ``i`` distinct (in place): its first row's ids start at ``i % 128``, still distinct."""
    a[0, 0] = (np.arange(FIELDS.top_k) + i) % FIELDS.num_experts


def check(a: np.ndarray, i: int) -> None:
    if a.shape != (PROMPT_TOKENS + COMPLETION_TOKENS, FIELDS.num_layers, FIELDS.top_k) or int(a[0, 0, 0]) != i % 128:
        raise RuntimeError(f"array {i}: got shape {a.shape}, first id {a.reshape(-1)[:1]}")


class Refpipe:
    """``Keeper.keep`` of a routing-only branch, ``fetch_arrays`` on threads, ``Ledger.delete``."""

    def __init__(self, workdir: str, threads: int):
        config = StorageConfig(root=os.path.join(workdir, "refpipe"), run_id=f"bench_{uuid.uuid4().hex[:8]}")
        self.store, self.threads = open_store(config), threads
        self.ledger = Ledger(self.store, "bench_env_worker")
        self.keeper = Keeper(self.store, self.ledger, FIELDS, config)
        self.refs: dict[int, object] = {}

    def put(self, i: int, a: np.ndarray) -> None:
        self.refs[i] = self.keeper.keep(Branch(PROMPT_TOKENS, COMPLETION_TOKENS, {"routed_experts": a}, f"b{i:06d}"))

    def get(self, batch: list[int]) -> list[np.ndarray]:
        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(lambda i: fetch_arrays(self.store, self.refs[i])["routed_experts"], batch))

    def free(self, batch: list[int]) -> None:
        result = self.ledger.delete([self.refs.pop(i) for i in batch], reason="bench")
        if result.failed:
            raise RuntimeError(f"refpipe delete failed: {result.failed}")

    def drain(self) -> None:
        self.ledger.wait_freed()

    def close(self) -> None:
        self.ledger.close()


class RawNpy:
    """One ``.npy`` file per array: ``np.save``, ``np.load`` on threads, ``os.remove``."""

    def __init__(self, workdir: str, threads: int):
        self.root, self.threads = os.path.join(workdir, "raw"), threads
        os.makedirs(self.root)

    def _path(self, i: int) -> str:
        return f"{self.root}/b{i:06d}.npy"

    def put(self, i: int, a: np.ndarray) -> None:
        np.save(self._path(i), a)

    def get(self, batch: list[int]) -> list[np.ndarray]:
        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(lambda i: np.load(self._path(i)), batch))

    def free(self, batch: list[int]) -> None:
        for i in batch:
            os.remove(self._path(i))

    def close(self) -> None:
        pass


class RayStore:
    """``ray.put``, ``ray.get`` of a batch with a copy out of the object store, free by ``del`` of the refs."""

    def __init__(self) -> None:
        self.refs: dict[int, ray.ObjectRef] = {}

    def put(self, i: int, a: np.ndarray) -> None:
        self.refs[i] = ray.put(a)

    def get(self, batch: list[int]) -> list[np.ndarray]:
        return [np.array(view) for view in ray.get([self.refs[i] for i in batch])]

    def free(self, batch: list[int]) -> None:
        for i in batch:
            del self.refs[i]

    def close(self) -> None:
        self.refs.clear()


class TransferQueue:
    """TransferQueue's key-value API: ``kv_put`` per array, ``kv_batch_get``, ``kv_clear`` of a batch."""

    PARTITION = "bench"

    def put(self, i: int, a: np.ndarray) -> None:
        tq.kv_put(key=f"b{i:06d}", partition_id=self.PARTITION, fields={"routed_experts": torch.from_numpy(a)})

    def get(self, batch: list[int]) -> list[np.ndarray]:
        got = tq.kv_batch_get(keys=[f"b{i:06d}" for i in batch], partition_id=self.PARTITION)["routed_experts"]
        return [t.numpy() for t in got.unbind(0)]

    def free(self, batch: list[int]) -> None:
        tq.kv_clear(keys=[f"b{i:06d}" for i in batch], partition_id=self.PARTITION)

    def close(self) -> None:
        pass


def run(args, sides: dict) -> Counter:
    """Put, get and free ``args.arrays`` arrays on every side, round by round; return seconds per (side, phase)."""
    a = routing()
    rounds = [list(r) for r in np.array_split(np.arange(args.arrays), args.rounds) if len(r)]
    seconds: Counter = Counter()
    for phase in PHASES:
        os.sync()  # untimed: no dirty pages from the previous phase
        for r, batch in enumerate(rounds):
            for name in SIDES[r % len(SIDES):] + SIDES[:r % len(SIDES)]:
                started = time.perf_counter()
                _do(phase, sides[name], batch, a, args.get_batch)
                seconds[name, phase] += time.perf_counter() - started
                if phase == "free" and name == "refpipe":
                    started = time.perf_counter()
                    sides[name].drain()
                    seconds[name, "drain"] += time.perf_counter() - started
    return seconds


def _do(phase: str, side, batch: list[int], a: np.ndarray, get_batch: int) -> None:
    if phase == "put":
        for i in batch:
            vary(a, i)
            side.put(i, a)
    elif phase == "get":
        for start in range(0, len(batch), get_batch):
            group = batch[start:start + get_batch]
            for got, i in zip(side.get(group), group, strict=True):
                check(got, i)
    else:
        side.free(batch)


def report(args, seconds: Counter, nbytes: int) -> dict:
    """Print a row per system; return the JSON summary."""
    n = args.arrays
    gib = n * nbytes / 2**30
    put = {s: gib / seconds[s, "put"] for s in SIDES}
    get = {s: gib / seconds[s, "get"] for s in SIDES}
    free = {s: n / seconds[s, "free"] for s in SIDES}
    print(f"{n} arrays x {nbytes / 2**20:.2f} MiB ({gib:.2f} GiB per system); Ray {ray.__version__}, "
          f"TransferQueue {version('TransferQueue')}")
    print(f"{'system':14s} {'put GiB/s':>10s} {'get GiB/s':>10s} {'frees/s':>10s}   seconds put / get / free")
    for s in SIDES:
        print(f"{s:14s} {put[s]:10.3f} {get[s]:10.3f} {free[s]:10.0f}   "
              f"{seconds[s, 'put']:.3f} / {seconds[s, 'get']:.3f} / {seconds[s, 'free']:.3f}")
    summary: dict = {"arrays": n, "mib_per_array": round(nbytes / 2**20, 3), "threads": args.threads,
                     "get_batch": args.get_batch}
    rate = {"put": put, "get": get, "free": free}
    summary.update({name: round(rate[phase]["refpipe"] / rate[phase][peer], 3)
                    for name, (phase, peer) in RATIOS.items()})
    drained = n / (seconds["refpipe", "free"] + seconds["refpipe", "drain"])
    print(f"refpipe frees until the bytes are removed (Ledger.wait_freed): {drained:.0f}/s, "
          f"{seconds['refpipe', 'drain']:.3f} s waiting for the reaper")
    summary.update({
        "put_gib_per_s": {s: round(put[s], 3) for s in SIDES},
        "get_gib_per_s": {s: round(get[s], 3) for s in SIDES},
        "frees_per_s": {s: round(free[s], 1) for s in SIDES},
        "frees_per_s_drained": round(drained, 1),
        "free_drained_vs_transferqueue_clear": round(drained / free["transferqueue"], 3),
        "seconds": {**{f"{s}_{p}": round(seconds[s, p], 3) for s in SIDES for p in PHASES},
                    "refpipe_drain": round(seconds["refpipe", "drain"], 3)},
    })
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arrays", type=positive_int, default=1024, help="routing arrays put, got and freed per system")
    p.add_argument("--dir", help="directory for refpipe and raw (default: a fresh temp dir on /tmp, removed after)")
    p.add_argument("--rounds", type=positive_int, default=16, help="rounds; the systems rotate going first")
    p.add_argument("--threads", type=positive_int, default=8, help="get threads of refpipe and raw")
    p.add_argument("--get-batch", type=positive_int, default=32, help="arrays per get call (bounds memory)")
    args = p.parse_args()
    workdir = tempfile.mkdtemp(prefix="refpipe-bench-peers-", dir=args.dir or "/tmp")
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit AF_UNIX's limit
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR,
             _temp_dir=ray_dir)
    sides: dict = {}
    try:
        tq.init({"backend": {"SimpleStorage": {"num_data_storage_units": 1}}})
        sides = {"refpipe": Refpipe(workdir, args.threads), "raw": RawNpy(workdir, args.threads), "ray": RayStore(),
                 "transferqueue": TransferQueue()}
        seconds = run(args, sides)
    finally:
        for side in sides.values():
            side.close()
        tq.close()
        ray.shutdown()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(ray_dir, ignore_errors=True)
    print(json.dumps({"dir": workdir, **report(args, seconds, routing().nbytes)}))


if __name__ == "__main__":
    main()
