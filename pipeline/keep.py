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

from refpipe.pipeline.fields import FieldsConfig, validate_branch
from refpipe.storage.chunk_codec import encode_chunk
from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.chunk_write import put_chunk
from refpipe.storage.config import StorageConfig
from refpipe.storage.ledger import DeleteResult, Ledger
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
    """Unique within the run; None draws a random id."""


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
            FieldError: an array breaks its field's rules (nothing is written).
            KeyExistsError: ``branch.branch_id`` was already kept in this run.
            LedgerClosedError: the keeper's ledger was closed (nothing is written).
        """
        self.ledger.check_open("keep")
        branch_id = branch.branch_id or f"{self.ledger.actor}-{uuid.uuid4().hex}"
        what = f"branch {branch_id} (env worker {self.ledger.actor})"
        arrays, specs = validate_branch(branch.fields, self.fields, num_prompt_tokens=branch.num_prompt_tokens,
                                        num_completion_tokens=branch.num_completion_tokens, what=what)
        chunk = encode_chunk(branch_id, arrays, specs, num_prompt_tokens=branch.num_prompt_tokens,
                             num_completion_tokens=branch.num_completion_tokens,
                             compression=self.storage.compression, zstd_level=self.storage.zstd_level,
                             writer=self.ledger.actor)
        uri = put_chunk(self.store, branch_id, chunk)
        ref = PayloadRef(uri=uri, branch_id=branch_id, num_prompt_tokens=branch.num_prompt_tokens,
                         num_completion_tokens=branch.num_completion_tokens, arrays=chunk.arrays,
                         nbytes=chunk.nbytes, checksum=chunk.checksum, compression=self.storage.compression)
        self.ledger.record_keep(ref)
        return ref

    def discard(self, refs: Sequence[PayloadRef], *, reason: str = "discarded by env server") -> DeleteResult:
        """Delete kept branches that will never reach the orchestrator (exactly once, via the ledger)."""
        return self.ledger.delete(refs, reason=reason)
