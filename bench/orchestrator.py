"""Orchestrator memory and step-file size: refpipe (side channels by reference) vs inline.

One run, each variant in its own fresh subprocess so its peak RSS (``VmHWM`` of
``/proc/self/status``: the peak of that process's own address space, reset by exec)
is clean:

- ``env``: an env-server process generates every branch's side channels and keeps them
  with ``Keeper.keep`` under a scratch run, then writes the episodes (tokens + refs, no
  arrays) to a pickle. It is not measured.
- ``refpipe``: the orchestrator process loads those episodes, runs ``Orchestrator``
  (advantages, packing, publish) and reports its peak RSS and the step file's bytes.
- ``inline``: the baseline. The same branches with their arrays held in the
  orchestrator process (generated in place, the lower bound of what receiving them
  would cost), the same advantages and packing, and a step file holding the token
  streams plus every side-channel array, concatenated per micro batch, written
  streaming to disk (so the file is never held in memory).

Default shape: 1,024 branches of 4,096 tokens (512 prompt), routing
[tokens, 48, 8] uint8, a top-128 head (``topk_ids`` int32 + ``topk_logprobs`` float32 on
completion tokens): about 5.2 MB of side channels per branch, 5.4 GB in all.
Last line: a JSON object with ``orchestrator_peak_rss_ratio`` and ``step_file_bytes_ratio``
(refpipe over inline). Targets: <= 0.2 and <= 0.05.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile

from _args import positive_int  # noqa: E402  (bench/ is sys.path[0] when run as a script)

NUM_EXPERTS = 128


def peak_rss_bytes() -> int:
    """Peak resident set size of this process's address space (``VmHWM``), in bytes."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def branch_arrays(i: int, args, base):
    """Side channels of branch ``i``: routing [T, layers, top_k] uint8, top-k ids/logprobs [C, k]."""
    import numpy as np

    routing, ids, logprobs = base
    return {"routed_experts": (routing + np.uint8(i % NUM_EXPERTS)) % np.uint8(NUM_EXPERTS),
            "topk_ids": ids + np.int32(i), "topk_logprobs": logprobs - np.float32(i * 1e-3)}


def base_arrays(args):
    """One random set of arrays; every branch derives its own from it cheaply."""
    import numpy as np

    rng = np.random.default_rng(0)
    c = args.tokens - args.prompt_tokens
    # distinct experts per token and layer (the data contract): a random first expert, then steps of
    # NUM_EXPERTS // top_k; adding a branch's offset modulo NUM_EXPERTS keeps them distinct
    first = rng.integers(0, NUM_EXPERTS, (args.tokens, args.layers, 1))
    step = np.arange(args.top_k) * (NUM_EXPERTS // args.top_k)
    return (((first + step) % NUM_EXPERTS).astype(np.uint8),
            rng.integers(0, 150_000, (c, args.logprobs_k), dtype=np.int32),
            -rng.random((c, args.logprobs_k), dtype=np.float32) * 10)


def episode_of(i: int, args, ref):
    """Episode ``i`` (one branch; groups of ``group_size``) with random tokens and reward."""
    import numpy as np

    from refpipe.pipeline.samples import BranchResult, Episode

    rng = np.random.default_rng(1000 + i)
    c = args.tokens - args.prompt_tokens
    branch = BranchResult(rng.integers(0, 150_000, args.prompt_tokens, dtype=np.int32),
                          rng.integers(0, 150_000, c, dtype=np.int32), -rng.random(c, dtype=np.float32),
                          temperature=1.0, policy_version=0, ref=ref)
    return Episode(f"e{i}", f"g{i // args.group_size}", "bench", float(rng.random()), [branch])


def orch_config(args):
    from refpipe.pipeline.orchestrator import OrchestratorConfig

    return OrchestratorConfig(seq_len=args.tokens, dp_world_size=args.dp, group_size=args.group_size,
                              groups_per_step=args.branches // args.group_size, max_async_level=1)


def fields_config(args):
    """The run's field shapes: routing [layers, top_k] of ``NUM_EXPERTS`` experts, a top-``logprobs_k`` head."""
    from refpipe.pipeline.fields import FieldsConfig

    return FieldsConfig(num_layers=args.layers, top_k=args.top_k, num_experts=NUM_EXPERTS, logprobs_k=args.logprobs_k)


def storage_config(args):
    from refpipe.storage.config import StorageConfig

    return StorageConfig(root=args.workdir, run_id="run_bench")


def run_env(args) -> dict:
    """Env-server process: keep every branch, write the episodes (refs only) to a pickle."""
    from refpipe.pipeline.keep import Branch, Keeper
    from refpipe.storage.backends import open_store
    from refpipe.storage.ledger import Ledger

    store = open_store(storage_config(args))
    keeper = Keeper(store, Ledger(store, "env_worker_0"), fields_config(args), storage_config(args))
    base, episodes, nbytes = base_arrays(args), [], 0
    for i in range(args.branches):
        ref = keeper.keep(Branch(args.prompt_tokens, args.tokens - args.prompt_tokens, branch_arrays(i, args, base),
                                 branch_id=f"b{i:05d}"))
        nbytes += ref.nbytes
        episodes.append(episode_of(i, args, ref))
    keeper.ledger.close()
    with open(os.path.join(args.workdir, "episodes.pkl"), "wb") as f:
        pickle.dump(episodes, f, protocol=pickle.HIGHEST_PROTOCOL)
    return {"chunk_bytes": nbytes}


def run_refpipe(args) -> dict:
    """Orchestrator process with refs: submit every episode, build and publish one step."""
    from refpipe.pipeline.orchestrator import Orchestrator
    from refpipe.storage.backends import open_store
    from refpipe.storage.layout import step_key

    with open(os.path.join(args.workdir, "episodes.pkl"), "rb") as f:
        episodes = pickle.load(f)
    store = open_store(storage_config(args))
    orch = Orchestrator(orch_config(args), store, fields=fields_config(args))
    start = time.perf_counter()
    for e in episodes:
        orch.submit(e)
    del episodes
    header = orch.build_step(0)
    seconds = time.perf_counter() - start
    orch.shutdown()
    assert header is not None and len(header.refs) == args.branches, "every branch must be shipped"
    size = os.path.getsize(store.path(step_key(0)))
    return {"peak_rss_bytes": peak_rss_bytes(), "step_file_bytes": size, "seconds": seconds}


def run_inline(args) -> dict:
    """Baseline orchestrator process: samples carry their arrays into the step file."""
    import numpy as np

    from refpipe.pipeline.advantages import group_advantages
    from refpipe.pipeline.packing import pack_step
    from refpipe.pipeline.samples import build_sample

    base = base_arrays(args)
    episodes = [episode_of(i, args, None) for i in range(args.branches)]
    arrays = {e.episode_id: branch_arrays(i, args, base) for i, e in enumerate(episodes)}  # held, as received
    del base
    start = time.perf_counter()
    samples = []
    for g in range(0, len(episodes), args.group_size):
        group = episodes[g:g + args.group_size]
        rewards = np.array([float(e.reward) for e in group])
        adv = group_advantages(rewards, np.full(len(group), args.tokens - args.prompt_tokens),
                               std_normalize=True, length_weighted_baseline=False)
        samples += [build_sample(e, e.branches[0], reward=r, advantage=float(a), seq_len=args.tokens)
                    for e, r, a in zip(group, rewards, adv)]
    packed = pack_step(samples, seq_len=args.tokens, dp_world_size=args.dp)
    path = os.path.join(args.workdir, "inline_step.npz")
    write_inline_step(path, packed, arrays)
    seconds = time.perf_counter() - start
    return {"peak_rss_bytes": peak_rss_bytes(), "step_file_bytes": os.path.getsize(path), "seconds": seconds}


def write_inline_step(path: str, packed, arrays) -> None:
    """An npz like a step file, with every side-channel array inline per micro batch (streamed to disk)."""
    import numpy as np

    from refpipe.pipeline.step_header import STREAMS

    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED, allowZip64=True) as zf:
        for mb in packed:
            members = {name: np.concatenate([getattr(s, name) for s in mb.samples]) for name in STREAMS}
            for field in ("routed_experts", "topk_ids", "topk_logprobs"):
                members[field] = np.concatenate([arrays[s.episode_id][field] for s in mb.samples])
            for name, a in members.items():
                with zf.open(f"dp{mb.dp_rank}.mb{mb.index}.{name}.npy", "w", force_zip64=True) as f:
                    np.lib.format.write_array(f, a, allow_pickle=False)


def child(variant: str, args) -> dict:
    """Run one variant in a fresh interpreter; return its JSON result."""
    cmd = [sys.executable, os.path.abspath(__file__), "--variant", variant, "--workdir", args.workdir]
    cmd += [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("variant", "workdir")]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--branches", type=positive_int, default=1024)
    p.add_argument("--tokens", type=positive_int, default=4096)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--layers", type=positive_int, default=48)
    p.add_argument("--top-k", type=positive_int, default=8)
    p.add_argument("--logprobs-k", type=positive_int, default=128)
    p.add_argument("--group-size", type=positive_int, default=8)
    p.add_argument("--dp", type=positive_int, default=8)
    p.add_argument("--variant", choices=["env", "refpipe", "inline"], default=None)
    p.add_argument("--workdir", default=None, help="scratch directory (default: a new one under /tmp)")
    args = p.parse_args()
    if args.variant:
        print(json.dumps({"env": run_env, "refpipe": run_refpipe, "inline": run_inline}[args.variant](args)))
        return
    per_branch = args.tokens * args.layers * args.top_k + (args.tokens - args.prompt_tokens) * args.logprobs_k * 8
    owned = args.workdir is None
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="refpipe-bench-orch-", dir="/tmp")
    free = shutil.disk_usage(args.workdir).free
    if free < 1.2 * per_branch * args.branches:
        sys.exit(f"{args.workdir}: {free / 2**30:.1f} GiB free, need {1.2 * per_branch * args.branches / 2**30:.1f}")
    try:
        inline = child("inline", args)
        os.remove(os.path.join(args.workdir, "inline_step.npz"))
        env = child("env", args)
        refpipe = child("refpipe", args)
    finally:
        shutil.rmtree(os.path.join(args.workdir, "run_bench"), ignore_errors=True)
        if owned:
            shutil.rmtree(args.workdir, ignore_errors=True)
    report(args, per_branch, env, inline, refpipe)


def report(args, per_branch: int, env: dict, inline: dict, refpipe: dict) -> None:
    """Print the figures; the last line is the JSON summary."""
    mib = 2**20
    print(f"{args.branches} branches x {args.tokens} tokens, side channels {per_branch / mib:.2f} MiB/branch "
          f"({env['chunk_bytes'] / 2**30:.2f} GiB kept)")
    for name, r in (("inline", inline), ("refpipe", refpipe)):
        print(f"{name:8s} orchestrator peak RSS {r['peak_rss_bytes'] / mib:9.1f} MiB   step file "
              f"{r['step_file_bytes'] / mib:9.1f} MiB   build {r['seconds']:.1f} s")
    print(json.dumps({
        "orchestrator_peak_rss_ratio": round(refpipe["peak_rss_bytes"] / inline["peak_rss_bytes"], 4),
        "step_file_bytes_ratio": round(refpipe["step_file_bytes"] / inline["step_file_bytes"], 4),
        "refpipe_peak_rss_bytes": refpipe["peak_rss_bytes"], "inline_peak_rss_bytes": inline["peak_rss_bytes"],
        "refpipe_step_file_bytes": refpipe["step_file_bytes"], "inline_step_file_bytes": inline["step_file_bytes"],
    }))


if __name__ == "__main__":
    main()
