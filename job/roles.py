"""The main job's roles and how they find each other: one run config, one command per role.

``refpipe init --config FILE`` writes the resolved run config to ``<run>/config.json`` (with
an absolute root), the env servers' auth key to ``<run>/envs/authkey`` and the warm-started
weights (version 0), then prints the commands that start the roles. Each role opens the run
from its URI alone (``open_run``), through whatever path the node mounts it under:

    refpipe orchestrate RUN_URI                   orchestrator + dispatcher (one)
    refpipe env-server RUN_URI --replica I        env-server replica I (0 .. job.num_env_workers - 1)
    torchrun ... -m refpipe.job.train_rank RUN_URI   the trainer ranks

An env-server replica binds its listening socket, then publishes its address as
``<run>/envs/<I>.address``; the orchestrator connects to every replica
(``multiprocessing.connection`` with the run's auth key). ``refpipe run`` is the one-machine
composition: it runs ``init`` and the orchestrator in its own process and starts the env
servers and trainer ranks as subprocesses running the same entry points.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shlex
import signal
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection
from typing import NoReturn

from pydantic import ValidationError

from refpipe.job.config import RunConfig
from refpipe.storage.backends import open_store
from refpipe.storage.config import run_storage
from refpipe.storage.errors import ConfigError, KeyExistsError, KeyNotFoundError, validation_problems
from refpipe.storage.layout import AUTHKEY_KEY, CONFIG_KEY, SUMMARY_KEY, address_key
from refpipe.storage.store import Store

LAUNCHER_PID_ENV = "REFPIPE_LAUNCHER_PID"
"""Set by ``refpipe run`` for the processes it starts: they exit when that process is gone."""


def open_run(run_uri: str, s3_endpoint_url: str | None = None) -> tuple[RunConfig, Store]:
    """The run config and store of the run at ``run_uri``, as this process reaches it.

    The config comes from ``<run>/config.json``; its ``storage.root`` and ``run_id`` are replaced
    by ``run_uri``'s, so a role resolves the run through the path it was given (another mount
    point, a symlink), never through the path the config was written with. Called by every role.

    Raises:
        ConfigError: not a run URI, no ``config.json`` under it, or an unreadable one.
    """
    storage = run_storage(run_uri, s3_endpoint_url)
    store = open_store(storage)
    try:
        cfg = RunConfig.model_validate_json(store.get(CONFIG_KEY))
    except KeyNotFoundError as e:
        raise ConfigError(f"run {store.prefix.uri}: no {CONFIG_KEY} (start the run with `refpipe init`)") from e
    except ValidationError as e:
        raise ConfigError(f"run {store.prefix.uri}: {CONFIG_KEY} is not a run config: {validation_problems(e)}") from e
    kept = {} if s3_endpoint_url is None else {"s3_endpoint_url": s3_endpoint_url}
    storage = cfg.storage.model_copy(update={"root": storage.root, "run_id": storage.run_id, **kept})
    return cfg.model_copy(update={"storage": storage}), open_store(storage)


def refuse_ended(store: Store) -> None:
    """``refpipe orchestrate``, before it opens its ledger session: refuse a run whose orchestrator already ended
    (it wrote ``summary.json``). Orchestrating it again waited ``job.step_deadline_s`` for replicas behind the
    stale addresses of the ended life and added a ledger session to the run.

    Raises:
        ConfigError: the run finished (nothing to do), or ended failed or unreadably (continue it with
            ``refpipe run --resume``).
    """
    try:
        summary = json.loads(store.get(SUMMARY_KEY))
        failure = summary["failure"] if summary["failed"] else None
        trained = int(summary["trained_steps"])
    except KeyNotFoundError:
        return
    except (ValueError, TypeError, KeyError) as e:
        failure = f"unreadable {SUMMARY_KEY}: {type(e).__name__}"
    uri = store.prefix.uri
    if failure is None:
        raise ConfigError(f"run {uri} already finished ({trained} steps trained, audit in {store.uri(SUMMARY_KEY)}): "
                          "nothing to orchestrate; start a new run with `refpipe init`")
    raise ConfigError(f"run {uri} already ended ({failure}); continue it from its newest checkpoint with `refpipe run "
                      f"--resume {uri}`")


def write_run_config(cfg: RunConfig, store: Store) -> RunConfig:
    """Write ``config.json`` (absolute root) and the auth key; return the config as written.

    Raises:
        ConfigError: the run already exists (its ``config.json`` is untouched).
    """
    head = store.prefix.path.rpartition("/")[0]
    resolved = cfg.model_copy(update={"storage": cfg.storage.model_copy(
        update={"root": head if store.prefix.scheme == "file" else f"s3://{head}"})})
    try:
        store.put(CONFIG_KEY, resolved.model_dump_json(indent=2).encode(), exclusive=True)
    except KeyExistsError as e:
        raise ConfigError(f"run {store.prefix.uri} already exists: choose another storage.run_id "
                          f'(or "auto")') from e
    store.put(AUTHKEY_KEY, secrets.token_hex(32).encode(), exclusive=True)  # 32 random bytes, hex
    return resolved


def start_commands(cfg: RunConfig, run_uri: str) -> list[str]:
    """The commands that start every role of a run initialised with ``cfg`` (printed by ``refpipe init``)."""
    world, run = cfg.job.trainer_world_size, shlex.quote(run_uri)
    return [
        f"refpipe orchestrate {run}",
        f"refpipe env-server {run} --replica I     # I = 0 .. {cfg.job.num_env_workers - 1}",
        f"torchrun --nnodes N --nproc-per-node M --rdzv-backend c10d --rdzv-endpoint HOST:29500 "
        f"--rdzv-id {cfg.storage.run_id} -m refpipe.job.train_rank {run}     # N x M = {world}",
    ]


def authkey(store: Store) -> bytes:
    """The run's env-server auth key.

    Raises:
        ConfigError: the run has none (not started with ``refpipe init``).
    """
    try:
        return store.get(AUTHKEY_KEY)
    except KeyNotFoundError as e:
        raise ConfigError(f"run {store.prefix.uri}: no {AUTHKEY_KEY} (start the run with `refpipe init`)") from e


def exit_reason(returncode: int) -> str:
    """How a role's process this process started ended, and where to look (``Popen.returncode``, not 0): a process
    killed by a signal printed nothing, so there is no log of it above (SIGKILL is also what the kernel's OOM
    killer sends, which its kernel log names); one that exited printed its error to this terminal."""
    if returncode >= 0:
        return f"exited with code {returncode}; its error is in its output above"
    name = signal.Signals(-returncode).name if -returncode in signal.valid_signals() else f"signal {-returncode}"
    hint = "; if nobody killed it, look for the kernel's OOM killer in `journalctl -k` or `dmesg` on this host" \
        if -returncode == signal.SIGKILL else ""
    return f"killed by {name}, so it printed nothing{hint}"


def connect_replica(store: Store, replica: int, key: bytes, deadline: float,
                    exit_code=lambda: None) -> Connection:
    """Connect to env-server replica ``replica`` once its address is published (a stale address of
    an earlier life is retried until the replica rewrites it, also when another run's replica now listens there:
    its auth key differs).

    Raises:
        TimeoutError: no connection before ``deadline`` (``time.monotonic()``), or ``exit_code()`` (the return code
            of the replica's process when this process started it, None while it runs) says it ended.
    """
    last = "no address published"
    while time.monotonic() < deadline:
        if (code := exit_code()) is not None:
            raise TimeoutError(f"env-server replica {replica} ended before it could be reached: {exit_reason(code)}")
        try:
            address = json.loads(store.get(address_key(replica)))
            return Client((address["host"], int(address["port"])), authkey=key)
        except KeyNotFoundError:
            pass
        except (OSError, ValueError, KeyError, AuthenticationError) as e:  # AuthenticationError: another run's
            last = f"{type(e).__name__}: {e}"                                 # replica took the stale address
        time.sleep(0.2)
    raise TimeoutError(f"env-server replica {replica} of {store.prefix.uri}: not reachable ({last})")


def exit_with_launcher() -> bool:
    """Started by ``refpipe run`` (``REFPIPE_LAUNCHER_PID`` set): exit when the launcher is gone
    (SIGKILLed); return True. A role started on its own (torchrun, SLURM) watches nothing: False."""
    launcher = int(os.environ.get(LAUNCHER_PID_ENV, "0"))
    if not launcher:
        return False

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(1.0)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="launcher-watch").start()
    return True


def exit_without_teardown(code: int) -> NoReturn:
    """End this process with exit code ``code`` once its work is done, without the interpreter's teardown.

    A trainer rank's process that used torch.distributed (gloo) can abort in that teardown, after
    ``destroy_process_group`` and after every file it wrote was closed: a C++ thread of torch's still
    joinable when its owner is destroyed calls ``std::terminate`` ("terminate called without an active
    exception", SIGABRT), seen on this machine kind in 2 of 7 two-node runs of
    ``tests/job/test_multi_node.py`` with only the main Python thread left. So ``python -m
    refpipe.job.train_rank`` flushes its logs and standard streams and leaves with ``os._exit``.
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def start_local_roles(cfg: RunConfig, run_uri: str, master_port: int, *,
                      published: int | None = None) -> tuple[list[subprocess.Popen], list[subprocess.Popen]]:
    """``refpipe run``: start the env-server replicas and the trainer ranks on this machine, each the
    same command an operator would start (trainers with torchrun's environment, gloo on loopback;
    ``--resume --published <published>`` for a later life whose earlier lives published steps ``0 .. published - 1``).
    Each runs in its own session: Ctrl-C is the launcher's, which stops them."""
    base = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid()), "OMP_NUM_THREADS": "1"}
    endpoint = ["--s3-endpoint-url", cfg.storage.s3_endpoint_url] if cfg.storage.s3_endpoint_url else []
    envs = [subprocess.Popen([sys.executable, "-m", "refpipe.cli.main", "env-server", run_uri,
                              "--replica", str(i), "--host", "127.0.0.1", *endpoint], env=base,
                             start_new_session=True) for i in range(cfg.job.num_env_workers)]
    world = cfg.job.trainer_world_size
    trainers = [subprocess.Popen([sys.executable, "-m", "refpipe.job.train_rank", run_uri, *endpoint,
                                  *(["--resume", "--published", str(published)] if published is not None else [])],
                                 env={**base, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                                      "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port)},
                                 start_new_session=True) for rank in range(world)]
    return envs, trainers
