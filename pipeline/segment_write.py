"""The segments of one writer life of an open branch (``pipeline.open_branch``): where each segment's bytes go.

A writer life is the run of appends from an open (or a resume) to a close, suspend or discard. On a store that
appends (``Store.appends``: a filesystem) every segment of a life goes into ONE object, the node of the life's first
segment id: the first segment creates it (an exclusive in-place put), each later one is written at its end
(``Store.write_at``); each segment's ref records its byte offset there (``PayloadRef.offset``) and its own block
crcs and crc32c, as a chunk of its own would. The life's end writes the object's ``zarr.json``
(``chunk_codec.segments_metadata``: shape = the bytes its refs cover), its commit marker, then records its keep in
the ledger, once for the object. As for any chunk, an object without a commit marker is an incomplete keep: held
while a session of the run is live, leaked after a crash (removed once by the sweep; never recorded kept, so never
missing after). On a store without appends (S3) each segment is a chunk of its own (``Keeper.write``), no offset.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

import numpy as np

from refpipe.storage.chunk_codec import encode_chunk, segments_metadata
from refpipe.storage.chunk_ref import ArraySpec, PayloadRef
from refpipe.storage.errors import KeyExistsError
from refpipe.storage.layout import chunk_keys, node_key
from refpipe.storage.store import Bytes

if TYPE_CHECKING:
    from refpipe.pipeline.keep import Keeper


class LifeWriter:
    """Writes the segments of one writer life of an open branch; used by ``OpenBranch`` in its process.

    Attributes:
        object_id: id of the life's object (its first segment's id); None before its first segment and after ``end``.
        nbytes: bytes written to that object so far (the next segment's offset).
    """

    def __init__(self, keeper: "Keeper"):
        self.keeper = keeper
        self.object_id: str | None = None
        self.nbytes = self._prompt = self._completion = 0

    def write(self, segment_id: str, arrays: Mapping[str, np.ndarray], specs: Mapping[str, ArraySpec],
              num_prompt_tokens: int, num_completion_tokens: int) -> PayloadRef:
        """Write one segment (``validate_branch``'s arrays of its tokens); return its ref. ``segment_id``: the id it
        would have as a chunk of its own, which names the life's object when it is the first.

        Raises:
            KeyExistsError: the object's id was already kept in this run (nothing written).
            StorageError: a write failed (after the store's retries); the life's refs so far stay valid and the next
                write goes to the same offset.
        """
        store = self.keeper.store
        if not store.appends:
            return self.keeper.write(segment_id, arrays, specs, num_prompt_tokens, num_completion_tokens)
        object_id = self.object_id or segment_id
        chunk = encode_chunk(segment_id, arrays, specs, num_prompt_tokens=num_prompt_tokens,
                             num_completion_tokens=num_completion_tokens, compression=self.keeper.storage.compression,
                             zstd_level=self.keeper.storage.zstd_level, writer=self.keeper.ledger.actor)
        ref = PayloadRef(uri=store.uri(node_key(object_id)), branch_id=object_id, offset=self.nbytes,
                         num_prompt_tokens=num_prompt_tokens, num_completion_tokens=num_completion_tokens,
                         arrays=chunk.arrays, nbytes=chunk.nbytes, checksum=chunk.checksum,
                         compression=self.keeper.storage.compression)
        data_key = chunk_keys(ref.key)[0]
        parts = cast("list[Bytes]", chunk.parts)  # list is invariant
        if self.object_id is None:
            self._create(data_key, parts, object_id)
        else:
            store.write_at(data_key, parts, self.nbytes)
        self.object_id = object_id
        self.nbytes += chunk.nbytes
        self._prompt += num_prompt_tokens
        self._completion += num_completion_tokens
        return ref

    def _create(self, data_key: str, parts: list[Bytes], object_id: str) -> None:
        """The life's object with its first segment (exclusive: an id is never written twice)."""
        try:
            self.keeper.store.put(data_key, parts, exclusive=True, in_place=True)
        except KeyExistsError as e:
            raise KeyExistsError(f"branch {object_id!r} was already kept in run {self.keeper.store.prefix.uri} "
                                 f"({e}): branch ids are unique per run; keep a new branch under a new id") from e

    def end(self) -> None:
        """Commit the life's object: write its ``zarr.json`` (shape: the bytes its segments take), record its keep; the
        next segment starts a new object. Nothing to do without one (no segment written since the last ``end``, or
        S3).

        Raises:
            StorageError: the put failed (after the store's retries); the object stays open (``end`` again).
        """
        if self.object_id is None:
            return
        metadata = segments_metadata(self.object_id, self.nbytes, self._prompt, self._completion,
                                     self.keeper.ledger.actor)
        node = node_key(self.object_id)
        self.keeper.store.put(chunk_keys(node)[1], metadata, exclusive=True)
        self.keeper.ledger.record("keep", branch_id=self.object_id, uri=self.keeper.store.uri(node), nbytes=self.nbytes)
        self.object_id, self.nbytes, self._prompt, self._completion = None, 0, 0, 0
