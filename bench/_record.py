"""Run one bench and write its result file: ``bench/results/<bench>_<machine>_<YYYYMMDD>.md``.

``python bench/_record.py [--as=NAME] <bench>.py [bench args...]`` runs ``python bench/<bench>.py [args]``
from the repository root and records the commit, the machine (``lscpu`` model, cores, memory), the load
average before and after, the versions of Python and the libraries the data path uses, the command, the
bench's output and its last line (the JSON summary). ``<machine>`` is the lscpu model and core count as a
slug (``amd-epyc-2c``); a later run of the same day gets ``_2``, ``_3``, ...; ``--as`` names the result another
way than the bench (``keep_fetch_s3`` for a run against S3).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VERSIONS = ("numpy", "numba", "zarr", "fastcrc", "xxhash", "fsspec", "s3fs", "torch")


def machine() -> dict:
    """lscpu's model name, the cores this process may use and the memory."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model = re.search(r"^Model name:\s*(.+)$", lscpu, re.M)
    with open("/proc/meminfo") as f:
        mem_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    return {"model": model.group(1).strip() if model else platform.processor(), "cores": len(os.sched_getaffinity(0)),
            "memory_GiB": round(mem_kib / 2**20, 1), "kernel": platform.release()}


def slug(m: dict) -> str:
    return f"{re.sub(r'[^a-z0-9]+', '-', m['model'].lower()).strip('-')}-{m['cores']}c"


def main() -> None:
    argv = sys.argv[1:]
    name = argv.pop(0).removeprefix("--as=") if argv and argv[0].startswith("--as=") else None
    if not argv or not (ROOT / "bench" / argv[0]).is_file():
        raise SystemExit(f"usage: python bench/_record.py [--as=NAME] <bench>.py [args...] (a script in "
                         f"{ROOT / 'bench'})")
    script, args = argv[0], argv[1:]
    name = name or Path(script).stem
    command = [sys.executable, f"bench/{script}", *args]
    load_before = os.getloadavg()
    started = datetime.datetime.now(datetime.timezone.utc)
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    load_after = os.getloadavg()
    if out.returncode:
        raise SystemExit(f"{' '.join(command)} exited {out.returncode}:\n{out.stderr[-4000:]}")
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                                capture_output=True, text=True).stdout.strip())
    m = machine()
    versions = {"python": platform.python_version(), **{dist: metadata.version(dist) for dist in VERSIONS}}
    path = ROOT / "bench" / "results" / f"{name}_{slug(m)}_{started:%Y%m%d}.md"
    for run in range(2, 100):  # another run of the same day: a file of its own, never overwritten
        if not path.exists():
            break
        path = path.with_name(f"{name}_{slug(m)}_{started:%Y%m%d}_{run}.md")
    path.parent.mkdir(exist_ok=True)
    path.write_text(
        f"# {name}, {started:%Y-%m-%d %H:%M} UTC\n\n"
        f"- commit: `{commit}`{' (with uncommitted changes)' if dirty else ''}\n"
        f"- machine: {m['model']}, {m['cores']} cores, {m['memory_GiB']} GiB, Linux {m['kernel']}\n"
        f"- load average (1, 5, 15 min): before {_load(load_before)}, after {_load(load_after)}\n"
        f"- versions: {', '.join(f'{k} {v}' for k, v in versions.items())}\n"
        f"- command: `{' '.join(['python', f'bench/{script}', *args])}`\n\n"
        f"Output:\n\n```\n{out.stdout.strip()}\n```\n\n"
        f"JSON summary:\n\n```json\n{json.dumps(summary, indent=1)}\n```\n")
    print(path)


def _load(load: tuple[float, float, float]) -> str:
    return ", ".join(f"{x:.2f}" for x in load)


if __name__ == "__main__":
    main()
