"""Untrusted metadata and unreachable stores through the CLI: one line, exit 2 (or a verify problem), never a
traceback and never an allocation the input merely asks for (issue 14 inputs 8 and 9)."""

from __future__ import annotations

import io
import json
import socket
import zipfile

import pytest

from refpipe.pipeline.audit import audit
from refpipe.pipeline.step_file import HEADER_MEMBER, StepFile
from refpipe.storage.errors import ConfigError, StepFileError
from refpipe.storage.layout import EVENTS_PREFIX, chunk_keys, node_key, step_key, tombstone_key
from refpipe.storage.uri import RunPrefix
from refpipe.trainer.fetch import wait_for_step
from tests.cli.test_inspect import invoke
from tests.cli.test_inspect_errors import assert_one_line_error


def rewrite_header(store, step: int, edit) -> str:
    """Rewrite step ``step``'s header in place (bypassing every check) with ``edit(header dict)``; return its URI."""
    data = io.BytesIO(store.get(step_key(step)))
    out = io.BytesIO()
    with zipfile.ZipFile(data) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as dst:
        for item in src.infolist():
            content = src.read(item)
            if item.filename == HEADER_MEMBER:
                header = json.loads(content)
                edit(header)
                content = json.dumps(header).encode()
            dst.writestr(item, content)
    store.put(step_key(step), out.getvalue())
    return store.uri(step_key(step))


def test_a_negative_shape_in_a_step_file_is_one_line(local_run):
    """``[-5, 3]`` passed ref validation and ``refpipe show`` died with a ValueError traceback."""
    def negative(header):
        header["refs"][0]["arrays"]["routed_experts"][1] = [-5, 2, 2]

    uri = rewrite_header(local_run.store, 0, negative)
    for command in (["show", uri, "--micro-batch", "0"], ["inspect", uri], ["verify", uri]):
        result = invoke(command)
        assert_one_line_error(result, f"error: step file {uri}: invalid header: refs.0: array "
                                      "'routed_experts': shape [-5, 2, 2]: expected at least one dimension, none "
                                      "negative")


def test_a_forged_seq_len_is_one_line_and_sizes_no_padding_buffer(local_run):
    """A step file declaring ``seq_len = 2**40`` (each micro batch's padding to match) sized the padding buffers of
    ``refpipe show`` and of the trainer (``[seq_len]`` per stream: a MemoryError); refused where the step file is
    validated, so every reader, the trainer's step load included (``trainer.fetch.wait_for_step``), gets it."""
    def huge(header):
        header["seq_len"] = 2**40
        for mb in header["micro_batches"]:
            mb["num_padding_tokens"] = 2**40 - sum(s["num_tokens"] for s in mb["sequences"])

    uri = rewrite_header(local_run.store, 0, huge)
    message = (f"step file {uri}: invalid header: seq_len 1099511627776: expected at most 1048576 tokens "
               "(MAX_SEQ_LEN: a reader pads every micro batch to seq_len)")
    for command in (["show", uri, "--micro-batch", "0"], ["inspect", uri], ["verify", uri]):
        assert_one_line_error(invoke(command), f"error: {message}")
    with pytest.raises(StepFileError) as info:
        wait_for_step(local_run.store, 0, timeout_s=1.0, poll_s=0.1)
    assert str(info.value) == message


def test_a_ref_declaring_2e8_rows_is_a_verify_problem_not_a_memory_error(local_run):
    """2e9 declared rows with a matching nbytes: ``refpipe verify`` died with a MemoryError traceback (22 GiB).
    2e8 here (0.8 GB declared, 390,625 block crcs: a 2e9-row ref's 3.9M crcs cost 7 s to write and read back);
    ``tests/storage/test_chunk_errors.py`` fetches the 2e9-row ref itself."""
    refs = {}

    def huge(header):
        ref = header["refs"][0]
        refs["before"] = dict(ref)
        rows = 200_000_000
        spec = ref["arrays"]["routed_experts"]
        ref["num_prompt_tokens"] = rows - ref["num_completion_tokens"]
        ref["nbytes"] += rows * 4 - -(-spec[1][0] * 4 // 64) * 64
        spec[1][0], spec[3] = rows, [0] * (rows // 512)  # one crc per 512-row block
        refs["after"] = ref

    uri = rewrite_header(local_run.store, 0, huge)
    result = invoke(["verify", uri])
    assert result.exit_code == 1, result.output
    ref = refs["after"]
    assert result.stdout.splitlines()[0] == (f"corrupt {ref['uri']}: chunk {ref['uri']}: expected {ref['nbytes']} "
                                             f"bytes, got {refs['before']['nbytes']} (truncated or replaced)")


def test_ls_on_an_unreachable_s3_endpoint_is_one_line(monkeypatch):
    """Before: a 400-line botocore traceback."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed once the block ends: nothing listens there
    result = invoke(["ls", "s3://bucket/prefix/run_1", "--s3-endpoint-url", f"http://127.0.0.1:{port}"])
    # a refused connection is transient: the store's one retry layer tries max_retries + 1 = 5 times first
    listing = "LIST s3://bucket/prefix/run_1/steps"
    assert_one_line_error(result, f"error: {listing}: gave up after 5 attempts: {listing}: EndpointConnectionError: "
                                  f'Could not connect to the endpoint URL: "http://127.0.0.1:{port}/bucket?')


def test_ls_reads_ledger_segments_as_tolerantly_as_the_audit(local_run):
    """A ledger segment line that is not JSON was tolerated by ``audit`` but crashed ``refpipe ls``."""
    store = local_run.store
    key = max(k for k in store.list_prefix(EVENTS_PREFIX) if k.startswith(f"{EVENTS_PREFIX}/env_worker_0/"))
    line = store.get(key).count(b"\n") + 1
    store.put(key, store.get(key) + b"{not json\n")
    result = invoke(["ls", store.prefix.uri, "--json"])
    assert result.exit_code == 0, result.output
    actors = json.loads(result.stdout)["ledger"]["actors"]
    assert (actors["env_worker_0"]["num_closed"], actors["env_worker_1"]["num_closed"]) == (1, 0)
    assert audit(store).bad_records == [f"{store.uri(key)} line {line}: JSONDecodeError: Expecting property name "
                                        "enclosed in double quotes: line 1 column 2 (char 1)"]


def test_ids_with_a_trailing_newline_are_refused():
    """The id regexes (``^...$``) accepted ``run_1\\n`` and ``abc\\n``; every parser now matches whole strings."""
    with pytest.raises(ConfigError, match=r"run_id 'run_1\\n': expected"):
        RunPrefix.from_root("/data", "run_1\n")
    with pytest.raises(ConfigError, match=r"branch_id 'abc\\n'"):
        node_key("abc\n")


@pytest.mark.parametrize("block_rows", [0, 2**31])
def test_a_forged_block_rows_in_zarr_json_is_a_verify_problem(local_run, block_rows):
    """``refpipe verify`` compared the field table of ``zarr.json`` with the ref but not its ``block_rows``: 0 or 2**31
    passed as intact. Now the one rule (``storage.chunk_ref.check_block_rows``) judges it as it judges a ref's."""
    store = local_run.store
    ref = StepFile.read(store, 0).header.refs[0]
    _, meta_key = chunk_keys(ref.key)
    document = json.loads(store.get(meta_key))
    document["attributes"]["refpipe"]["block_rows"] = block_rows
    store.put(meta_key, json.dumps(document).encode())
    result = invoke(["verify", local_run.step_uris[0]])
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines() == [
        f"corrupt {store.uri(ref.key)}: zarr.json: block_rows={block_rows}: expected 512 (rows per verified block "
        "of chunk format 2)",
        "step 0: 7 chunks (2972 bytes), 4 micro batches: 1 problem"]


def test_a_malformed_delete_record_is_a_verify_and_show_problem_not_a_crash(local_run):
    """A deleted chunk whose delete record is ``[]``: ``refpipe verify`` ended with ``error: AttributeError: 'list'
    object has no attribute 'get'`` (exit 2, the other chunks never reported). The one reader
    (``storage.ledger_records.read_delete_record``) names the record and what is wrong; every other chunk is still
    checked."""
    store = local_run.store
    ref = StepFile.read(store, 0).header.refs[0]
    store.delete_keys(list(chunk_keys(ref.key)))
    store.put(tombstone_key(ref.branch_id), b"[]")
    tomb = store.uri(tombstone_key(ref.branch_id))
    why = f"deleted (delete record {tomb} is unreadable: Input should be an object)"
    result = invoke(["verify", local_run.step_uris[0]])
    assert result.exit_code == 1, result.output
    assert result.stdout.splitlines() == [f"missing {store.uri(ref.key)}: {why}",
                                          "step 0: 7 chunks (2972 bytes), 4 micro batches: 1 problem"]
    shown = invoke(["inspect", local_run.step_uris[0]])
    assert shown.exit_code == 0, shown.output
    assert f"missing {ref.uri} (owner DP rank 0): {why}" in shown.stdout


def test_an_invalid_config_is_one_line_naming_each_field_and_value(tmp_path):
    """Before: pydantic's own text, ``2 validation errors for RunConfig\\njob.num_steps\\n  Input should be ... For
    further information visit https://errors.pydantic.dev/...`` printed with escaped newlines."""
    config = tmp_path / "bad.toml"
    config.write_text(f'[job]\nnum_steps = "abc"\nnum_env_workers = 0\n[storage]\nroot = "{tmp_path}/root"\n[bogus]\n'
                      'x = 1\n')
    result = invoke(["run", "--config", str(config)])
    assert_one_line_error(result, f"error: config {config}: job.num_steps: Input should be a valid integer (got "
                                  "'abc'); job.num_env_workers: Input should be greater than or equal to 1 (got 0); "
                                  "bogus: Extra inputs are not permitted\n")
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("line,problem", [
    ("[trainer]\ncollective_timeout_s = inf",
     "trainer.collective_timeout_s: Input should be a finite number (got inf)"),
    ("[job]\nstep_deadline_s = nan", "job.step_deadline_s: Input should be a finite number (got nan)"),
    ("[job]\nnum_steps = true", "job.num_steps: Input should be a valid integer (got True)"),
    ("[trainer]\nstep_timeout_s = \"300\"", "trainer.step_timeout_s: Input should be a valid number (got '300')"),
    ("[model]\nseed = \"0\"", "model.seed: Input should be a valid integer (got '0')"),
])
def test_a_config_value_of_another_type_or_not_finite_is_refused_before_the_run_starts(tmp_path, line, problem):
    """Fresh-user inputs: ``inf`` passed validation and ``config.json`` held it as ``null``, so every role refused the
    run (and its resume) after the warm start; ``true`` ran 1 step, ``"300"`` and ``"0"`` were taken as numbers."""
    config = tmp_path / "typed.toml"
    config.write_text(f'[storage]\nroot = "{tmp_path}/root"\n{line}\n')
    result = invoke(["run", "--config", str(config)])
    assert_one_line_error(result, f"error: config {config}: {problem}\n")
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("section,key,value,bound", [
    ("model", "max_positions", 100_000_000_000, 65536), ("model", "d_model", 4_000_000_000, 4096),
    ("orchestrator", "group_size", 1_000_000_000, 4096), ("job", "num_env_workers", 100_000, 1024),
])
def test_a_config_value_past_what_the_main_job_can_run_is_one_line(tmp_path, section, key, value, bound):
    """Before: ``max_positions = 1e11`` crashed the warm start with a torch allocation traceback after writing the run's
    config.json; ``group_size = 1e9`` ran the env servers out of memory; ``num_env_workers = 100000`` started them."""
    config = tmp_path / "big.toml"
    config.write_text(f'[storage]\nroot = "{tmp_path}/root"\n[{section}]\n{key} = {value}\n')
    result = invoke(["run", "--config", str(config)])
    assert_one_line_error(result, f"error: config {config}: {section}.{key}: Input should be less than or equal to "
                                  f"{bound} (got {value})\n")
    assert not (tmp_path / "root").exists()
