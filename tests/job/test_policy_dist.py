"""The main job's policy update on 2 real gloo ranks when a rank has nothing live to train (issue 14 input 11)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from pathlib import Path

import numpy as np

from refpipe.job.config import RunConfig
from refpipe.job.workload.model import MoELM
from tests.helpers.children import module_argv, module_env

WORKER = "tests.job.policy_worker"
SCENARIOS = {"peer_dropped": [["live"], ["dropped"]], "peer_empty": [["live"], []], "no_micro_batches": [[], []]}


def run_ranks(tmp_path: Path) -> dict[str, list[dict[str, np.ndarray]]]:
    """Start 2 ranks that run every scenario in order; return scenario -> each rank's parameters and stats."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"out_dir": str(tmp_path), "init_method": f"tcp://127.0.0.1:{port}",
                                "scenarios": SCENARIOS}))
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen(module_argv(WORKER, spec, r), env=module_env(env),
                              stderr=open(tmp_path / f"rank{r}.log", "w")) for r in range(2)]
    try:
        codes = [p.wait(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(2))
    assert codes == [0, 0], f"exit codes {codes}\n{logs}"
    return {name: [dict(np.load(tmp_path / f"{name}_rank{r}.npz")) for r in range(2)] for name in SCENARIOS}


def test_a_rank_with_nothing_live_to_train_still_joins_every_collective(tmp_path):
    """Rank 1's only micro batch was dropped, or it got none, or the step file had none at all: it contributes
    zero gradients and every rank steps identically. Before, its gradients were None and ``dist.all_reduce``
    raised TypeError on it while its peer died with a gloo error."""
    out = run_ranks(tmp_path)
    initial = {n: p.detach().numpy().copy() for n, p in MoELM(RunConfig().model).named_parameters()}
    for name, ranks in out.items():
        stats = [json.loads(str(r.pop("stats"))) for r in ranks]
        assert stats[0] == stats[1], name
        assert stats[0]["loss_tokens"] == (0 if name == "no_micro_batches" else 6), name  # rank 0's completion tokens
        assert all(ranks[0][n].tobytes() == ranks[1][n].tobytes() for n in initial), name
    changed = {name: [n for n in initial if ranks[0][n].tobytes() != initial[n].tobytes()]
               for name, ranks in out.items()}
    assert changed["no_micro_batches"] == []  # Adam's step of an all-zero gradient moves nothing
    assert changed["peer_dropped"] == changed["peer_empty"] and "embed.weight" in changed["peer_dropped"]
