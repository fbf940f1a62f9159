"""``refpipe show``: byte identity with the trainer's assembly and with the kept branches (local and S3)."""

from __future__ import annotations

import numpy as np
import pytest

from refpipe.pipeline.fields import spread_expert_rows
from refpipe.pipeline.step_file import StepFile
from refpipe.pipeline.step_header import STREAMS
from refpipe.storage.chunk_read import fetch_arrays
from refpipe.storage.ledger import Ledger
from refpipe.trainer.assemble import assemble_micro_batch
from refpipe.trainer.layout import pad_streams, padded_cu_seqlens
from tests.cli.test_inspect import FIELDS_CFG, PACKING, SEQ_LEN, invoke, snapshot

COMPLETION_FIELDS = ("topk_ids", "topk_logprobs", "sampling_mask")


def expected_names(has_routing: bool) -> set[str]:
    names = {"cu_seqlens", *STREAMS}
    if has_routing:
        names |= {"routed_experts.values", "routed_experts.cu_seqlens", "routed_experts.padded"}
    for field in COMPLETION_FIELDS:
        names |= {f"{field}.values", f"{field}.cu_seqlens", f"{field}.row_ids"}
    return names | {"sampling_mask.counts"}


def trainer_view(run, step: int, dp_rank: int, index: int):
    """What a trainer rank assembles for this micro batch (whole chunks fetched, the run's own config)."""
    step_file = StepFile.read(run.store, step)
    header = step_file.header
    mb = header.micro_batches_of(dp_rank)[index]
    arrays = {s.ref: fetch_arrays(run.store, header.refs[s.ref]) for s in mb.sequences if s.ref is not None}
    return mb, assemble_micro_batch(mb, step_file.streams(dp_rank, index), arrays, header.refs, seq_len=SEQ_LEN,
                                    fields=FIELDS_CFG)


def load_npy(directory, stem: str) -> dict[str, np.ndarray]:
    return {p.name.removeprefix(stem + ".").removesuffix(".npy"): np.load(p) for p in directory.glob(f"{stem}.*.npy")}


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def test_show_npy_is_byte_identical_to_the_trainer_assembly(run, tmp_path):
    before = snapshot(run.store)
    for dp_rank, index in PACKING:
        out = tmp_path / f"dp{dp_rank}"
        result = invoke(["show", run.step_uris[1], "--micro-batch", str(index), "--dp-rank", str(dp_rank),
                         "--npy", str(out), *run.cli_args()])
        assert result.exit_code == 0, result.output
        got = load_npy(out, f"step00000001.dp{dp_rank}.mb{index}")
        mb, batch = trainer_view(run, 1, dp_rank, index)
        assert set(got) == expected_names(mb.has_routing)
        assert same_bytes(got["cu_seqlens"], batch.cu_seqlens)
        for name in STREAMS:
            assert same_bytes(got[name], batch.streams[name]), name
        for name, f in batch.fields.items():
            for part in ("values", "cu_seqlens", "counts", "padded", "row_ids"):
                if getattr(f, part) is not None:
                    assert same_bytes(got[f"{name}.{part}"], getattr(f, part)), f"{name}.{part}"
    assert snapshot(run.store) == before


def test_show_sequence_holds_the_kept_bytes(local_run, tmp_path):
    # micro batch dp0/0: a (whole), b (first 5 tokens), c (whole); sequence 1 is b, truncated
    b, ref = local_run.branches["b"], local_run.refs["b"]
    result = invoke(["show", local_run.step_uris[0], "--micro-batch", "0", "--sequence", "1", "--npy", str(tmp_path)])
    assert result.exit_code == 0, result.output
    got = load_npy(tmp_path, "step00000000.dp0.mb0.seq1")
    assert set(got) == expected_names(True)
    n, p = 5, ref.num_prompt_tokens
    c = max(0, n - p)
    start = local_run.refs["a"].num_tokens
    assert same_bytes(got["routed_experts.values"], b.fields["routed_experts"][:n])
    assert same_bytes(got["routed_experts.padded"], b.fields["routed_experts"][:n])  # real rows: the kept ones
    assert same_bytes(got["topk_ids.values"], b.fields["topk_ids"][:c])
    assert same_bytes(got["topk_logprobs.values"], b.fields["topk_logprobs"][:c])
    counts = b.fields["sampling_mask"].counts[:c]
    assert same_bytes(got["sampling_mask.counts"], counts)
    assert same_bytes(got["sampling_mask.values"], b.fields["sampling_mask"].ids[: counts.sum()])
    streams = StepFile.read(local_run.store, 0).streams(0, 0)
    assert same_bytes(got["input_ids"], streams["input_ids"][start: start + n])
    assert got["cu_seqlens"].tolist() == [0, n] and got["topk_ids.cu_seqlens"].tolist() == [0, c]
    # completion row r is predicted by the position just before it: p - 1 + r, rebased to the sequence
    assert got["topk_ids.row_ids"].tolist() == [-1] * (p - 1) + list(range(c)) + [-1] * (n - p + 1 - c)


def test_show_prints_one_field_with_the_routing_of_padding_tokens(local_run):
    result = invoke(["show", local_run.step_uris[0], "--micro-batch", "1", "--field", "routed_experts"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    mb = StepFile.read(local_run.store, 0).header.micro_batches_of(0)[1]
    assert lines[0] == (f"step 0, DP rank 0, micro batch 1: 2 sequences, {mb.num_tokens} tokens + "
                        f"{SEQ_LEN - mb.num_tokens} padding (seq_len {SEQ_LEN})")
    assert [line for line in lines if "<" in line or "|" in line] == [
        f"routed_experts.values  |u1 [{mb.num_tokens}, 2, 2]", "routed_experts.cu_seqlens  <i4 [3]",
        f"routed_experts.padded  |u1 [{SEQ_LEN}, 2, 2]"]
    assert result.stderr == ""
    result = invoke(["show", local_run.step_uris[0], "--micro-batch", "1", "--field", "input_ids"])
    assert result.stdout.splitlines()[1] == f"input_ids  <i4 [{SEQ_LEN}]" and result.stderr == ""


def test_show_pads_routing_with_the_num_experts_of_the_step_header(local_run, tmp_path):
    # the header's fields (num_experts=8) decide the padding rows; no flag, no other config
    result = invoke(["show", local_run.step_uris[0], "--micro-batch", "1", "--field", "routed_experts",
                     "--npy", str(tmp_path)])
    assert result.exit_code == 0, result.output
    got = load_npy(tmp_path, "step00000000.dp0.mb1")
    header = StepFile.read(local_run.store, 0).header
    assert header.fields == FIELDS_CFG
    t = header.micro_batches_of(0)[1].num_tokens
    assert same_bytes(got["routed_experts.padded"][:t], got["routed_experts.values"])
    expected = spread_expert_rows(SEQ_LEN - t, 2, 2, 8, np.dtype("|u1"))
    assert same_bytes(got["routed_experts.padded"][t:], expected)
    assert not np.array_equal(expected, spread_expert_rows(SEQ_LEN - t, 2, 2, 256, np.dtype("|u1")))  # uint8 range


@pytest.mark.parametrize("args, message", [
    (["--micro-batch", "2"], "error: --dp-rank 0 --micro-batch 2: step 0 has DP ranks 0..1 with 2 micro batches each"),
    (["--micro-batch", "0", "--dp-rank", "2"], "error: --dp-rank 2 --micro-batch 0: step 0 has DP ranks 0..1"),
    (["--micro-batch", "1", "--sequence", "2"],
     "error: --sequence 2: micro batch dp_rank=0 index=1 has sequences 0..1"),
    (["--micro-batch", "0", "--field", "nope"], "error: --field 'nope': expected one of ['advantages', 'cu_seqlens'"),
])
def test_show_bad_selection_is_one_line(local_run, args, message):
    result = invoke(["show", local_run.step_uris[0], *args])
    assert result.exit_code == 2 and result.stdout == ""
    assert result.stderr.startswith(message) and result.stderr.count("\n") == 1


def test_show_of_a_deleted_chunk_shows_the_step_files_streams_and_says_which_fields_are_gone(run, tmp_path):
    """``show STEP --micro-batch 1 --dp-rank 1 --field input_ids`` exited 2 once g's chunk was deleted, though the
    token streams live in the step file. It shows them now (exit 0) and names the gone fields, the chunk looked at
    (in the run as opened) and its deleter; asking for a gone field is one error line saying so."""
    g = run.refs["g"]
    ledger = Ledger(run.store, "trainer_dp1")
    ledger.delete([g], reason="step 0 trained")
    ledger.close()  # its reaper has removed the chunk's bytes
    gone = (f"gone: sampling_mask, topk_ids, topk_logprobs of sequence 0: chunk {run.store.uri(g.key)}: deleted by "
            "trainer_dp1 (step 0 trained)")
    args = ["show", run.step_uris[0], "--micro-batch", "1", "--dp-rank", "1", *run.cli_args()]
    step = StepFile.read(run.store, 0)
    mb = step.header.micro_batches_of(1)[1]
    result = invoke([*args, "--field", "input_ids"])
    assert (result.exit_code, result.stderr) == (0, "")
    assert result.stdout.splitlines()[:4] == [
        f"step 0, DP rank 1, micro batch 1: 1 sequences, {mb.num_tokens} tokens + {SEQ_LEN - mb.num_tokens} padding "
        f"(seq_len {SEQ_LEN})", gone,
        "shown: the step file's own arrays (cu_seqlens, token streams); a trainer drops this micro batch",
        f"input_ids  <i4 [{SEQ_LEN}]"]
    saved = invoke([*args, "--npy", str(tmp_path)])
    assert saved.exit_code == 0 and saved.stdout.splitlines()[1] == gone
    got = load_npy(tmp_path, "step00000000.dp1.mb1")
    want = {"cu_seqlens": padded_cu_seqlens(mb, SEQ_LEN), **pad_streams(step.streams(1, 1), SEQ_LEN)}
    assert sorted(got) == sorted(want) and all(same_bytes(got[name], want[name]) for name in want)
    refused = invoke([*args, "--field", "topk_ids"])
    assert (refused.exit_code, refused.stdout) == (2, "")
    assert refused.stderr == f"error: --field 'topk_ids' is gone: {gone.removeprefix('gone: ')}\n"


def test_show_refuses_npy_inside_the_run(local_run):
    before = snapshot(local_run.store)
    inside = local_run.store.path("payloads") + "/../dump"
    result = invoke(["show", local_run.step_uris[0], "--micro-batch", "0", "--npy", inside])
    assert result.exit_code == 2
    assert result.stderr == (f"error: --npy {inside!r} is inside run {local_run.store.prefix.uri}: "
                             "inspection never writes there\n")
    assert snapshot(local_run.store) == before


@pytest.mark.parametrize("command", [["show", "--micro-batch", "0"], ["inspect"], ["verify"]])
def test_a_reader_that_closes_the_pipe_ends_the_command_quietly(local_run, command):
    """``refpipe show ... | head`` ended with ``error: [Errno 32] Broken pipe`` (exit 2): the reader is gone, so the
    command stops as Unix tools do, saying nothing (typer's exit code for it, 1). The pipe is closed before the
    command writes, so every write meets it."""
    import os
    import subprocess
    import sys

    refpipe = os.path.join(os.path.dirname(sys.executable), "refpipe")
    proc = subprocess.Popen([refpipe, command[0], local_run.step_uris[0], *command[1:]], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "COLUMNS": "200"})
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=120)
    assert (proc.returncode, stderr.decode()) == (1, "")


def test_show_names_every_gone_chunk_of_the_micro_batch_and_with_sequence_only_its_own(run):
    """Micro batch dp0/0 holds a, b and c, each its own chunk; all three deleted. ``show`` printed one ``gone:`` line
    (the field names mapped to one line each, so the last chunk's overwrote the others') and ``--sequence 1``
    still printed sequence 2's (c's) line. Now: one line per gone chunk; with ``--sequence``, that sequence's only;
    ``--field`` of a gone field names every gone chunk holding it."""
    ledger = Ledger(run.store, "trainer_dp0")
    ledger.delete([run.refs[x] for x in "abc"], reason="step 0 trained")
    ledger.close()  # its reaper has removed the chunks' bytes
    fields = "routed_experts, sampling_mask, topk_ids, topk_logprobs"
    gone = [f"{fields} of sequence {j}: chunk {run.store.uri(run.refs[x].key)}: deleted by trainer_dp0 (step 0 "
            f"trained)" for j, x in enumerate("abc")]
    args = ["show", run.step_uris[0], "--micro-batch", "0", *run.cli_args()]
    result = invoke(args)
    assert (result.exit_code, result.stderr) == (0, "")
    assert [line for line in result.stdout.splitlines() if line.startswith("gone: ")] == [f"gone: {g}" for g in gone]
    one = invoke([*args, "--sequence", "1"])
    assert (one.exit_code, one.stderr) == (0, "")
    assert [line for line in one.stdout.splitlines() if line.startswith("gone: ")] == [f"gone: {gone[1]}"]
    refused = invoke([*args, "--field", "routed_experts"])
    assert (refused.exit_code, refused.stdout) == (2, "")
    assert refused.stderr == f"error: --field 'routed_experts' is gone: {'; '.join(gone)}\n"
