"""The replay hash of an assembled micro batch: a digest that fixes every byte the model gets from it, so a replay after
a crash can be compared with the first life (``job.train_rank``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from refpipe.storage.chunk_ref import PayloadRef
from refpipe.trainer.assemble import AssembledMicroBatch

_PROVENANCE: dict[str, Any] = {"uri": True, "segments": {"__all__": {"uri"}}}
"""Where a ref's chunks were kept (``PayloadRef.uri``): not part of the bytes, and another path in a copied run."""


def micro_batch_hash(mb: AssembledMicroBatch, refs: Sequence[PayloadRef]) -> str:
    """XXH3-128 hex digest of every byte the model gets from ``mb`` (``refs``: the step file's refs).

    The rows read from chunks enter by what fixes them, not by a second pass over their bytes: each sequence's ref
    (JSON without its ``uri``: its crc32c, block crcs, dtypes and shapes) and tokens kept, in packing order. A fetch
    returns only bytes with those crc32c (``storage.chunk_read``: anything else is ``ChunkCorruptError`` and the micro
    batch is dropped), and assembly is a function of those bytes and the record, so equal digests mean equal rows.
    Then the bytes of what assembly makes, in name order, each with its name, dtype and shape: the streams,
    ``cu_seqlens``, and per field its ``cu_seqlens``, ``row_ids``, ragged ``counts`` and a token-domain field's
    padding rows (``padded[T:]``); its ``values`` (and ``padded[:T]``) only by dtype and shape.

    A replay after a crash must reproduce it exactly (``job.train_rank`` compares it with the first life's step
    metrics). A check of determinism, not of tampering: non-cryptographic; it releases the GIL, so the fetch
    threads that call it (``trainer.fetch``) overlap.
    """
    digest = xxhash.xxh3_128()
    for seq in mb.record.sequences:
        ref = "" if seq.ref is None else refs[seq.ref].model_dump_json(exclude=_PROVENANCE)
        digest.update(f"seq:{seq.num_tokens}:{seq.borrowed}:{ref}".encode())
    arrays = {f"streams.{k}": v for k, v in mb.streams.items()} | {"cu_seqlens": mb.cu_seqlens}
    for name, batch in mb.fields.items():
        arrays |= {f"{name}.{k}": v for k, v in vars(batch).items() if v is not None and k not in ("values", "padded")}
        digest.update(f"{name}.values:{batch.values.dtype.str}:{batch.values.shape}".encode())
        if batch.padded is not None:
            arrays[f"{name}.padding"] = batch.padded[len(batch.values):]
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        digest.update(f"{name}:{a.dtype.str}:{a.shape}".encode())
        digest.update(a.view(np.uint8).reshape(-1))  # type: ignore[arg-type]  # numpy stubs: an ndarray is a Buffer only from Python 3.12
    return digest.hexdigest()
