"""refpipe: per-token side-channel arrays of LLM RL training, passed by reference.

The stable API for embedding refpipe in your own RL stack (README, "Use refpipe in your own
stack"); every other module is internal and may change:

- env-server worker: ``Keeper`` (``keep`` a branch's arrays -> ``PayloadRef``; ``discard``),
  ``Branch``, ``Ragged``, ``Ledger`` (one per actor per process);
- orchestrator: ``Orchestrator`` (``submit`` episodes, ``build_step`` publishes a step file;
  ``shutdown``), ``Episode``, ``BranchResult``, ``StepHeader``;
- trainer rank: ``init_process_group`` / ``new_data_group``, ``TrainerRank`` with its steps
  ``load_and_fetch``, ``agree_failures``, ``release_step`` and ``run_step`` composing them
  (then ``finish``, ``close``), ``TrainMicroBatch``, ``StepMetrics``;
- configs: ``StorageConfig``, ``FieldsConfig``, ``OrchestratorConfig``, ``TrainerConfig``;
- storage: ``open_store``, ``Store``, ``PayloadRef``, ``fetch_arrays``;
- step files, read-only (docs/step-files.md): ``read_step_file``, ``StepFile``;
- errors: ``RefpipeError`` and its subclasses.

Names load on first use, so ``import refpipe`` stays light (the trainer's names import torch).
The subpackages are installed from the top-level folders of the repository (``storage/``,
``pipeline/``, ``trainer/``, ``job/``, ``cli/``, ``integrations/``) as ``refpipe.storage`` and
so on; nothing of refpipe is importable under a bare name.
"""

from importlib import import_module
from importlib.metadata import version as _version

__version__ = _version("refpipe")

_ERRORS = ("RefpipeError", "ConfigError", "OutsideRunError", "StorageError", "TransientStorageError",
           "KeyNotFoundError", "ChunkNotFoundError", "RunNotFoundError", "RunPathNotADirectoryError",
           "ChunkCorruptError", "KeyExistsError",
           "DoubleDeleteError", "UnknownRefError", "FieldError", "EpisodeError", "StepFileError", "PackingError",
           "FetchError", "AlignmentError", "DeleteKeysError", "CheckpointError", "ReplayMismatchError",
           "RunStillRunningError", "DeleteRecordError", "LedgerRecordError",
           "RefError")
_WHERE = {
    "Branch": "refpipe.pipeline.keep", "Keeper": "refpipe.pipeline.keep",
    "Ragged": "refpipe.pipeline.fields", "FieldsConfig": "refpipe.pipeline.fields",
    "Ledger": "refpipe.storage.ledger", "DeleteResult": "refpipe.storage.ledger",
    "Orchestrator": "refpipe.pipeline.orchestrator", "OrchestratorConfig": "refpipe.pipeline.orchestrator",
    "Episode": "refpipe.pipeline.samples", "BranchResult": "refpipe.pipeline.samples",
    "StepHeader": "refpipe.pipeline.step_file",
    "StepFile": "refpipe.pipeline.step_file", "read_step_file": "refpipe.pipeline.step_file",
    "TrainerRank": "refpipe.trainer.step", "StepMetrics": "refpipe.trainer.step",
    "TrainerConfig": "refpipe.trainer.config", "TrainMicroBatch": "refpipe.trainer.tensors",
    "init_process_group": "refpipe.trainer.dist", "new_data_group": "refpipe.trainer.dist",
    "StorageConfig": "refpipe.storage.config", "open_store": "refpipe.storage.backends",
    "Store": "refpipe.storage.store", "PayloadRef": "refpipe.storage.chunk", "fetch_arrays": "refpipe.storage.fetch",
    **{name: "refpipe.storage.errors" for name in _ERRORS},
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'refpipe' has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
