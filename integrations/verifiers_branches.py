"""verifiers 0.4 message graphs as refpipe branches, and where their refs travel.

A verifiers ``Trace`` is a graph of ``MessageNode``s; each root-to-leaf path is a
``Branch`` (``Trace.branches``, one per leaf node, in leaf order) and each trainable
branch becomes one training sample. Nodes carry ``routed_experts`` uint8/uint16
[len(token_ids), layers, top_k] and, on sampled nodes, ``sampling_mask``
(``ids`` int32 flat, ``counts`` int32 per sampled token). ``Branch.routed_experts``
concatenates the node rows along the path ([T, layers, top_k], None when any node
lacks routing) and ``Branch.sampling_mask`` widens the counts to every token
([T], 0 on unsampled tokens): these are the arrays a trainer builds from the inline
stream, and the arrays refpipe keeps.

Mapping to refpipe's token domains: the branch's prompt is everything before its
first sampled token (``P`` tokens), the completion is the rest (``C = T - P``,
including later tool and user turns, whose tokens are not sampled).
``routed_experts`` is kept whole (tokens domain); ``sampling_mask`` keeps its
completion rows ``counts[P:]`` (``counts[:P]`` is all zeros by construction).

Refs travel in ``Trace.info["refpipe"]``: ``info`` is a free-form dict that the
client's final validation (``WireEpisode.model_validate``) keeps, whereas unknown
``MessageNode`` keys are dropped there.
"""

from __future__ import annotations

import secrets
from typing import NamedTuple

import numpy as np
from verifiers.v1 import graph
from verifiers.v1.trace import Branch as TraceBranch
from verifiers.v1.trace import Trace

from refpipe.pipeline.fields import Ragged
from refpipe.pipeline.keep import Branch
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import EpisodeError, FieldError

INFO_KEY = "refpipe"
"""Key of the refs record in ``Trace.info``: ``{"branches": [{"leaf": int, "ref": PayloadRef JSON}]}``."""


class BranchRef(NamedTuple):
    """A kept branch of a trace: its leaf node index and its chunk's reference."""

    leaf: int
    ref: PayloadRef


def trainable_branches(trace: Trace) -> list[tuple[int, TraceBranch]]:
    """``(leaf node index, branch)`` of every branch that trains: the trace's agent is
    trainable, the branch is (not an abandoned compaction attempt), and it has at least
    one sampled token."""
    if trace.agent is None or not trace.agent.trainable:
        return []
    return [(leaf, branch) for leaf, branch in zip(graph.leaves(trace), trace.branches, strict=True)
            if branch.trainable and any(branch.sampled_mask)]


def num_prompt_tokens(branch: TraceBranch) -> int:
    """P: tokens before the branch's first sampled token (the branch has at least one)."""
    return int(np.asarray(branch.sampled_mask, dtype=bool).argmax())


def side_channels(trace_id: str, leaf: int, branch: TraceBranch) -> Branch | None:
    """The branch's side channels as a refpipe ``Branch`` (None when it carries none).

    ``routed_experts`` [T, layers, top_k] as ``Branch.routed_experts`` builds it;
    ``sampling_mask`` as ``Ragged(ids, counts[P:])``. The branch id is
    ``<trace id>.<leaf>.<8 random hex>``, fresh per keep.

    Raises:
        FieldError: some nodes of the path carry routing and others do not (or carry the wrong
            number of rows): verifiers' ``Branch.routed_experts`` is then None, and keeping the
            branch without routing would silently drop it for the whole branch.
    """
    routed, mask = branch.routed_experts, branch.sampling_mask
    _check_routing_whole(trace_id, leaf, branch, routed)
    if routed is None and mask is None:
        return None
    total = len(branch.sampled_mask)
    prompt = num_prompt_tokens(branch)
    fields: dict[str, np.ndarray | Ragged] = {}
    if routed is not None:
        fields["routed_experts"] = routed
    if mask is not None:
        fields["sampling_mask"] = Ragged(ids=mask.ids, counts=mask.counts[prompt:])
    return Branch(num_prompt_tokens=prompt, num_completion_tokens=total - prompt, fields=fields,
                  branch_id=f"{trace_id}.{leaf}.{secrets.token_hex(4)}")


def _check_routing_whole(trace_id: str, leaf: int, branch: TraceBranch, routed: np.ndarray | None) -> None:
    """Raise ``FieldError`` when nodes of the branch carry routing but the branch's rows cannot be assembled."""
    nodes = [n for n in branch.nodes if n.token_ids]
    if routed is not None or all(n.routed_experts is None for n in nodes):
        return
    rows = [(i, len(n.token_ids), None if n.routed_experts is None else len(n.routed_experts))
            for i, n in enumerate(nodes)]
    bad = [(i, tokens, got) for i, tokens, got in rows if got != tokens]
    raise FieldError(f"trace {trace_id} leaf {leaf}: path nodes (index, tokens, routing rows) {bad} lack routing "
                     f"rows that the other {len(nodes) - len(bad)} nodes carry: expected one routing row per token "
                     "on every node (keeping the branch without routing would drop it for the whole branch)")


def fingerprint(trace: Trace) -> tuple:
    """What can still change a completed trace's kept arrays or its trainable branches.

    verifiers appends nodes at turn granularity and otherwise only repairs the last
    routing row of a node (the placeholder of a turn's final token, ``graph.
    _replace_placeholder_routing_row``) and adds semantic links (which decide whether a
    compaction attempt trains). Equal fingerprints mean equal kept arrays.
    """
    rows = tuple((n.routed_experts.dtype.str, n.routed_experts[-1:].tobytes())
                 for n in trace.nodes if n.routed_experts is not None)
    links = sum(len(n.semantic_parents) for n in trace.nodes)
    return len(trace.nodes), links, rows, trace.agent is not None and trace.agent.trainable


def refs_record(refs: list[BranchRef]) -> dict:
    """The ``Trace.info["refpipe"]`` value for a trace's kept branches (JSON types only)."""
    return {"branches": [{"leaf": r.leaf, "ref": r.ref.model_dump(mode="json")} for r in refs]}


def read_refs(info: dict, what: str) -> dict[int, PayloadRef]:
    """Leaf node index -> ref, from a trace's ``info`` (empty when it carries no refs).

    Raises:
        EpisodeError: the record is not ``{"branches": [{"leaf": int, "ref": PayloadRef}]}``
            or names a leaf twice.
    """
    record = info.get(INFO_KEY)
    if record is None:
        return {}
    try:
        entries = [(int(e["leaf"]), PayloadRef.model_validate(e["ref"])) for e in record["branches"]]
    except (KeyError, TypeError, ValueError) as e:  # pydantic's ValidationError is a ValueError
        raise EpisodeError(f"{what}: info[{INFO_KEY!r}] is not a refs record "
                           f"({{'branches': [{{'leaf', 'ref'}}]}}): {e}") from e
    refs = dict(entries)
    if len(refs) != len(entries):
        raise EpisodeError(f"{what}: info[{INFO_KEY!r}] names a leaf twice: {[leaf for leaf, _ in entries]}")
    return refs
