"""Test hook for crash tests: stop a process at a named point so the test can SIGKILL the whole run there.

``REFPIPE_PAUSE_AT="<point>:<step>:<file>"`` (inherited by every process of ``refpipe run``): the
first time a process reaches ``point`` at ``step``, it creates ``file`` and sleeps until killed.
Points: ``keep`` (an env worker, after keeping the first branch of group request ``step``),
``fetch`` (every trainer rank, step file read, nothing fetched), ``train`` (inside the train
callback), ``release_dp1`` (DP rank 1 about to release: DP rank 0 goes on and releases),
``after_release`` (every trainer rank, step trained and released, before any checkpoint) and
``checkpoint`` (every trainer rank, DCP files written, before the commit marker). Unset: no effect.
"""

from __future__ import annotations

import os
import time

ENV = "REFPIPE_PAUSE_AT"


def pause_point(point: str, step: int) -> None:
    """Pause here for good if ``REFPIPE_PAUSE_AT`` names this point and step (see the module doc)."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    name, at, path = spec.split(":", 2)
    if name == point and int(at) == step:
        with open(path, "a"):
            pass
        while True:
            time.sleep(60)
