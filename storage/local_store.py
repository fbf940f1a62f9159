"""The store on a POSIX directory (local disk, NFS, Lustre): ``storage.store.Store`` with ``os`` calls.

Every key is reached through ``storage.local_confined.ConfinedPrefix``: below the run prefix no symlink is
ever followed (DESIGN.md, invariant 4), the directory fds reached are cached and reused, and the operation
acts on the last name relative to its directory fd. The bytes of one open file are read and written by
``storage.local_io``.

Every failed system call is classified by ``storage.local_errors.classify`` (the one place for a
directory) and retried through ``Store.retrying`` when transient (a Lustre or NFS client's
``EIO``/``ESTALE``/``ETIMEDOUT``/``EAGAIN``).
"""

from __future__ import annotations

import errno
import functools
import os
import re
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import numpy as np

from refpipe.storage.concurrency import bounded_map
from refpipe.storage.errors import KeyNotFoundError, OutsideRunError, RunPathNotADirectoryError, StorageError
from refpipe.storage.local_confined import ConfinedPrefix
from refpipe.storage.local_errors import classify
from refpipe.storage.local_io import pwrite_all, read_all, readv_all
from refpipe.storage.local_put import (
    HAVE_TMPFILE,
    WRITE_FLAGS,
    put_in_place,
    put_named,
    put_unnamed,
    token_of,
)
from refpipe.storage.store import Bytes, Store, byte_view

T = TypeVar("T")


class LocalStore(Store):
    """A run prefix on a POSIX directory (local disk, NFS, Lustre).

    ``put`` writes a temp file in the key's directory and renames it into place.
    ``exclusive`` puts write an unnamed ``O_TMPFILE`` file, set its write token as the extended
    attribute ``user.refpipe-write`` (``fsetxattr``; skipped where the filesystem has no user
    xattrs: then an applied put whose answer was lost stays ``KeyExistsError``) and ``linkat(2)``
    it to the key, which fails atomically with ``EEXIST`` when the key exists: one new
    directory entry per object and no temp name (where the filesystem lacks
    ``O_TMPFILE``: a named temp file, ``link(2)``, ``unlink(2)``). An ``in_place`` one (a branch's chunk)
    creates the file under its name (``O_CREAT | O_EXCL``), claims it by setting its token
    (``XATTR_CREATE``) and writes it there: one new entry, one metadata operation. A ``durable`` put ``fsync``s the file
    before it gets its name (the directory entry itself is not synced). ``get`` is
    ``open``, ``pread``, ``close`` (plus an ``fstat`` for whole reads); ``get_array`` is ``open``, ``fstat``,
    ``preadv`` into a fresh numpy array of the file's size, ``close``; ``get_into`` is ``open``,
    ``fstat``, ``preadv`` (one call per ``IOV_MAX`` buffers, repeated only after a short read), ``close``.
    ``delete_keys``
    unlinks in order per directory and removes branch directories it empties,
    directories in parallel; ``claim_by_unlink`` (``claims_by_unlink``) unlinks chunks' commit markers as their
    claims, one after another, each held by an ``O_PATH`` fd until ``delete_keys`` of its directory, so the unlink
    only removes a name (7-11 us here, where threads cost more to start than they save; on Lustre each is a
    metadata round trip).
    """

    claims_by_unlink = True

    def _attempt(self, what: str, key: str, op: Callable[[], T]) -> T:
        """Run ``op`` (system calls on ``key``); classify its ``OSError`` (``local_errors.classify``) and retry the
        transient ones (``Store.retrying``). ``what``: ``cannot read`` ..., for messages."""
        uri = self.uri(key)

        def once() -> T:
            try:
                return op()
            except OSError as e:
                raise classify(what, uri, e) from e

        return self.retrying(f"{what} {uri}", once)

    def get(self, key: str, start: int | None = None, end: int | None = None) -> bytes:
        return self._attempt("cannot read", key, lambda: self._read(key, start, end))

    def _read(self, key: str, start: int | None, end: int | None) -> bytes:
        fd = self._confined().open_read(key)
        try:
            start, object_nbytes = start or 0, os.fstat(fd).st_size
            size = (object_nbytes if end is None else min(end, object_nbytes)) - start  # never more than it holds
            return read_all(fd, max(size, 0), start)
        finally:
            os.close(fd)

    def get_array(self, key: str) -> np.ndarray:
        return self._attempt("cannot read", key, lambda: self._read_array(key))

    def _read_array(self, key: str) -> np.ndarray:
        fd = self._confined().open_read(key)
        try:
            data = np.empty(os.fstat(fd).st_size, np.uint8)  # numpy's allocator: huge pages for >= 4 MiB
            data = data[: readv_all(fd, [byte_view(data)], data.nbytes)]  # fewer only if the file shrank since fstat
        finally:
            os.close(fd)
        data.flags.writeable = False
        return data

    def get_into(self, key: str, buffers: Sequence[Bytes], offset: int = 0) -> int:
        return self._attempt("cannot read", key, lambda: self._read_into(key, buffers, offset))

    def _read_into(self, key: str, buffers: Sequence[Bytes], offset: int) -> int:
        fd = self._confined().open_read(key)
        try:
            size = max(os.fstat(fd).st_size - offset, 0)
            views = [byte_view(b) for b in buffers]
            wanted = min(size, sum(v.nbytes for v in views))
            got = readv_all(fd, [v for v in views if v], wanted, offset)
            return size if got == wanted else got  # a short read: the file shrank since fstat
        finally:
            os.close(fd)

    appends = True

    def write_at(self, key: str, buffers: Sequence[Bytes], offset: int) -> None:
        def write() -> None:
            def op(dir_fd: int, name: str) -> None:
                fd = os.open(name, WRITE_FLAGS | os.O_NONBLOCK, dir_fd=dir_fd)  # no create; a FIFO never blocks
                try:
                    pwrite_all(fd, buffers, offset)
                finally:
                    os.close(fd)

            self._confined().at(key, op)

        self._attempt("cannot write", key, write)

    def _confined(self) -> ConfinedPrefix:
        """This store's confined directory handles (made on first use in a process; not pickled)."""
        confined: ConfinedPrefix | None = self.__dict__.get("_confined_prefix")
        if confined is None:
            confined = self.__dict__.setdefault("_confined_prefix", ConfinedPrefix(self.prefix))
        return confined

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state.pop("_confined_prefix", None)
        return state

    def _put(self, key: str, buffers: list[Bytes] | tuple[Bytes, ...], token: str | None, durable: bool,
             in_place: bool) -> None:
        def op(dir_fd: int, name: str) -> None:
            if token is not None and in_place:
                if put_in_place(dir_fd, name, buffers, token, durable):
                    self.found_own_attempt()
            elif token is not None and HAVE_TMPFILE:
                put_unnamed(dir_fd, name, buffers, token, durable)
            else:
                put_named(dir_fd, name, buffers, token, durable)

        try:
            self._confined().at(key, op, create=True)
        except OSError as e:
            raise classify("cannot write", self.uri(key), e) from e

    def _token(self, key: str) -> str | None:
        def read() -> str | None:
            fd = self._confined().open_read(key)
            try:
                return token_of(fd)
            finally:
                os.close(fd)

        try:
            return self._attempt("cannot read the write token of", key, read)
        except KeyNotFoundError:
            return None

    def _delete_keys(self, keys: list[str]) -> dict[str, StorageError]:
        by_directory: dict[str, list[str]] = {}
        for key in keys:
            by_directory.setdefault(self.prefix.check_key(key).rpartition("/")[0], []).append(key)
        # rmdir(2) waits on the filesystem (~2-5 ms each on ext4 with discard, a metadata round trip on
        # Lustre) while costing little CPU: empty the branch directories in parallel
        parts = bounded_map(lambda item: self._delete_in(*item), list(by_directory.items()), _DELETE_THREADS)
        return {key: error for part in parts for key, error in part.items()}

    def claim_by_unlink(self, keys: Sequence[str]) -> list[StorageError | None]:
        checked = [self.prefix.check_key(key) for key in keys]
        return [self._claim_one(key) for key in checked]

    def _claim_one(self, key: str) -> StorageError | None:
        """``claim_by_unlink`` of one key: ``unlink(2)`` with its file held by an ``O_PATH`` fd, closed when its
        directory's other keys are deleted (``local_dirs.HeldInodes``); ``ENOENT`` after an attempt whose answer was
        lost is this call's removal."""
        attempts: list[str] = []

        def unlink_held(dir_fd: int, name: str) -> None:
            fd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
            try:
                os.unlink(name, dir_fd=dir_fd)
            except BaseException:
                os.close(fd)
                raise
            self._confined().held.hold(key.rpartition("/")[0], fd)

        def attempt() -> None:
            attempts.append(key)
            self._confined().at(key, unlink_held)

        try:
            self._attempt("cannot delete", key, attempt)
        except KeyNotFoundError as e:
            return e if len(attempts) == 1 else None
        except StorageError as e:
            return e
        return None

    def _delete_in(self, directory: str, keys: list[str]) -> dict[str, StorageError]:
        """Unlink ``keys`` (all in ``directory``) in order, then remove ``directory`` if this emptied a branch
        directory (``payloads/<shard>/<branch_id>``; shards stay).
        Names are unlinked relative to the directory's fd: a symlink is removed itself, never followed. Returns the
        keys not deleted."""
        for fd in self._confined().held.take(directory):  # a claimed marker's inode, freed here (off the claim's path)
            os.close(fd)
        failed, removed = dict[str, StorageError](), False
        for key in keys:
            attempts: list[str] = []
            try:
                self._attempt("cannot delete", key, functools.partial(self._unlink, key, attempts))
            except KeyNotFoundError:
                removed = removed or len(attempts) > 1  # absent, or removed by an attempt whose answer was lost
                continue
            except OutsideRunError:
                raise
            except StorageError as e:
                failed[key] = e
                continue
            removed = True
        if removed and directory.count("/") >= 2:
            try:
                self._remove_empty_dir(directory)
            except StorageError as e:  # this directory's trouble, not the batch's
                failed.update({key: e for key in keys if key not in failed})
        return failed

    def _unlink(self, key: str, attempts: list[str]) -> None:
        attempts.append(key)
        self._confined().at(key, lambda dir_fd, name: os.unlink(name, dir_fd=dir_fd))

    def _remove_empty_dir(self, directory: str) -> None:
        """``rmdir`` an emptied directory; one that holds entries again stays. A transient error is retried, and an
        attempt applied whose answer was lost (``ESTALE``) is done: the retry finds no directory."""
        def rmdir(dir_fd: int, name: str) -> None:
            try:
                os.rmdir(name, dir_fd=dir_fd)
            except OSError as e:
                if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                    raise

        try:
            self._attempt("cannot remove directory", directory, lambda: self._confined().at(directory, rmdir))
        except KeyNotFoundError:
            return
        finally:
            self._confined().handles.forget(directory)

    def remove_empty_directories(self) -> int:
        """Bottom-up ``os.fwalk`` of the run prefix (symlinks never followed: ``rmdir(2)`` of one is ``ENOTDIR``,
        and ``fwalk`` does not descend into them); ``rmdir`` relative to the parent's fd, a non-empty one stays."""
        try:
            top = os.open(self.prefix.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            return 0
        removed = 0
        try:
            for directory, dirs, _, dir_fd in os.fwalk(".", dir_fd=top, topdown=False, onerror=_raise_unless_gone):
                removed += sum(self._rmdir_if_empty(dir_fd, os.path.normpath(f"{directory}/{name}"), name)
                               for name in dirs)
        except StorageError:
            raise
        except OSError as e:
            raise StorageError(f"cannot list {self.prefix.uri} for empty directories: {e.strerror}") from e
        finally:
            os.close(top)
        return removed

    def _rmdir_if_empty(self, dir_fd: int, key: str, name: str) -> bool:
        try:
            os.rmdir(name, dir_fd=dir_fd)
            return True
        except OSError as e:
            if e.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOENT, errno.ENOTDIR):
                return False
            raise StorageError(f"cannot remove directory {self.uri(key)}: {e.strerror}") from e

    def exists(self, key: str) -> bool:
        def stat() -> None:
            self._confined().at(key, lambda dir_fd, name: os.stat(name, dir_fd=dir_fd, follow_symlinks=False))

        try:
            self._attempt("cannot stat", key, stat)
        except KeyNotFoundError:
            return False
        return True

    def list_prefix(self, key_prefix: str) -> list[str]:
        return sorted(key for key, _ in self._walk(key_prefix))

    def list_sizes(self, key_prefix: str) -> dict[str, int]:
        sizes = {}
        for key, path in self._walk(key_prefix, strict=True):
            try:
                sizes[key] = os.stat(path, follow_symlinks=False).st_size
            except FileNotFoundError:
                continue  # deleted while listing
        return dict(sorted(sizes.items()))

    def _walk(self, key_prefix: str, strict: bool = False) -> Iterator[tuple[str, str]]:
        """``(key, path)`` of every file under ``key_prefix/`` (``""``: the whole run), unordered; a symlinked
        directory below the prefix is not descended into (``os.fwalk``), a symlink to a file is listed
        (every access to it is refused); an NFS client's placeholder (``_NFS_PLACEHOLDER``) is not. ``strict``: a
        directory that cannot be read raises its ``OSError`` (a vanished one is skipped)."""
        base = f"{self.prefix.path}/{self.prefix.check_key(key_prefix)}" if key_prefix else self.prefix.path
        try:
            # refuses a symlink on the way to the listed directory
            self._confined().at(key_prefix or "x", lambda dir_fd, name: None, is_dir=bool(key_prefix))
            top = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (KeyNotFoundError, FileNotFoundError):
            return
        except RunPathNotADirectoryError:
            raise
        except OSError:
            if strict:
                raise
            return
        try:
            for directory, _, files, _ in os.fwalk(".", dir_fd=top, onerror=_raise_unless_gone if strict else None):
                rel = os.path.normpath(os.path.join(key_prefix, directory))
                for name in files:
                    if not _NFS_PLACEHOLDER.fullmatch(name):
                        yield (name if rel == "." else f"{rel}/{name}"), f"{base}/{directory}/{name}"
        finally:
            os.close(top)


def _raise_unless_gone(e: OSError) -> None:
    if not isinstance(e, FileNotFoundError):
        raise e


_NFS_PLACEHOLDER = re.compile(r"\.nfs[0-9A-Fa-f]+")
"""What an NFS client renames a file to when it is unlinked while a process holds it open (the "silly rename",
``.nfs<hex>`` in the same directory; unlinking it is ``EBUSY`` until the last close, when the client removes it
itself): no object of the run, never listed, so no audit counts it and no sweep unlinks it."""
_DELETE_THREADS = 8
