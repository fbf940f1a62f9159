"""Env-server side of refpipe: keep a branch's arrays under the run prefix, discard refs.

An env-server worker creates one ``Keeper`` per process (after any fork) and calls
``keep`` once per trainable branch; the ``PayloadRef`` it returns travels with the
episode. ``keep`` holds no reference to the arrays after it returns and caches
nothing, so a worker's memory does not grow with the number of branches kept.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from refpipe.pipeline.fields import FieldsConfig, validate_branch
from refpipe.pipeline.open_branch import OpenBranch, keep_prefix
from refpipe.storage.chunk_codec import encode_chunk
from refpipe.storage.chunk_ref import ArraySpec, PayloadRef
from refpipe.storage.chunk_write import put_chunk
from refpipe.storage.config import StorageConfig
from refpipe.storage.delete_result import DeleteResult
from refpipe.storage.errors import expect_each, expect_type
from refpipe.storage.layout import check_id
from refpipe.storage.ledger import Ledger
from refpipe.storage.ledger_open import claim_branch_id
from refpipe.storage.store import Store


@dataclass
class Branch:
    """One trainable token sequence's side channels, as the inference engine produced them.

    ``fields`` maps field names (``FieldsConfig.registry``: built-in and declared) to numpy arrays or
    CPU tensors (torch: taken without a copy): ``routed_experts`` [P + C, num_layers, top_k] of any
    integer dtype (stored uint8/uint16), ``topk_ids``/``topk_logprobs`` [C, k] int32 (any integer
    dtype)/float32, ``sample_support`` [C, width] int32, ``sampling_mask`` ``Ragged``; a declared
    field as its declaration says (docs/fields.md).
    """

    num_prompt_tokens: int
    num_completion_tokens: int
    fields: Mapping[str, object] = field(default_factory=dict)
    branch_id: str | None = None
    """Unique within the run; None draws a random id (``<actor>-<uuid4 hex>``); an empty string is refused."""


class Keeper:
    """Keeps branches for one env-server worker.

    Args:
        store: the run's store (created in this process).
        ledger: this worker's ledger (actor name = the worker).
        fields: the run's field shapes.
        storage: compression settings.
    """

    def __init__(self, store: Store, ledger: Ledger, fields: FieldsConfig, storage: StorageConfig):
        self.store, self.ledger, self.fields, self.storage = store, ledger, fields, storage

    def keep(self, branch: Branch) -> PayloadRef:
        """Validate and write a branch's arrays as one Zarr v3 chunk; return its reference.

        Raises:
            ArgumentTypeError: ``branch`` is not a ``Branch``.
            ConfigError: ``branch.branch_id`` is not a valid id (an empty one too; nothing is written).
            FieldError: an array breaks its field's rules (nothing is written).
            KeyExistsError: ``branch.branch_id`` was already kept in this run.
            LedgerClosedError: the keeper's ledger was closed (nothing is written).
        """
        branch = expect_type(branch, Branch, "Keeper.keep(branch)")
        self.ledger.check_open("keep")
        branch_id = self._chosen_id(branch.branch_id, "branch_id")
        what = f"branch {branch_id} (env worker {self.ledger.actor})"
        arrays, specs = validate_branch(branch.fields, self.fields, num_prompt_tokens=branch.num_prompt_tokens,
                                        num_completion_tokens=branch.num_completion_tokens, what=what)
        return self.write(branch_id, arrays, specs, branch.num_prompt_tokens, branch.num_completion_tokens)

    def write(self, chunk_id: str, arrays: Mapping[str, np.ndarray], specs: Mapping[str, ArraySpec],
              num_prompt_tokens: int, num_completion_tokens: int, holders: Sequence[str] = ()) -> PayloadRef:
        """Write validated arrays (``validate_branch``'s) as one chunk under ``chunk_id``, record its keep (a shared
        prefix's with its ``holders``).

        Raises:
            KeyExistsError: ``chunk_id`` was already kept in this run.
            LedgerClosedError: the ledger session is closed (nothing written).
        """
        self.ledger.check_open(f"keep of {chunk_id}")  # before the chunk: a keep it cannot record is not written
        num_prompt_tokens, num_completion_tokens = int(num_prompt_tokens), int(num_completion_tokens)  # numpy ints
        chunk = encode_chunk(chunk_id, arrays, specs, num_prompt_tokens=num_prompt_tokens,
                             num_completion_tokens=num_completion_tokens,
                             compression=self.storage.compression, zstd_level=self.storage.zstd_level,
                             writer=self.ledger.actor)
        uri = put_chunk(self.store, chunk_id, chunk)
        ref = PayloadRef(uri=uri, branch_id=chunk_id, num_prompt_tokens=num_prompt_tokens,
                         num_completion_tokens=num_completion_tokens, arrays=chunk.arrays,
                         nbytes=chunk.nbytes, checksum=chunk.checksum, compression=self.storage.compression,
                         holders=tuple(holders))
        self.ledger.record_keep(ref)
        return ref

    def open_branch(self, num_prompt_tokens: int, *, branch_id: str | None = None,
                    prefix: PayloadRef | None = None) -> OpenBranch:
        """Open a branch to keep turn by turn (``pipeline.open_branch.OpenBranch``: append, close), starting with a
        shared ``prefix`` (``keep_prefix``; ``branch_id`` must be one of its holders) or with no tokens.

        Raises:
            ArgumentTypeError: ``branch_id`` is not a string or ``prefix`` not a ``PayloadRef``.
            ConfigError: ``branch_id`` is not a valid id (an empty one too: None draws one), or too long to name its
                segments.
            FieldError: ``num_prompt_tokens`` is not an integer >= 0.
            OpenBranchError: ``branch_id`` was opened before in this run (names who opened it: the id is claimed
                here, by one exclusive put per branch), is not a holder of ``prefix``, or already released it
                (``release_holders``, a discard), or the prefix's prompt tokens disagree.
        """
        if branch_id is not None:
            expect_type(branch_id, str, "Keeper.open_branch(branch_id)")
        if prefix is not None:
            expect_type(prefix, PayloadRef, "Keeper.open_branch(prefix)")
        branch = OpenBranch(self, self._chosen_id(branch_id, "branch_id"), num_prompt_tokens, prefix)
        claim_branch_id(self.store, branch.branch_id, self.ledger.actor, self.ledger.session)
        self.ledger.open_branches.add(branch.branch_id)
        return branch

    def resume_branch(self, branch_id: str) -> OpenBranch:
        """Continue a branch suspended at a step boundary (``OpenBranch.suspend``), by this or an earlier process:
        open again at its appended tokens (``OpenBranch.num_tokens``; the next append starts there and gives the rows
        it would have given had the branch not been cut).

        Raises:
            OpenBranchError: no suspended branch of that id (names why: who closed or discarded it, or opened it and
                never suspended it), its record is unreadable, or another process resumed it (names its actor and
                ledger session; nothing written or deleted: of all resumers of one record exactly one continues it).
        """
        return OpenBranch.resume(self, branch_id)

    def keep_prefix(self, num_tokens: int, fields: Mapping[str, object], *, holders: Sequence[str],
                    prefix_id: str | None = None) -> PayloadRef:
        """Keep the rows of a group's shared prompt once, held by the branches ``holders`` (their ids, declared now):
        each opens with ``open_branch(..., prefix=ref)`` and is kept turn by turn; the prefix is deleted after the
        last of them was released or discarded (``Ledger.delete``, ``OpenBranch.discard``, ``release_holders``).
        ``fields`` as ``Branch.fields`` for ``num_tokens`` prompt tokens (every row, ``all_but_last`` fields too).
        The keep event is flushed at once. Returns the prefix's ref (``PayloadRef.holders``).

        Raises:
            FieldError: the rows break their declarations.
            ConfigError: a holder or ``prefix_id`` is not a valid id (an empty one too: None draws one);
                OpenBranchError: no holders, or repeated.
        """
        return keep_prefix(self, num_tokens, fields, holders, self._chosen_id(prefix_id, "prefix_id"))

    def _chosen_id(self, given: str | None, what: str) -> str:
        """``given`` if it is a valid id (an empty string is one given, and refused), or a new one when None.

        Raises:
            ConfigError: ``given`` is not a valid id (``what`` names it).
        """
        return f"{self.ledger.actor}-{uuid.uuid4().hex}" if given is None else check_id(given, what)

    def release_holders(self, prefix: PayloadRef, holders: Sequence[str], *,
                        reason: str = "holder discarded by env server") -> DeleteResult:
        """Release ``prefix`` for declared holders that will never hold it (their episodes failed before opening).
        Raises as ``Ledger.delete``; ArgumentTypeError: ``prefix`` is not a ``PayloadRef`` or ``holders`` not
        strings."""
        prefix = expect_type(prefix, PayloadRef, "Keeper.release_holders(prefix)")
        holders = expect_each(holders, str, "Keeper.release_holders(holders)")
        return self.ledger.release_chunks([(prefix, h) for h in holders], reason=reason)

    def discard(self, refs: Sequence[PayloadRef], *, reason: str = "discarded by env server") -> DeleteResult:
        """Delete kept branches that will never reach the orchestrator (exactly once, via the ledger). Raises as
        ``Ledger.delete``; ArgumentTypeError: ``refs`` is not a sequence of ``PayloadRef`` (nothing deleted)."""
        return self.ledger.delete(expect_each(refs, PayloadRef, "Keeper.discard(refs)"), reason=reason)
