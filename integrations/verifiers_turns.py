"""The trainable branches of a live verifiers trace, kept turn by turn as open branches.

verifiers grows a ``Trace`` a turn at a time: each committed turn adds nodes at the end of
one root-to-leaf path (a new leaf, or a fork from an earlier node). The engine returns no
routing row for a turn's last token (no forward pass follows it), so verifiers pads the
turn's last node with a placeholder row (a copy of the row before it); the next turn's
prefill on that path replaces it (``graph._replace_placeholder_routing_row``, the
``routing_repairs`` of verifiers' stream). So every row of a path is final except the
one of its last token, until the path grows or the trace completes.

``TraceTurns`` follows one trace on the event loop and plans ``Step``s: one open branch
(``pipeline.open_branch``, id ``<trace id>.<leaf when opened>.<8 random hex>``; the refs record
names the final leaf) per trainable branch, continued by the branch that extends its last leaf;
each turn appends the rows of the tokens that became final (the held-back last
token of the previous turn, whose row the new prefill repaired, and the new nodes' tokens
but the last), so a placeholder that a repair would replace is never written; completing
the trace appends the last token (its row stays the placeholder, as in verifiers' own
arrays) and closes. ``OpenBranches`` runs the steps in a worker thread. The stored rows
equal ``verifiers_branches.side_channels``' whole arrays byte for byte.

A fork opens a branch of its own and appends its whole path (the rows it shares with
the branch it forked from are stored twice). A later prefill that routes an already
written position again (a fork from an interior node) does not rewrite it.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, cast

import numpy as np
from verifiers.v1.graph import MessageNode
from verifiers.v1.trace import Trace

from refpipe.integrations.verifiers_branches import BranchRef, num_prompt_tokens, trainable_branches
from refpipe.pipeline.fields import Ragged
from refpipe.storage.errors import FieldError

if TYPE_CHECKING:
    from refpipe.pipeline.keep import Keeper
    from refpipe.pipeline.open_branch import OpenBranch


class Step(NamedTuple):
    """One operation on an open branch: ``open`` (arg: prompt tokens), ``append`` (arg: ``(start, end, fields)``),
    ``close`` (arg: the branch's leaf node index) or ``discard`` (arg: the reason)."""

    kind: str
    branch_id: str
    arg: object


@dataclass
class _Track:
    branch_id: str
    leaf: int
    """The last node of the path seen so far."""
    tokens: int
    """Tokens planned for appending (all of the path but its last token)."""


@dataclass
class TraceTurns:
    """The open branches of one trace, as planned on the event loop (``OpenBranches`` holds the real ones)."""

    trace_id: str
    tracks: list[_Track] = field(default_factory=list)

    def advance(self, trace: Trace, *, close: bool) -> list[Step]:
        """Steps appending the rows that became final since the last call, one open branch per trainable branch
        with side channels (``close``: every row, then close each branch, in leaf order); a branch no longer
        trainable is discarded.

        Raises:
            FieldError: some nodes of a path carry routing and others do not (as ``side_channels``).
        """
        steps: list[Step] = []
        claimed: list[_Track] = []
        for leaf, branch in trainable_branches(trace):
            nodes, path = branch.nodes, set(path_ids(trace, leaf))
            if not any(n.routed_experts is not None for n in nodes if n.token_ids) \
                    and all(n.sampling_mask is None for n in nodes):
                continue
            track = next((t for t in self.tracks if t.leaf in path and t not in claimed), None)
            if track is None:
                track = _Track(f"{trace.id}.{leaf}.{secrets.token_hex(4)}", leaf, 0)
                steps.append(Step("open", track.branch_id, num_prompt_tokens(branch)))
            claimed.append(track)
            end = len(branch.sampled_mask) - (0 if close else 1)
            if end > track.tokens:
                rows = token_rows(f"trace {trace.id} leaf {leaf}", nodes, track.tokens, end, num_prompt_tokens(branch))
                steps.append(Step("append", track.branch_id, (track.tokens, end, rows)))
            track.leaf, track.tokens = leaf, end
            if close:
                steps.append(Step("close", track.branch_id, leaf))
        steps += self.drop(f"untrainable: branch of trace {trace.id} no longer trains",
                           [t for t in self.tracks if t not in claimed])
        self.tracks = [] if close else claimed
        return steps

    def drop(self, reason: str, tracks: list[_Track] | None = None) -> list[Step]:
        """Steps discarding ``tracks`` (default: every open branch of the trace)."""
        return [Step("discard", t.branch_id, reason) for t in (self.tracks if tracks is None else tracks)]


def path_ids(trace: Trace, leaf: int) -> list[int]:
    """Node indices of the root-to-``leaf`` path."""
    out: list[int] = []
    nid: int | None = leaf
    while nid is not None:
        out.append(nid)
        nid = trace.nodes[nid].parent
    return out


def token_rows(what: str, nodes: list[MessageNode], start: int, end: int, prompt: int) -> dict[str, object]:
    """The side channels of tokens ``[start, end)`` of a path, as ``side_channels`` builds them for the whole path
    (copies of those rows only): ``routed_experts`` [end - start, layers, top_k] when the path carries routing,
    ``sampling_mask`` as ``Ragged`` of the completion tokens among them when any node carries a mask.

    Raises:
        FieldError: a path node among those tokens lacks routing rows that other nodes carry.
    """
    routed = any(n.routed_experts is not None for n in nodes if n.token_ids)
    masked = any(n.sampling_mask is not None for n in nodes)
    routing: list[np.ndarray] = []
    ids: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    bad: list[tuple[int, int, int | None]] = []
    offset = 0
    for i, node in enumerate(n for n in nodes if n.token_ids):
        size = len(node.token_ids)
        lo, hi, offset = max(start - offset, 0), min(end - offset, size), offset + size
        if lo >= hi:
            continue
        rows = node.routed_experts
        if routed and (rows is None or len(rows) != size):
            bad.append((i, size, None if rows is None else len(rows)))
        elif routed:
            routing.append(rows[lo:hi])
        if masked:
            node_counts = np.zeros(size, np.int32)
            node_ids = np.zeros(0, np.int32)
            if node.sampling_mask is not None and len(node.sampling_mask.counts):
                node_counts[np.nonzero(node.mask)[0]] = node.sampling_mask.counts
                node_ids = node.sampling_mask.ids
            skip = int(node_counts[:lo].sum())
            ids.append(np.asarray(node_ids[skip:skip + int(node_counts[lo:hi].sum())], np.int32))
            counts.append(node_counts[lo:hi])
    if bad:
        raise FieldError(f"{what}: path nodes (index, tokens, routing rows) {bad} lack routing rows that the other "
                         f"nodes carry: expected one routing row per token on every node (keeping the branch "
                         f"without routing would drop it for the whole branch)")
    fields: dict[str, object] = {}
    if routed:
        fields["routed_experts"] = np.concatenate(routing)
    if masked:
        completion = np.concatenate(counts)[max(prompt - start, 0):]
        fields["sampling_mask"] = Ragged(ids=np.concatenate(ids), counts=completion)
    return fields


class OpenBranches:
    """The open branches of one served run; ``run`` and ``discard_all`` run in its worker thread, one at a time."""

    def __init__(self, keeper: "Keeper"):
        self.keeper = keeper
        self.open: dict[str, "OpenBranch"] = {}

    def run(self, steps: list[Step], closed: list[BranchRef]) -> None:
        """Run ``steps`` in order; add each closed branch's ref to ``closed``.

        Raises:
            RefpipeError: an append, close or discard failed (every branch still open stays in ``open``).
        """
        for step in steps:
            if step.kind == "open":
                assert isinstance(step.arg, int)
                self.open[step.branch_id] = self.keeper.open_branch(step.arg, branch_id=step.branch_id)
            elif step.kind == "append":
                start, end, rows = cast(tuple[int, int, dict[str, object]], step.arg)
                self.open[step.branch_id].append(start, end, rows)
            elif step.kind == "close":
                assert isinstance(step.arg, int)
                closed.append(BranchRef(step.arg, self.open[step.branch_id].close()))
                del self.open[step.branch_id]
            else:
                self.open.pop(step.branch_id).discard(reason=str(step.arg))

    def discard_all(self, reason: str) -> int:
        """Discard every open branch; return how many."""
        n = 0
        while self.open:  # a failed discard leaves the rest open (the audit lists them)
            self.open.pop(next(iter(self.open))).discard(reason=reason)
            n += 1
        return n
