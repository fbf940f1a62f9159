"""What a run cost, per step and per process: ``summary.json``'s cost fields and ``<run>/report.png``.

The orchestrator role (``job.launcher``) feeds one ``StepCost`` per trained step (from the step file it built
and the trainer's metrics) and each process's peak RSS; ``RunCosts.summary`` is merged into
``summary.json`` and ``RunCosts.plot`` draws reward, exposed data seconds, kept bytes in
flight and deletes by path per step (matplotlib, Agg backend). ``RunTally`` holds the counts the
role's parts (dispatch, step building, the trainer's progress, the end of the run) add to.
"""

from __future__ import annotations

import io
import resource
from collections import Counter
from dataclasses import asdict, dataclass, field


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far, in bytes: ``VmHWM`` of ``/proc/self/status`` on Linux
    (``ru_maxrss`` would carry the launcher's peak into a spawned child: Linux keeps it across ``execve``),
    else ``ru_maxrss`` (KiB)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass(frozen=True)
class StepCost:
    """One trained step as the launcher saw it when the trainer's metrics arrived."""

    step: int
    reward: float
    exposed_data_seconds: float
    """Slowest rank's data-path seconds on the critical path (``StepMetrics.exposed_data_seconds_max``)."""
    fetch_seconds: float
    """Slowest rank's fetch seconds (in the background when prefetched)."""
    step_wait_seconds: float
    """Slowest rank's wait for the step file to appear (the orchestrator was behind)."""
    kept_bytes_in_flight: int
    """Bytes kept by env workers and not yet deleted by the orchestrator or a finished trainer release."""
    held_for_checkpoint_bytes: int
    """Bytes of trained steps' chunks held until a checkpoint covers them (``release = "after_checkpoint"``: what
    replaying them after a crash costs in storage; 0 with ``after_step``), part of ``kept_bytes_in_flight``."""
    deletes: dict[str, int]
    """Chunks deleted so far per path: ``orchestrator``, ``trainer``, ``env worker discard``."""


@dataclass
class RunCosts:
    """Per-step costs and per-process peak RSS of one run (launcher process only)."""

    steps: list[StepCost] = field(default_factory=list)
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)
    """Process name (``orchestrator``, ``env_worker_<i>``, ``trainer_rank_<r>``) -> peak RSS in bytes."""

    def process_rss(self, name: str, nbytes: int) -> None:
        """Record a process's peak RSS (the max of what it reported so far)."""
        self.peak_rss_bytes[name] = max(self.peak_rss_bytes.get(name, 0), int(nbytes))

    def summary(self) -> dict:
        """The cost fields of ``summary.json`` (this process's RSS recorded as ``orchestrator``)."""
        self.process_rss("orchestrator", peak_rss_bytes())
        return {"peak_rss_bytes": dict(sorted(self.peak_rss_bytes.items())),
                "exposed_data_seconds_per_step": [s.exposed_data_seconds for s in self.steps],
                "kept_bytes_in_flight_per_step": [s.kept_bytes_in_flight for s in self.steps],
                "peak_kept_bytes_in_flight": max((s.kept_bytes_in_flight for s in self.steps), default=0),
                "held_for_checkpoint_bytes_per_step": [s.held_for_checkpoint_bytes for s in self.steps],
                "peak_held_for_checkpoint_bytes": self.peak_held_for_checkpoint_bytes(),
                "steps": [asdict(s) for s in self.steps]}

    def peak_held_for_checkpoint_bytes(self) -> int:
        """The most bytes trained steps held for a checkpoint at once (``StepCost.held_for_checkpoint_bytes``)."""
        return max((s.held_for_checkpoint_bytes for s in self.steps), default=0)

    def plot(self, title: str) -> bytes:
        """PNG bytes: reward; exposed data and fetch seconds; kept MiB in flight; deletes by path, per step."""
        from matplotlib.figure import Figure  # here, not at import: every process of a run imports this module

        fig = Figure(figsize=(8, 10))
        axes = fig.subplots(4, 1, sharex=True)
        x = [s.step for s in self.steps]
        axes[0].plot(x, [s.reward for s in self.steps], marker="o")
        axes[0].set_ylabel("reward (mean)")
        axes[1].plot(x, [s.exposed_data_seconds for s in self.steps], marker="o", label="exposed data s")
        axes[1].plot(x, [s.fetch_seconds for s in self.steps], marker=".", linestyle=":", label="fetch s")
        axes[1].plot(x, [s.step_wait_seconds for s in self.steps], marker=".", linestyle="--",
                     label="waiting for the step file s")
        axes[1].set_ylabel("seconds (slowest rank)")
        axes[2].plot(x, [s.kept_bytes_in_flight / 2**20 for s in self.steps], marker="o")
        axes[2].set_ylabel("kept MiB in flight")
        for path in sorted({p for s in self.steps for p in s.deletes}):
            axes[3].plot(x, [s.deletes.get(path, 0) for s in self.steps], marker="o", label=path)
        axes[3].set_ylabel("chunks deleted (cumulative)")
        axes[3].set_xlabel("step")
        for ax in axes[1::2] if self.steps else ():
            ax.legend()
        fig.suptitle(title, fontsize=9)
        fig.tight_layout()
        out = io.BytesIO()
        fig.savefig(out, format="png", dpi=90)
        return out.getvalue()


@dataclass
class RunTally:
    """What the orchestrator role counts over one life of a run, for its progress view and ``summary.json``."""

    deletes: Counter[str] = field(default_factory=Counter)
    """Path (``trainer``, ``orchestrator <reason>``, ``env worker discard``, ``sweep``, ...) -> chunks deleted."""
    costs: RunCosts = field(default_factory=RunCosts)
    kept_chunks: int = 0
    """Chunks env workers kept so far (as their group results said)."""
    kept_bytes: int = 0
    """Bytes of those chunks."""
    rewards: list[float] = field(default_factory=list)
    """Mean reward of every step built, in order."""
    alignment_max: float = 0.0
    """Max |recomputed - inference| logprob on on-policy tokens over the trained steps."""
    alignment_tokens: int = 0
    """On-policy tokens that max was taken over."""
    lives: Counter[str] = field(default_factory=Counter)
    """A later life's ``replayed`` and ``skipped`` steps (counted as their metrics arrive) and ``reclaimed`` chunks
    (``refpipe run --resume``)."""
