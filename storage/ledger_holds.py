"""Shared prefix segments: each holder's release recorded once, the prefix deleted after the last.

A shared prefix (``PayloadRef.holders``: e.g. a group's prompt rows, kept once by ``Keeper.keep_prefix``) is held
by the branches declared when it was kept. Releasing a holder (``Ledger.delete`` of a branch whose segments include
the prefix, or ``Ledger.release_holds``) writes that holder's release record
``ledger/holds/<aa>/<bb>/<prefix_id>/<holder>.json`` with an exclusive put, then lists the prefix's records. A
releaser that finds every holder released claims the prefix's last release (``.../<prefix_id>/_last.json``,
exclusive put); only the one whose claim succeeds deletes the prefix, through the ledger's ordinary exactly-once
delete. So holders released by different processes at once delete the prefix exactly once. A releaser that dies
after the claim leaves the prefix to the sweep: the audit finds it held by nobody.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence

from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import DoubleDeleteError, KeyExistsError, StorageError, UnknownRefError
from refpipe.storage.store import Store

HOLDS_PREFIX = "ledger/holds"
LAST_NAME = "_last.json"
"""The last release's claim; no holder id starts with ``_``, so no holder's record has this name."""


def holds_dir(prefix_id: str) -> str:
    """Directory of a prefix's release records: ``ledger/holds/<aa>/<bb>/<prefix_id>``."""
    digest = hashlib.blake2b(prefix_id.encode(), digest_size=2).hexdigest()
    return f"{HOLDS_PREFIX}/{digest[:2]}/{digest[2:]}/{prefix_id}"


def parse_hold_key(key: str) -> tuple[str, str] | None:
    """``(prefix_id, holder)`` of a holder's release record key; None for any other key (the last claim too)."""
    parts = key.split("/")
    if len(parts) != 6 or "/".join(parts[:2]) != HOLDS_PREFIX or not parts[5].endswith(".json") \
            or parts[5] == LAST_NAME:
        return None
    return parts[4], parts[5].removesuffix(".json")


def released_holders(store: Store, prefix_id: str) -> set[str]:
    """The holders of ``prefix_id`` whose release is recorded (one listing)."""
    return {parsed[1] for key in store.list_prefix(holds_dir(prefix_id)) if (parsed := parse_hold_key(key))}


def release_hold(store: Store, prefix: PayloadRef, holder: str, *, actor: str, reason: str) -> bool:
    """Record that ``holder`` released ``prefix``; True when this call must delete it (every holder released and this
    call won the last release's claim).

    Raises:
        UnknownRefError: ``holder`` is not one of ``prefix.holders`` (nothing written).
        DoubleDeleteError: ``holder`` released ``prefix`` before (names the first release).
        StorageError: a put or the listing failed (after the store's retries).
    """
    uri = store.uri(prefix.key)
    if holder not in prefix.holders:
        raise UnknownRefError(f"shared prefix {uri}: release by {actor} ({reason}) for branch {holder!r} refused: "
                              f"not one of its declared holders {list(prefix.holders)}")
    record = json.dumps({"holder": holder, "actor": actor, "reason": reason, "t": round(time.time(), 3)}).encode()
    key = f"{holds_dir(prefix.branch_id)}/{holder}.json"
    try:
        store.put(key, record, exclusive=True)
    except KeyExistsError:
        first = store.get(key).decode(errors="replace")
        first_holder, first_reason = _first_release(first)
        raise DoubleDeleteError(f"shared prefix {uri}: branch {holder!r} released it twice: first {first}; second "
                                f"by {actor} ({reason})", first_holder=first_holder, first_reason=first_reason,
                                second_holder=actor) from None
    if not set(prefix.holders) <= released_holders(store, prefix.branch_id):
        return False
    try:
        store.put(f"{holds_dir(prefix.branch_id)}/{LAST_NAME}", record, exclusive=True)
    except KeyExistsError:
        return False  # another holder's releaser found every release too and deletes it
    return True


def _first_release(record: str) -> tuple[str, str]:
    """``(actor, reason)`` of a holder's release record; ``("?", why)`` when it is not one."""
    try:
        first = json.loads(record)
        return str(first["actor"]), str(first["reason"])
    except (ValueError, KeyError, TypeError) as e:
        return "?", f"its release record is unreadable: {type(e).__name__}: {e}"


def release_holds(store: Store, holds: Sequence[tuple[PayloadRef, str]], *, actor: str,
                  reason: str) -> tuple[list[PayloadRef], list[tuple[PayloadRef, StorageError]]]:
    """``release_hold`` of each ``(prefix, holder)``: ``(prefixes to delete now, (prefix, problem) pairs)``."""
    doomed: list[PayloadRef] = []
    problems: list[tuple[PayloadRef, StorageError]] = []
    for prefix, holder in holds:
        try:
            if release_hold(store, prefix, holder, actor=actor, reason=reason):
                doomed.append(prefix)
        except StorageError as e:
            problems.append((prefix, e))
    return doomed, problems


__all__ = ["HOLDS_PREFIX", "holds_dir", "parse_hold_key", "release_hold", "release_holds", "released_holders"]
