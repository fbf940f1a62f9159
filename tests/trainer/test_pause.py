"""The crash tests' pause hook (``trainer.pause``): a malformed ``REFPIPE_PAUSE_AT`` is a typed error at first use."""

from __future__ import annotations

import pytest

from refpipe.storage.errors import ConfigError
from refpipe.trainer.pause import ENV, PauseAt, parse_pause_at, pause_point

EXPECTED = ("expected '<point>:<step>:<file>' with point one of keep, fetch, train, release_dp1, after_release, "
            "checkpoint, step a non-negative integer and a file path")


@pytest.mark.parametrize("value", ["fetch:x:/tmp/m", "fetch:1", "fetch:1:", "fetch:-1:/tmp/m", "nowhere:1:/tmp/m",
                                   "Fetch:1:/tmp/m"])
def test_a_malformed_pause_at_is_a_config_error_naming_the_variable(monkeypatch, value):
    """Before: ``fetch:x`` raised a bare ``ValueError: invalid literal for int()``, ``fetch:1`` ``not enough values to
    unpack``, ``fetch:1:`` a ``FileNotFoundError`` for ''; ``fetch:-1`` and an unknown or misspelt point never paused,
    so the crash test waited out its deadline instead."""
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ConfigError) as info:
        pause_point("fetch", 1)
    assert str(info.value) == f"{ENV}={value!r}: {EXPECTED}"


@pytest.mark.parametrize("value", [None, ""])
def test_unset_pause_at_never_pauses(monkeypatch, value):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    pause_point("fetch", 0)  # returns at once (a pause would hang until pytest-timeout)
    assert parse_pause_at(value) is None


def test_a_pause_at_elsewhere_returns_at_once(monkeypatch, tmp_path):
    marker = tmp_path / "paused:here"
    monkeypatch.setenv(ENV, f"fetch:3:{marker}")
    assert parse_pause_at(f"fetch:3:{marker}") == PauseAt("fetch", 3, str(marker))  # a ':' in the path is the path's
    for point, step in (("fetch", 2), ("train", 3), ("keep", 30)):
        pause_point(point, step)
    assert not marker.exists()
