"""``refpipe inspect --plot``: the micro batches of a step file as one picture.

One horizontal bar per micro batch (grouped by DP rank, top to bottom), as long
as ``seq_len``: its sequences side by side in packing order, coloured by env
name, borrowed padding dummies hatched, sequences whose chunk is gone outlined
in red, and the padding tokens the trainer adds in grey at the end. Uses matplotlib's
Agg backend (no display needed).
"""

from __future__ import annotations

from collections import defaultdict

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after selecting the backend)
import numpy as np  # noqa: E402
from matplotlib.collections import PolyCollection  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from refpipe.pipeline.packing import PADDING_ENV_NAME  # noqa: E402

_BAR_HEIGHT = 0.8
_PADDING_COLOUR = "#d0d0d0"
_MAX_LABELS = 60
_MAX_BARS_HEIGHT_IN = 30


def _env_colours(summary: dict) -> dict[str, tuple]:
    names = sorted({s["env_name"] for mb in summary["micro_batches"] for s in mb["sequences"]})
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def _segments(summary: dict) -> dict[tuple[str | None, bool, bool], list[tuple[int, int, int]]]:
    """``(env_name, borrowed, chunk missing) -> [(row, left, width)]`` in tokens; env None is padding."""
    missing_ids = {chunk["branch_id"] for chunk in summary["missing"]}
    groups: dict[tuple[str | None, bool, bool], list[tuple[int, int, int]]] = defaultdict(list)
    for row, mb in enumerate(summary["micro_batches"]):
        left = 0
        for seq in mb["sequences"]:
            key = (seq["env_name"], seq["borrowed"], seq["branch_id"] in missing_ids)
            groups[key].append((row, left, seq["num_tokens"]))
            left += seq["num_tokens"]
        groups[(None, False, False)].append((row, left, mb["num_padding_tokens"]))
    return groups


def _draw(ax, summary: dict, colours: dict[str, tuple]) -> None:
    """One ``PolyCollection`` per (env, borrowed, missing) group, so steps with thousands of sequences draw fast."""
    half = _BAR_HEIGHT / 2
    for (env, borrowed, gone), bars in _segments(summary).items():
        b = np.array(bars, dtype=np.float64)
        rows, lefts, rights = b[:, 0], b[:, 1], b[:, 1] + b[:, 2]
        verts = np.stack([np.stack([lefts, rows - half], 1), np.stack([rights, rows - half], 1),
                          np.stack([rights, rows + half], 1), np.stack([lefts, rows + half], 1)], 1)
        colour = _PADDING_COLOUR if env is None else colours.get(env, _PADDING_COLOUR)
        ax.add_collection(PolyCollection(verts, facecolors=colour,  # type: ignore[arg-type]  # stubs: a list, not [N,4,2]
                                         hatch="//" if borrowed else None, edgecolors="red" if gone else "white",
                                         linewidths=2 if gone else 0.5))
    ax.set_ylim(len(summary["micro_batches"]) - 0.5, -0.5)


def _label_rows(ax, mbs: list[dict]) -> None:
    """Name at most ~60 rows ``dp<r> mb<i>``; a line between DP ranks."""
    every = -(-len(mbs) // _MAX_LABELS)
    ax.set_yticks(range(0, len(mbs), every), [f"dp{mb['dp_rank']} mb{mb['index']}" for mb in mbs[::every]])
    for row in range(1, len(mbs)):
        if mbs[row]["dp_rank"] != mbs[row - 1]["dp_rank"]:
            ax.axhline(row - 0.5, color="black", linewidth=1)


def legend_handles(colours: dict[str, tuple]) -> list[Patch]:
    """One legend entry per env name (padding dummies as ``dummy sequence (padding)``), then the trainer's
    padding tokens, the borrowed hatching and the missing-chunk outline."""
    handles = [Patch(color=c, label=f"dummy sequence ({name})" if name == PADDING_ENV_NAME else name)
               for name, c in colours.items()]
    return handles + [Patch(color=_PADDING_COLOUR, label="padding tokens"),
                      Patch(facecolor="white", edgecolor="black", hatch="//", label="borrowed dummy"),
                      Patch(facecolor="white", edgecolor="red", linewidth=2, label="chunk missing")]


def plot_micro_batches(summary: dict, png_path: str) -> None:
    """Draw ``summary`` (``cli.inspect.summarize``) into ``png_path`` (a PNG, overwritten).

    Raises:
        OSError: the file cannot be written.
    """
    mbs = summary["micro_batches"]
    colours = _env_colours(summary)
    fig, ax = plt.subplots(figsize=(10, 1.5 + min(0.35 * len(mbs), _MAX_BARS_HEIGHT_IN)))
    try:
        _draw(ax, summary, colours)
        _label_rows(ax, mbs)
        ax.set_xlim(0, summary["seq_len"])
        ax.set_xlabel(f"tokens (seq_len = {summary['seq_len']})")
        ax.set_title(f"step {summary['step']}: {len(mbs)} micro batches, {summary['dp_world_size']} DP ranks, "
                     f"{summary['num_chunks_missing']} of {summary['num_chunks']} chunks missing", fontsize=10)
        ax.legend(handles=legend_handles(colours), loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8,
                  frameon=False)
        fig.tight_layout()
        fig.savefig(png_path, dpi=100)
    finally:
        plt.close(fig)
