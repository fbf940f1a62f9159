"""Inspection commands: one-line errors, nothing written under the run prefix, no torch import."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys

import numpy as np

from refpipe.storage.config import StorageConfig
from refpipe.storage.layout import step_key
from tests.cli.test_inspect import build_run, invoke, snapshot

REFPIPE = os.path.join(os.path.dirname(sys.executable), "refpipe")
STEP_COMMANDS = (["inspect"], ["inspect", "--json"], ["verify"], ["show", "--micro-batch", "0"])


def assert_one_line_error(result, expected_start: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert result.stderr.startswith(expected_start) and result.stderr.count("\n") == 1, result.stderr


def test_missing_step_file(store, storage_config):
    uri = store.uri(step_key(9))
    endpoint = ["--s3-endpoint-url", storage_config.s3_endpoint_url] if storage_config.s3_endpoint_url else []
    for command in STEP_COMMANDS:
        assert_one_line_error(invoke([command[0], uri, *command[1:], *endpoint]), f"error: {uri} does not exist\n")


def test_truncated_foreign_and_other_run_step_files(local_run, tmp_path):
    store, data = local_run.store, local_run.store.get(step_key(0))
    npz = io.BytesIO()
    np.savez(npz, x=np.arange(3))
    other = build_run(StorageConfig(root=str(tmp_path / "other"), run_id="run_1"))
    files = {3: data[: len(data) // 2], 4: b"hello, not a step file\n", 5: npz.getvalue(),
             6: other.store.get(step_key(0))}
    for step, content in files.items():
        store.put(step_key(step), content)
    before = snapshot(store)
    expected = {3: "not a readable step file (truncated or foreign): File is not a zip file",
                4: "not a readable step file (truncated or foreign): File is not a zip file",
                5: "not a readable step file (truncated or foreign): \"There is no item named 'header.json' in the "
                   "archive\"",
                # runs are relocatable (refs are run-relative), so another run's step file is judged by its
                # own header: it names step 0
                6: "header says step 0, expected step 6"}
    for step, message in expected.items():
        for command in STEP_COMMANDS:
            result = invoke([command[0], store.uri(step_key(step)), *command[1:]])
            assert_one_line_error(result, f"error: step file {store.uri(step_key(step))}: {message}\n")
    assert snapshot(store) == before


def test_uris_that_name_no_step_or_run(local_run, tmp_path):
    assert_one_line_error(invoke(["inspect", str(tmp_path / "x" / "step_00000000.npz")]),
                          f"error: step URI '{tmp_path}/x/step_00000000.npz': expected "
                          "<root>/<run_id>/steps/step_<N:08d>.npz\n")
    assert_one_line_error(invoke(["verify", "ftp://host/r/run_1/steps/step_00000000.npz"]),
                          "error: run root 'ftp://host/r': scheme 'ftp' is not one of ('file', 's3')\n")
    assert_one_line_error(invoke(["ls", str(tmp_path / "root" / "run_2")]),
                          f"error: run file://{tmp_path}/root/run_2: nothing under the run prefix (wrong URI or "
                          "endpoint?)\n")
    not_a_dir = local_run.store.path(step_key(0)) + "/run_1"  # a path through a file
    step_path = local_run.store.path(step_key(0))
    assert_one_line_error(invoke(["ls", not_a_dir]), f"error: run file://{not_a_dir}: {step_path} "
                          "is a file, not a directory (the run root): pass the run's real location, or set "
                          "storage.root to a directory (or a path that can become one)\n")


def test_plot_inside_the_run_is_refused(local_run):
    before = snapshot(local_run.store)
    png = local_run.store.path("steps") + "/plot.png"
    assert_one_line_error(invoke(["inspect", local_run.step_uris[0], "--plot", png]),
                          f"error: --plot {png!r} is inside run {local_run.store.prefix.uri}: inspection never "
                          "writes there\n")
    assert snapshot(local_run.store) == before


def test_permission_denied_is_one_line(local_run):
    """Root reads any file, so the command runs as root without CAP_DAC_OVERRIDE/CAP_DAC_READ_SEARCH
    (``setpriv --bounding-set``): the kernel then applies the file modes to root as to anyone."""
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to drop root's file-permission override"
    step_path, steps_dir = local_run.store.path(step_key(0)), local_run.store.path("steps")

    def refpipe(*args):
        return subprocess.run([setpriv, "--bounding-set", "-dac_override,-dac_read_search", REFPIPE, *args],
                              capture_output=True, text=True, timeout=120)

    os.chmod(step_path, 0)
    result = refpipe("inspect", step_path)
    assert (result.returncode, result.stdout, result.stderr) == (
        2, "", f"error: cannot read {local_run.store.uri(step_key(0))}: EACCES (Permission denied)\n")
    os.chmod(step_path, 0o644)
    os.chmod(steps_dir, 0)
    try:
        result = refpipe("ls", local_run.store.prefix.uri)
    finally:
        os.chmod(steps_dir, 0o755)
    assert (result.returncode, result.stdout, result.stderr) == (2, "", f"error: permission denied: {steps_dir}\n")


def test_no_command_changes_the_run(run, tmp_path):
    from refpipe.storage.layout import chunk_keys

    run.store.delete_keys(list(chunk_keys(run.refs["e"].key)))  # so failing paths run too
    before = snapshot(run.store)
    step, endpoint = run.step_uris[0], run.cli_args()
    commands = [["inspect", step, "--json"], ["inspect", step, "--plot", str(tmp_path / "p.png")],
                ["verify", step], ["ls", run.store.prefix.uri],
                ["show", step, "--micro-batch", "1", "--npy", str(tmp_path / "npy")],
                ["show", step, "--micro-batch", "0", "--dp-rank", "1"]]
    codes = []
    for command in commands:
        codes.append(invoke([*command, *endpoint]).exit_code)
        assert snapshot(run.store) == before, command
    assert codes == [0, 0, 1, 0, 0, 0]  # show of e's micro batch: the step file's streams, e's fields named gone
    assert len(os.listdir(tmp_path / "npy")) == 20


def test_commands_do_not_import_torch(local_run, tmp_path):
    """All four commands in one fresh interpreter with ``-X importtime``: no torch module is loaded."""
    step = local_run.step_uris[0]
    commands = [["inspect", step, "--plot", str(tmp_path / "p.png")], ["ls", local_run.store.prefix.uri],
                ["verify", step], ["show", step, "--micro-batch", "0"]]
    script = ("import sys\nfrom refpipe.cli.main import app\n"
              f"codes = [app(c, standalone_mode=False) for c in {commands!r}]\n"
              "print('RESULT', codes, sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))\n")
    result = subprocess.run([sys.executable, "-X", "importtime", "-c", script], capture_output=True, text=True,
                            timeout=300, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert result.stdout.splitlines()[-1] == "RESULT [None, None, None, None] []", result.stderr[-2000:]
    imported = [line.rpartition("|")[2].strip() for line in result.stderr.splitlines() if "|" in line]
    assert "matplotlib" in imported and "refpipe.trainer.assemble" in imported
    assert [m for m in imported if m.split(".")[0] == "torch"] == []


def test_step_file_whose_header_names_another_step(local_run):
    """``step_00000002.npz`` holding step 0 (its header says so) is refused by every command."""
    store = local_run.store
    store.put(step_key(2), store.get(step_key(0)))
    before = snapshot(store)
    for command in STEP_COMMANDS:
        result = invoke([command[0], store.uri(step_key(2)), *command[1:]])
        assert_one_line_error(result, f"error: step file {store.uri(step_key(2))}: header says step 0, expected "
                                      "step 2\n")
    assert snapshot(store) == before


def test_plot_suffix_is_checked_before_anything_is_printed(local_run, tmp_path):
    for name in ("x.txt", "x"):
        result = invoke(["inspect", local_run.step_uris[0], "--plot", str(tmp_path / name)])
        assert_one_line_error(result, f"error: --plot {str(tmp_path / name)!r}: expected a file name ending "
                                      "in .png\n")
        assert not (tmp_path / name).exists()
