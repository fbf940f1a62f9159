"""Heartbeat liveness of ledger sessions across processes (and so across hosts): real processes, SIGSTOP.

The child process stands for an env server on another node: its ledger session beats every
0.2 s with a 1 s timeout (fast, for the test; the defaults are 5 s x 3), and the parent judges
it only by the heartbeat object under the run prefix (content changes between two looks).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from refpipe.pipeline.audit import audit
from refpipe.pipeline.sweep import sweep
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import ConfigError
from refpipe.storage.layout import heartbeat_key, node_key, tombstone_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.liveness import SessionWatch, live_sessions

CHILD = """
import json, sys
from tests.storage.storage_helpers import FIELDS_CFG, make_fields
from refpipe.pipeline.keep import Branch, Keeper

from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import DoubleDeleteError
from refpipe.storage.ledger import Ledger
from refpipe.storage.backends import open_store
config = StorageConfig.model_validate_json(sys.argv[1])
store = open_store(config)
ledger = Ledger(store, "env_worker_0")
keeper = Keeper(store, ledger, FIELDS_CFG, config)
refs = [keeper.keep(Branch(2, 3, make_fields(i, 2, 3), f"b{i}")) for i in range(2)]
ledger.flush()
print(json.dumps({"session": ledger.session}), flush=True)
sys.stdin.readline()  # the parent's go: discard what this session kept
try:
    ledger.delete(refs, reason="env server: group filtered")
    print("deleted", flush=True)
except DoubleDeleteError as e:
    print(json.dumps({"deleted": e.result.deleted, "double_deletes": len(e.result.double_deletes)}), flush=True)
"""


@pytest.fixture
def child(tmp_path):
    """A process holding a live ``env_worker_0`` session that kept chunks b0 and b1; yields (store, proc, session)."""
    config = StorageConfig(root=str(tmp_path / "root"), run_id="run_1", heartbeat_interval_s=0.2,
                           heartbeat_timeout_s=1.0)
    proc = subprocess.Popen([sys.executable, "-c", CHILD, config.model_dump_json()], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2])
    try:
        session = json.loads(proc.stdout.readline())["session"]
        yield open_store(config.model_copy(update={"heartbeat_interval_s": 5.0, "heartbeat_timeout_s": 15.0})), \
            proc, session
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_a_second_live_session_of_one_actor_is_refused_naming_the_live_one(child):
    store, proc, session = child
    before = store.list_prefix("ledger/events")
    with pytest.raises(ConfigError, match=f"ledger actor 'env_worker_0' of run {store.prefix.uri} already has a live "
                                          f"session {session} .*: one process per actor"):
        Ledger(store, "env_worker_0")
    assert store.list_prefix("ledger/events") == before  # the refused session wrote nothing
    assert Ledger(store, "env_worker_1").session  # another actor is fine


def test_a_stopped_process_is_dead_after_its_timeout_swept_once_and_cannot_delete_again(child):
    store, proc, session = child
    held = audit(store)
    assert held.live_sessions == [f"env_worker_0/{session}"] and held.outstanding_by_holder == {"env_worker_0": 2}
    assert sweep(store).deleted == []  # a plain sweep never deletes what a live session holds
    os.kill(proc.pid, signal.SIGSTOP)
    stopped = audit(store)
    assert (stopped.live_sessions, stopped.leaked, stopped.outstanding) == ([], 2, 0)
    swept = sweep(store)
    assert sorted(swept.deleted) == sorted([store.uri(node_key("b0")), store.uri(node_key("b1"))])
    assert store.list_prefix("payloads") == []
    os.kill(proc.pid, signal.SIGCONT)
    proc.stdin.write("go\n")
    proc.stdin.flush()
    assert json.loads(proc.stdout.readline()) == {"deleted": [], "double_deletes": 2}
    for branch_id in ("b0", "b1"):
        assert json.loads(store.get(tombstone_key(branch_id)))["holder"] == "sweep"
    after = audit(store, finished=True)
    assert (after.kept, after.deleted, after.leaked, after.double_deletes) == (2, 2, 0, 2)



@pytest.mark.parametrize("timing", [{}, {"timeout_s": "x", "interval_s": 5},
                                    {"timeout_s": float("nan"), "interval_s": 5},
                                    {"timeout_s": 1e30, "interval_s": 5}, {"timeout_s": 15, "interval_s": 0}])
def test_a_heartbeat_stating_no_usable_timeout_is_unreadable_so_dead(local_config, timing):
    store = open_store(local_config)
    beat = {"actor": "env_worker_0", "session": "7-1", "pid": 7, "host": "another-node", "beat": 3, **timing}
    store.put(heartbeat_key("env_worker_0", "7-1"), json.dumps(beat).encode())
    assert live_sessions(store, [("env_worker_0", "7-1")]) == set()
    assert SessionWatch(store).dead([("env_worker_0", "7-1")]) == {("env_worker_0", "7-1"): "unreadable heartbeat"}
