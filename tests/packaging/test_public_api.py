"""``import refpipe``: the stable embedding API, nothing else, and light to import (no torch until used)."""

from __future__ import annotations

import subprocess
import sys

PUBLIC = [
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
    "publish_step", "r3_routing_rows", "read_step_file", "rloo", "sglang_routed_experts", "sglang_suffix_rows",
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
    import refpipe
    from refpipe.storage import errors

    types = {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, errors.RefpipeError)}
    assert len(types) == 33 and types <= set(refpipe.__all__)


def test_type_checkers_see_every_public_name_where_it_loads_from():
    """The ``TYPE_CHECKING`` imports (what mypy, pyright and IDEs read) name exactly ``_WHERE``'s modules, and
    ``__all__`` is its names, sorted; ``py.typed`` marks the package as typed."""
    import ast
    from pathlib import Path

    import refpipe

    source = Path(refpipe.__file__).resolve()
    (block,) = [node for node in ast.parse(source.read_text()).body if isinstance(node, ast.If)
                and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"]
    seen = {alias.name: node.module for node in block.body if isinstance(node, ast.ImportFrom)
            for alias in node.names}
    assert seen == refpipe._WHERE
    assert refpipe.__all__ == sorted(refpipe._WHERE) == PUBLIC
    assert (source.parent / "py.typed").is_file()
