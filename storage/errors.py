"""Error types of refpipe: one root, builtins as second parents.

Every message names the object (URI, step, DP rank, field) and says what was
expected and what was found.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from pydantic import ValidationError

    from refpipe.storage.delete_result import DeleteResult

T = TypeVar("T")


class RefpipeError(Exception):
    """Root of every error refpipe raises on purpose."""


class ConfigError(RefpipeError, ValueError):
    """A run config or CLI argument is invalid."""


class RunStillRunningError(ConfigError):
    """A command that needs the run stopped (``sweep --stopped``, ``run --resume``) found live sessions.

    Attributes:
        running: one ``<actor> (pid <pid> on <host>)`` per session whose heartbeat is live, on any host.
    """

    def __init__(self, message: str, *, running: list[str]):
        super().__init__(message)
        self.running = running


class OutsideRunError(RefpipeError, ValueError):
    """A URI or key lies outside the run prefix (another run, bucket or scheme, or ``..``)."""


class StorageError(RefpipeError, OSError):
    """A store operation failed."""


class TransientStorageError(StorageError):
    """A store operation failed in a way that may succeed on retry (throttling, 5xx, timeouts)."""


class KeyNotFoundError(StorageError, FileNotFoundError):
    """No object at a key of the run (a step file, a delete record, metrics, weights, ...)."""


class ChunkNotFoundError(KeyNotFoundError):
    """A chunk that a reference names does not exist."""


class RunNotFoundError(StorageError, FileNotFoundError):
    """Nothing at all lies under a run prefix (a wrong URI or endpoint, or a run that never started)."""


class RunPathNotADirectoryError(StorageError, NotADirectoryError):
    """A local run root or run prefix is, or lies under, a regular file: no run can be read or written there."""


class ChunkCorruptError(StorageError, ValueError):
    """A chunk exists but its length, checksum or metadata does not match its reference."""


class TruncatedChunkError(ChunkCorruptError):
    """A chunk read returned fewer bytes than its reference spans on every read (the first and each re-read)."""


class RefError(RefpipeError, ValueError):
    """A reference cannot be read as asked: its arrays' rows disagree with its token counts, or a read asks for
    more tokens than it holds (a step file's slice longer than its chunk). Nothing is read."""


class KeyExistsError(StorageError, FileExistsError):
    """An exclusive put found the key already present."""


class DeleteKeysError(StorageError):
    """Some keys of a many-key delete could not be deleted (after the store's retries); the others were.

    Attributes:
        failed: key -> the classified error of that key (``TransientStorageError`` or ``StorageError``).
    """

    def __init__(self, message: str, failed: dict[str, StorageError]):
        super().__init__(message)
        self.failed = failed


class DoubleDeleteError(StorageError):
    """A chunk was deleted a second time; names the first and the second holder.

    Attributes:
        first_holder: the actor whose delete (or release) record holds the chunk (``"?"`` when that record is
            unreadable or gone: ``first_reason`` says which).
        first_reason: the first delete's reason, or why its holder is unknown.
        second_holder: the actor whose delete was refused.
        result: set when ``Ledger.delete`` raises it for a whole call: that call's ``DeleteResult``.
    """

    def __init__(self, message: str, *, first_holder: str, first_reason: str, second_holder: str,
                 result: DeleteResult | None = None):
        super().__init__(message)
        self.first_holder = first_holder
        self.first_reason = first_reason
        self.second_holder = second_holder
        self.result = result


class DeleteRecordError(StorageError, ValueError):
    """A chunk's delete record is not what ``Ledger`` writes (not JSON, not an object, a field missing or mistyped)."""


class LedgerRecordError(StorageError, ValueError):
    """A run's ledger segments hold records that cannot be read (not JSON, no event name, a crc32c mismatch, no line
    end, a field of the wrong type): the sweep refuses to delete on the audit's word (names the segment and line)."""


class UnknownRefError(StorageError, LookupError):
    """A delete named a chunk that was never kept (no commit marker, no delete record).

    Attributes:
        result: set when ``Ledger.delete`` raises it for a whole call: that call's ``DeleteResult``.
    """

    def __init__(self, message: str, *, result: DeleteResult | None = None):
        super().__init__(message)
        self.result = result


class OpenBranchError(RefpipeError, ValueError):
    """An open branch was used out of turn: rows appended out of order, an append or close after close, a close
    with nothing appended, a shared prefix held by a branch not declared as its holder."""


class FieldError(RefpipeError, ValueError):
    """A side-channel array does not match its field's registry entry."""


class EpisodeError(RefpipeError, ValueError):
    """An episode from an env server is malformed (bad token arrays, rewards, or refs that disagree with its tokens)."""


class StepFileError(RefpipeError, ValueError):
    """A step file is missing, truncated, of an unknown schema version or references another run."""


class PackingError(RefpipeError, ValueError):
    """Samples cannot be packed as asked (e.g. a sample longer than ``seq_len``)."""


class SliceError(RefpipeError, ValueError):
    """A payload slice is malformed, or its wire form names a ref the table lacks or holds with another digest."""


class FetchError(RefpipeError):
    """A trainer step could not fetch any of its micro batches."""


class AlignmentError(RefpipeError):
    """Recomputed logprobs disagree with the inference logprobs beyond tolerance."""


class CheckpointError(RefpipeError, RuntimeError):
    """A trainer checkpoint could not be written on every rank, published, or loaded."""


class ReplayMismatchError(RefpipeError, RuntimeError):
    """A step replayed after a restart assembled micro batches that differ from the first time, or gave other
    weights than an earlier life published under the same version."""


class RunError(RefpipeError, RuntimeError):
    """The main job (``refpipe run``/``orchestrate``) could not go on: a trainer rank died, no env-server replica is
    left, a group failed on every attempt, or no step progressed within ``job.step_deadline_s``."""


class LedgerClosedError(RefpipeError, RuntimeError):
    """An event recorded (a keep, ship or delete) through a ledger session after its ``close``: the session's log
    ended with its ``close`` event, so nothing may follow it; open a new ``Ledger`` for the actor."""


class ArgumentTypeError(RefpipeError, TypeError):
    """A public call got an argument of another type than it takes (a dict for a ``Branch``, a string for a
    ``PayloadRef``); raised before anything is read, written or deleted (``expect_type``, ``expect_each``)."""


class StepOrderError(RefpipeError, RuntimeError):
    """A trainer rank's pull loop was driven out of order: a step released twice, or the next step asked for
    before the previous one was released (``TrainerRank.steps``)."""


def expect_type(value: object, expected: type[T], argument: str) -> T:
    """``value``, checked to be an ``expected`` at a public call; ``argument`` names it (``"Keeper.keep(branch)"``).

    Raises:
        ArgumentTypeError: naming the argument, the expected type and what was given.
    """
    if not isinstance(value, expected):
        raise ArgumentTypeError(f"{argument}: expected a {expected.__name__}, got {_given(value)}")
    return value


def expect_each(values: object, expected: type[T], argument: str) -> list[T]:
    """``values`` as a list, checked to be a sequence (any iterable but a string) of ``expected`` at a public call.

    Raises:
        ArgumentTypeError: naming the argument (an element by its index), the expected type and what was given.
    """
    if isinstance(values, (str, bytes, expected)) or not isinstance(values, Iterable):
        raise ArgumentTypeError(f"{argument}: expected a sequence of {expected.__name__}, got {_given(values)}")
    items = list(values)
    for i, value in enumerate(items):
        if not isinstance(value, expected):
            raise ArgumentTypeError(f"{argument}[{i}]: expected a {expected.__name__}, got {_given(value)}")
    return items


def _given(value: object) -> str:
    return f"{type(value).__name__} {_cut(repr(value), 60)}"


def validation_problems(error: ValidationError) -> str:
    """One line naming each problem of a pydantic ``ValidationError``: ``<field path>: <message> (got <value>)``,
    joined by ``; `` (the field path is left out where the model itself is wrong; the value only where it
    is a scalar, cut at 60 characters). The one way a validation error becomes a refpipe error's
    message (pydantic's own text spans lines and links to its docs)."""
    problems = []
    for err in error.errors():
        where = ".".join(map(str, err["loc"]))
        custom = err["type"] in ("value_error", "assertion_error") and "error" in err.get("ctx", {})
        message = str(err["ctx"]["error"]) if custom else err["msg"]  # not "Value error, <ours>"
        scalar = isinstance(err["input"], (str, bytes, int, float)) and err["type"] != "missing"
        got = f" (got {_cut(repr(err['input']), 60)})" if scalar else ""
        problems.append(f"{where}: {message}{got}" if where else f"{message}{got}")
    return "; ".join(problems)


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."
