"""``import refpipe``: the stable embedding API, nothing else, and light to import (no torch until used)."""

from __future__ import annotations

import subprocess
import sys

PUBLIC = [
    "AlignmentError", "Branch", "BranchResult", "CheckpointError", "ChunkCorruptError", "ChunkNotFoundError",
    "ConfigError", "DeleteKeysError", "DeleteRecordError", "DeleteResult", "DoubleDeleteError", "Episode",
    "EpisodeError", "FetchError", "FieldDecl", "FieldError", "FieldsConfig", "GroupRollouts", "Keeper",
    "KeyExistsError", "KeyNotFoundError", "Ledger", "LedgerRecordError", "Orchestrator", "OrchestratorConfig",
    "OutsideRunError", "PackedSequence", "PackingError", "PayloadRef", "PayloadSlice", "Ragged", "RefpipeError",
    "ReplayMismatchError", "RunNotFoundError", "RunPathNotADirectoryError", "RunStillRunningError", "SliceError",
    "SliceId", "StepFileError", "StepHeader", "StepMetrics", "StepMicroBatch", "StorageConfig", "StorageError",
    "Store", "TrainMicroBatch", "TrainerConfig", "TrainerRank", "TransientStorageError", "UnknownRefError",
    "ValueChecks", "balanced_packer", "engine_routed_experts", "fetch_arrays", "first_fit_packer", "from_episode",
    "group_normalized", "init_process_group", "new_data_group", "open_store", "publish_step", "rloo",
    "sglang_routed_experts",
]
