"""One trainer rank of a distributed test world: ``python -m tests.trainer.dist_worker <spec.json> <rank>``.

Joins a gloo world at the spec's ``init_method``, runs ``TrainerRank.run_step`` for each step of
the spec, and writes per step ``step<N>_rank<r>.npz`` (every tensor the train callback got, as
numpy, keyed ``mb<i>.<name>``) and ``step<N>_rank<r>.json`` (metrics or the error, dropped flags,
how long the step took, how many collectives it ran on the data group: gloo's sequence number of the
group, which every collective advances, ``all_gather_object`` by two); after the last step, if no step
broke the world, ``finish_rank<r>.json``
(``TrainerRank.finish``: the last release's counts). A rank listed in ``exit_before`` leaves the
world with ``os._exit`` at that step, as a crashed rank would. A branch id in ``fetch_raises``
makes its fetch raise that builtin exception, as a bug in the fetch path would.

With ``"default_backend": "fake"`` the default process group is torch's ``fake`` backend (its
collectives return at once and combine nothing: a stand-in for an NCCL world that cannot take the
data path's CPU tensors), and the data path must run on ``TrainerRank``'s own gloo group.
"""

from __future__ import annotations

import builtins
import json
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch.distributed as dist

from refpipe.pipeline.fields import FieldsConfig
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.trainer import fetch as trainer_fetch
from refpipe.trainer.config import TrainerConfig
from refpipe.trainer.dist import init_process_group
from refpipe.trainer.step import TrainerRank
from tests.trainer.trainer_helpers import flatten


def _inject_bugs(fetch_raises: dict[str, str]) -> None:
    """Make the trainer's fetch of the named branches raise the named builtin exception."""
    real = trainer_fetch.fetch_into

    def fetch_into(store, ref, num_tokens, out, step=None):
        if ref.branch_id in fetch_raises:
            raise getattr(builtins, fetch_raises[ref.branch_id])(f"injected bug fetching {ref.branch_id}")
        return real(store, ref, num_tokens, out, step)

    trainer_fetch.fetch_into = fetch_into


def main(spec_path: str, rank: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    logging.basicConfig(level=logging.INFO, format=f"rank{rank} %(name)s %(levelname)s %(message)s")
    config = TrainerConfig(**spec["trainer"])
    storage = StorageConfig(**spec["storage"])
    if spec.get("default_backend") == "fake":
        import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

        host, port = spec["init_method"].removeprefix("tcp://").split(":")
        store = dist.TCPStore(host, int(port), spec["world_size"], is_master=rank == 0)
        dist.init_process_group("fake", store=store, rank=rank, world_size=spec["world_size"])
    else:
        init_process_group(config, rank=rank, world_size=spec["world_size"], init_method=spec["init_method"])
    _inject_bugs(spec.get("fetch_raises", {}))
    rank_obj = TrainerRank(open_store(storage), FieldsConfig(**spec["fields"]), storage, config)
    for step in spec["steps"]:
        if step in spec.get("exit_before", {}).get(str(rank), []):
            os._exit(3)
        got: dict[str, np.ndarray] = {}
        result: dict = {"rank": rank, "dp_rank": rank_obj.topology.dp_rank, "dropped": []}

        def train(batches):
            for mb in batches:
                result["dropped"].append(mb.dropped)
                got.update({f"mb{mb.record.index}.{k}": v
                            for k, v in flatten(mb.streams, mb.cu_seqlens, mb.fields).items()})

        started = time.monotonic()
        collectives = rank_obj.data_group._get_sequence_number_for_group()
        try:
            result["metrics"] = rank_obj.run_step(step, train).model_dump()
        except Exception as e:  # noqa: BLE001 -- the test asserts on what each rank raised
            result["error"], result["message"] = type(e).__name__, str(e)
        result["seconds"] = time.monotonic() - started
        result["collectives"] = rank_obj.data_group._get_sequence_number_for_group() - collectives
        np.savez(out / f"step{step}_rank{rank}.npz", **got)
        (out / f"step{step}_rank{rank}.json").write_text(json.dumps(result))
        if "error" in result and result["error"] != "FetchError":
            break  # the world is broken (a peer left); the remaining steps cannot run
    else:
        (out / f"finish_rank{rank}.json").write_text(rank_obj.finish().model_dump_json())
    rank_obj.close()
    os._exit(0)  # skip process-group teardown, which can wait on peers that already left


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
