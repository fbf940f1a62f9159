"""RunPrefix: run roots, run ids, and confinement of URIs and keys to the run prefix (DESIGN.md, invariant 4)."""

from __future__ import annotations

import os
import re

import pytest

from refpipe.storage.config import StorageConfig
from refpipe.storage.errors import ConfigError, OutsideRunError
from refpipe.storage.uri import RunPrefix


@pytest.mark.parametrize("root,run_id,scheme,path", [
    ("/data/runs", "run_1", "file", "/data/runs/run_1"),
    ("/data/runs/", "run_1", "file", "/data/runs/run_1"),
    ("file:///data/runs", "r.7-a_b", "file", "/data/runs/r.7-a_b"),
    ("file://localhost/data/runs", "run_1", "file", "/data/runs/run_1"),
    ("s3://bucket/some/prefix", "run_1", "s3", "bucket/some/prefix/run_1"),
    ("s3://bucket/some/prefix/", "run_1", "s3", "bucket/some/prefix/run_1"),
    ("s3://bucket", "run_1", "s3", "bucket/run_1"),
])
def test_from_root(root, run_id, scheme, path):
    prefix = RunPrefix.from_root(root, run_id)
    assert (prefix.scheme, prefix.path, prefix.run_id) == (scheme, path, run_id)
    assert prefix.uri == f"{scheme}://{path}"


def test_relative_local_root_becomes_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert RunPrefix.from_root("runs", "run_1").path == os.path.join(str(tmp_path), "runs", "run_1")


@pytest.mark.parametrize("run_id", ["", ".hidden", "..", "a..b", "a/b", "a b", "-x", "x" * 129, "run\x00"])
def test_bad_run_id(run_id):
    with pytest.raises(ConfigError, match="run_id"):
        RunPrefix.from_root("/data", run_id)


@pytest.mark.parametrize("root,message", [
    ("gs://bucket/x", "scheme 'gs'"),
    ("http://host/x", "scheme 'http'"),
    ("s3:///nobucket", "expected s3://bucket"),
    ("file://otherhost/data", "take no host"),
])
def test_bad_root(root, message):
    with pytest.raises(ConfigError, match=message):
        RunPrefix.from_root(root, "run_1")


def test_root_with_dotdot_segment_is_refused():
    with pytest.raises(OutsideRunError, match="'..'"):
        RunPrefix.from_root("s3://bucket/a/../b", "run_1")


@pytest.mark.parametrize("run_uri,scheme,path,run_id", [
    ("/data/runs/run_7", "file", "/data/runs/run_7", "run_7"),
    ("file:///data/runs/run_7/", "file", "/data/runs/run_7", "run_7"),
    ("s3://bucket/p/run_7", "s3", "bucket/p/run_7", "run_7"),
])
def test_from_uri(run_uri, scheme, path, run_id):
    assert RunPrefix.from_uri(run_uri) == RunPrefix(scheme, path, run_id)


@pytest.mark.parametrize("run_uri", ["run_7", "s3://bucket", "file:///", ""])
def test_from_uri_needs_root_and_run(run_uri):
    with pytest.raises(ConfigError):
        RunPrefix.from_uri(run_uri)


LOCAL = RunPrefix.from_root("/data/runs", "run_1")
S3 = RunPrefix.from_root("s3://bucket/prefix", "run_1")


@pytest.mark.parametrize("prefix,uri,key", [
    (LOCAL, "file:///data/runs/run_1/payloads/ab/b1", "payloads/ab/b1"),
    (LOCAL, "/data/runs/run_1/payloads/ab/b1", "payloads/ab/b1"),
    (LOCAL, "file://localhost/data/runs/run_1/steps/step_3", "steps/step_3"),
    (S3, "s3://bucket/prefix/run_1/payloads/ab/b1", "payloads/ab/b1"),
    (S3, "s3://bucket/prefix/run_1/a..b/c", "a..b/c"),
])
def test_key_of_inside(prefix, uri, key):
    assert prefix.key_of(uri) == key
    assert prefix.uri_of(key) == f"{prefix.uri}/{key}"


@pytest.mark.parametrize("prefix,uri,why", [
    (LOCAL, "file:///data/runs/run_1/../run_2/payloads/ab/b1", "'..'"),
    (LOCAL, "/data/runs/run_1/payloads/../../run_2/x", "'..'"),
    (LOCAL, "file:///data/runs/run_1/./payloads/x", "'.'"),
    (LOCAL, "file:///data/runs/run_10/payloads/ab/b1", "expected a URI under"),
    (LOCAL, "file:///data/runs/run_1", "expected a URI under"),
    (LOCAL, "file:///data/runs/run_1/", "expected a relative key"),
    (LOCAL, "file:///data/runs/run_1//payloads/x", "expected a relative key"),
    (LOCAL, "file:///etc/passwd", "expected a URI under"),
    (LOCAL, "file://otherhost/data/runs/run_1/payloads/x", "names host"),
    (LOCAL, "s3://bucket/prefix/run_1/payloads/x", "scheme 's3'"),
    (LOCAL, "http://host/data/runs/run_1/payloads/x", "scheme 'http'"),
    (S3, "s3://other-bucket/prefix/run_1/payloads/ab/b1", "expected a URI under"),
    (S3, "s3://bucket/prefix/run_10/payloads/ab/b1", "expected a URI under"),
    (S3, "s3://bucket/prefix/run_1/../run_2/x", "'..'"),
    (S3, "s3://bucket/prefix2/run_1/payloads/x", "expected a URI under"),
    (S3, "file:///bucket/prefix/run_1/payloads/x", "scheme 'file'"),
    (S3, "/bucket/prefix/run_1/payloads/x", "scheme 'file'"),
    (S3, "gs://bucket/prefix/run_1/payloads/x", "scheme 'gs'"),
])
def test_key_of_outside(prefix, uri, why):
    with pytest.raises(OutsideRunError, match=why) as info:
        prefix.key_of(uri)
    assert repr(uri) in str(info.value) or uri in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("key", ["", "/abs", "a//b", "a/../b", "..", ".", "a/./b", "a\\b", "a\x00b", "a/.."])
def test_check_key_refuses(key):
    with pytest.raises(OutsideRunError):
        S3.check_key(key)
    with pytest.raises(OutsideRunError):
        LOCAL.uri_of(key)


@pytest.mark.parametrize("key", ["payloads/ab/b1/c.0", "ledger/events/w/1.jsonl", "x", "a..b/.c", "a/b/"])
def test_check_key_accepts(key):
    assert S3.check_key(key) == key


@pytest.mark.parametrize("root,char,position", [
    ("/data/exp#3", "#", 9), ("s3://bucket/exp#3", "#", 15), ("s3://bucket/exp#4", "#", 15),
    ("/data/exp?x=1", "?", 9), ("file:///data/a\nb", "\n", 14), ("/data/tab\there", "\t", 9), ("/data/100%", "%", 9),
])
def test_a_root_that_cannot_round_trip_through_a_uri_is_refused_at_configuration(root, char, position):
    """Issue 14 input 5: ``<dir>/exp#3`` kept chunks its own run then refused as outside it (they leaked), and
    ``s3://bucket/exp#3`` and ``s3://bucket/exp#4`` both became ``s3://bucket/exp/run_1`` (one prefix, two runs)."""
    expected = (f"run root {root!r}: character {char!r} at position {position} cannot be part of a run URI (# and ? "
                "start a URI fragment or query, % an escape, control characters are stripped): "
                "expected a root without it")
    with pytest.raises(ConfigError) as info:
        RunPrefix.from_root(root, "run_1")
    assert str(info.value) == expected
    with pytest.raises(ValueError, match=re.escape(expected)):
        StorageConfig(root=root, run_id="run_1")


def test_a_relative_root_under_a_working_directory_with_a_hash_is_refused_at_configuration(tmp_path, monkeypatch):
    """``root="runs"`` from ``.../job#42`` was accepted and the run written to ``file://.../job#42/runs/x``, which
    every CLI command then refused: the library refuses it at configuration, as the CLI does, naming the path."""
    cwd = tmp_path / "job#42"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    resolved = f"{cwd}/runs"
    expected = (f"run root 'runs' (resolved to {resolved!r}): character '#' at position {resolved.index('#')} "
                "cannot be part of a run URI (# and ? start a URI fragment or query, % an escape, control characters "
                "are stripped): expected a root without it (give an absolute root, or start from another working "
                "directory)")
    with pytest.raises(ValueError, match=re.escape(expected)):
        StorageConfig(root="runs", run_id="x")
    with pytest.raises(ConfigError) as info:
        RunPrefix.from_root("runs", "x")
    assert str(info.value) == expected
    assert os.listdir(cwd) == []
