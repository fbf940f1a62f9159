"""Confinement by resolution (issue 14 input 6): below the run prefix the local store never follows a symlink."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from refpipe.pipeline.fields import FieldsConfig
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.errors import OutsideRunError
from refpipe.storage.layout import node_key
from refpipe.storage.ledger import Ledger

FIELDS = FieldsConfig(logprobs_k=2)


def keep_one(store, config, branch_id: str):
    keeper = Keeper(store, Ledger(store, "env_worker_0"), FIELDS, config)
    return keeper.keep(Branch(1, 3, {"topk_ids": np.arange(6, dtype=np.int32).reshape(3, 2)}, branch_id=branch_id))


def test_a_symlinked_shard_is_never_read_written_or_deleted_through(local_config, tmp_path):
    """``ln -s /elsewhere <run>/payloads/<shard>``: fetch read, and the trainer's release unlinked and rmdir'ed,
    under ``/elsewhere``. Now every access refuses with ``OutsideRunError`` and ``/elsewhere`` stays as it was."""
    store = open_store(local_config)
    ref = keep_one(store, local_config, "b1")
    shard = node_key("b1").rpartition("/")[0]
    elsewhere = tmp_path / "elsewhere"
    shutil.move(f"{store.prefix.path}/{shard}", elsewhere)
    os.symlink(elsewhere, f"{store.prefix.path}/{shard}")
    expected = (f"{store.uri(node_key('b1') + '/c.0')}: {store.uri(shard)} is a symlink: the local store never "
                "follows a symlink below the run prefix")
    with pytest.raises(OutsideRunError) as info:
        fetch_arrays(store, ref)
    assert str(info.value) == expected
    with pytest.raises(OutsideRunError):
        fetch_arrays(store, ref, 2)
    with pytest.raises(OutsideRunError):
        Ledger(store, "trainer_dp0").delete([ref], reason="trained step 0")
    with pytest.raises(OutsideRunError):
        store.put(f"{shard}/b2/c.0", b"x")
    assert sorted(os.listdir(elsewhere / "b1")) == ["c.0", "zarr.json"] and sorted(os.listdir(elsewhere)) == ["b1"]


def test_a_symlinked_object_is_refused_and_a_symlinked_run_root_is_fine(tmp_path, local_config):
    real = tmp_path / "real_root"
    real.mkdir()
    os.symlink(real, tmp_path / "linked_root")  # a symlink above the run prefix (a mount path): allowed
    config = local_config.model_copy(update={"root": str(tmp_path / "linked_root")})
    store = open_store(config)
    ref = keep_one(store, config, "b1")
    assert fetch_arrays(store, ref)["topk_ids"].shape == (3, 2)
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * ref.nbytes)
    data = f"{store.prefix.path}/{node_key('b1')}/c.0"
    os.unlink(data)
    os.symlink(secret, data)
    with pytest.raises(OutsideRunError, match="c.0 is a symlink: the local store never follows"):
        fetch_arrays(store, ref)
    store.delete_key(f"{node_key('b1')}/c.0")  # removes the link itself, never its target
    assert secret.read_bytes() == b"s" * ref.nbytes and not os.path.lexists(data)
