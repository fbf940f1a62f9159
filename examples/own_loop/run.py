"""refpipe as the transport alone, in a loop that is yours: ``python examples/own_loop/run.py [--work DIR]``.

- 2 env-server processes keep each branch's side channels (``Keeper.keep`` -> ``PayloadRef``) and send the
  episode with its ref to the orchestrator;
- the orchestrator is yours: RLOO advantages (reward minus the mean of the group's other rewards) and a
  token-balanced packing of its own, published with ``publish_step`` (no ``refpipe.Orchestrator``);
- 2 torchrun trainer ranks (gloo) run your training loop over refpipe's pull loop (``train.py``); in the first
  life DP rank 1 is SIGKILLed after DP rank 0 released step 2 and before it did; the second life restores your
  checkpoint and resumes through ``TrainerRank.resume_plan``.

Prints one JSON line counted from what happened: whether every trained sample carried your advantage and sat in
the micro batch your packing put it in, whether the kill and the resume happened, samples trained twice (in
any two micro batches of any lives) and lost (published but not in the final weights' history: a life's
training after the checkpoint the next life restored does not count), and the finished audit's verdict.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from refpipe import (
    Branch,
    FieldsConfig,
    Keeper,
    Ledger,
    PackedSequence,
    PayloadRef,
    PayloadSlice,
    StepMicroBatch,
    StorageConfig,
    open_store,
    publish_step,
)

NUM_STEPS, CRASH_STEP, GROUP_SIZE, ENV_SERVERS, SEQ_LEN, VOCAB = 4, 2, 4, 2, 48, 64
FIELDS = FieldsConfig(num_layers=2, top_k=2, num_experts=8)
HERE = Path(__file__).parent


def env_server(worker: int, storage: StorageConfig, episodes: multiprocessing.Queue) -> None:
    """One env-server process: per step, one group of ``GROUP_SIZE`` branches (group ``worker`` of the step)."""
    store = open_store(storage)
    ledger = Ledger(store, f"env_worker_{worker}")
    keeper = Keeper(store, ledger, FIELDS, storage)
    for step in range(NUM_STEPS):
        for i in range(GROUP_SIZE):
            rng = np.random.default_rng([worker, step, i])
            prompt, completion = int(rng.integers(3, 8)), int(rng.integers(4, 14))
            routing = np.argsort(rng.random((prompt + completion, 2, 8)), axis=-1)[..., :2].astype(np.uint8)
            ref = keeper.keep(Branch(prompt, completion, {"routed_experts": routing},
                                     branch_id=f"s{step}g{worker}i{i}"))
            episodes.put({"step": step, "group": worker, "ref": ref.model_dump_json(), "reward": float(rng.random()),
                          "ids": rng.integers(0, VOCAB, prompt + completion).tolist(), "prompt": prompt})
    ledger.close()


def leave_one_out(rewards: list[float]) -> list[float]:
    """Your advantage estimator: each reward minus the mean of the other rewards of its group."""
    total = sum(rewards)
    return [r - (total - r) / (len(rewards) - 1) for r in rewards]


def pack(samples: list[dict], dp_world_size: int) -> list[list[list[dict]]]:
    """Your packing: longest first onto the DP rank with the fewest tokens, first fit into its micro batches of
    ``SEQ_LEN`` tokens; every DP rank gets as many micro batches (a short one a zero-loss padding batch)."""
    ranks: list[list[list[dict]]] = [[] for _ in range(dp_world_size)]
    tokens = [0] * dp_world_size
    for sample in sorted(samples, key=lambda s: -len(s["ids"])):
        r = tokens.index(min(tokens))
        tokens[r] += len(sample["ids"])
        fit = next((mb for mb in ranks[r] if sum(len(s["ids"]) for s in mb) + len(sample["ids"]) <= SEQ_LEN), None)
        if fit is None:
            ranks[r].append(fit := [])
        fit.append(sample)
    most = max(len(mbs) for mbs in ranks)
    return [mbs + [[]] * (most - len(mbs)) for mbs in ranks]


def micro_batch(samples: list[dict]) -> StepMicroBatch:
    """Your samples as one micro batch: token streams concatenated, the advantage on every completion token."""
    if not samples:  # padding: one zero-loss token without side channels
        samples, payloads = [{"ids": [0], "prompt": 1, "advantage": 0.0}], [None]
    else:
        payloads = [PayloadSlice(PayloadRef.model_validate_json(s["ref"]), len(s["ids"])) for s in samples]
    sequences = [PackedSequence(len(s["ids"]), "own_env", payload=p) for s, p in zip(samples, payloads)]
    completion = [np.arange(len(s["ids"])) >= s["prompt"] for s in samples]
    streams = {"input_ids": np.concatenate([s["ids"] for s in samples]).astype(np.int32),
               "loss_mask": np.concatenate(completion),
               "advantages": np.concatenate([c * np.float32(s["advantage"]) for s, c in zip(samples, completion)]),
               "inference_logprobs": np.concatenate([-0.5 * c for c in completion]).astype(np.float32),
               "position_ids": np.concatenate([np.arange(len(s["ids"])) for s in samples]).astype(np.int32),
               "temperatures": np.ones(sum(len(s["ids"]) for s in samples), np.float32)}
    return StepMicroBatch(sequences, streams)


def orchestrate(storage: StorageConfig, episodes: multiprocessing.Queue) -> dict:
    """Your orchestrator: collect each step's groups, score, pack and publish them. Returns the plan it published:
    ``{"advantages": {sample id: float32 value}, "packing": {"step/dp/index": [sample ids]}}``."""
    store = open_store(storage)
    ledger = Ledger(store, "orchestrator")
    pending: dict[int, list[dict]] = {}
    published = {"advantages": {}, "packing": {}}
    for step in range(NUM_STEPS):
        while len(pending.get(step, [])) < ENV_SERVERS * GROUP_SIZE:
            episode = episodes.get(timeout=60)
            pending.setdefault(episode["step"], []).append(episode)
        samples = pending.pop(step)
        for group in range(ENV_SERVERS):
            members = [s for s in samples if s["group"] == group]
            for s, a in zip(members, leave_one_out([s["reward"] for s in members])):
                s["advantage"] = float(np.float32(a))
                published["advantages"][json.loads(s["ref"])["branch_id"]] = s["advantage"]
        packed = pack(samples, dp_world_size=2)
        for dp, mbs in enumerate(packed):
            for i, mb in enumerate(mbs):
                published["packing"][f"{step}/{dp}/{i}"] = [json.loads(s["ref"])["branch_id"] for s in mb]
        publish_step(store, ledger, step, [[micro_batch(mb) for mb in mbs] for mbs in packed], seq_len=SEQ_LEN,
                     fields=FIELDS)
    ledger.close()
    return published


def torchrun(work: Path, life: int) -> subprocess.Popen:
    """One life of the 2 trainer ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
                             "--master-addr", "127.0.0.1", "--master-port", str(port), str(HERE / "train.py"),
                             str(work), str(life)], env=env, stdout=open(work / f"life{life}.log", "w"),
                            stderr=subprocess.STDOUT)


def released(store, dp_rank: int, step: int) -> bool:
    """Whether DP rank ``dp_rank`` recorded the release of ``step`` in its ledger (``trainer_dp<r>``)."""
    return any(json.loads(line).get("event") == "release" and json.loads(line).get("step") == step
               for key in store.list_prefix(f"ledger/events/trainer_dp{dp_rank}")
               for line in store.get(key).splitlines())


def kill_after_one_release(work: Path, store, life: subprocess.Popen) -> bool:
    """SIGKILL DP rank 1 once it paused before releasing ``CRASH_STEP`` and DP rank 0 released it; whether that
    is what happened."""
    deadline = time.monotonic() + 120
    while not ((work / "paused").exists() and released(store, 0, CRASH_STEP)):
        if life.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    one_released = not released(store, 1, CRASH_STEP)
    os.kill(int((work / "paused").read_text()), signal.SIGKILL)
    return life.wait(timeout=120) != 0 and one_released


def count(work: Path, published: dict) -> dict:
    """Samples trained per life, against what the orchestrator published and the checkpoint life 2 restored."""
    restored = json.loads((work / "plan_life2.json").read_text())["checkpoint_step"]
    records = [(life, json.loads(line)) for life in (1, 2) for path in work.glob(f"trained_life{life}_rank*.jsonl")
               for line in path.read_text().splitlines()]
    times = Counter(sample for _, r in records for sample in r["samples"])
    history = {sample for life, r in records if life == 2 or r["step"] <= restored for sample in r["samples"]}
    return {"own_advantages": all(published["advantages"][s] == a for _, r in records
                                  for s, a in zip(r["samples"], r["advantages"])) and bool(records),
            "own_packing": all(published["packing"][f"{r['step']}/{r['dp_rank']}/{r['index']}"] == r["samples"]
                               for _, r in records) and bool(records),
            "samples_trained_twice": sum(n > 1 for n in times.values()),
            "samples_lost": len(set(published["advantages"]) - history)}


def main(work: Path) -> None:
    storage = StorageConfig(root=str(work / "root"), run_id="own_loop")
    store = open_store(storage)
    (work / "spec.json").write_text(json.dumps({"storage": storage.model_dump(), "fields": FIELDS.model_dump(),
                                                "num_steps": NUM_STEPS, "crash_step": CRASH_STEP, "vocab": VOCAB}))
    context = multiprocessing.get_context("spawn")
    episodes = context.Queue()
    servers = [context.Process(target=env_server, args=(w, storage, episodes)) for w in range(ENV_SERVERS)]
    for server in servers:
        server.start()
    first = torchrun(work, 1)  # waits for step files as the orchestrator publishes them
    published = orchestrate(storage, episodes)
    for server in servers:
        server.join()
    killed = kill_after_one_release(work, store, first)
    resumed = torchrun(work, 2).wait(timeout=300) == 0
    audit = subprocess.run([str(Path(sys.executable).with_name("refpipe")), "audit", store.prefix.uri, "--finished",
                            "--json"], capture_output=True, text=True)
    counted = count(work, published)
    print(json.dumps({"own_advantages": counted["own_advantages"], "own_packing": counted["own_packing"],
                      "killed_and_resumed": killed and resumed,
                      "samples_trained_twice": counted["samples_trained_twice"],
                      "samples_lost": counted["samples_lost"],
                      "audit_clean": audit.returncode == 0 and json.loads(audit.stdout)["clean"]}))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, help="directory for the run and the logs (default: a temporary one)")
    args = parser.parse_args()
    if args.work:
        args.work.mkdir(parents=True, exist_ok=True)
        main(args.work)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            main(Path(tmp))
