"""What one delete call did: ``DeleteResult``, each ref of the call in exactly one outcome, and how its problems are
raised (``raise_problems``). Returned by ``Ledger.delete``, ``Ledger.release`` and the sweep's deletes."""

from __future__ import annotations

from dataclasses import dataclass, field

from refpipe.storage.errors import DoubleDeleteError, StorageError, UnknownRefError


@dataclass
class DeleteResult:
    """Outcome of one ``Ledger.delete`` or ``Ledger.release`` call: each ref in exactly one outcome (``outcome``)."""

    deleted: list[str] = field(default_factory=list)
    """URIs this call deleted: claimed (by this call or by this holder's earlier unfinished call), their bytes removed
    or, on a filesystem, being removed by the ledger's background reaper (``Ledger.wait_freed``)."""
    double_deletes: dict[str, DoubleDeleteError] = field(default_factory=dict)
    """URI -> the error: chunks another holder (or this one, in an earlier finished delete, or earlier in this
    call) had already deleted."""
    unknown: dict[str, UnknownRefError] = field(default_factory=dict)
    """URI -> the error: refs that were never kept (no commit marker and no delete record)."""
    already_released: list[str] = field(default_factory=list)
    """URIs this actor claimed in an earlier session (an earlier life of the same actor): already released,
    not a double delete; any objects the earlier life left are removed."""
    failed: dict[str, StorageError] = field(default_factory=dict)
    """URI -> the store error (after the store's retries) that stopped its claim or the removal of its objects:
    an unfinished delete this ledger keeps and retries with the same claim (``finish_unfinished``)."""

    def outcome(self, uri: str) -> str:
        """``"failed"``, ``"deleted"``, ``"already_released"``, ``"double_delete"`` or ``"unknown"`` (the first that
        holds, in this order) for the URI of a ref of this call (the chunk's URI in the run as opened:
        ``Store.uri(ref.key)``); the URIs every field is keyed by.

        Raises:
            KeyError: ``uri`` is not the URI of a ref of this call.
        """
        if uri in self.failed:
            return "failed"
        if uri in self.deleted:
            return "deleted"
        if uri in self.already_released:
            return "already_released"
        if uri in self.double_deletes:
            return "double_delete"
        if uri in self.unknown:
            return "unknown"
        raise KeyError(f"{uri}: not the URI of a ref of this delete call")

    def merge(self, other: "DeleteResult") -> None:
        """Add the outcomes of ``other`` (a call made for part of this call's refs) to this result."""
        self.deleted += other.deleted
        self.already_released += other.already_released
        self.double_deletes.update(other.double_deletes)
        self.unknown.update(other.unknown)
        self.failed.update(other.failed)


def double_delete_error(uri: str, *, first_holder: str, first_reason: str, second_holder: str,
                        reason: str) -> DoubleDeleteError:
    """The error of a chunk deleted a second time: ``chunk <uri> was already deleted by <first holder> (<first
    reason>); second delete from <second holder> (<reason>)``."""
    return DoubleDeleteError(f"chunk {uri} was already deleted by {first_holder} ({first_reason}); second delete "
                             f"from {second_holder} ({reason})", first_holder=first_holder, first_reason=first_reason,
                             second_holder=second_holder)


def raise_problems(result: DeleteResult) -> None:
    """Raise a call's double deletes (first) or deletes of unknown refs as one error carrying ``result``.

    Raises:
        DoubleDeleteError: naming how many of each there were, and the first double delete.
        UnknownRefError: no double delete, some unknown refs; naming the first.
    """
    def message(first: StorageError) -> str:
        return (f"{len(result.double_deletes)} double deletes, {len(result.unknown)} deletes of unknown refs "
                f"({len(result.deleted)} other chunks deleted); first: {first}")

    double = next(iter(result.double_deletes.values()), None)
    if double is not None:
        raise DoubleDeleteError(message(double), result=result, first_holder=double.first_holder,
                                first_reason=double.first_reason, second_holder=double.second_holder)
    raise UnknownRefError(message(next(iter(result.unknown.values()))), result=result)
