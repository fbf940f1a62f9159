"""refpipe: per-token side-channel arrays of LLM RL training, passed by reference.

The stable API for embedding refpipe in your own RL stack (README, "Use refpipe in your own
stack"); every other module is internal and may change:

- env-server worker: ``Keeper`` (``keep`` a branch's arrays -> ``PayloadRef``; ``discard``; multi-turn:
  ``open_branch`` -> ``OpenBranch`` to append each turn's rows, ``keep_prefix`` for a group's shared prompt,
  ``resume_branch`` for a ``SuspendedBranch``), ``Branch``, ``Ragged``, ``Ledger`` (one per actor per process);
- orchestrator: ``Orchestrator`` (``submit`` episodes, ``build_step`` publishes a step file;
  ``shutdown``), ``Episode``, ``BranchResult``, ``StepHeader``;
- the layers below it (docs/embedding.md): ``PayloadSlice`` / ``SliceId`` (a sample's slice of a ref and its
  small wire form), ``publish_step`` with ``StepMicroBatch`` / ``PackedSequence`` (a step from the caller's own
  packed micro batches), advantage estimators ``group_normalized``, ``rloo``, ``from_episode`` (``GroupRollouts``)
  and packers ``balanced_packer``, ``first_fit_packer``;
- trainer rank: ``init_process_group`` / ``new_data_group``, ``TrainerRank`` with its pull loop
  ``steps`` (a ``TrainingStep`` per step: train on its ``batches``, then ``release()``; or a
  ``StepDataset`` for a ``DataLoader``), ``run_step`` (the same with a callback), a restart's
  ``resume_plan`` (a ``ResumePlan``), then ``finish``, ``close``; ``TrainMicroBatch``, ``StepMetrics``;
- configs: ``StorageConfig``, ``FieldsConfig``, ``OrchestratorConfig``, ``TrainerConfig``;
- fields: ``FieldDecl`` and ``ValueChecks`` (declare a field), ``sglang_routed_experts`` and
  ``engine_routed_experts`` (routing as inference engines return it), ``sglang_suffix_rows``, ``TurnRows`` and
  ``r3_routing_rows`` (a turn's new routing rows, docs/fields.md);
- storage: ``open_store``, ``Store``, ``PayloadRef``, ``fetch_arrays``;
- step files, read-only (docs/step-files.md): ``read_step_file``, ``StepFile``;
- errors: ``RefpipeError`` and its subclasses.

Names load on first use, so ``import refpipe`` stays light (the trainer's names import torch); type checkers
and IDEs read them from the ``TYPE_CHECKING`` imports below (a test keeps those, ``__all__`` and ``_WHERE`` equal).
The subpackages are installed from the top-level folders of the repository (``storage/``,
``pipeline/``, ``trainer/``, ``job/``, ``cli/``, ``integrations/``) as ``refpipe.storage`` and
so on; nothing of refpipe is importable under a bare name.
"""

from importlib import import_module
from importlib.metadata import version as _version
from typing import TYPE_CHECKING

__version__ = _version("refpipe")

_ERRORS = ("RefpipeError", "ArgumentTypeError", "ConfigError", "OutsideRunError", "StorageError",
           "TransientStorageError",
           "KeyNotFoundError", "ChunkNotFoundError", "RunNotFoundError", "RunPathNotADirectoryError",
           "ChunkCorruptError", "KeyExistsError",
           "DoubleDeleteError", "UnknownRefError", "FieldError", "EpisodeError", "StepFileError", "PackingError",
           "FetchError", "AlignmentError", "DeleteKeysError", "CheckpointError", "ReplayMismatchError",
           "RunStillRunningError", "RunError", "DeleteRecordError", "LedgerRecordError", "TruncatedChunkError",
           "StepOrderError", "RefError", "LedgerClosedError", "OpenBranchError")
_WHERE = {
    "Branch": "refpipe.pipeline.keep", "Keeper": "refpipe.pipeline.keep",
    "OpenBranch": "refpipe.pipeline.open_branch", "SuspendedBranch": "refpipe.storage.ledger_open",
    "Ragged": "refpipe.pipeline.fields", "FieldsConfig": "refpipe.pipeline.fields",
    "FieldDecl": "refpipe.pipeline.field_decl", "ValueChecks": "refpipe.pipeline.field_decl",
    "sglang_routed_experts": "refpipe.pipeline.engines", "engine_routed_experts": "refpipe.pipeline.engines",
    "sglang_suffix_rows": "refpipe.pipeline.engines", "TurnRows": "refpipe.pipeline.engines",
    "r3_routing_rows": "refpipe.pipeline.engines",
    "Ledger": "refpipe.storage.ledger", "DeleteResult": "refpipe.storage.delete_result",
    "Orchestrator": "refpipe.pipeline.orchestrator", "OrchestratorConfig": "refpipe.pipeline.orchestrator",
    "Episode": "refpipe.pipeline.samples", "BranchResult": "refpipe.pipeline.samples",
    "StepHeader": "refpipe.pipeline.step_header",
    "StepFile": "refpipe.pipeline.step_file", "read_step_file": "refpipe.pipeline.step_file",
    "PayloadSlice": "refpipe.pipeline.slices", "SliceId": "refpipe.pipeline.slices",
    "publish_step": "refpipe.pipeline.publish", "StepMicroBatch": "refpipe.pipeline.publish",
    "PackedSequence": "refpipe.pipeline.publish",
    "balanced_packer": "refpipe.pipeline.packing", "first_fit_packer": "refpipe.pipeline.packing",
    "GroupRollouts": "refpipe.pipeline.advantages", "group_normalized": "refpipe.pipeline.advantages",
    "rloo": "refpipe.pipeline.advantages", "from_episode": "refpipe.pipeline.advantages",
    "SliceError": "refpipe.storage.errors",
    "TrainerRank": "refpipe.trainer.step", "StepMetrics": "refpipe.trainer.metrics",
    "TrainerConfig": "refpipe.trainer.config", "TrainMicroBatch": "refpipe.trainer.tensors",
    "init_process_group": "refpipe.trainer.dist", "new_data_group": "refpipe.trainer.dist",
    "TrainingStep": "refpipe.trainer.loop", "StepDataset": "refpipe.trainer.loop",
    "ResumePlan": "refpipe.trainer.resume",
    "StorageConfig": "refpipe.storage.config", "open_store": "refpipe.storage.backends",
    "Store": "refpipe.storage.store", "PayloadRef": "refpipe.storage.chunk_ref",
    "fetch_arrays": "refpipe.storage.chunk_read",
    **{name: "refpipe.storage.errors" for name in _ERRORS},
}
__all__ = [
    "AlignmentError", "ArgumentTypeError", "Branch", "BranchResult", "CheckpointError", "ChunkCorruptError",
    "ChunkNotFoundError",
    "ConfigError", "DeleteKeysError", "DeleteRecordError", "DeleteResult", "DoubleDeleteError", "Episode",
    "EpisodeError", "FetchError", "FieldDecl", "FieldError", "FieldsConfig", "GroupRollouts", "Keeper",
    "KeyExistsError", "KeyNotFoundError", "Ledger", "LedgerClosedError", "LedgerRecordError", "OpenBranch",
    "OpenBranchError", "Orchestrator", "OrchestratorConfig", "OutsideRunError", "PackedSequence", "PackingError",
    "PayloadRef", "PayloadSlice", "Ragged", "RefError",
    "RefpipeError", "ReplayMismatchError", "ResumePlan", "RunError", "RunNotFoundError", "RunPathNotADirectoryError",
    "RunStillRunningError", "SliceError", "SliceId", "StepDataset", "StepFile", "StepFileError", "StepHeader",
    "StepMetrics", "StepMicroBatch", "StepOrderError", "StorageConfig", "StorageError", "Store", "SuspendedBranch",
    "TrainMicroBatch",
    "TrainerConfig", "TrainerRank", "TrainingStep", "TransientStorageError", "TruncatedChunkError", "TurnRows",
    "UnknownRefError", "ValueChecks", "balanced_packer", "engine_routed_experts", "fetch_arrays",
    "first_fit_packer", "from_episode", "group_normalized", "init_process_group", "new_data_group", "open_store",
    "publish_step", "r3_routing_rows", "read_step_file", "rloo", "sglang_routed_experts", "sglang_suffix_rows"
]
"""The public names, spelled out so that type checkers see them (pyright reads only a literal ``__all__``)."""

if TYPE_CHECKING:
    from refpipe.pipeline.advantages import GroupRollouts, from_episode, group_normalized, rloo
    from refpipe.pipeline.engines import (
        TurnRows,
        engine_routed_experts,
        r3_routing_rows,
        sglang_routed_experts,
        sglang_suffix_rows,
    )
    from refpipe.pipeline.field_decl import FieldDecl, ValueChecks
    from refpipe.pipeline.fields import FieldsConfig, Ragged
    from refpipe.pipeline.keep import Branch, Keeper
    from refpipe.pipeline.open_branch import OpenBranch
    from refpipe.pipeline.orchestrator import Orchestrator, OrchestratorConfig
    from refpipe.pipeline.packing import balanced_packer, first_fit_packer
    from refpipe.pipeline.publish import PackedSequence, StepMicroBatch, publish_step
    from refpipe.pipeline.samples import BranchResult, Episode
    from refpipe.pipeline.slices import PayloadSlice, SliceId
    from refpipe.pipeline.step_file import StepFile, read_step_file
    from refpipe.pipeline.step_header import StepHeader
    from refpipe.storage.backends import open_store
    from refpipe.storage.chunk_read import fetch_arrays
    from refpipe.storage.chunk_ref import PayloadRef
    from refpipe.storage.config import StorageConfig
    from refpipe.storage.delete_result import DeleteResult
    from refpipe.storage.errors import (
        AlignmentError,
        ArgumentTypeError,
        CheckpointError,
        ChunkCorruptError,
        ChunkNotFoundError,
        ConfigError,
        DeleteKeysError,
        DeleteRecordError,
        DoubleDeleteError,
        EpisodeError,
        FetchError,
        FieldError,
        KeyExistsError,
        KeyNotFoundError,
        LedgerClosedError,
        LedgerRecordError,
        OpenBranchError,
        OutsideRunError,
        PackingError,
        RefError,
        RefpipeError,
        ReplayMismatchError,
        RunError,
        RunNotFoundError,
        RunPathNotADirectoryError,
        RunStillRunningError,
        SliceError,
        StepFileError,
        StepOrderError,
        StorageError,
        TransientStorageError,
        TruncatedChunkError,
        UnknownRefError,
    )
    from refpipe.storage.ledger import Ledger
    from refpipe.storage.ledger_open import SuspendedBranch
    from refpipe.storage.store import Store
    from refpipe.trainer.config import TrainerConfig
    from refpipe.trainer.dist import init_process_group, new_data_group
    from refpipe.trainer.loop import StepDataset, TrainingStep
    from refpipe.trainer.metrics import StepMetrics
    from refpipe.trainer.resume import ResumePlan
    from refpipe.trainer.step import TrainerRank
    from refpipe.trainer.tensors import TrainMicroBatch


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'refpipe' has no attribute {name!r}")
    value = getattr(import_module(_WHERE[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return [*__all__, "__version__"]
