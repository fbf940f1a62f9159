"""One trainer rank driving the pull loop: ``python -m tests.trainer.pull_worker <spec.json> <rank>``.

The spec is ``dist_worker.py``'s plus ``stop`` (steps ``0 .. stop - 1``), ``data_loader`` (iterate a
``DataLoader(StepDataset(...), batch_size=None)`` instead of ``TrainerRank.steps``) and ``next_before_release``
(a step after which this rank asks for the next step before releasing it, then releases it and goes on). Writes
``step<N>_rank<r>.npz``/``.json`` as ``dist_worker.py`` does (its ``collectives``: those of the data group since
the previous step was released, so opening and releasing the step), plus ``release_again`` (what a second
``release()`` raised), ``next_before_release`` (what that early ``next()`` raised) and, for a step that failed
to open, the error the loop raised and ``then`` (what the ``next()`` after it raised). A restarted life:
``checkpoint_step`` (the loop resumes through ``TrainerRank.resume_plan(checkpoint_step)``, the plan written to
``plan_rank<r>.json``); a crash: ``pause`` ``[step, dp_rank]`` (that DP rank creates ``paused`` and sleeps before
releasing the step, until the test kills it).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

from refpipe.pipeline.fields import FieldsConfig
from refpipe.storage.backends import open_store
from refpipe.storage.config import StorageConfig
from refpipe.trainer.config import TrainerConfig
from refpipe.trainer.dist import init_process_group
from refpipe.trainer.loop import StepDataset
from refpipe.trainer.step import TrainerRank
from tests.trainer.trainer_helpers import flatten


def main(spec_path: str, rank: int) -> None:
    spec = json.loads(Path(spec_path).read_text())
    out = Path(spec["out_dir"])
    logging.basicConfig(level=logging.INFO, format=f"rank{rank} %(name)s %(levelname)s %(message)s")
    config, storage = TrainerConfig(**spec["trainer"]), StorageConfig(**spec["storage"])
    init_process_group(config, rank=rank, world_size=spec["world_size"], init_method=spec["init_method"])
    trainer = TrainerRank(open_store(storage), FieldsConfig(**spec["fields"]), storage, config)
    group = trainer.data_group
    plan = None
    if "checkpoint_step" in spec:
        plan = trainer.resume_plan(checkpoint_step=spec["checkpoint_step"])
        (out / f"plan_rank{rank}.json").write_text(json.dumps(
            {"start_step": plan.start_step, "skipped": plan.skipped, "replayed": plan.replayed}))
    steps = iter(DataLoader(StepDataset(trainer, spec["stop"], resume=plan), batch_size=None)
                 if spec["data_loader"] else trainer.steps(spec["stop"], resume=plan))
    seen, step = group._get_sequence_number_for_group(), 0
    try:
        for opened in steps:
            step = opened.step
            result = {"rank": rank, "dp_rank": trainer.topology.dp_rank,
                      "dropped": [mb.dropped for mb in opened.batches], "replayed": opened.replayed}
            got = {f"mb{mb.record.index}.{k}": v for mb in opened.batches
                   for k, v in flatten(mb.streams, mb.cu_seqlens, mb.fields).items()}
            if [step, trainer.topology.dp_rank] == spec.get("pause"):
                np.savez(out / f"step{step}_rank{rank}.npz", **got)
                (out / f"step{step}_rank{rank}.json").write_text(json.dumps(result))
                (out / "paused").touch()
                time.sleep(3600)
            if step == spec.get("next_before_release"):
                result["next_before_release"] = _raised(lambda: next(steps))
            result["metrics"] = opened.release().model_dump()
            result["release_again"] = _raised(opened.release)
            result["collectives"] = group._get_sequence_number_for_group() - seen
            seen = group._get_sequence_number_for_group()
            np.savez(out / f"step{step}_rank{rank}.npz", **got)
            (out / f"step{step}_rank{rank}.json").write_text(json.dumps(result))
            step += 1
    except Exception as e:  # noqa: BLE001 -- the test asserts on what each rank raised
        error = {"rank": rank, "dp_rank": trainer.topology.dp_rank, "dropped": [], "error": type(e).__name__,
                 "message": str(e), "collectives": group._get_sequence_number_for_group() - seen,
                 "then": _raised(lambda: next(steps))}
        np.savez(out / f"step{step}_rank{rank}.npz")
        (out / f"step{step}_rank{rank}.json").write_text(json.dumps(error))
    trainer.close()
    os._exit(0)  # skip process-group teardown, which can wait on peers that already left


def _raised(call: Callable[[], object]) -> str:
    """``"<type>: <message>"`` of what ``call`` raised ("returned" if it did not)."""
    try:
        call()
    except Exception as e:  # noqa: BLE001 -- the test asserts on what it raised
        return f"{type(e).__name__}: {e}"
    return "returned"


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
