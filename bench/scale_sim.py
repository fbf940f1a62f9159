"""Metadata at scale: the lifecycle of N tiny chunks (keep, ship, release, audit) on a local directory.

For each N (``--sizes``, default 10,000 and 100,000; 1,000,000 with ``--sizes 10000,100000,1000000``),
in steps of 1,024 chunks: keep branches of 1 prompt + 1 completion token with routing only
(``[2, 1, 1]`` uint8, one env worker through the real keep path), ship them (one step file, one
DP rank), release them through the trainer's ledger (``Ledger.delete``: commit-marker check,
exclusive delete record, unlinks) and audit incrementally; then audit the finished run
(``pipeline.audit.audit``), incrementally and in full.
Prints per N the seconds of each phase (and the keep phase's user and system CPU seconds: on a shared
machine wall time also counts other processes' load), the largest directory (entries) and where it is,
and the audit seconds per chunk; progress every 64 steps on stderr. After each N past the first, and
last: one JSON object with ``max_entries_per_dir`` (at the largest N so far),
``max_entries_per_dir_at_10M`` and its directory (each kind of directory's largest extrapolated linearly
from the smallest and largest N, capped where the layout bounds it), and ``audit_seconds_growth`` (audit
seconds per chunk at the largest N over the smallest: 1.0 means the audit costs the same per
chunk at every size; a full audit lists every delete record, so it stays linear in N). The
incremental audit (``audit(incremental=True)``) runs after every step (``step_audit_s_min_max``) and
once more at the end:
``incremental_audit_seconds`` is that last one per N (it reads what is new: the last step's
1,024 chunks and the closing segments), and ``incremental_audit_seconds_growth`` its seconds at
the largest N over the smallest (1.0: each audit costs what is new, whatever the run's size;
what still grows with N is the listing of ``steps/`` and ``ledger/events/`` and the summary's
list of covered segments, one key per 1,024 chunks and per segment).

Feasibility: on the shared 2-core machine this project is measured on (load ~2), the lifecycle runs at
~600 chunks/s (keep ~0.8 ms, ship+release ~0.75 ms per chunk), so 1M chunks take ~30 min plus the
audits; the default stops at 100,000 and 10M is extrapolated.

Usage: ``.venv/bin/python bench/scale_sim.py [--sizes 10000,100000] [--tmp /tmp]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from refpipe.pipeline.audit import audit
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.pipeline.step_file import publish_step_file
from refpipe.pipeline.step_header import SCHEMA_VERSION, MicroBatchRecord, SequenceRecord, StepHeader
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.layout import EVENTS_PREFIX, SEGMENTS_PER_DIRECTORY
from refpipe.storage.ledger import Ledger
from refpipe.storage.store import Store

FIELDS = FieldsConfig(num_layers=1, top_k=1, num_experts=2, logprobs_k=1, support_width=1)
PER_STEP = 1024
TOKENS = 2


STREAMS = {"input_ids": np.zeros(TOKENS, np.int32), "loss_mask": np.ones(TOKENS, bool),
           "advantages": np.zeros(TOKENS, np.float32), "inference_logprobs": np.zeros(TOKENS, np.float32),
           "position_ids": np.arange(TOKENS, dtype=np.int32), "temperatures": np.ones(TOKENS, np.float32)}


def ship(store: Store, step: int, step_refs: list) -> None:
    """Publish step ``step`` shipping ``step_refs`` (one micro batch per ref, DP rank 0)."""
    records = [MicroBatchRecord(dp_rank=0, index=i, num_padding_tokens=0, has_routing=True,
                                sequences=[SequenceRecord(num_tokens=TOKENS, env_name="sim", ref=i)])
               for i in range(len(step_refs))]
    header = StepHeader(schema_version=SCHEMA_VERSION, run_uri=store.prefix.uri, step=step, seq_len=TOKENS,
                        dp_world_size=1, micro_batches=records, refs=step_refs, owners=[0] * len(step_refs),
                        fields=FIELDS)
    publish_step_file(store, header, {(0, r.index): STREAMS for r in records})


def lifecycle(store: Store, storage: StorageConfig, n: int) -> dict[str, float | list[float]]:
    """Per step of ``PER_STEP`` chunks: keep them (one env worker), ship them, release them through the trainer's
    ledger, then audit incrementally (``stopped``: no waiting on the live sessions' heartbeats). Returns seconds:
    ``keep_s``, ``ship_release_s`` (sums) and ``step_audits_s`` (one per step)."""
    keeper = Keeper(store, Ledger(store, "env_worker_0"), FIELDS, storage)
    trainer = Ledger(store, "trainer_dp0")
    routing = np.zeros((TOKENS, 1, 1), np.uint8)
    begun = time.perf_counter()
    seconds: dict = {"keep_s": 0.0, "keep_cpu_s": [0.0, 0.0], "ship_release_s": 0.0, "step_audits_s": []}
    for step, first in enumerate(range(0, n, PER_STEP)):
        started, cpu = time.perf_counter(), os.times()
        refs = [keeper.keep(Branch(1, 1, {"routed_experts": routing}, branch_id=f"b{i:08d}"))
                for i in range(first, min(n, first + PER_STEP))]
        keeper.ledger.flush()
        shipped, cpu_shipped = time.perf_counter(), os.times()
        ship(store, step, refs)
        trainer.delete(refs, reason=f"trained step {step}")
        trainer.record("release", step=step, dp_rank=0)
        trainer.flush()
        audited = time.perf_counter()
        audit(store, stopped=True, incremental=True)
        seconds["keep_s"] += shipped - started
        seconds["keep_cpu_s"][0] += cpu_shipped.user - cpu.user
        seconds["keep_cpu_s"][1] += cpu_shipped.system - cpu.system
        seconds["ship_release_s"] += audited - shipped
        seconds["step_audits_s"].append(time.perf_counter() - audited)
        if step % 64 == 63:
            print(f"N={n}: {first + PER_STEP} chunks in {time.perf_counter() - begun:.0f} s "
                  f"(keep {seconds['keep_s']:.0f} s, ship+release {seconds['ship_release_s']:.0f} s)",
                  file=sys.stderr, flush=True)
    keeper.ledger.close()
    trainer.close()
    return seconds


SHARD = re.compile(r"[0-9a-f]{2}")
SESSION = re.compile(rf"(?<=^{EVENTS_PREFIX}/)([^/]+)/\d+-\d+(?=/|$)")
BUCKET = re.compile(r"(?<=/<session>/)\d{4,}$")


def directory_classes(root: str) -> dict[str, int]:
    """Directory class -> the most entries any directory of that class holds under ``root``. A class is a
    path with its hash shards written ``<xx>`` (``ledger/deletes/<xx>/<xx>``, ``payloads``, ``steps``) and a
    ledger session and its segment buckets as ``<session>`` and ``<bucket>``
    (``ledger/events/<actor>/<session>/<bucket>``); a class whose entries are all shard directories (a fan-out
    level: at most 256) ends in ``/*``."""
    classes: dict[str, int] = {}
    for directory, dirs, files in os.walk(root):
        name = re.sub(r"(?<=/)[0-9a-f]{2}(?=/|$)", "<xx>", os.path.relpath(directory, root))
        name = BUCKET.sub("<bucket>", SESSION.sub(r"\1/<session>", name))
        if dirs and not files and all(SHARD.fullmatch(d) for d in dirs):
            name += "/*"
        classes[name] = max(classes.get(name, 0), len(dirs) + len(files))
    return classes


def extrapolate(first: dict, last: dict, n: int) -> tuple[int, str]:
    """(entries, class) of the largest directory at ``n`` chunks: each class's largest directory extrapolated
    linearly from the smallest and largest simulated N (an upper bound: the max of hashed shards grows slower),
    capped where the layout bounds it (a shard level at 256, a segment bucket at ``SEGMENTS_PER_DIRECTORY``)."""
    n0, n1 = first["chunks"], last["chunks"]
    best = (0, "")
    for name, e1 in last["classes"].items():
        e0 = first["classes"].get(name, 0)
        entries = round(e1 + (e1 - e0) * (n - n1) / (n1 - n0)) if n1 > n0 else e1
        if name.endswith("/*"):
            entries = min(entries, 256)
        elif name.endswith("/<bucket>"):
            entries = min(entries, SEGMENTS_PER_DIRECTORY)
        best = max(best, (entries, name.removesuffix("/*")))
    return best


def simulate(tmp: str, n: int) -> dict:
    """The whole lifecycle of ``n`` chunks in a fresh run; its timings and largest directory."""
    run_dir = tempfile.mkdtemp(prefix="refpipe-scale-", dir=tmp)
    try:
        storage = StorageConfig(root=run_dir, run_id="sim")
        store = open_store(storage)
        row: dict = {"chunks": n}
        seconds = lifecycle(store, storage, n)
        row["keep_s"], row["ship_release_s"] = round(seconds["keep_s"], 2), round(seconds["ship_release_s"], 2)
        row["keep_cpu_user_sys_s"] = [round(x, 2) for x in seconds["keep_cpu_s"]]
        row["step_audit_s_min_max"] = [round(min(seconds["step_audits_s"]), 3), round(max(seconds["step_audits_s"]), 3)]
        started = time.perf_counter()
        incremental = audit(store, finished=True, incremental=True)
        row["incremental_audit_s"] = round(time.perf_counter() - started, 3)
        started = time.perf_counter()
        report = audit(store, finished=True)
        row["audit_s"] = round(time.perf_counter() - started, 3)
        if not report.clean or report.deleted != n or incremental != report:
            raise SystemExit(f"N={n}: audit not clean or incremental != full: {report.violations[:3]} "
                             f"deleted={report.deleted} incremental deleted={incremental.deleted}")
        row["audit_us_per_chunk"] = round(row["audit_s"] / n * 1e6, 2)
        row["classes"] = directory_classes(store.prefix.path)
        row["max_entries_per_dir"], row["largest_dir"] = max((e, name) for name, e in row["classes"].items())
        return row
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def summary(rows: list[dict]) -> dict:
    """The bench's result over ``rows`` (ascending N): largest directories, extrapolation to 10M, audit growth."""
    first, last = rows[0], rows[-1]
    at_10m, at_10m_dir = extrapolate(first, last, 10_000_000)
    return {"bench": "scale_sim", "sizes": [r["chunks"] for r in rows],
            "max_entries_per_dir": last["max_entries_per_dir"], "largest_dir": last["largest_dir"],
            "max_entries_per_dir_at_10M": at_10m,
            "largest_dir_at_10M": at_10m_dir,
            "audit_seconds": [r["audit_s"] for r in rows],
            "audit_seconds_growth": round(last["audit_us_per_chunk"] / first["audit_us_per_chunk"], 2),
            "incremental_audit_seconds": [r["incremental_audit_s"] for r in rows],
            "incremental_audit_seconds_growth": round(last["incremental_audit_s"] / first["incremental_audit_s"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000", help="comma-separated chunk counts, ascending")
    parser.add_argument("--tmp", default="/tmp")
    args = parser.parse_args()
    try:
        sizes = [int(x) for x in args.sizes.split(",")]
    except ValueError:
        sizes = []
    if not sizes or any(n < PER_STEP for n in sizes) or sizes != sorted(sizes):
        raise SystemExit(f"--sizes {args.sizes!r}: expected ascending integers >= {PER_STEP}, comma-separated")
    Path(args.tmp).mkdir(parents=True, exist_ok=True)
    rows = []
    for n in sizes:
        rows.append(simulate(args.tmp, n))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "classes"}), flush=True)
        if len(rows) > 1 or n == sizes[-1]:
            print(json.dumps(summary(rows)), flush=True)  # so far: a run stopped before the largest N still has one


if __name__ == "__main__":
    main()
