"""Child-process bodies of the store tests, in a module light enough for ``spawn`` children to import quickly."""

from __future__ import annotations

import os

from refpipe.storage.errors import KeyExistsError


def race_payload(i: int) -> bytes:
    """The distinct bytes writer ``i`` puts in the exclusive-put races (6 KiB)."""
    return f"writer {i:02d};".encode() * 512


def race_in_child(store, key: str, i: int, barrier) -> None:
    """One exclusive put of ``key``; exit 0 = won, 17 = ``KeyExistsError``."""
    barrier.wait(timeout=60)
    try:
        store.put(key, race_payload(i), exclusive=True)
    except KeyExistsError:
        os._exit(17)
    os._exit(0)


def use_in_child(store, queue) -> None:
    """Read the parent's object, write ``child/obj``, report (bytes read, whether the filesystem was rebuilt
    in this process; None for a store without one)."""
    inherited_fs = getattr(store, "_fs", None)
    got = store.get("parent/obj")
    store.put("child/obj", b"from child " + str(os.getpid()).encode(), exclusive=True)
    rebuilt = store.fs is not inherited_fs and store._pid == os.getpid() if hasattr(store, "_fs") else None
    queue.put((got, rebuilt))


def claim_then_hang(store, refs, ready) -> None:
    """``Ledger.delete`` of ``refs`` as actor ``trainer_dp0`` that stops for good after its batch record is written,
    before any commit marker is unlinked (the parent SIGKILLs it once ``ready`` is set)."""
    import threading

    from refpipe.storage.ledger import Ledger

    def hang(chunks):
        ready.set()
        threading.Event().wait()

    store.claim_by_unlink = hang
    Ledger(store, "trainer_dp0").delete(refs, reason="trained step 3")


def free_then_hang(store, refs, ready) -> None:
    """``Ledger.delete`` of ``refs`` as actor ``trainer_dp0`` that returns (every commit marker unlinked: claimed),
    while its reaper stops for good before removing any chunk (the parent SIGKILLs it once ``ready`` is set)."""
    import threading

    from refpipe.storage.ledger import Ledger

    def hang(keys):
        ready.set()
        threading.Event().wait()

    store.delete_keys = hang
    result = Ledger(store, "trainer_dp0").delete(refs, reason="trained step 3")
    assert result.deleted == [r.uri for r in refs]
    threading.Event().wait()
