"""The run config file: a section given in part keeps the run's defaults and what other sections say (it reset
``orchestrator.dp_world_size`` to the library's 1, ``seq_len`` to 4096 and the trainer's timeouts to 1800/600 s)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from refpipe.job.config import RunConfig, load_config
from refpipe.storage.errors import ConfigError


def _load(tmp_path, text: str) -> RunConfig:
    path = tmp_path / "run.toml"
    path.write_text(f'[storage]\nroot = "{tmp_path}/root"\nrun_id = "r1"\n{text}')
    return load_config(path)


def _topology(cfg: RunConfig) -> tuple:
    return (cfg.orchestrator.dp_world_size, cfg.trainer.model_parallel_size, cfg.job.trainer_world_size)


def test_a_partial_orchestrator_section_keeps_the_run_defaults(tmp_path):
    cfg = _load(tmp_path, "[orchestrator]\nseq_len = 128\n")
    o = cfg.orchestrator
    assert (o.seq_len, o.dp_world_size, o.groups_per_step, o.group_size) == (128, 2, 8, 8)
    assert _topology(cfg) == (2, 1, 2)


def test_a_partial_trainer_section_keeps_the_run_timeouts(tmp_path):
    cfg = _load(tmp_path, '[trainer]\nrelease = "after_step"\n')
    t = cfg.trainer
    assert (t.release, t.step_timeout_s, t.collective_timeout_s) == ("after_step", 300.0, 300.0)


@pytest.mark.parametrize(("text", "expected"), [
    ("[job]\ntrainer_world_size = 4\n", (4, 1, 4)),
    ("[orchestrator]\ndp_world_size = 3\n", (3, 1, 3)),
    ("[trainer]\nmodel_parallel_size = 2\n", (2, 2, 4)),
    ("[job]\ntrainer_world_size = 4\n[trainer]\nmodel_parallel_size = 2\n", (2, 2, 4)),
    ("[job]\ntrainer_world_size = 6\n[orchestrator]\ndp_world_size = 3\n[trainer]\nmodel_parallel_size = 2\n",
     (3, 2, 6)),
])
def test_the_trainer_world_is_derived_from_whichever_side_is_given(tmp_path, text, expected):
    assert _topology(_load(tmp_path, text)) == expected


def test_sizes_that_disagree_are_still_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"job.trainer_world_size=5: expected orchestrator.dp_world_size \(3\) x "
                                          r"trainer.model_parallel_size \(1\)"):
        _load(tmp_path, "[job]\ntrainer_world_size = 5\n[orchestrator]\ndp_world_size = 3\n")


def test_a_resolved_config_reads_back_unchanged(tmp_path):
    cfg = _load(tmp_path, "[job]\ntrainer_world_size = 4\n[trainer]\nmodel_parallel_size = 2\n")
    assert RunConfig.model_validate_json(cfg.model_dump_json()) == cfg


def test_fields_declared_in_toml_join_the_runs_fields_and_read_back(tmp_path):
    cfg = _load(tmp_path, """
[fields]
vocab_size = 64

[[fields.declare]]
name = "teacher_logprobs"
dtypes = ["float32"]
checks = {finite = true, high = 0.0}

[[fields.declare]]
name = "image_features"
dtypes = ["float16"]
shape = [16]
domain = "prompt"
""")
    fields = cfg.fields
    assert list(fields.registry())[-2:] == ["teacher_logprobs", "image_features"]
    assert fields.vocab_size == 64 and fields.registry()["image_features"].dtypes == ("<f2",)
    assert fields.registry()["teacher_logprobs"].checks.high == 0.0
    assert RunConfig.model_validate_json(cfg.model_dump_json()) == cfg  # config.json of the run


def test_a_bad_declaration_in_toml_names_it(tmp_path):
    with pytest.raises(ConfigError, match="padding 'zeros' in the completion domain"):
        _load(tmp_path, '[[fields.declare]]\nname = "x"\ndtypes = ["float32"]\npadding = "zeros"\n')


def test_the_default_release_needs_checkpoints_and_says_how_to_run_without(tmp_path):
    with pytest.raises(ConfigError) as info:
        _load(tmp_path, "[job]\ncheckpoint_every_steps = 0\n")
    assert str(info.value) == f"config {tmp_path / 'run.toml'}: " + (
        'trainer.release="after_checkpoint" (the default) needs job.checkpoint_every_steps >= 1 (with 0 no checkpoint '
        'is ever written, so no trained chunk would ever be deleted); without checkpoints set trainer.release = '
        '"after_step"')
    assert _load(tmp_path, '[job]\ncheckpoint_every_steps = 0\n[trainer]\nrelease = "after_step"\n').trainer.release \
        == "after_step"


def test_a_working_directory_with_a_hash_needs_no_relative_root(tmp_path):
    """RunConfig's storage default is built per config, not at import: ``refpipe init`` of a config with an absolute
    root works from a directory whose path holds ``#`` (it printed a ValidationError traceback at import)."""
    cwd = tmp_path / "job#42"
    cwd.mkdir()
    config = tmp_path / "run.toml"
    config.write_text(f'[storage]\nroot = "{tmp_path / "root"}"\nrun_id = "x"\n')
    result = subprocess.run([sys.executable, "-m", "refpipe.cli.main", "init", "--config", str(config)], cwd=cwd,
                            capture_output=True, text=True, timeout=120)
    assert (result.returncode, result.stderr) == (0, "")
    assert f"file://{tmp_path / 'root'}/x" in result.stdout and (tmp_path / "root" / "x" / "config.json").is_file()
