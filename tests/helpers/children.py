"""Starting a module of the test package as a script in its own process: ``python -m tests.<folder>.<module>``.

The child finds ``tests`` through ``PYTHONPATH`` (the repository root first), wherever its working directory
is; the root comes before site-packages, where another distribution's top-level ``tests`` package may sit
(verl ships one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def module_argv(module: str, *args: object) -> list[str]:
    """The command running ``module`` (dotted from the repository root, e.g. ``tests.trainer.dist_worker``) with
    ``args`` (each as ``str``) under this interpreter."""
    return [sys.executable, "-m", module, *map(str, args)]


def module_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's environment) with the repository root first on ``PYTHONPATH``."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))])
    return env


def killed_at_first_line(args: list[str]) -> tuple[str, str, int]:
    """Start ``args`` (``module_argv``), read its first stdout line (its crash point), SIGKILL it: ``(line, stderr,
    returncode)``; the child is killed even when reading fails."""
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=module_env())
    try:
        line = proc.stdout.readline() if proc.stdout else ""
    finally:
        proc.send_signal(signal.SIGKILL)
        _, stderr = proc.communicate()
    return line, stderr, proc.returncode
