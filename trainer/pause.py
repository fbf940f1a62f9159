"""Test hook for crash tests: stop a process at a named point so the test can SIGKILL the whole run there.

``REFPIPE_PAUSE_AT="<point>:<step>:<file>"`` (inherited by every process of ``refpipe run``): the
first time a process reaches ``point`` at ``step``, it creates ``file`` and sleeps until killed.
Points (``POINTS``): ``keep`` (an env worker, after keeping the first branch of group request ``step``),
``fetch`` (every trainer rank, step file read, nothing fetched), ``train`` (inside the train
callback), ``release_dp1`` (DP rank 1 about to release: DP rank 0 goes on and releases),
``after_release`` (every trainer rank, step trained and released, before any checkpoint) and
``checkpoint`` (every trainer rank, DCP files written, before the commit marker). Unset: no effect.

It lives in the production paths because the crash tests SIGKILL the real ``refpipe run`` process
tree at these points; unset, a call costs one environment lookup and one cache hit.
"""

from __future__ import annotations

import functools
import os
import re
import time
from typing import NamedTuple

from refpipe.storage.errors import ConfigError

ENV = "REFPIPE_PAUSE_AT"
POINTS = ("keep", "fetch", "train", "release_dp1", "after_release", "checkpoint")


class PauseAt(NamedTuple):
    """A parsed ``REFPIPE_PAUSE_AT``."""

    point: str
    step: int
    path: str
    """File created on pausing (the test waits for it)."""


def pause_point(point: str, step: int) -> None:
    """Pause here for good if ``REFPIPE_PAUSE_AT`` names this point and step (see the module doc).

    Raises:
        ConfigError: ``REFPIPE_PAUSE_AT`` is set but malformed (``parse_pause_at``), at the first call.
    """
    at = parse_pause_at(os.environ.get(ENV))
    if at is None or at.point != point or at.step != step:
        return
    with open(at.path, "a"):
        pass
    while True:
        time.sleep(60)


@functools.lru_cache(maxsize=4)
def parse_pause_at(value: str | None) -> PauseAt | None:
    """``REFPIPE_PAUSE_AT``'s value parsed and validated once per value (None: unset or empty).

    Raises:
        ConfigError: not ``<point>:<step>:<file>`` with a point of ``POINTS``, a non-negative decimal step and
            a non-empty file path (names the variable, its value and the expected form).
    """
    if not value:
        return None
    match = re.fullmatch(r"([a-z_0-9]+):([0-9]+):(.+)", value, re.DOTALL)
    if match is None or match[1] not in POINTS:
        raise ConfigError(f"{ENV}={value!r}: expected '<point>:<step>:<file>' with point one of {', '.join(POINTS)}, "
                          f"step a non-negative integer and a file path")
    return PauseAt(match[1], int(match[2]), match[3])
