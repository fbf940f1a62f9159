"""What ``release = "after_checkpoint"`` costs on storage, and how long a resume takes.

Runs the main job (``refpipe run``, local directory) twice with the same config, once per
release policy, and samples the bytes present under ``<run>/payloads/`` every 0.2 s: the peak
is what each policy holds at once (``after_checkpoint`` keeps every step since the last
checkpoint). Then SIGKILLs an ``after_checkpoint`` run right after a step's training (before
the next checkpoint) and times ``refpipe run --resume`` to the end.

``python bench/release_hold.py [--steps N] [--checkpoint-every K] [--dir DIR]``
Last line: a JSON object with ``peak_held_bytes`` per policy, their ratio, and
``resume_wall_s`` (the whole second life: process start, checkpoint load, replay, the rest).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
from _args import positive_int  # noqa: E402  (bench/ is sys.path[0] when run as a script)

REFPIPE = os.path.join(os.path.dirname(sys.executable), "refpipe")


def config(root: Path, run_id: str, release: str, steps: int, every: int) -> Path:
    path = root / f"{run_id}.toml"
    path.write_text(f'[storage]\nroot = "{root}"\nrun_id = "{run_id}"\n'
                    f"[job]\nnum_steps = {steps}\nwarm_start_steps = 20\ncheckpoint_every_steps = {every}\n"
                    "[orchestrator]\nseq_len = 128\ndp_world_size = 2\ngroups_per_step = 4\ngroup_size = 8\n"
                    f'[trainer]\nrelease = "{release}"\n')
    return path


def present_bytes(payloads: Path) -> int:
    """Bytes of the files under ``payloads`` (a file deleted while listing counts 0)."""
    total = 0
    for directory, _, files in os.walk(payloads):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.stat(os.path.join(directory, name)).st_size
    return total


def peak_held(root: Path, run_id: str, cfg: Path) -> int:
    """Run the job to the end; return the peak bytes present under payloads/ while it ran."""
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], present_bytes(root / run_id / "payloads"))
            time.sleep(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    subprocess.run([REFPIPE, "run", "--config", str(cfg)], check=True, stdout=subprocess.DEVNULL)
    done.set()
    thread.join()
    return peak[0]


def _kill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and its descendants (trainer ranks run in their own sessions, so not one process group)."""
    for member in [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, signal.SIGKILL)


def resume_wall_s(root: Path, steps: int, every: int) -> float:
    """SIGKILL an after_checkpoint run after training step ``every`` (before the next checkpoint); time the resume."""
    cfg = config(root, "killed", "after_checkpoint", steps, every)
    marker = root / "paused"
    env = {**os.environ, "REFPIPE_PAUSE_AT": f"after_release:{every}:{marker}"}
    proc = subprocess.Popen([REFPIPE, "run", "--config", str(cfg)], env=env, stdout=subprocess.DEVNULL)
    while not marker.exists():
        time.sleep(0.2)
    _kill_tree(proc.pid)
    proc.wait()
    started = time.perf_counter()
    subprocess.run([REFPIPE, "run", "--resume", str(root / "killed")], check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=positive_int, default=8)
    parser.add_argument("--checkpoint-every", type=positive_int, default=4)
    parser.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="refpipe-bench-", dir=args.dir))
    peaks = {release: peak_held(root, release, config(root, release, release, args.steps, args.checkpoint_every))
             for release in ("after_step", "after_checkpoint")}
    resume = resume_wall_s(root, args.steps, args.checkpoint_every)
    print(f"{'release':<18}{'peak held MiB':>14}")
    for release, nbytes in peaks.items():
        print(f"{release:<18}{nbytes / 2**20:>14.3f}")
    print(f"resume wall time: {resume:.1f} s ({args.steps} steps, checkpoint every {args.checkpoint_every})")
    print(json.dumps({"peak_held_bytes": peaks, "after_checkpoint_vs_after_step":
                      peaks["after_checkpoint"] / max(peaks["after_step"], 1), "resume_wall_s": round(resume, 1)}))


if __name__ == "__main__":
    main()
