"""Writing a branch's chunk into a run's store (``put_chunk``): the chunk, then its commit marker.

The bytes are ``storage.chunk_codec``'s; the keys ``storage.layout.chunk_keys``; reading is ``storage.chunk_read``.
"""

from __future__ import annotations

import contextlib
from typing import cast

from refpipe.storage.chunk_codec import EncodedChunk
from refpipe.storage.errors import KeyExistsError, StorageError
from refpipe.storage.layout import chunk_keys, node_key
from refpipe.storage.store import Bytes, Store


def put_chunk(store: Store, branch_id: str, chunk: EncodedChunk) -> str:
    """Write a chunk, then its ``zarr.json`` (the commit marker); return the node URI.

    Both puts are exclusive, so a branch id is never written twice. The chunk is written in place
    (``Store.put``'s ``in_place``: on a filesystem one create, no temp file and link): until its commit
    marker exists no reader trusts it, and the audit counts a chunk without one as an incomplete keep,
    held by its live writer. When the commit marker's put
    fails (after the store's retries), the chunk is removed again (best effort; the sweep removes an
    incomplete keep left behind).

    Raises:
        KeyExistsError: a branch with this id was already kept in this run.
        StorageError: a put failed (after the store's retries).
    """
    key = node_key(branch_id)
    data_key, meta_key = chunk_keys(key)
    try:
        store.put(data_key, cast("list[Bytes]", chunk.parts), exclusive=True, in_place=True)  # list is invariant
    except KeyExistsError as e:
        raise KeyExistsError(f"branch {branch_id!r} was already kept in run {store.prefix.uri} ({e}): branch ids "
                             f"are unique per run; keep a new branch under a new id") from e
    try:
        store.put(meta_key, chunk.metadata, exclusive=True)
    except KeyExistsError:
        raise
    except StorageError:  # not kept (no ref was returned): remove what this call wrote, best effort
        with contextlib.suppress(StorageError):
            store.delete_keys([meta_key, data_key])
        raise
    return store.uri(key)

