"""A branch's chunk in a run's store: where its objects are (``chunk_keys``) and writing them (``put_chunk``).

Reading is ``storage.fetch``; the key layout is ``storage.layout``; the bytes are ``storage.chunk``'s codec.
"""

from __future__ import annotations

import contextlib
from typing import cast

from refpipe.storage.chunk import EncodedChunk, PayloadRef
from refpipe.storage.errors import KeyExistsError, StorageError
from refpipe.storage.layout import chunk_keys as node_chunk_keys
from refpipe.storage.layout import node_key
from refpipe.storage.store import Bytes, Store


def put_chunk(store: Store, branch_id: str, chunk: EncodedChunk) -> str:
    """Write a chunk, then its ``zarr.json`` (the commit marker); return the node URI.

    Both puts are exclusive, so a branch id is never written twice. When the commit marker's put
    fails (after the store's retries), the chunk is removed again (best effort; the sweep removes an
    incomplete keep left behind).

    Raises:
        KeyExistsError: a branch with this id was already kept in this run.
        StorageError: a put failed (after the store's retries).
    """
    key = node_key(branch_id)
    data_key, meta_key = node_chunk_keys(key)
    try:
        store.put(data_key, cast("list[Bytes]", chunk.parts), exclusive=True)  # list is invariant; put only reads it
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


def chunk_keys(store: Store, ref: PayloadRef) -> tuple[str, str]:
    """``(data_key, meta_key)`` of a ref in the store's run: derived from its branch id (``PayloadRef.key``),
    so confined to the run prefix whatever path the writer saw the run under.

    Raises:
        OutsideRunError: the ref's URI names another chunk than its branch id (nothing is read).
    """
    return node_chunk_keys(ref.key)
