"""Multi-turn rollouts kept turn by turn: bytes written, env-server memory, append time, fetch, shared prompts.

One env-server worker (this process, a local directory) keeps ``--branches`` branches in groups of
``--group-size`` sharing a ``--prompt-tokens`` prompt (``Keeper.keep_prefix``, once per group) and appends
``--turns`` turns of ``--turn-tokens`` new routing rows ``[tokens, layers, top_k]`` uint8 to each
(``OpenBranch.append``), every branch live at once, turn by turn. At the middle turn a step boundary cuts every
branch (``suspend``), the worker restarts (its ledger is closed, a new one opened) and resumes and finishes them.
Then every branch is closed and its rows are kept again whole (``Keeper.keep``, the baseline), each ref is fetched
into a buffer of its size (``fetch_into`` on ``StorageConfig.fetch_threads()`` threads, as a trainer rank reads its
micro batches), alternating segmented and whole refs, and everything is released (segments, shared prompts
after their last holder) and audited.

``python bench/multi_turn.py [--branches 64] [--turns 50] [--turn-tokens 300] [--prompt-tokens 2048]
[--group-size 8] [--layers 48] [--top-k 8] [--rounds 3] [--dir DIR]``

Last line: a JSON object: ``bytes_written_vs_unique_rows`` (bytes under ``payloads/`` after the appends, zarr.json
included / bytes of distinct rows), ``env_peak_rss_growth_vs_one_turn`` (peak RSS growth of this process while
appending / one turn's rows of every live branch), ``keep_seconds_last_vs_first_turns`` (append seconds of the last
10 turns / the first 10), ``fetch_segmented_vs_whole`` (fetch throughput of the segmented refs / the same rows kept
whole, best round each), ``raw_read_segmented_vs_whole`` (the same for the objects' bytes alone, read on the same
threads with ``os.open``/``os.preadv``/``close`` into one buffer per ref, touched before (no page faults), and
crc32c'd, no refpipe code, in thread CPU seconds summed over the threads, best round each, as wall time on a 2-core
machine shared with other work is too noisy for it: the ceiling the page cache and the objects' layout leave
``fetch_segmented_vs_whole``; the fetches' CPU seconds are printed beside it), ``shared_prefix_copies`` (most chunks
of one group holding prompt rows), ``partial_rollouts_continued`` (branches suspended and finished after a restart,
byte-identical to their rows kept whole) and ``audit_violations`` (``audit --finished`` after the release).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import psutil
from _args import positive_int  # noqa: E402  (bench/ is sys.path[0] when run as a script)

from refpipe.pipeline.audit import audit
from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.backends import open_store
from refpipe.storage.checksum import crc32c
from refpipe.storage.chunk_codec import read_attributes
from refpipe.storage.chunk_read import fetch_into
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.concurrency import bounded_map
from refpipe.storage.config import StorageConfig
from refpipe.storage.layout import chunk_keys
from refpipe.storage.ledger import Ledger
from refpipe.storage.store import Store, byte_view

NUM_EXPERTS = 256


def rows(seed: int, n: int, layers: int, top_k: int) -> np.ndarray:
    """Routing rows of ``n`` tokens, distinct experts per (token, layer), reproducible from ``seed``."""
    base = np.random.default_rng(seed).integers(0, NUM_EXPERTS, (n, layers, 1), dtype=np.uint16)
    return ((base + np.arange(top_k, dtype=np.uint16)) % NUM_EXPERTS).astype(np.uint8)


class PeakRss:
    """Samples this process's RSS every millisecond while active."""

    def __init__(self) -> None:
        self.proc, self.peak, self.done = psutil.Process(), 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.done.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.001)

    def __enter__(self) -> "PeakRss":
        self.start = self.proc.memory_info().rss
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        self.thread.join()


def fetch_all(store: Store, refs: dict[str, PayloadRef], buffers: dict[str, np.ndarray]) -> float:
    """Read every ref into its buffer on ``StorageConfig.fetch_threads()`` threads, as a trainer rank does; return the
    CPU seconds of those threads (user and system), summed."""
    def fetch(i: str) -> float:
        started = time.thread_time()
        fetch_into(store, refs[i], None, {"routed_experts": buffers[i]})
        return time.thread_time() - started

    return sum(bounded_map(fetch, list(refs), store.config.fetch_threads()))


def object_runs(root: Path, ref: PayloadRef) -> list[tuple[Path, int, int]]:
    """What a fetch of ``ref`` reads: (path, offset, bytes) of each object, its segments' bytes taken together."""
    runs: dict[Path, list[int]] = {}
    for s in ref.segments or (ref,):
        run = runs.setdefault(root / chunk_keys(s.key)[0], [s.offset or 0, 0])
        run[1] += s.nbytes
    return [(path, offset, nbytes) for path, (offset, nbytes) in runs.items()]


def read_raw(runs: list[tuple[Path, int, int]], buffer: np.ndarray) -> float:
    """Read the runs into ``buffer`` in order (``open``, one ``preadv``, ``close`` each) and crc32c each; return the
    CPU seconds of this thread (user and system) it took."""
    started, view, at = time.thread_time(), byte_view(buffer), 0
    for path, offset, nbytes in runs:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.preadv(fd, [view[at : at + nbytes]], offset)
        finally:
            os.close(fd)
        crc32c(view[at : at + nbytes])
        at += nbytes
    return time.thread_time() - started


def payload_bytes(root: Path) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root / "payloads") for f in files)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name, default in (("branches", 64), ("turns", 50), ("turn-tokens", 300), ("prompt-tokens", 2048),
                          ("group-size", 8), ("layers", 48), ("top-k", 8), ("rounds", 3)):
        parser.add_argument(f"--{name}", type=positive_int, default=default)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    a = parser.parse_args()
    config = StorageConfig(root=tempfile.mkdtemp(prefix="refpipe-bench-", dir=a.dir), run_id="multi_turn")
    fields = FieldsConfig(num_layers=a.layers, top_k=a.top_k, num_experts=NUM_EXPERTS)
    store = open_store(config)
    keeper = Keeper(store, Ledger(store, "env_worker_0"), fields, config)
    groups = -(-a.branches // a.group_size)
    ids = [f"g{b // a.group_size}-b{b}" for b in range(a.branches)]
    p, turn, cut = a.prompt_tokens, a.turn_tokens, a.turns // 2

    def turn_rows(b: int, t: int) -> np.ndarray:
        return rows(1000 * b + t + 1, turn, a.layers, a.top_k)

    prefixes = [keeper.keep_prefix(p, {"routed_experts": rows(10**9 + g, p, a.layers, a.top_k)},
                                   holders=ids[g * a.group_size : (g + 1) * a.group_size], prefix_id=f"g{g}-prompt")
                for g in range(groups)]
    branches = {i: keeper.open_branch(p, branch_id=i, prefix=prefixes[b // a.group_size]) for b, i in enumerate(ids)}
    turn_seconds = []
    with PeakRss() as rss:
        for t in range(a.turns):
            started = time.perf_counter()
            if t == cut:  # a step boundary cuts every rollout; the env server restarts and continues them
                for i in ids:
                    branches[i].suspend()
                keeper.ledger.close()
                keeper = Keeper(store, Ledger(store, "env_worker_0"), fields, config)
                branches = {i: keeper.resume_branch(i) for i in ids}
            for b, i in enumerate(ids):
                start = p + t * turn
                branches[i].append(start, start + turn, {"routed_experts": turn_rows(b, t)})
            turn_seconds.append(time.perf_counter() - started)
    refs = {i: branches[i].close() for i in ids}
    written = payload_bytes(Path(config.root) / config.run_id)
    row_bytes = a.layers * a.top_k
    unique = (groups * p + a.branches * a.turns * turn) * row_bytes
    one_turn = a.branches * turn * row_bytes
    copies = max(sum(read_attributes(store.get(f"{s.key}/zarr.json"))["num_prompt_tokens"] > 0
                     for i in ids[g * a.group_size : (g + 1) * a.group_size] for s in refs[i].segments
                     if s.branch_id != f"g{g}-prompt") + 1 for g in range(groups))

    wholes = {}
    for b, i in enumerate(ids):
        prompt = rows(10**9 + b // a.group_size, p, a.layers, a.top_k)
        whole = np.concatenate([prompt, *(turn_rows(b, t) for t in range(a.turns))])
        wholes[i] = keeper.keep(Branch(p, a.turns * turn, {"routed_experts": whole}, branch_id=f"{i}-whole"))
    n = p + a.turns * turn
    seconds: dict[str, list[float]] = {"segmented": [], "whole": []}
    cpu_seconds: dict[str, list[float]] = {"segmented": [], "whole": []}
    raw_seconds: dict[str, list[float]] = {"segmented": [], "whole": []}
    continued = 0
    for r in range(a.rounds):
        for kind, chosen in (("segmented", refs), ("whole", wholes)) if r % 2 == 0 else \
                (("whole", wholes), ("segmented", refs)):
            buffers = {i: np.empty((n, a.layers, a.top_k), np.uint8) for i in ids}
            started = time.perf_counter()
            cpu_seconds[kind].append(fetch_all(store, chosen, buffers))
            seconds[kind].append(time.perf_counter() - started)
            if r == 0 and kind == "segmented":
                other = np.empty_like(buffers[ids[0]])
                for i in ids:
                    fetch_into(store, wholes[i], None, {"routed_experts": other})
                    continued += int(np.array_equal(buffers[i], other))
            del buffers
        for kind, chosen in (("segmented", refs), ("whole", wholes)) if r % 2 == 0 else \
                (("whole", wholes), ("segmented", refs)):
            runs = [object_runs(Path(config.root) / config.run_id, ref) for ref in chosen.values()]
            raw = [np.ones(sum(nbytes for _, _, nbytes in run), np.uint8) for run in runs]  # touched: no page faults
            raw_seconds[kind].append(sum(bounded_map(lambda j: read_raw(runs[j], raw[j]), range(len(runs)),
                                                     config.fetch_threads())))
    trainer = Ledger(store, "trainer_dp0")
    trainer.delete(list(refs.values()) + list(wholes.values()), reason="bench: trained")
    for ledger in (keeper.ledger, trainer):
        ledger.close()
    report = audit(store, finished=True)

    first, last = sum(turn_seconds[:10]), sum(turn_seconds[-10:])
    summary = {
        "bytes_written_vs_unique_rows": round(written / unique, 4),
        "env_peak_rss_growth_vs_one_turn": round((rss.peak - rss.start) / one_turn, 3),
        "keep_seconds_last_vs_first_turns": round(last / first, 3),
        "fetch_segmented_vs_whole": round(min(seconds["whole"]) / min(seconds["segmented"]), 3),
        "raw_read_segmented_vs_whole": round(min(raw_seconds["whole"]) / min(raw_seconds["segmented"]), 3),
        "shared_prefix_copies": copies,
        "partial_rollouts_continued": continued,
        "audit_violations": len(report.violations),
    }
    print(f"{a.branches} branches x {a.turns} turns x {turn} tokens, prompt {p} shared by {a.group_size}, "
          f"routing [tokens, {a.layers}, {a.top_k}] uint8")
    print(f"written {written / 2**20:.1f} MiB for {unique / 2**20:.1f} MiB of distinct rows; RSS growth "
          f"{(rss.peak - rss.start) / 2**20:.1f} MiB for {one_turn / 2**20:.1f} MiB per turn of all branches")
    print(f"appends: first 10 turns {first:.3f} s, last 10 {last:.3f} s; fetch of {a.branches} refs: segmented "
          f"{min(seconds['segmented']):.3f} s, whole {min(seconds['whole']):.3f} s (best of {a.rounds}), "
          f"{min(cpu_seconds['segmented']):.3f} s and {min(cpu_seconds['whole']):.3f} s of CPU; their objects' bytes "
          f"alone: {min(raw_seconds['segmented']):.3f} s and {min(raw_seconds['whole']):.3f} s of CPU")
    print(f"audit: {report.violations or 'clean'}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
