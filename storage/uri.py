"""Run URIs and confinement.

A run root is a local path, a ``file://`` URI or ``s3://bucket/prefix``; the run
prefix is ``<root>/<run_id>``. Everything refpipe stores lives under the run
prefix and is addressed by a *key* relative to it (``payloads/3f/b91``). Every
URI that comes from outside (a reference, a step file, the CLI) is turned into
a key by :meth:`RunPrefix.key_of`, which refuses anything outside the prefix
before any I/O (DESIGN.md, invariant 4).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from refpipe.storage.errors import ConfigError, OutsideRunError
from refpipe.storage.layout import is_id

SCHEMES = ("file", "s3")


_NOT_IN_URIS = re.compile(r"[#?%\x00-\x1f\x7f]")
"""Characters a root may not hold: ``#`` and ``?`` start a URI's fragment and query, ``%`` an escape that
other readers (zarr, fsspec) may decode, and URI parsers strip or refuse control characters, so a URI
built from such a root would not parse back to it (DESIGN.md, invariant 4)."""


def _refuse_uri_characters(root: str, path: str) -> None:
    """Raise ``ConfigError`` when ``path`` (``root`` itself, or the absolute path it resolves to) holds a character
    of ``_NOT_IN_URIS``."""
    bad = _NOT_IN_URIS.search(path)
    if bad:
        where = "" if path == root else f" (resolved to {path!r})"
        raise ConfigError(f"run root {root!r}{where}: character {bad[0]!r} at position {bad.start()} cannot be part of "
                          "a run URI (# and ? start a URI fragment or query, % an escape, control characters are "
                          "stripped): expected a root without it" + (" (give an absolute root, or start from another "
                                                                     "working directory)" if where else ""))


def _split_root(root: str) -> tuple[str, str]:
    """Return ``(scheme, path)`` of a run root; local paths become absolute ``file`` paths.

    Raises:
        ConfigError: a character that does not round-trip through a URI (``_NOT_IN_URIS``) in the root or in the
            absolute path a relative root resolves to (the working directory), an unknown scheme or a malformed root.
    """
    _refuse_uri_characters(root, root)
    parts = urlsplit(root)
    if parts.scheme in ("", "file"):
        if parts.scheme == "file" and parts.netloc not in ("", "localhost"):
            raise ConfigError(f"run root {root!r}: file:// URIs take no host, got {parts.netloc!r}")
        path = os.path.abspath(os.path.expanduser(parts.path if parts.scheme == "file" else root))
        _refuse_uri_characters(root, path)  # a relative root takes on the working directory's characters
        return "file", path
    if parts.scheme == "s3":
        if not parts.netloc:
            raise ConfigError(f"run root {root!r}: expected s3://bucket[/prefix]")
        return "s3", (parts.netloc + "/" + parts.path.strip("/")).rstrip("/")
    raise ConfigError(f"run root {root!r}: scheme {parts.scheme!r} is not one of {SCHEMES}")


def _check_segments(path: str, what: str) -> None:
    for segment in path.split("/"):
        if segment in (".", ".."):
            raise OutsideRunError(f"{what}: path segment {segment!r} is not allowed")


@dataclass(frozen=True)
class RunPrefix:
    """Where one run's data lives.

    Attributes:
        scheme: ``"file"`` or ``"s3"``.
        path: the run prefix without scheme: an absolute local path, or ``bucket/prefix/run_id``.
        run_id: the run's id (letters, digits, ``._-``; at most 128 characters).
    """

    scheme: str
    path: str
    run_id: str

    @classmethod
    def from_root(cls, root: str, run_id: str) -> "RunPrefix":
        """Build the run prefix ``<root>/<run_id>``.

        Raises:
            ConfigError: unknown scheme, malformed root, or an invalid ``run_id``.
        """
        if not is_id(run_id) or ".." in run_id:
            raise ConfigError(f"run_id {run_id!r}: expected 1-128 of [A-Za-z0-9._-], not starting with a dot")
        scheme, root_path = _split_root(root)
        _check_segments(root_path, f"run root {root!r}")
        return cls(scheme, f"{root_path.rstrip('/')}/{run_id}", run_id)

    @classmethod
    def from_uri(cls, run_uri: str) -> "RunPrefix":
        """Parse a full run URI (``/runs/run_7``, ``s3://b/p/run_7``): the last segment is the run id."""
        head, _, run_id = run_uri.rstrip("/").rpartition("/")
        if not head or head in ("s3:/", "s3:", "file:/", "file:"):
            raise ConfigError(f"run URI {run_uri!r}: expected <root>/<run_id>")
        return cls.from_root(head or "/", run_id)

    @property
    def uri(self) -> str:
        """The run prefix as a URI: ``file:///abs/run`` or ``s3://bucket/prefix/run``."""
        return f"{self.scheme}://{self.path}"

    def uri_of(self, key: str) -> str:
        """URI of a key under the run prefix (checks the key first)."""
        return f"{self.uri}/{self.check_key(key)}"

    def check_key(self, key: str) -> str:
        """Return ``key`` if it is a clean relative key, else raise ``OutsideRunError``."""
        if not key or key.startswith("/") or "\\" in key or "//" in key or "\x00" in key:
            raise OutsideRunError(f"key {key!r} under run {self.uri}: expected a relative key like 'payloads/ab/x'")
        _check_segments(key, f"key {key!r} under run {self.uri}")
        return key

    def key_of(self, uri: str) -> str:
        """The key of ``uri`` relative to this run prefix.

        Raises:
            OutsideRunError: ``uri`` has another scheme, bucket or run (``run_1`` vs ``run_10``),
                contains ``.``/``..`` segments, or is the prefix itself.
        """
        parts = urlsplit(uri)
        scheme = parts.scheme or "file"
        if scheme != self.scheme:
            raise OutsideRunError(f"URI {uri!r} is outside run {self.uri}: scheme {scheme!r}, expected {self.scheme!r}")
        if scheme == "file" and parts.netloc not in ("", "localhost"):
            raise OutsideRunError(f"URI {uri!r} is outside run {self.uri}: file URI names host {parts.netloc!r}")
        path = parts.netloc + parts.path if scheme == "s3" else parts.path
        _check_segments(path, f"URI {uri!r} is outside run {self.uri}")
        prefix = self.path + "/"
        if not path.startswith(prefix):
            raise OutsideRunError(f"URI {uri!r} is outside run {self.uri}: expected a URI under {self.uri}/")
        try:
            return self.check_key(path[len(prefix):])
        except OutsideRunError as e:
            raise OutsideRunError(f"URI {uri!r} is outside run {self.uri}: {e}") from None
