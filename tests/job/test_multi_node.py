"""Each role of the main job started on its own, as an operator would on several nodes.

The "nodes" are process trees on this machine, each with its own working directory and its
own path to the run root (a symlink per node, as login and compute nodes mount Lustre at
different paths): ``refpipe init``, then the env-server replicas and the orchestrator in one
tree, and two ``torchrun --nnodes 2`` invocations (rendezvous on 127.0.0.1) in others.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

from refpipe.cli.main import app
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.layout import AUTHKEY_KEY, CONFIG_KEY, SUMMARY_KEY, address_key
from test_main_job import write_config
from typer.testing import CliRunner

BIN = os.path.dirname(sys.executable)


def _node(tmp_path, name: str, root) -> str:
    """A node's working directory, where the run root is mounted as ``mnt``."""
    node = tmp_path / name
    node.mkdir()
    os.symlink(root, node / "mnt")
    return str(node)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_init_writes_the_run_config_with_an_absolute_root_and_prints_the_commands(tmp_path, monkeypatch):
    root = tmp_path / "root"
    config = write_config(tmp_path, "root", "prep", warm_start_steps=0)  # a relative root, resolved against init's cwd
    monkeypatch.chdir(tmp_path)
    init = CliRunner().invoke(app, ["init", "--config", config])
    assert init.exit_code == 0, init.output
    store = open_store(StorageConfig(root=str(root), run_id="prep"))
    assert json.loads(store.get(CONFIG_KEY))["storage"]["root"] == str(root)
    assert len(store.get(AUTHKEY_KEY)) == 64
    lines = init.stdout.splitlines()
    uri = f"file://{root}/prep"
    ready = lines.index(f"run {uri} is ready; start each role, on any node that reaches the run (in any order):")
    assert lines[ready + 1:] == [f"  refpipe orchestrate {uri}",
                         f"  refpipe env-server {uri} --replica I     # I = 0 .. 1",
                         "  torchrun --nnodes N --nproc-per-node M --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
                         f"--rdzv-id prep -m refpipe.job.train_rank {uri}     # N x M = 2"]
    again = CliRunner().invoke(app, ["init", "--config", config])
    assert again.exit_code == 2 and "already exists: choose another storage.run_id" in again.stdout
    wrong = subprocess.run([sys.executable, "-m", "refpipe.job.train_rank", str(root / "prep")],
                           env={**os.environ, "RANK": "0", "WORLD_SIZE": "3"}, capture_output=True, text=True,
                           timeout=120)
    assert (wrong.returncode, wrong.stdout) == (2, "")
    assert wrong.stderr == (f"error: WORLD_SIZE=3 (torchrun --nnodes x --nproc-per-node): run {uri} expects 2 "
                            "ranks (orchestrator.dp_world_size x trainer.model_parallel_size)\n")


def test_two_nodes_each_role_started_on_its_own_train_to_a_clean_audit(tmp_path):
    root = tmp_path / "lustre"
    root.mkdir()
    config = write_config(tmp_path, root, "two", num_steps=2)
    init = subprocess.run([f"{BIN}/refpipe", "init", "--config", config], capture_output=True, text=True,
                          timeout=300)
    assert init.returncode == 0, init.stdout + init.stderr
    run = "mnt/two"  # every node reaches the run through its own mount path, relative to its own cwd
    inference, train0, train1 = (_node(tmp_path, name, root) for name in ("inference", "train0", "train1"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    envs = [subprocess.Popen([f"{BIN}/refpipe", "env-server", run, "--replica", str(i), "--host",
                              "127.0.0.1"], cwd=inference, env=env) for i in range(2)]
    orchestrator = subprocess.Popen([f"{BIN}/refpipe", "orchestrate", run], cwd=inference, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    port = _free_port()
    trainers = [subprocess.Popen([f"{BIN}/torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank",
                                  str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
                                  "-m", "refpipe.job.train_rank", run], cwd=cwd, env=env)
                for rank, cwd in enumerate((train0, train1))]
    out, _ = orchestrator.communicate(timeout=600)
    codes = [p.wait(timeout=120) for p in envs + trainers]
    assert (orchestrator.returncode, codes) == (0, [0, 0, 0, 0]), out
    store = open_store(StorageConfig(root=str(root), run_id="two"))
    summary = json.loads(store.get(SUMMARY_KEY))
    assert summary["trained_steps"] == 2 and summary["alignment_ok"] and summary["alignment_on_policy_tokens"] > 0
    audit = summary["audit"]
    assert audit["clean"] and audit["kept"] == audit["deleted"] > 0 and audit["finished"]
    assert (audit["outstanding"], audit["leaked"], audit["double_deletes"]) == (0, 0, 0)
    assert store.list_prefix("payloads") == []
    address = json.loads(store.get(address_key(1)))
    assert (address["host"], address["pid"]) == ("127.0.0.1", envs[1].pid)
    assert "audit clean; alignment ok" in out
