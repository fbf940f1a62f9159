"""``refpipe inspect`` / ``ls`` on a small real run (local and S3), plus the shared run builder.

The run: two env workers keep branches through ``Keeper`` (one of them with
explicit branch ids, so ``ls`` must read those chunks' ``zarr.json`` for the
writer), one branch is discarded, and two step files are packed by hand and
published with ``publish_step_file``: two DP ranks, two micro batches each,
routing and non-routing micro batches, a truncated sequence, a sequence without
a ref and a borrowed padding dummy.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass

import fsspec
import numpy as np
import pytest
from typer.testing import CliRunner

from refpipe.cli.main import app
from refpipe.pipeline.fields import FieldsConfig, Ragged
from refpipe.pipeline.keep import Branch, Keeper
from refpipe.pipeline.step_file import publish_step_file
from refpipe.pipeline.step_header import SCHEMA_VERSION, STREAMS, MicroBatchRecord, SequenceRecord, StepHeader
from refpipe.storage.backends import open_store
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.config import StorageConfig
from refpipe.storage.layout import chunk_keys, step_key
from refpipe.storage.ledger import Ledger
from refpipe.storage.s3_store import S3Store
from refpipe.storage.store import Store

FIELDS_CFG = FieldsConfig(num_layers=2, top_k=2, num_experts=8, logprobs_k=3, sampling_mask=True)
SEQ_LEN = 40
# (dp_rank, index) -> [(branch name or None, num_tokens or None = whole branch, env, borrowed)]
PACKING = {
    (0, 0): [("a", None, "math", False), ("b", 5, "math", False), ("c", None, "code", False)],
    (0, 1): [("d", None, "code", False), ("a", 3, "math", True)],
    (1, 0): [("e", None, "chat", False), (None, 5, "chat", False), ("f", 6, "math", False)],
    (1, 1): [("g", None, "chat", False)],
}
ROUTING = {"a", "b", "c", "d"}
EXPLICIT_IDS = {"e": "episode7-b0", "f": "episode7-b1"}  # kept by env_worker_1 with ids of its own


@dataclass
class Run:
    """A published run: its store, the kept branches and their refs by name, and the step files' URIs."""

    config: StorageConfig
    store: Store
    branches: dict[str, Branch]
    refs: dict[str, PayloadRef]
    discarded: PayloadRef
    step_uris: list[str]

    def cli_args(self) -> list[str]:
        """``--s3-endpoint-url`` for S3 runs."""
        return ["--s3-endpoint-url", self.config.s3_endpoint_url] if self.config.s3_endpoint_url else []

    def local_step_path(self, step: int) -> str:
        return self.store.path(step_key(step))


def make_branch(rng: np.random.Generator, name: str, routing: bool) -> Branch:
    p, c = int(rng.integers(2, 6)), int(rng.integers(4, 10))
    counts = rng.integers(0, 4, c).astype(np.int32)
    fields = {
        "topk_ids": rng.integers(0, 100, (c, 3)).astype(np.int32),
        "topk_logprobs": -np.abs(rng.standard_normal((c, 3))).astype(np.float32),  # logprobs <= 0
        "sampling_mask": Ragged(rng.integers(0, 100, int(counts.sum())).astype(np.int32), counts),
    }
    if routing:
        fields["routed_experts"] = ((rng.integers(0, 8, (p + c, 2, 1)) + np.arange(2)) % 8).astype(np.uint8)
    return Branch(p, c, fields, branch_id=EXPLICIT_IDS.get(name))


def keep_branches(store: Store, config: StorageConfig) -> tuple[dict[str, Branch], dict[str, PayloadRef], PayloadRef]:
    rng = np.random.default_rng(7)
    workers = [Ledger(store, "env_worker_0"), Ledger(store, "env_worker_1")]
    keepers = [Keeper(store, ledger, FIELDS_CFG, config) for ledger in workers]
    branches = {name: make_branch(rng, name, name in ROUTING) for name in "abcdefg"}
    refs = {name: keepers[name in "efg"].keep(branch) for name, branch in branches.items()}
    discarded = keepers[0].keep(make_branch(rng, "z", False))
    keepers[0].discard([discarded], reason="group filtered")
    workers[0].close()  # env_worker_1 stays open: ls shows its session as not closed
    workers[1].flush()
    return branches, refs, discarded


def packed_header(store: Store, refs: dict[str, PayloadRef], step: int) -> tuple[StepHeader, dict]:
    order = list(dict.fromkeys(n for seqs in PACKING.values() for n, _, _, _ in seqs if n))
    owners = {}
    micro_batches, streams = [], {}
    rng = np.random.default_rng(step)
    for (dp_rank, index), seqs in PACKING.items():
        records = []
        for name, num_tokens, env, borrowed in seqs:
            n = num_tokens or refs[name].num_tokens
            records.append(SequenceRecord(num_tokens=n, env_name=env, ref=order.index(name) if name else None,
                                          borrowed=borrowed))
            if name and not borrowed:
                owners.setdefault(name, dp_rank)
        t = sum(r.num_tokens for r in records)
        micro_batches.append(MicroBatchRecord(dp_rank=dp_rank, index=index, sequences=records,
                                              num_padding_tokens=SEQ_LEN - t, has_routing=seqs[0][0] in ROUTING))
        streams[(dp_rank, index)] = {name: (rng.standard_normal(t) * 10).astype(dtype)
                                     for name, dtype in STREAMS.items()}
    header = StepHeader(schema_version=SCHEMA_VERSION, run_uri=store.prefix.uri, step=step, seq_len=SEQ_LEN,
                        dp_world_size=2, micro_batches=micro_batches, refs=[refs[n] for n in order],
                        owners=[owners[n] for n in order], fields=FIELDS_CFG, metrics={"reward_mean": 0.25})
    return header, streams


def build_run(config: StorageConfig) -> Run:
    store = open_store(config)
    branches, refs, discarded = keep_branches(store, config)
    uris = [publish_step_file(store, *packed_header(store, refs, step)) for step in (0, 1)]
    return Run(config, store, branches, refs, discarded, uris)


@pytest.fixture
def run(storage_config) -> Run:
    """A small real run on each backend (local directory, then S3)."""
    return build_run(storage_config)


@pytest.fixture
def local_run(local_config) -> Run:
    """The same run on a local directory only."""
    return build_run(local_config)


def invoke(args: list[str]):
    """Run ``refpipe`` in-process; a wide terminal so tables are not truncated."""
    return CliRunner().invoke(app, args, env={"COLUMNS": "200"}, catch_exceptions=False)


def snapshot(store: Store) -> dict[str, tuple]:
    """Every object under the run prefix but heartbeats (rewritten by the test's own live ledger sessions): size
    and modification stamps (local mtime; S3 ETag and LastModified)."""
    fs = store.fs if isinstance(store, S3Store) else fsspec.filesystem("file")  # a raw view, past the Store verbs
    found = fs.find(store.prefix.path, detail=True)
    return {name: (info["size"], info.get("mtime"), info.get("ETag"), str(info.get("LastModified")))
            for name, info in found.items() if "/ledger/heartbeats/" not in name}


def test_inspect_json_counts_equal_what_was_packed(run):
    before = snapshot(run.store)
    result = invoke(["inspect", run.step_uris[1], "--json", *run.cli_args()])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert (summary["step"], summary["seq_len"], summary["dp_world_size"]) == (1, SEQ_LEN, 2)
    assert summary["run_uri"] == run.store.prefix.uri and summary["metrics"] == {"reward_mean": 0.25}
    assert (summary["num_chunks"], summary["num_chunks_present"], summary["num_chunks_missing"]) == (7, 7, 0)
    assert [(mb["dp_rank"], mb["index"]) for mb in summary["micro_batches"]] == list(PACKING)
    for mb, seqs in zip(summary["micro_batches"], PACKING.values()):
        lengths = [n or run.refs[name].num_tokens for name, n, _, _ in seqs]
        names = {name for name, _, _, _ in seqs if name}
        assert [s["num_tokens"] for s in mb["sequences"]] == lengths
        assert (mb["num_sequences"], mb["num_tokens"], mb["num_padding_tokens"]) == (len(seqs), sum(lengths),
                                                                                       SEQ_LEN - sum(lengths))
        assert mb["num_borrowed"] == sum(b for _, _, _, b in seqs)
        assert mb["env_names"] == {env: [e for _, _, e, _ in seqs].count(env) for _, _, env, _ in seqs}
        assert mb["fields"] == (["routed_experts"] if names & ROUTING else []) + ["sampling_mask", "topk_ids",
                                                                                   "topk_logprobs"]
        assert (mb["num_chunks"], mb["num_chunks_present"], mb["missing"]) == (len(names), len(names), [])
        assert [s["branch_id"] for s in mb["sequences"]] == [run.refs[n].branch_id if n else None
                                                             for n, _, _, _ in seqs]
    assert snapshot(run.store) == before


def test_inspect_table_shows_counts_and_missing_chunks(run):
    ledger = Ledger(run.store, "trainer_dp0")
    ledger.delete([run.refs["a"]], reason="step 0 trained")
    ledger.close()  # its reaper has removed the chunk's bytes: the snapshot below is the run at rest
    run.store.delete_keys(list(chunk_keys(run.refs["g"].key)))  # gone without a delete record
    before = snapshot(run.store)
    result = invoke(["inspect", run.step_uris[0], *run.cli_args()])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert f"step 0 of {run.store.prefix.uri}  seq_len=40  dp_world_size=2  chunks: 5 present, 2 missing" in out
    rows = [re.sub(r"\s+", " ", line.strip("│┃ ")) for line in out.splitlines() if line.startswith("│")]
    lengths = {k: sum(n or run.refs[name].num_tokens for name, n, _, _ in seqs) for k, seqs in PACKING.items()}
    assert rows[0].startswith(f"0 │ 3 │ {lengths[0, 0]} │ {SEQ_LEN - lengths[0, 0]} │ 0 │ math x2, code │ "
                              "routed_experts, sampling_mask, topk_ids, topk_logprobs │ 2 present, 1 missing")
    assert rows[1].startswith(f"1 │ 2 │ {lengths[0, 1]} │ {SEQ_LEN - lengths[0, 1]} │ 1 │ code, math │")
    assert rows[1].endswith("1 present, 1 missing")
    assert rows[3].endswith("0 present, 1 missing")
    missing = [line for line in out.splitlines() if line.startswith("missing ")]
    assert missing == [f"missing {run.refs['a'].uri} (owner DP rank 0): deleted by trainer_dp0 (step 0 trained)",
                       f"missing {run.refs['g'].uri} (owner DP rank 1): missing (no delete record)"]
    assert snapshot(run.store) == before



def test_a_piped_inspect_table_keeps_every_cell_whole(local_run, monkeypatch):
    """Not a terminal and no ``COLUMNS`` (a file, ``less``, a job log): the table takes the width its cells need
    (``cli.inspect_common.out_console``); rich alone would cut the fields column at 80 columns."""
    monkeypatch.delenv("COLUMNS", raising=False)
    result = CliRunner().invoke(app, ["inspect", local_run.step_uris[0]], catch_exceptions=False)
    rows = [re.sub(r"\s+", " ", line.strip("│┃ ")) for line in result.stdout.splitlines() if line.startswith("│")]
    assert rows[0].split(" │ ")[5:7] == ["math x2, code", "routed_experts, sampling_mask, topk_ids, topk_logprobs"]

def test_inspect_plot_writes_a_png(run, tmp_path):
    run.store.delete_keys(list(chunk_keys(run.refs["c"].key)))
    before = snapshot(run.store)
    png = tmp_path / "out" / "step0.png"
    png.parent.mkdir()
    result = invoke(["inspect", run.step_uris[0], "--plot", str(png), *run.cli_args()])
    assert result.exit_code == 0, result.output
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1000, 290)  # 10 x (1.5 + 0.35 * 4 micro batches) inches at 100 dpi
    assert snapshot(run.store) == before


def test_ls_counts_steps_chunks_per_writer_and_ledger(run):
    before = snapshot(run.store)
    result = invoke(["ls", run.store.prefix.uri, "--json", *run.cli_args()])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    files = {k.removeprefix(run.store.prefix.path + "/"): v[0] for k, v in before.items()}
    step_bytes = sum(v for k, v in files.items() if k.startswith("steps/"))
    assert summary["steps"] == {"num_steps": 2, "first": 0, "latest": 1, "nbytes": step_bytes, "damaged": {}}
    def nbytes(names):
        return sum(v for k, v in files.items() for n in names
                   if k.startswith(chunk_keys(run.refs[n].key)[0][:-3]))
    assert summary["chunks"] == {
        "num_chunks": 7, "nbytes": sum(v for k, v in files.items() if k.startswith("payloads/")),
        "num_incomplete": 0, "num_temp_files": 0, "corrupt": [],
        "writers": {"env_worker_0": {"num_chunks": 4, "nbytes": nbytes("abcd")},
                    "env_worker_1": {"num_chunks": 3, "nbytes": nbytes("efg")}},
    }
    segments = {a: sum(k.startswith(f"ledger/events/{a}/") for k in files) for a in ("env_worker_0", "env_worker_1")}
    assert summary["ledger"] == {"num_delete_records": 1, "actors": {
        "env_worker_0": {"num_segments": segments["env_worker_0"], "num_sessions": 1, "num_closed": 1},
        "env_worker_1": {"num_segments": segments["env_worker_1"], "num_sessions": 1, "num_closed": 0}},
        "num_suspended_branches": 0}
    assert snapshot(run.store) == before


def test_ls_table(local_run):
    result = invoke(["ls", local_run.config.root + "/run_1"])
    assert result.exit_code == 0, result.output
    lines = [re.sub(r"\s+", " ", line.strip("│┃ ")) for line in result.stdout.splitlines()]
    assert lines[0] == f"run {local_run.store.prefix.uri}"
    assert lines[1].startswith("steps: 2 (first 0, latest 1), ")
    assert lines[2].startswith("chunks: 7, ") and lines[2].endswith("; 0 incomplete, 0 temp files")
    assert [line.split(" │ ")[:2] for line in lines if line.startswith("env_worker_")][:2] == [
        ["env_worker_0", "4"], ["env_worker_1", "3"]]
    assert [line.split(" │ ")[2:] for line in lines if line.startswith("env_worker_")][2:] == [
        ["1", "1/1"], ["1", "0/1"]]
    assert "ledger: 1 delete records, 0 suspended open branches" in lines


def test_ls_sees_incomplete_and_temp_objects(local_run):
    data_key, meta_key = chunk_keys(local_run.refs["b"].key)
    os.unlink(local_run.store.path(meta_key))  # a keep that crashed before its commit marker
    open(local_run.store.path(data_key) + ".tmp-0123456789ab", "wb").close()
    summary = json.loads(invoke(["ls", local_run.store.prefix.uri, "--json"]).stdout)
    assert (summary["chunks"]["num_chunks"], summary["chunks"]["num_incomplete"],
            summary["chunks"]["num_temp_files"]) == (6, 1, 1)
    assert summary["chunks"]["writers"]["env_worker_0"]["num_chunks"] == 3


def test_s3_endpoint_from_aws_environment(s3_config, monkeypatch):
    run = build_run(s3_config)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_config.s3_endpoint_url)
    result = invoke(["ls", run.store.prefix.uri, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["chunks"]["num_chunks"] == 7
    result = invoke(["inspect", run.step_uris[0], "--json"])
    assert json.loads(result.stdout)["num_chunks_present"] == 7


def test_inspect_and_verify_a_step_the_orchestrator_packed(storage_config):
    """A step packed by the real orchestrator: every shipped sample is one non-borrowed sequence with its tokens."""
    from refpipe.pipeline.orchestrator import Orchestrator, OrchestratorConfig
    from refpipe.pipeline.samples import BranchResult, Episode

    store = open_store(storage_config)
    rng = np.random.default_rng(3)
    keeper = Keeper(store, Ledger(store, "env_worker_0"), FIELDS_CFG, storage_config)
    orchestrator = Orchestrator(OrchestratorConfig(seq_len=24, dp_world_size=2, groups_per_step=3, group_size=2),
                                store, fields=FIELDS_CFG)
    shipped = {}
    for g, env in enumerate(("math", "code", "chat")):
        for e in range(2):
            branch = make_branch(rng, f"g{g}e{e}", routing=g == 0)
            ref = keeper.keep(branch)
            p, c = branch.num_prompt_tokens, branch.num_completion_tokens
            result = BranchResult(np.arange(p, dtype=np.int32), np.arange(c, dtype=np.int32),
                                  np.zeros(c, np.float32), 1.0, 0, ref)
            orchestrator.submit(Episode(f"g{g}e{e}", f"g{g}", env, float(e), [result]))
            shipped[ref.branch_id] = (p + c, env)
    header = orchestrator.build_step(0)
    step_uri = store.uri(step_key(0))
    endpoint = ["--s3-endpoint-url", storage_config.s3_endpoint_url] if storage_config.s3_endpoint_url else []
    summary = json.loads(invoke(["inspect", step_uri, "--json", *endpoint]).stdout)
    sequences = [s for mb in summary["micro_batches"] for s in mb["sequences"] if not s["borrowed"]]
    assert {s["branch_id"]: (s["num_tokens"], s["env_name"]) for s in sequences} == shipped
    assert len(sequences) == len(shipped) == summary["num_chunks_present"] == len(header.refs)
    assert [(mb["num_tokens"] + mb["num_padding_tokens"], mb["num_chunks_missing"])
            for mb in summary["micro_batches"]] == [(24, 0)] * len(header.micro_batches)
    result = invoke(["verify", step_uri, *endpoint])
    assert (result.exit_code, result.stderr) == (0, "") and result.stdout.endswith(": all intact\n")


def test_ls_flags_a_corrupt_zarr_json_and_goes_on(local_run):
    """A chunk with an id of its own has its ``zarr.json`` read for the writer: garbage there is flagged."""
    _, meta_key = chunk_keys(local_run.refs["e"].key)
    with open(local_run.store.path(meta_key), "w") as f:
        f.write("{garbage")
    result = invoke(["ls", local_run.store.prefix.uri, "--json"])
    assert (result.exit_code, result.stderr) == (0, "")
    chunks = json.loads(result.stdout)["chunks"]
    assert chunks["num_chunks"] == 7 and chunks["corrupt"] == [local_run.store.uri(meta_key)]
    assert {w: c["num_chunks"] for w, c in chunks["writers"].items()} == {
        "(corrupt zarr.json)": 1, "env_worker_0": 4, "env_worker_1": 2}
    result = invoke(["ls", local_run.store.prefix.uri])
    assert (result.exit_code, result.stderr) == (0, "")
    assert f"corrupt zarr.json (writer unknown): {local_run.store.uri(meta_key)}" in result.stdout.splitlines()


def test_ls_names_a_truncated_step_file_as_damaged_and_goes_on(run):
    """Step 1 cut to its first 1,000 bytes: `ls` names it in one line (it listed the steps and said nothing), by the
    zip end record its last bytes lack; the intact step 0 is not named."""
    key = step_key(1)
    run.store.put(key, run.store.get(key)[:1000])
    result = invoke(["ls", run.store.prefix.uri, "--json", *run.cli_args()])
    assert (result.exit_code, result.stderr) == (0, "")
    problem = "no zip end record in its last 22 bytes (1000 bytes: truncated or foreign)"
    assert json.loads(result.stdout)["steps"]["damaged"] == {run.store.uri(key): problem}
    result = invoke(["ls", run.store.prefix.uri, *run.cli_args()])
    assert (result.exit_code, result.stderr) == (0, "")
    assert [line for line in result.stdout.splitlines() if "damaged" in line] == [
        f"damaged step file ({problem}): {run.store.uri(key)}"]


def test_inspect_counts_a_chunk_without_its_data_as_missing(local_run):
    """``zarr.json`` alone is not a chunk: ``inspect`` agrees with ``verify`` and ``show``."""
    data_key, _ = chunk_keys(local_run.refs["b"].key)
    local_run.store.delete_keys([data_key])
    summary = json.loads(invoke(["inspect", local_run.step_uris[0], "--json"]).stdout)
    assert (summary["num_chunks_present"], summary["num_chunks_missing"]) == (6, 1)
    assert summary["missing"] == [{"uri": local_run.refs["b"].uri, "branch_id": local_run.refs["b"].branch_id,
                                   "owner_dp_rank": 0, "problem": "incomplete: c.0 missing (no delete record)"}]
    assert (summary["micro_batches"][0]["num_chunks_present"], summary["micro_batches"][0]["missing"]) == (
        2, [local_run.refs["b"].uri])


def test_plot_legend_names_each_entry_once():
    """An env named ``padding`` (a borrowed dummy's) and the trainer's padding tokens get distinct labels."""
    from refpipe.cli.inspect_plot import legend_handles

    labels = [h.get_label() for h in legend_handles({"math": (0, 0, 1, 1), "padding": (1, 0, 0, 1)})]
    assert labels == ["math", "dummy sequence (padding)", "padding tokens", "borrowed dummy", "chunk missing"]


def test_inspect_plot_is_written_when_the_reader_closes_the_pipe_early(local_run, tmp_path):
    """``refpipe inspect STEP --plot P | head -1``: before, the table's print hit the closed pipe first and the
    PNG was never drawn."""
    import os
    import subprocess
    import sys

    png = tmp_path / "step0.png"
    refpipe = os.path.join(os.path.dirname(sys.executable), "refpipe")
    subprocess.run(f"{refpipe} inspect {local_run.step_uris[0]} --plot {png} | head -c 1 > /dev/null", shell=True,
                   check=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
