"""Untrusted metadata and unreachable stores through the CLI: one line, exit 2 (or a verify problem), never a
traceback and never an allocation the input merely asks for (issue 14 inputs 8 and 9)."""

from __future__ import annotations

import io
import json
import socket
import zipfile

from refpipe.pipeline.step_file import HEADER_MEMBER, step_key
from test_inspect import invoke
from test_inspect_errors import assert_one_line_error


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
        assert_one_line_error(result, f"error: step file {uri}: invalid header: 1 validation error for StepHeader; "
                                      "refs.0; Value error, array 'routed_experts': shape [-5, 2, 2]: expected at "
                                      "least one dimension, none negative")


def test_a_ref_declaring_2e9_rows_is_a_verify_problem_not_a_memory_error(local_run):
    """2e9 declared rows with a matching nbytes: ``refpipe verify`` died with a MemoryError traceback (22 GiB)."""
    refs = {}

    def huge(header):
        ref = header["refs"][0]
        refs["before"] = dict(ref)
        rows = 2_000_000_000
        spec = ref["arrays"]["routed_experts"]
        ref["num_prompt_tokens"] = rows - ref["num_completion_tokens"]
        ref["nbytes"] += rows * 4 - -(-spec[1][0] * 4 // 64) * 64
        spec[1][0], ref["block_rows"] = rows, 2**31
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
    assert_one_line_error(result, f"error: LIST s3://bucket/prefix/run_1/steps: EndpointConnectionError: Could "
                                  f'not connect to the endpoint URL: "http://127.0.0.1:{port}/bucket?')
