"""``import refpipe``: the stable embedding API, nothing else, and light to import (no torch until used)."""

from __future__ import annotations

import subprocess
import sys

PUBLIC = [
    "AlignmentError", "Branch", "BranchResult", "CheckpointError", "ChunkCorruptError", "ChunkNotFoundError",
    "ConfigError", "DeleteKeysError", "DeleteRecordError", "DeleteResult", "DoubleDeleteError", "Episode",
    "EpisodeError", "FetchError", "FieldError", "FieldsConfig", "Keeper", "KeyExistsError", "KeyNotFoundError",
    "Ledger", "LedgerRecordError", "Orchestrator", "OrchestratorConfig", "OutsideRunError", "PackingError",
    "PayloadRef", "Ragged", "RefError", "RefpipeError", "ReplayMismatchError", "RunNotFoundError",
    "RunPathNotADirectoryError", "RunStillRunningError", "StepFile", "StepFileError", "StepHeader", "StepMetrics",
    "StorageConfig", "StorageError", "Store", "TrainMicroBatch", "TrainerConfig", "TrainerRank",
    "TransientStorageError", "UnknownRefError", "fetch_arrays", "init_process_group", "new_data_group", "open_store",
    "read_step_file",
]


def test_the_public_api_is_exactly_these_names_and_each_resolves():
    code = ("import sys, refpipe\n"
            "light = 'torch' not in sys.modules\n"
            "names = [n for n in refpipe.__all__ if getattr(refpipe, n) is not None]\n"
            "print(light, ' '.join(names))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", *PUBLIC]


def test_an_unknown_name_is_an_attribute_error():
    import refpipe

    try:
        refpipe.LocalStore  # noqa: B018 -- internal: not part of the API
    except AttributeError as e:
        assert str(e) == "module 'refpipe' has no attribute 'LocalStore'"
    else:
        raise AssertionError("refpipe.LocalStore resolved")


def test_every_error_type_is_public():
    from refpipe.storage import errors

    import refpipe

    types = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.RefpipeError)}
    assert len(types) == 26 and types <= set(refpipe.__all__)
