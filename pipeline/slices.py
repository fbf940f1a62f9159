"""The per-sample slice: a kept branch's ref plus the tokens a sample keeps of it, and its small wire form.

A ``PayloadSlice`` is what a caller puts in its own sample objects: the ``PayloadRef`` that
``Keeper.keep`` returned and ``num_tokens``, the sample's kept token range ``[0, num_tokens)`` of
the branch (truncation keeps a prefix; the chunk is never rewritten). In memory it holds the
whole ref, which ``publish_step`` writes into the step file's ref table once per step.

Across a process boundary a sample carries its ``SliceId`` instead (``PayloadSlice.slice_id``):
branch id, kept tokens and a 64-bit digest of the ref, at most 200 bytes as JSON or pickle,
where a ref with its block crcs takes several hundred. The receiver resolves it against a
table of whole refs (``SliceId.resolve``; e.g. ``StepHeader.refs`` of the step that ships it),
and the digest proves the table's ref is the one the sender sliced.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from numbers import Integral
from typing import NamedTuple

from refpipe.storage.chunk_ref import PayloadRef
from refpipe.storage.errors import OutsideRunError, SliceError
from refpipe.storage.layout import is_id
from refpipe.storage.uri import RunPrefix

DIGEST_HEX_CHARS = 16
"""Hex characters of a ``SliceId``'s ref digest (BLAKE2b, 8 bytes)."""


def ref_digest(ref: PayloadRef) -> str:
    """16 hex characters of BLAKE2b-64 over the ref's JSON without ``uri`` (provenance only, so two views of one
    run agree): branch id, token counts, arrays with their block crcs, byte count, checksum, codec, segments."""
    canonical = ref.model_dump_json(exclude={"uri": True, "segments": {"__all__": {"uri"}}}).encode()
    return hashlib.blake2b(canonical, digest_size=DIGEST_HEX_CHARS // 2).hexdigest()


class SliceId(NamedTuple):
    """The wire form of a ``PayloadSlice``: picklable, ``to_json`` <= 200 bytes for every valid branch id.

    Attributes:
        branch_id: the branch whose chunk is sliced (names the ref in a ref table).
        num_tokens: tokens kept, ``[0, num_tokens)`` of the branch.
        digest: ``ref_digest`` of the sliced ref.
    """

    branch_id: str
    num_tokens: int
    digest: str

    def to_json(self) -> str:
        """Compact JSON: ``{"branch_id": ..., "num_tokens": ..., "digest": ...}``."""
        return json.dumps(self._asdict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> "SliceId":
        """Parse ``to_json``'s output.

        Raises:
            SliceError: not such a JSON object (names what is wrong).
        """
        try:
            raw = json.loads(text)
            value = cls(**raw) if isinstance(raw, dict) else None
        except (ValueError, TypeError) as e:
            raise SliceError(f"slice {str(text)[:80]!r}: not a slice id: {e}") from None
        if value is None or not (is_id(value.branch_id) and type(value.num_tokens) is int and value.num_tokens >= 1
                                 and isinstance(value.digest, str) and len(value.digest) == DIGEST_HEX_CHARS):
            raise SliceError(f"slice {str(text)[:80]!r}: expected {{branch_id: id, num_tokens: int >= 1, digest: "
                             f"{DIGEST_HEX_CHARS} hex characters}}")
        return value

    def resolve(self, refs: Mapping[str, PayloadRef]) -> "PayloadSlice":
        """The slice this id names, with its whole ref taken from ``refs`` (branch id -> ref).

        Raises:
            SliceError: ``refs`` has no ref of ``branch_id``, its digest differs (another chunk, or a ref
                changed on the way), or it has fewer than ``num_tokens`` tokens.
        """
        ref = refs.get(self.branch_id)
        if ref is None:
            raise SliceError(f"slice of branch {self.branch_id!r}: no ref of that branch in the table "
                             f"({len(refs)} refs)")
        if ref_digest(ref) != self.digest:
            raise SliceError(f"slice of branch {self.branch_id!r}: ref digest {ref_digest(ref)} in the table: "
                             f"expected {self.digest} (another chunk under the same id?)")
        return PayloadSlice(ref, self.num_tokens).checked(f"slice of branch {self.branch_id!r}")


class PayloadSlice(NamedTuple):
    """A sample's view of a chunk: the whole ref and the tokens ``[0, num_tokens)`` it keeps (1..ref.num_tokens)."""

    ref: PayloadRef
    num_tokens: int

    @property
    def slice_id(self) -> SliceId:
        """The small wire form (``SliceId``) of this slice."""
        return SliceId(self.ref.branch_id, int(self.num_tokens), ref_digest(self.ref))

    def checked(self, what: str) -> "PayloadSlice":
        """This slice, if ``ref`` is a ``PayloadRef`` and ``1 <= num_tokens <= ref.num_tokens``.

        Raises:
            SliceError: otherwise (``what`` names the slice in the message).
        """
        if not isinstance(self.ref, PayloadRef):
            raise SliceError(f"{what}: ref is {type(self.ref).__name__}: expected a PayloadRef")
        if not isinstance(self.num_tokens, Integral) or isinstance(self.num_tokens, bool) \
                or not 1 <= self.num_tokens <= self.ref.num_tokens:
            raise SliceError(f"{what}: keeps {self.num_tokens!r} tokens of {self.ref.uri}: expected 1.."
                             f"{self.ref.num_tokens}")
        return self


def check_in_run(ref: PayloadRef, prefix: RunPrefix, what: str) -> None:
    """Refuse a ref kept in another run: the run id in its URI is not ``prefix``'s (the rest of the URI is the
    writer's view of the run and may differ). Its branch id may name a chunk of this run too, so nothing may
    act on it here.

    Raises:
        OutsideRunError: names ``what``, the ref and both runs.
    """
    kept_in = ref.uri.removesuffix("/" + ref.key).rpartition("/")[2]
    if kept_in != prefix.run_id:
        raise OutsideRunError(f"{what}: ref {ref.branch_id} was kept in run {kept_in!r} ({ref.uri}): "
                              f"expected run {prefix.run_id!r} (an env server of another run?)")
