"""``refpipe inspect --plot``: the micro batches of a step file as one picture.

One horizontal bar per micro batch (grouped by DP rank, top to bottom), as long
as ``seq_len``: its sequences side by side in packing order, coloured by env
name, borrowed padding dummies hatched, sequences whose chunk is gone outlined
in red, and the padding the trainer adds in grey at the end. Uses matplotlib's
Agg backend (no display needed).
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (after selecting the backend)
from matplotlib.patches import Patch  # noqa: E402

_BAR_HEIGHT = 0.8
_PADDING_COLOUR = "#d0d0d0"


def _env_colours(summary: dict) -> dict[str, tuple]:
    names = sorted({s["env_name"] for mb in summary["micro_batches"] for s in mb["sequences"]})
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {name: cmap(i % cmap.N) for i, name in enumerate(names)}


def _draw_micro_batch(ax, y: float, mb: dict, missing_ids: set[str], colours: dict[str, tuple]) -> None:
    start = 0
    for seq in mb["sequences"]:
        gone = seq["branch_id"] in missing_ids
        ax.barh(y, seq["num_tokens"], left=start, height=_BAR_HEIGHT, color=colours[seq["env_name"]],
                hatch="//" if seq["borrowed"] else None, edgecolor="red" if gone else "white",
                linewidth=2 if gone else 0.5)
        start += seq["num_tokens"]
    if mb["num_padding_tokens"]:
        ax.barh(y, mb["num_padding_tokens"], left=start, height=_BAR_HEIGHT, color=_PADDING_COLOUR,
                edgecolor="white", linewidth=0.5)


def plot_micro_batches(summary: dict, png_path: str) -> None:
    """Draw ``summary`` (``cli.inspect.summarize``) into ``png_path`` (a PNG, overwritten).

    Raises:
        OSError: the file cannot be written.
    """
    mbs = summary["micro_batches"]
    missing_ids = {chunk["branch_id"] for chunk in summary["missing"]}
    colours = _env_colours(summary)
    fig, ax = plt.subplots(figsize=(10, 1.5 + 0.35 * len(mbs)))
    try:
        for row, mb in enumerate(mbs):
            _draw_micro_batch(ax, row, mb, missing_ids, colours)
        ax.set_yticks(range(len(mbs)), [f"dp{mb['dp_rank']} mb{mb['index']}" for mb in mbs])
        for row in range(1, len(mbs)):
            if mbs[row]["dp_rank"] != mbs[row - 1]["dp_rank"]:
                ax.axhline(row - 0.5, color="black", linewidth=1)
        ax.invert_yaxis()
        ax.set_xlim(0, summary["seq_len"])
        ax.set_xlabel(f"tokens (seq_len = {summary['seq_len']})")
        ax.set_title(f"step {summary['step']}: {len(mbs)} micro batches, {summary['dp_world_size']} DP ranks, "
                     f"{summary['num_chunks_missing']} of {summary['num_chunks']} chunks missing", fontsize=10)
        handles = [Patch(color=c, label=name) for name, c in colours.items()]
        handles += [Patch(color=_PADDING_COLOUR, label="padding"),
                    Patch(facecolor="white", edgecolor="black", hatch="//", label="borrowed dummy"),
                    Patch(facecolor="white", edgecolor="red", linewidth=2, label="chunk missing")]
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
        fig.tight_layout()
        fig.savefig(png_path, dpi=100)
    finally:
        plt.close(fig)
