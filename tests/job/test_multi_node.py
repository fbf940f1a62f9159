"""Each role of the main job started on its own, as an operator would on several nodes.

The "nodes" are process trees on this machine, each with its own working directory and its
own path to the run root (a symlink per node, as login and compute nodes mount Lustre at
different paths): ``refpipe init``, then the env-server replicas and the orchestrator in one
tree, and two ``torchrun --nnodes 2`` invocations (rendezvous on 127.0.0.1) in others.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from refpipe.cli.main import app
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.layout import (
    AUTHKEY_KEY,
    CONFIG_KEY,
    ORCHESTRATOR_ACTOR,
    SUMMARY_KEY,
    address_key,
    parse_segment_key,
)
from refpipe.storage.ledger import Ledger
from refpipe.trainer.pause import ENV
from tests.helpers.ports import free_port
from tests.job.test_main_job import write_config

BIN = os.path.dirname(sys.executable)


def _init(tmp_path, root, run_id: str, **overrides) -> None:
    """Write a run config (``test_main_job.write_config``) and run ``refpipe init`` on it as its own process."""
    config = write_config(tmp_path, root, run_id, **overrides)
    init = subprocess.run([f"{BIN}/refpipe", "init", "--config", config], capture_output=True, text=True,
                          timeout=300)
    assert init.returncode == 0, init.stdout + init.stderr


def _node(tmp_path, name: str, root) -> str:
    """A node's working directory, where the run root is mounted as ``mnt``."""
    node = tmp_path / name
    node.mkdir()
    os.symlink(root, node / "mnt")
    return str(node)


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
    assert again.exit_code == 2 and "already exists: choose another storage.run_id" in again.stderr
    wrong = subprocess.run([sys.executable, "-m", "refpipe.job.train_rank", str(root / "prep")],
                           env={**os.environ, "RANK": "0", "WORLD_SIZE": "3"}, capture_output=True, text=True,
                           timeout=120)
    assert (wrong.returncode, wrong.stdout) == (2, "")
    assert wrong.stderr == (f"error: WORLD_SIZE=3 (torchrun --nnodes x --nproc-per-node): run {uri} expects 2 "
                            "ranks (orchestrator.dp_world_size x trainer.model_parallel_size)\n")


@pytest.mark.parametrize("command", [["orchestrate"], ["env-server", "--replica", "0"]])
def test_a_role_given_a_run_that_is_not_there_says_so_in_one_line_with_its_path_as_given(tmp_path, command):
    missing = tmp_path / "[x]" / "run"  # rich markup in a path: printed as text, never parsed
    result = CliRunner().invoke(app, [command[0], str(missing), *command[1:]])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1
    assert f"file://{missing}" in result.output


def test_a_second_orchestrator_is_refused_at_once_naming_the_live_one(tmp_path, monkeypatch):
    config = write_config(tmp_path, tmp_path / "root", "solo", warm_start_steps=0)
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(app, ["init", "--config", config]).exit_code == 0
    store = open_store(StorageConfig(root=str(tmp_path / "root"), run_id="solo"))
    first = Ledger(store, ORCHESTRATOR_ACTOR)  # the live orchestrator
    try:
        second = CliRunner().invoke(app, ["orchestrate", store.prefix.uri])
    finally:
        first.close()
    assert second.exit_code == 2 and second.output.startswith("error: ") and "Traceback" not in second.output
    assert second.output.startswith(f"error: ledger actor 'orchestrator' of run {store.prefix.uri} already has a "
                                    f"live session {first.session} ")


def test_two_nodes_each_role_started_on_its_own_train_to_a_clean_audit(tmp_path):
    root = tmp_path / "lustre"
    root.mkdir()
    _init(tmp_path, root, "two", num_steps=2)
    run = "mnt/two"  # every node reaches the run through its own mount path, relative to its own cwd
    inference, train0, train1 = (_node(tmp_path, name, root) for name in ("inference", "train0", "train1"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    envs = [subprocess.Popen([f"{BIN}/refpipe", "env-server", run, "--replica", str(i), "--host",
                              "127.0.0.1"], cwd=inference, env=env) for i in range(2)]
    orchestrator = subprocess.Popen([f"{BIN}/refpipe", "orchestrate", run], cwd=inference, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    port = free_port()
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


def test_orchestrate_stops_naming_a_trainer_node_that_was_sigkilled(tmp_path):
    """The trainer runs under torchrun as "node trainer-b"; once its tree is SIGKILLed mid-step, `refpipe orchestrate`
    stops by the trainer's ledger heartbeat (1 s interval, 4 s timeout), not after the 120 s step deadline."""
    from tests.job.test_resume import _tree, as_node

    root = tmp_path / "root"
    config = tmp_path / "dies.toml"
    config.write_text(f'[storage]\nroot = "{root}"\nrun_id = "dies"\nheartbeat_interval_s = 1.0\n'
                      "heartbeat_timeout_s = 4.0\n[job]\nnum_steps = 3\nnum_env_workers = 1\ntrainer_world_size = 1\n"
                      "warm_start_steps = 20\neval_every_steps = 0\nstep_deadline_s = 120\n"
                      "[orchestrator]\nseq_len = 128\ndp_world_size = 1\ngroups_per_step = 2\ngroup_size = 4\n"
                      "[trainer]\nstep_timeout_s = 120\ncollective_timeout_s = 120\n")
    node_b = as_node("trainer-b")
    init = CliRunner().invoke(app, ["init", "--config", str(config)])
    assert init.exit_code == 0, init.output
    run, marker = str(root / "dies"), tmp_path / "paused"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    server = subprocess.Popen([f"{BIN}/refpipe", "env-server", run, "--replica", "0", "--host", "127.0.0.1"], env=env)
    orchestrator = subprocess.Popen([f"{BIN}/refpipe", "orchestrate", run], env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
    trainer = subprocess.Popen([*node_b, f"{BIN}/torchrun", "--nnodes", "1", "--nproc-per-node", "1", "--master-addr",
                                "127.0.0.1", "--master-port", str(free_port()), "-m", "refpipe.job.train_rank", run],
                               env={**env, ENV: f"train:1:{marker}"})  # step 0 trained; stays in step 1's train
    try:
        while not marker.exists():
            assert trainer.poll() is None and orchestrator.poll() is None, orchestrator.communicate()[0]
            time.sleep(0.2)
        tree = _tree(trainer.pid)  # the torchrun agent and its worker
        for pid in tree:
            os.kill(pid, signal.SIGKILL)
        out, _ = orchestrator.communicate(timeout=300)
    finally:
        for proc in (server, orchestrator, trainer):
            proc.kill()
            proc.wait()
    store = open_store(StorageConfig(root=str(root), run_id="dies"))
    [beat] = store.list_prefix("ledger/heartbeats/trainer_dp0")
    worker = int(beat.rpartition("/")[2].split("-")[0])  # the session id is <pid>-<ms>
    assert worker in tree[1:]
    summary = json.loads(store.get(SUMMARY_KEY))
    assert (orchestrator.returncode, server.returncode, summary["failed"], summary["trained_steps"]) == (1, 0, True, 1)
    assert summary["failure"] == (
        f"RunError: trainer dead: trainer_dp0 (pid {worker} on trainer-b: heartbeat {store.uri(beat)} unchanged for "
        f"4 s). The run cannot go on: stop its other roles (env-server replicas, trainer ranks), then continue it "
        f"from its newest checkpoint with `refpipe run --resume {store.prefix.uri}` (unless a trainer rank's own "
        f"error says a resume meets it again)"), out


@pytest.mark.parametrize("command", [["orchestrate"], ["env-server", "--replica", "0"]])
def test_a_role_given_a_bad_run_id_says_so_in_one_line(tmp_path, command):
    result = CliRunner().invoke(app, [command[0], str(tmp_path / "bad id"), *command[1:]])
    assert (result.exit_code, result.output) == (
        2, "error: run_id 'bad id': expected 1-128 of [A-Za-z0-9._-], not starting with a dot\n")


@pytest.mark.parametrize("num_steps", [3, 4], ids=["finished", "more_steps"])
def test_an_env_server_of_a_finished_run_is_refused_before_any_keep(tmp_path, monkeypatch, num_steps):
    """Before: env servers started against a finished run kept chunks into it (its clean audit then counted them as
    leaked). A run whose config.json asks for more steps (a later life raising job.num_steps) is not finished."""
    config = write_config(tmp_path, tmp_path / "root", "done", warm_start_steps=0, num_steps=num_steps)
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(app, ["init", "--config", config]).exit_code == 0
    store = open_store(StorageConfig(root=str(tmp_path / "root"), run_id="done"))
    store.put(SUMMARY_KEY, json.dumps({"failed": False, "failure": None, "trained_steps": 3}).encode())
    before = sorted(store.list_prefix(""))
    if num_steps == 4:
        from refpipe.job.resume import refuse_finished
        from refpipe.job.roles import open_run

        assert refuse_finished(store, open_run(store.prefix.uri)[0]) is None
        return
    result = CliRunner().invoke(app, ["env-server", store.prefix.uri, "--replica", "0", "--host", "127.0.0.1"])
    uri = store.prefix.uri
    assert (result.exit_code, result.output) == (2, (
        f"error: run {uri} is finished (3 of 3 steps trained, see {store.uri(SUMMARY_KEY)}): an env server would "
        f"keep chunks into it that nothing trains; start a new run (`refpipe init` with another storage.run_id, or "
        f"\"auto\"), or train this one further: `refpipe run --resume {uri} --config FILE` with a larger "
        f"job.num_steps\n"))
    assert sorted(store.list_prefix("")) == before


@pytest.mark.parametrize("summary,problem", [
    ({"failed": False, "failure": None, "trained_steps": 3},
     "already finished (3 steps trained, audit in {summary}): nothing to orchestrate; start a new run with `refpipe "
     "init`"),
    ({"failed": True, "failure": "RunError: trainer dead", "trained_steps": 1},
     "already ended (RunError: trainer dead); continue it from its newest checkpoint with `refpipe run --resume "
     "{run}`"),
    ("not json", "already ended (unreadable summary.json: JSONDecodeError); continue it from its newest checkpoint "
                 "with `refpipe run --resume {run}`"),
], ids=["finished", "failed", "unreadable"])
def test_orchestrating_an_ended_run_is_refused_at_once_and_adds_no_session(tmp_path, monkeypatch, summary, problem):
    """Before: `refpipe orchestrate` on a finished run opened an orchestrator session in its ledger and waited
    ``job.step_deadline_s`` (326 s) for replicas behind the ended life's stale address files."""
    config = write_config(tmp_path, tmp_path / "root", "ended", warm_start_steps=0)
    monkeypatch.chdir(tmp_path)
    assert CliRunner().invoke(app, ["init", "--config", config]).exit_code == 0
    store = open_store(StorageConfig(root=str(tmp_path / "root"), run_id="ended"))
    store.put(SUMMARY_KEY, summary.encode() if isinstance(summary, str) else json.dumps(summary).encode())
    before = sorted(store.list_prefix(""))
    result = CliRunner().invoke(app, ["orchestrate", store.prefix.uri])
    expected = problem.format(summary=store.uri(SUMMARY_KEY), run=store.prefix.uri)
    assert (result.exit_code, result.output) == (2, f"error: run {store.prefix.uri} {expected}\n")
    assert sorted(store.list_prefix("")) == before


def test_a_stale_address_where_another_runs_replica_listens_is_retried_then_named(tmp_path):
    """Before: ``multiprocessing.AuthenticationError`` (the other run's auth key) escaped ``connect_replica`` as a
    traceback at once instead of being retried like any stale address until the deadline."""
    import threading
    from multiprocessing import AuthenticationError
    from multiprocessing.connection import Listener

    from refpipe.job.roles import connect_replica

    store = open_store(StorageConfig(root=str(tmp_path), run_id="stale"))
    with Listener(("127.0.0.1", 0), authkey=b"another run") as other:
        def serve():
            for _ in range(100):
                try:
                    other.accept().close()
                except (AuthenticationError, OSError, EOFError):
                    pass

        threading.Thread(target=serve, daemon=True).start()
        store.put(address_key(0), json.dumps({"host": "127.0.0.1", "port": other.address[1]}).encode())
        with pytest.raises(TimeoutError) as info:
            connect_replica(store, 0, b"this run", time.monotonic() + 1.0)
    assert str(info.value) == (f"env-server replica 0 of {store.prefix.uri}: not reachable (AuthenticationError: "
                               "digest sent was rejected)")


def test_an_env_server_started_on_its_own_says_where_it_listens_and_how_far_it_got(tmp_path):
    """`refpipe env-server` printed nothing at all: now one startup line (run, address, actor, session, pid), the
    orchestrator's connection, a progress line per `orchestrator.groups_per_step` groups, and a last line."""
    from refpipe.job.env_worker import GroupRequest
    from refpipe.job.roles import authkey, connect_replica

    root = tmp_path / "root"
    _init(tmp_path, root, "solo", warm_start_steps=0)
    store = open_store(StorageConfig(root=str(root), run_id="solo"))
    server = subprocess.Popen([f"{BIN}/refpipe", "env-server", str(root / "solo"), "--replica", "1", "--host",
                               "127.0.0.1"], stderr=subprocess.PIPE, text=True, env={**os.environ,
                                                                                    "OMP_NUM_THREADS": "1"})
    try:
        conn = connect_replica(store, 1, authkey(store), time.monotonic() + 120, exit_code=server.poll)
        results = []
        for i in range(2):  # groups_per_step = 2: one progress line
            conn.send(GroupRequest(i, f"g{i:06d}", i))
            results.append(conn.recv())
        conn.send(None)
        _, err = server.communicate(timeout=120)
    finally:
        server.kill()
    address = json.loads(store.get(address_key(1)))
    session, = {parse_segment_key(k)[1] for k in store.list_prefix("ledger/events/env_worker_1")}
    chunks, nbytes = sum(r.kept_chunks for r in results), sum(r.kept_bytes for r in results)
    progress = (f"2 groups served (0 failed), {chunks} chunks kept ({nbytes / 2**20:.2f} MiB), 0 discarded, "
                f"weights version 0")
    assert err.splitlines() == [
        f"[env-server 1] replica 1 of run file://{root}/solo listening on 127.0.0.1:{address['port']} (actor "
        f"env_worker_1, session {session}, pid {server.pid}; replicas 0..1); address in "
        f"file://{root}/solo/envs/1.address",
        f"[env-server 1] orchestrator connected from {err.splitlines()[1].rsplit(' ', 1)[1]}",
        f"[env-server 1] {progress}",
        f"[env-server 1] stopped: {progress}",
    ]
    assert err.splitlines()[1].rsplit(" ", 1)[1].startswith("127.0.0.1:")
    assert server.returncode == 0 and chunks == 8


def test_a_rank_whose_gloo_peer_was_sigkilled_ends_with_one_line(tmp_path):
    """Two training nodes under torchrun (the first one's worker output in files: ``--log-dir``, ``--redirects 3``);
    DP rank 1 pauses before releasing step 1 and its worker is SIGKILLed while rank 0 waits in step 2's collective.
    Rank 0's stderr is one line naming the failed collective and the resume command, exit code 1; it was gloo's
    traceback (``RuntimeError: [.../gloo/transport/tcp/pair.cc:553] Connection closed by peer``, 22 lines)."""
    import glob
    import re

    import psutil

    root = tmp_path / "root"
    root.mkdir()
    _init(tmp_path, root, "peer", num_steps=4)
    run, marker, logs = str(root / "peer"), tmp_path / "paused", tmp_path / "logs"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([f"{BIN}/refpipe", "env-server", run, "--replica", str(i), "--host", "127.0.0.1"],
                              env=env, stderr=subprocess.DEVNULL) for i in range(2)]
    procs.append(subprocess.Popen([f"{BIN}/refpipe", "orchestrate", run], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL))
    port = free_port()
    trainers = [subprocess.Popen([f"{BIN}/torchrun", "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(rank),
                                  "--master-addr", "127.0.0.1", "--master-port", str(port),
                                  *(["--log-dir", str(logs), "--redirects", "3"] if rank == 0 else []),
                                  "-m", "refpipe.job.train_rank", run],
                                 env={**env, ENV: f"release_dp1:1:{marker}"}, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL) for rank in range(2)]
    try:
        while not marker.exists():
            assert all(p.poll() is None for p in trainers + procs)
            time.sleep(0.2)
        time.sleep(3)  # rank 0 goes on into step 2's collectives
        for worker in psutil.Process(trainers[1].pid).children(recursive=True):
            os.kill(worker.pid, signal.SIGKILL)
        assert trainers[0].wait(timeout=300) == 1
    finally:
        for proc in procs + trainers:
            proc.kill()
            proc.wait()
    [err_path] = glob.glob(f"{logs}/*/attempt_0/0/stderr.log")
    with open(err_path) as f:
        lines = f.read().splitlines()
    assert len(lines) == 1, "\n".join(lines)
    uri = open_store(StorageConfig(root=str(root), run_id="peer")).prefix.uri
    assert re.fullmatch(
        r"error: trainer rank 0 of 2: a collective failed \(Connection closed by peer \[127\.0\.0\.1\]:\d+\): a peer "
        r"rank died or stopped answering, so this rank stops too; once no role of the run is left, continue it from "
        rf"its newest checkpoint with `refpipe run --resume {re.escape(uri)}`", lines[0]), lines[0]
