"""Keep, fetch and delete of branches: refpipe vs the same bytes as raw files (one per field, and one per
branch), in one run.

Both sides work on the same directory (``--dir``, default a fresh temp dir on /tmp) or,
with ``--s3-endpoint URL`` / ``--s3-moto``, the same S3 bucket:

- refpipe: ``Keeper.keep`` (validate, pack into one Zarr v3 chunk, 2 exclusive puts,
  a ledger event), ``fetch_arrays`` on 8 threads (whole chunks, checksum checked), and
  ``Ledger.release`` of each round's branches as one trainer step would release them (a filesystem: one batch
  record per round, then per chunk the unlink of its commit marker as its claim, of its chunk and of its
  directory; S3: one release record per round, then batched ``DeleteObjects``). The delete is timed and counted
  until the bytes are removed (``Ledger.wait_freed``: a filesystem's release returns once the chunks are claimed
  and its reaper thread unlinks them after), so it compares with ``os.remove``.
- raw: one file per field, written with ``open(path, "wb").write(array)``, read with
  ``open(path, "rb").read()`` + ``np.frombuffer`` on 8 threads, removed with ``os.remove``.
  On S3: one object per field through the same client (``S3Store.put``/``get``, one
  request each), removed with batched ``DeleteObjects``.
- one file: the minimum a keep can do -- the branch's bytes as one raw file (``os.writev``),
  read back with one ``read`` and cut into fields, removed with ``os.remove`` (S3: one object).

Branch shape: 4,096 tokens = 1,024 prompt + 3,072 completion; ``routed_experts``
[4096, 48, 8] uint8, ``topk_ids``/``topk_logprobs`` [3072, 128] int32/float32,
``sample_support`` [3072, 20] int32: 4.73 MiB per branch. The arrays are generated once
and reused; each branch changes a few bytes. The branches are split into rounds, and the
two sides alternate which goes first in each round, so page-cache and writeback state
favours neither; each phase starts after a ``sync`` (untimed).

Counting, from the client side: filesystem calls through CPython audit events (``open``
incl. ``os.open``, ``mkdir``, ``link``, ``rename``, ``remove``, ``rmdir``, ``listdir``,
``scandir``; ``stat`` is not audited); entries created = ``O_CREAT`` opens, ``mkdir`` and ``link`` calls;
refpipe's ``O_PATH`` opens of the directories on a key's way count as ``walk`` (``FsCounter``).
S3 requests through botocore's ``request-created`` event on each side's s3fs client.

Last line: one JSON object with ``keep_time_ratio``, ``fetch_throughput_ratio``,
``delete_time_ratio`` (refpipe over raw; throughput refpipe/raw), ``keep_time_vs_one_file``,
``fetch_throughput_vs_one_file``, ``delete_time_vs_one_file`` (the same over one file), ``objects_per_branch``,
``ledger_overhead_ratio`` (``Ledger.ledger_seconds`` over refpipe's keep + delete time),
``validation_share_of_keep`` (``validate_branch`` of one branch, best of 20, over refpipe's keep time per branch),
and per-branch filesystem ops / entries created (and S3 requests by kind) per phase.
Targets: keep vs one file <= 1.2, fetch >= 0.95 (vs raw and vs one file), delete vs one file <= 1.2;
filesystem operations per branch: keep <= 4, fetch <= 1.5, delete <= 5; on S3 delete <= 1.5 (vs raw), no
GET/LIST in keep and no LIST in fetch; ledger overhead <= 0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import numpy as np  # noqa: E402
from _args import positive_int  # noqa: E402  (bench/ is sys.path[0] when run as a script)

from refpipe.pipeline.fields import FieldsConfig, validate_branch  # noqa: E402
from refpipe.pipeline.keep import Branch, Keeper  # noqa: E402
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_arrays  # noqa: E402
from refpipe.storage.concurrency import bounded_map  # noqa: E402
from refpipe.storage.config import StorageConfig  # noqa: E402
from refpipe.storage.ledger import Ledger  # noqa: E402
from refpipe.storage.store import Store  # noqa: E402

PROMPT_TOKENS, COMPLETION_TOKENS = 1024, 3072
FIELDS = FieldsConfig(num_layers=48, top_k=8, num_experts=128, logprobs_k=128, support_width=20)
PHASES = ("keep", "fetch", "delete")
SIDES = ("refpipe", "raw", "one_file")


def base_fields() -> dict[str, np.ndarray]:
    """One random branch: routing [4096, 48, 8] uint8, top-128 ids/logprobs [3072, 128], support [3072, 20]."""
    rng = np.random.default_rng(0)
    c = COMPLETION_TOKENS
    support = rng.integers(0, 150_000, (c, FIELDS.support_width), dtype=np.int32)
    support[:, 12:] = -1
    return {
        "routed_experts": ((rng.integers(0, FIELDS.num_experts, (PROMPT_TOKENS + c, FIELDS.num_layers, 1))
                            + np.arange(FIELDS.top_k)) % FIELDS.num_experts).astype(np.uint8),  # distinct top-k
        "topk_ids": rng.integers(0, 150_000, (c, FIELDS.logprobs_k), dtype=np.int32),
        "topk_logprobs": -rng.exponential(2.0, (c, FIELDS.logprobs_k)).astype(np.float32),
        "sample_support": support,
    }


def vary(fields: dict[str, np.ndarray], i: int) -> None:
    """Make branch ``i`` distinct by a few bytes (in place)."""
    fields["routed_experts"][0, 0] = (np.arange(FIELDS.top_k) + i) % FIELDS.num_experts  # still distinct ids
    fields["topk_ids"][0, 0] = i
    fields["topk_logprobs"][0, 0] = -i * 1e-3
    fields["sample_support"][0, 0] = i


class FsCounter:
    """Filesystem calls of each side, per phase, from CPython audit events.

    The raw sides name absolute paths under their roots. refpipe's local store opens the run prefix by its
    path and resolves every key below it from directory fds (``openat(O_PATH | O_NOFOLLOW)`` per component,
    then the operation relative to the last one, the directory fds cached: ``ConfinedPrefix.at``), so its calls
    name a bare entry name: a relative path is refpipe's, and its ``O_PATH`` opens (the run prefix's included) count as
    ``walk``, apart from the calls that touch data or create entries.
    """

    EVENTS = {"open", "os.mkdir", "os.link", "os.rename", "os.remove", "os.rmdir", "os.listdir", "os.scandir"}

    def __init__(self, roots: dict[str, str]):
        self.roots = roots
        self.phase = None
        self.ops = {(s, p): Counter() for s in SIDES for p in PHASES}
        self.created = {(s, p): 0 for s in SIDES for p in PHASES}
        sys.addaudithook(self._hook)

    def _hook(self, event: str, args: tuple) -> None:
        if self.phase is None or event not in self.EVENTS:
            return
        path = str(args[1] if event in ("os.link", "os.rename") else args[0])
        side = "refpipe" if not path.startswith("/") else next(
            (side for side, root in self.roots.items() if path.startswith(root) or path == root.rstrip("/")), None)
        if side is None:
            return
        walk = event == "open" and args[2] & os.O_PATH
        self.ops[side, self.phase]["walk" if walk else event] += 1
        if event in ("os.mkdir", "os.link") or (event == "open" and args[2] & os.O_CREAT):
            self.created[side, self.phase] += 1


class S3Counter:
    """S3 requests each side's client sends, per phase, by kind (botocore ``request-created`` events)."""

    KINDS = {"PutObject": "PUT", "GetObject": "GET", "HeadObject": "HEAD", "DeleteObjects": "DELETE",
             "DeleteObject": "DELETE", "ListObjectsV2": "LIST", "ListObjects": "LIST"}

    def __init__(self, stores: dict[str, Store]):
        self.phase = None
        self.requests = {(s, p): Counter() for s in SIDES for p in PHASES}
        for side, store in stores.items():
            store.fs.s3.meta.events.register("request-created.s3", self._hook(side))

    def _hook(self, side: str):
        def count(operation_name, **_):
            if self.phase is not None:
                self.requests[side, self.phase][self.KINDS.get(operation_name, operation_name)] += 1
        return count


class RawFiles:
    """The baseline on a directory: one file per field, plain open/write/read/remove."""

    def __init__(self, root: str, threads: int):
        self.root, self.threads = root, threads

    def _path(self, i: int, name: str) -> str:
        return f"{self.root}/{i % 256:02x}/b{i:06d}.{name}"

    def keep(self, i: int, fields: dict[str, np.ndarray]) -> None:
        for name, a in fields.items():
            path = self._path(i, name)
            try:
                f = open(path, "wb")
            except FileNotFoundError:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                f = open(path, "wb")
            with f:
                f.write(a)

    def fetch(self, batch: list[int], specs: dict) -> list[dict[str, np.ndarray]]:
        def one(i: int) -> dict[str, np.ndarray]:
            out = {}
            for name, (dtype, shape) in specs.items():
                with open(self._path(i, name), "rb") as f:
                    out[name] = np.frombuffer(f.read(), dtype).reshape(shape)
            return out

        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(one, batch))

    def delete(self, batch: list[int], names) -> None:
        for i in batch:
            for name in names:
                os.remove(self._path(i, name))


class RawObjects:
    """The baseline on S3: one object per field through the same client (one PUT / GET each), batched deletes."""

    def __init__(self, store: Store, threads: int):
        self.store, self.threads = store, threads

    def keep(self, i: int, fields: dict[str, np.ndarray]) -> None:
        for name, a in fields.items():
            self.store.put(f"b{i:06d}.{name}", a.reshape(-1).view(np.uint8))

    def fetch(self, batch: list[int], specs: dict) -> list[dict[str, np.ndarray]]:
        def one(i: int) -> dict[str, np.ndarray]:
            return {name: np.frombuffer(self.store.get(f"b{i:06d}.{name}"), dtype).reshape(shape)
                    for name, (dtype, shape) in specs.items()}

        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(one, batch))

    def delete(self, batch: list[int], names) -> None:
        self.store.delete_keys([f"b{i:06d}.{name}" for i in batch for name in names])


class OneFile:
    """The minimum a keep can do on a directory: the branch's bytes as one raw file (``os.writev`` of the
    fields), read back whole (one ``read``) and cut into fields with ``np.frombuffer``, removed with
    ``os.remove``: no metadata, no checksum, no atomicity, no exactly-once."""

    def __init__(self, root: str, threads: int):
        self.root, self.threads = root, threads

    def _path(self, i: int) -> str:
        return f"{self.root}/{i % 256:02x}/b{i:06d}"

    def keep(self, i: int, fields: dict[str, np.ndarray]) -> None:
        path = self._path(i)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        except FileNotFoundError:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.writev(fd, [a.reshape(-1).view(np.uint8) for a in fields.values()])
        finally:
            os.close(fd)

    def fetch(self, batch: list[int], specs: dict) -> list[dict[str, np.ndarray]]:
        def one(i: int) -> dict[str, np.ndarray]:
            with open(self._path(i), "rb") as f:
                data = f.read()
            return _cut(data, specs)

        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(one, batch))

    def delete(self, batch: list[int], names) -> None:
        for i in batch:
            os.remove(self._path(i))


class OneObject:
    """``OneFile`` on S3: one object per branch (one PUT, one GET), batched deletes."""

    def __init__(self, store: Store, threads: int):
        self.store, self.threads = store, threads

    def keep(self, i: int, fields: dict[str, np.ndarray]) -> None:
        self.store.put(f"b{i:06d}", [a.reshape(-1).view(np.uint8) for a in fields.values()])

    def fetch(self, batch: list[int], specs: dict) -> list[dict[str, np.ndarray]]:
        with ThreadPoolExecutor(self.threads) as pool:
            return list(pool.map(lambda i: _cut(self.store.get(f"b{i:06d}"), specs), batch))

    def delete(self, batch: list[int], names) -> None:
        self.store.delete_keys([f"b{i:06d}" for i in batch])


def _cut(data: bytes, specs: dict) -> dict[str, np.ndarray]:
    """The fields of one branch's concatenated bytes (``specs``: name -> (dtype, shape), in order)."""
    out, offset = {}, 0
    for name, (dtype, shape) in specs.items():
        count = int(np.prod(shape))
        out[name] = np.frombuffer(data, dtype, count, offset).reshape(shape)
        offset += count * np.dtype(dtype).itemsize
    return out


class Refpipe:
    """The refpipe side: ``Keeper.keep``, ``fetch_arrays`` (whole chunks, ``bounded_map``), ``Ledger.release`` (each
    delete call one step)."""

    def __init__(self, store: Store, config: StorageConfig, threads: int):
        self.store, self.threads = store, threads
        self.ledger = Ledger(store, "bench_env_worker")
        self.keeper = Keeper(store, self.ledger, FIELDS, config)
        self.refs: dict[int, object] = {}
        self.releases = 0

    def keep(self, i: int, fields: dict[str, np.ndarray]) -> None:
        self.refs[i] = self.keeper.keep(Branch(PROMPT_TOKENS, COMPLETION_TOKENS, fields, f"b{i:06d}"))

    def fetch(self, batch: list[int], specs: dict) -> list:
        return bounded_map(lambda i: fetch_arrays(self.store, self.refs[i]), batch, self.threads)

    def delete(self, batch: list[int], names) -> None:
        self.ledger.release(self.releases, [self.refs[i] for i in batch], reason="bench")
        self.ledger.wait_freed()  # until the bytes are removed, like os.remove
        self.releases += 1


def run(args, sides: dict, counter) -> dict:
    """Keep, fetch and delete ``args.branches`` branches on both sides, round by round; return times and counts."""
    fields = base_fields()
    specs = {name: (a.dtype, a.shape) for name, a in fields.items()}
    rounds = [list(r) for r in np.array_split(np.arange(args.branches), args.rounds) if len(r)]
    ledger = sides["refpipe"].ledger
    seconds, ledger_seconds = Counter(), {}
    for phase in PHASES:
        os.sync()  # untimed: start each phase with no dirty pages from earlier phases or runs
        before = ledger.ledger_seconds
        for r, batch in enumerate(rounds):
            for name in (SIDES if r % 2 == 0 else SIDES[::-1]):
                counter.phase = phase
                started = time.perf_counter()
                _do(phase, sides[name], batch, fields, specs, args.fetch_batch)
                seconds[name, phase] += time.perf_counter() - started
                counter.phase = None
        ledger_seconds[phase] = ledger.ledger_seconds - before
        if phase == "keep":
            objects = len(sides["refpipe"].store.list_prefix("payloads"))
    ledger.close()
    return {"seconds": seconds, "ledger_seconds": ledger_seconds, "objects": objects,
            "branch_nbytes": sum(a.nbytes for a in fields.values())}


def _do(phase: str, side, batch: list[int], fields: dict, specs: dict, fetch_batch: int) -> None:
    """One side's work on one round's branches: keep each, fetch in groups (bounding memory), or delete all."""
    if phase == "keep":
        for i in batch:
            vary(fields, i)
            side.keep(i, fields)
    elif phase == "fetch":
        for group in _groups(batch, fetch_batch):
            _check_fetched(side.fetch(group, specs), group)
    else:
        side.delete(batch, list(fields))


def _groups(batch: list[int], size: int) -> list[list[int]]:
    return [batch[i:i + size] for i in range(0, len(batch), size)]


def _check_fetched(results: list, group: list[int]) -> None:
    for result, i in zip(results, group):
        if isinstance(result, Exception) or int(result["topk_ids"][0, 0]) != i:
            raise RuntimeError(f"branch {i}: fetched {result!r:.200}")


def validation_seconds(repeats: int = 20) -> float:
    """Best-of-``repeats`` seconds of the data contract's checks of one branch (``validate_branch``, as keep does)."""
    fields, best = base_fields(), float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        validate_branch(fields, FIELDS, num_prompt_tokens=PROMPT_TOKENS, num_completion_tokens=COMPLETION_TOKENS,
                        what="bench")
        best = min(best, time.perf_counter() - started)
    return best


def report(args, res: dict, counter, backend: str) -> dict:
    """Print the table; return the JSON summary."""
    n, sec = args.branches, res["seconds"]
    gib = n * res["branch_nbytes"] / 2**30
    ratio = {p: sec["refpipe", p] / sec["raw", p] for p in PHASES}
    vs_one = {p: sec["refpipe", p] / sec["one_file", p] for p in PHASES}
    summary = {
        "backend": backend, "branches": n, "mib_per_branch": round(res["branch_nbytes"] / 2**20, 3),
        "keep_time_ratio": round(ratio["keep"], 3),
        "fetch_throughput_ratio": round(1 / ratio["fetch"], 3),
        "delete_time_ratio": round(ratio["delete"], 3),
        "keep_time_vs_one_file": round(vs_one["keep"], 3),
        "fetch_throughput_vs_one_file": round(1 / vs_one["fetch"], 3),
        "delete_time_vs_one_file": round(vs_one["delete"], 3),
        "ledger_overhead_ratio": round((res["ledger_seconds"]["keep"] + res["ledger_seconds"]["delete"])
                                       / (sec["refpipe", "keep"] + sec["refpipe", "delete"]), 4),
        "validation_share_of_keep": round(validation_seconds() * n / sec["refpipe", "keep"], 4),
        "objects_per_branch": round(res["objects"] / n, 3),
        "raw_objects_per_branch": 4,
        "seconds": {f"{s}_{p}": round(sec[s, p], 3) for s in SIDES for p in PHASES},
        "fetch_gib_per_s": {s: round(gib / sec[s, "fetch"], 3) for s in SIDES},
    }
    print(f"{n} branches x {res['branch_nbytes'] / 2**20:.2f} MiB ({gib:.2f} GiB per side), backend {backend}")
    print(f"{'phase':7s} {'refpipe s':>10s} {'raw s':>9s} {'1-file s':>9s} {'vs raw':>9s} {'vs 1-file':>10s}   "
          f"per branch: refpipe | raw | one file")
    for p in PHASES:
        shown = [f"{1 / r[p]:.3f} thr" if p == "fetch" else f"{r[p]:.3f}" for r in (ratio, vs_one)]
        print(f"{p:7s} {sec['refpipe', p]:10.3f} {sec['raw', p]:9.3f} {sec['one_file', p]:9.3f} {shown[0]:>9s} "
              f"{shown[1]:>10s}   {_counts(counter, p, n)}")
    print(f"ledger (record/flush/claims): keep {res['ledger_seconds']['keep']:.3f} s, "
          f"delete {res['ledger_seconds']['delete']:.3f} s; objects per branch {summary['objects_per_branch']}")
    summary.update(_count_summary(counter, n))
    return summary


def _counts(counter, phase: str, n: int) -> str:
    if isinstance(counter, S3Counter):
        return " | ".join(_fmt({k: v / n for k, v in counter.requests[s, phase].items()}) for s in SIDES)
    return " | ".join(f"{sum(counter.ops[s, phase].values()) / n:.2f} ops ({_fmt(_short(counter.ops[s, phase], n))}), "
                      f"{counter.created[s, phase] / n:.2f} created" for s in SIDES)


def _short(ops: Counter, n: int) -> dict:
    return {k.removeprefix("os."): v / n for k, v in ops.items()}


def _fmt(d: dict) -> str:
    return " ".join(f"{k} {v:.3g}" for k, v in sorted(d.items())) or "none"


def _count_summary(counter, n: int) -> dict:
    if isinstance(counter, S3Counter):
        return {"s3_requests_per_branch": {p: {s: {k: round(v / n, 3)
                                                   for k, v in sorted(counter.requests[s, p].items())}
                                               for s in SIDES} for p in PHASES}}
    return {
        "fs_ops_per_branch": {p: {s: round(sum(counter.ops[s, p].values()) / n, 3) for s in SIDES} for p in PHASES},
        "fs_ops_by_kind_per_branch": {p: {s: {k: round(v, 3) for k, v in sorted(_short(counter.ops[s, p], n).items())}
                                          for s in SIDES} for p in PHASES},
        "fs_entries_created_per_branch": {p: {s: round(counter.created[s, p] / n, 3) for s in SIDES}
                                          for p in PHASES},
    }


def start_moto() -> tuple[subprocess.Popen, str]:
    """A moto S3 server in its own process on a free loopback port; large objects spool to disk."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MOTO_S3_DEFAULT_KEY_BUFFER_SIZE=str(1 << 20))
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("moto server did not start")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--branches", type=positive_int, default=1024, help="branches kept, fetched and deleted per side")
    p.add_argument("--dir", help="directory to work in (default: a fresh temp dir on /tmp, removed afterwards)")
    p.add_argument("--rounds", type=positive_int, default=16, help="rounds; the sides alternate going first")
    p.add_argument("--threads", type=positive_int, default=8, help="fetch threads per side")
    p.add_argument("--fetch-batch", type=positive_int, default=32, help="branches per fetch call (bounds memory)")
    p.add_argument("--s3-endpoint", help="run against this S3 endpoint (a fresh bucket is created)")
    p.add_argument("--s3-moto", action="store_true", help="start a moto S3 server and run against it")
    args = p.parse_args()
    if args.s3_endpoint or args.s3_moto:
        summary = run_s3(args)
    else:
        summary = run_local(args)
    print(json.dumps(summary))


def run_local(args) -> dict:
    workdir = args.dir or tempfile.mkdtemp(prefix="refpipe-bench-keep-", dir="/tmp")
    os.makedirs(workdir, exist_ok=True)
    config = StorageConfig(root=os.path.join(workdir, "refpipe"), run_id=f"bench_{uuid.uuid4().hex[:8]}")
    raw_root = os.path.join(workdir, "raw", config.run_id)
    store = open_store(config)
    one_root = os.path.join(workdir, "one_file", config.run_id)
    counter = FsCounter({"refpipe": store.prefix.path + "/", "raw": raw_root + "/", "one_file": one_root + "/"})
    sides = {"refpipe": Refpipe(store, config, args.threads), "raw": RawFiles(raw_root, args.threads),
             "one_file": OneFile(one_root, args.threads)}
    try:
        res = run(args, sides, counter)
    finally:
        shutil.rmtree(os.path.join(workdir, "refpipe", config.run_id), ignore_errors=True)
        shutil.rmtree(raw_root, ignore_errors=True)
        shutil.rmtree(one_root, ignore_errors=True)
        if not args.dir:
            shutil.rmtree(workdir, ignore_errors=True)
    return {"dir": workdir, "filesystem": _fstype(workdir), **report(args, res, counter, "local")}


def run_s3(args) -> dict:
    import boto3

    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        if args.s3_moto:
            os.environ.setdefault(var, value)
    moto = start_moto() if args.s3_moto else None
    endpoint = moto[1] if moto else args.s3_endpoint
    bucket = f"refpipe-bench-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    config = StorageConfig(root=f"s3://{bucket}/refpipe", run_id="bench", s3_endpoint_url=endpoint)
    raw_store = open_store(StorageConfig(root=f"s3://{bucket}/raw", run_id="bench", s3_endpoint_url=endpoint))
    one_store = open_store(StorageConfig(root=f"s3://{bucket}/one", run_id="bench", s3_endpoint_url=endpoint))
    try:
        store = open_store(config)
        counter = S3Counter({"refpipe": store, "raw": raw_store, "one_file": one_store})
        sides = {"refpipe": Refpipe(store, config, args.threads), "raw": RawObjects(raw_store, args.threads),
                 "one_file": OneObject(one_store, args.threads)}
        res = run(args, sides, counter)
    finally:
        if moto:
            moto[0].kill()
    return {"s3_endpoint": endpoint, **report(args, res, counter, "s3 (moto)" if moto else "s3")}


def _fstype(path: str) -> str:
    best = ("", "?")
    with open("/proc/mounts") as f:
        for line in f:
            _, mount, fstype = line.split()[:3]
            if path.startswith(mount) and len(mount) > len(best[0]):
                best = (mount, fstype)
    return best[1]


if __name__ == "__main__":
    main()
