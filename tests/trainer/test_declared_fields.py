"""A declared field travels as a built-in one does: keep, step file, fetch, assembly by its declaration (domain
and padding rule, never its name), the replay hash, and the CLI (inspect, show, verify, plot)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from refpipe.cli.main import app
from refpipe.pipeline.field_decl import FieldDecl, ValueChecks
from refpipe.pipeline.fields import FieldsConfig, Ragged, validate_branch
from refpipe.pipeline.keep import Branch
from refpipe.pipeline.step_file import StepFile
from refpipe.storage.backends import open_store
from refpipe.storage.errors import FieldError
from refpipe.storage.layout import step_key
from refpipe.trainer.fetch import fetch_own
from refpipe.trainer.replay_hash import micro_batch_hash
from tests.trainer.trainer_helpers import Seq, build_step, keep_all

DECLARED = (
    FieldDecl(name="value_targets", dtypes=["float32"], domain="tokens", padding="zeros",
              checks=ValueChecks(finite=True)),
    FieldDecl(name="draft_ids", dtypes=["int32"], shape=[2], domain="tokens", padding="repeat_rows",
              checks=ValueChecks(low=0, below="vocab_size", distinct=True)),
    FieldDecl(name="teacher_logprobs", dtypes=["float32"], checks=ValueChecks(finite=True, high=0.0)),
    FieldDecl(name="image_features", dtypes=["float16"], shape=[4], domain="prompt"),
    FieldDecl(name="prompt_tags", dtypes=["int16"], domain="prompt", ragged=True, checks=ValueChecks(low=0)),
)
CFG = FieldsConfig(num_layers=2, top_k=2, num_experts=8, vocab_size=100, declare=DECLARED)
SEQ_LEN = 16


def _branch(rng, p: int, c: int, name: str) -> Branch:
    t = p + c
    return Branch(p, c, {
        "routed_experts": ((rng.integers(0, 8, (t, 2, 1)) + np.arange(2)) % 8).astype(np.uint8),
        "value_targets": torch.from_numpy(rng.standard_normal(t).astype(np.float32)),
        "draft_ids": (rng.integers(0, 50, (t, 1)) + np.array([0, 50])).astype(np.int64),
        "teacher_logprobs": -rng.random(c, dtype=np.float32),
        "image_features": rng.standard_normal((p, 4)).astype(np.float16),
        "prompt_tags": Ragged(np.arange(2 * p, dtype=np.int64), np.full(p, 2, np.int32)),
    }, branch_id=name)


@pytest.fixture
def built(local_config):
    store = open_store(local_config)
    rng = np.random.default_rng(5)
    branches = {"a": _branch(rng, 3, 4, "a"), "b": _branch(rng, 2, 5, "b")}
    refs = keep_all(store, local_config, branches, CFG)
    build_step(store, 0, SEQ_LEN, [[[Seq("a", 7), Seq("b", 6)]]], branches, refs, rng, cfg=CFG)
    return store, branches


def test_declared_fields_assemble_by_their_declarations(built):
    store, branches = built
    fetched = fetch_own(store, StepFile.read(store, 0), 0, CFG, max_concurrency=2)
    assert not fetched.errors
    mb = fetched.assembled[0]
    a, b = (branches[n].fields for n in "ab")
    values = mb.fields["value_targets"]
    assert values.padded.tolist() == [*a["value_targets"].tolist(), *b["value_targets"][:6].tolist(), 0.0, 0.0, 0.0]
    draft = mb.fields["draft_ids"]
    real = np.concatenate([a["draft_ids"], b["draft_ids"][:6]]).astype(np.int32)
    assert draft.padded.dtype == np.int32 and draft.padded.tolist() == [*real.tolist(), *real[:3].tolist()]
    teacher = mb.fields["teacher_logprobs"]
    assert teacher.values.tolist() == [*a["teacher_logprobs"].tolist(), *b["teacher_logprobs"][:4].tolist()]
    assert teacher.row_ids.tolist() == [-1, -1, 0, 1, 2, 3, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1]
    image = mb.fields["image_features"]
    assert image.values.tobytes() == a["image_features"].tobytes() + b["image_features"].tobytes()
    assert image.row_ids.tolist() == [0, 1, 2, -1, -1, -1, -1, 3, 4, -1, -1, -1, -1, -1, -1, -1]
    tags = mb.fields["prompt_tags"]
    assert tags.values.dtype == np.int16 and tags.values.tolist() == [*range(6), *range(4)]
    assert tags.counts.tolist() == [2] * 5 and tags.row_ids.tolist() == image.row_ids.tolist()
    assert micro_batch_hash(mb, StepFile.read(store, 0).header.refs) == fetched.hashes[0]
    values.padded[-1] = 1.0  # the replay hash covers every declared field's padding rows (and each ref)
    assert micro_batch_hash(mb, StepFile.read(store, 0).header.refs) != fetched.hashes[0]


def test_the_cli_shows_and_verifies_declared_fields(built, tmp_path):
    store, branches = built
    step_uri = store.uri(step_key(0))
    runner = CliRunner()
    shown = runner.invoke(app, ["show", step_uri, "--micro-batch", "0", "--npy", str(tmp_path)],
                          env={"COLUMNS": "200"}, catch_exceptions=False)
    assert shown.exit_code == 0, shown.output
    got = np.load(tmp_path / "step00000000.dp0.mb0.image_features.values.npy")
    assert got.tobytes() == branches["a"].fields["image_features"].tobytes() + \
        branches["b"].fields["image_features"].tobytes()
    summary = json.loads(runner.invoke(app, ["inspect", step_uri, "--json"], catch_exceptions=False).stdout)
    assert summary["micro_batches"][0]["fields"] == ["draft_ids", "image_features", "prompt_tags", "routed_experts",
                                                     "teacher_logprobs", "value_targets"]
    verified = runner.invoke(app, ["verify", step_uri], catch_exceptions=False)
    assert verified.exit_code == 0 and "all intact" in verified.stdout, verified.output
    plotted = runner.invoke(app, ["inspect", step_uri, "--plot", str(tmp_path / "p.png")], catch_exceptions=False)
    assert plotted.exit_code == 0 and (tmp_path / "p.png").stat().st_size > 0


def test_declared_value_checks_run_at_keep_and_torch_is_taken_without_a_copy():
    p, c = 2, 3
    t = torch.zeros(p + c, dtype=torch.float32)
    arrays, _ = validate_branch({"value_targets": t}, CFG, num_prompt_tokens=p, num_completion_tokens=c, what="b")
    assert np.shares_memory(arrays["value_targets"], t.numpy())
    with pytest.raises(FieldError) as info:
        validate_branch({"draft_ids": np.array([[1, 2], [3, 3], [4, 5], [6, 7], [8, 9]])}, CFG, num_prompt_tokens=p,
                        num_completion_tokens=c, what="b")
    assert str(info.value) == ("b: field 'draft_ids': row 1 holds [3, 3]: expected 2 distinct ids (no router picks "
                               "one id twice for a token)")
    with pytest.raises(FieldError, match=r"'draft_ids': row 4 \[index 1\] value 100: expected >= 0, < vocab_size=100$"):
        validate_branch({"draft_ids": np.array([[1, 2], [3, 4], [4, 5], [6, 7], [8, 100]])}, CFG,
                        num_prompt_tokens=p, num_completion_tokens=c, what="b")
    with pytest.raises(FieldError, match=r"'teacher_logprobs': row 2 value 0.5: expected finite, <= 0.0$"):
        validate_branch({"teacher_logprobs": np.array([-1, -2, 0.5], np.float32)}, CFG, num_prompt_tokens=p,
                        num_completion_tokens=c, what="b")
