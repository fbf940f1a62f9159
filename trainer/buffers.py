"""Reuse of a trainer rank's micro batch arrays across steps, so a fetch reads into memory already mapped.

A fresh ``np.empty`` of a step's arrays (~10 MiB per micro batch) gets pages the kernel must fault
in and zero while ``preadv`` fills them; once a step's arrays are freed, malloc hands the memory back
to the kernel, so every step paid that again (measured: 0.25 s of ``preadv`` per step of 76 MiB
into fresh arrays, 0.04 s into reused ones, one thread). ``BufferPool`` keeps the byte buffers of
the arrays it lent and lends them again once nothing refers to them any more.

Whether anything still refers to a buffer is its reference count: every array carved from it
(views, and tensors made with ``torch.from_numpy``, which keep their array) holds a reference, so
a buffer the train callback kept a tensor of is never lent again: it leaves the pool and is freed
when its last holder lets go.
"""

from __future__ import annotations

import bisect
import math
import sys
import threading

import numpy as np

_SLACK = 1.125
"""A new buffer is this much larger than asked, so the slightly larger arrays of later steps fit it."""


class BufferPool:
    """Byte buffers of one trainer rank's micro batch arrays, lent by ``empty`` and taken back by ``reclaim``.

    Called by the thread that fetches a step (the rank's main thread, or its prefetch thread):
    ``reclaim`` before the fetch, ``empty`` while it plans the micro batches; thread-safe.

    Memory bound: the idle buffers are those ``reclaim`` found unreferenced last (earlier steps' arrays
    that nothing uses any more: a rank's arrays in use are at most two steps', as
    ``trainer.background.Prefetch`` says), each at most ``_SLACK`` times the array it held; ``empty``
    lends them for this step's arrays, and frees an idle buffer too small for what it is asked before
    it allocates a new one. Buffers the caller's code still refers to stay lent (held by the pool too)
    until the next ``reclaim`` after it lets go.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lent: list[np.ndarray] = []
        self._idle: list[np.ndarray] = []
        """Idle buffers, smallest first."""
        self._sizes: list[int] = []
        """``nbytes`` of each idle buffer, in the same order."""

    def empty(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A writable C-contiguous array like ``np.empty(shape, dtype)`` (uninitialised), in a lent buffer: the
        smallest idle buffer that fits it, else a new one."""
        dtype = np.dtype(dtype)
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            fits = bisect.bisect_left(self._sizes, nbytes)
            if fits < len(self._idle):
                buffer = self._idle.pop(fits)
                del self._sizes[fits]
            else:
                if self._idle:  # too small for this; a later array of this size would not fit it either
                    del self._idle[-1], self._sizes[-1]
                buffer = np.empty(max(1, int(nbytes * _SLACK)), np.uint8)
            array = buffer[:nbytes].view(dtype).reshape(shape)
            self._lent.append(buffer)
        return array

    def reclaim(self) -> None:
        """Take back the lent buffers nothing refers to any more: they become the idle ones (the previous idle
        buffers are freed); the others stay lent."""
        with self._lock:
            probe = np.empty(0, np.uint8)  # referenced like an unreferenced lent buffer: by the list and the loop
            lent, self._lent, self._idle = [probe, *self._lent], [], []
            del probe
            unreferenced = None
            for buffer in lent:
                count = sys.getrefcount(buffer)
                if unreferenced is None:
                    unreferenced = count
                elif count <= unreferenced:
                    self._idle.append(buffer)
                else:
                    self._lent.append(buffer)
            self._idle.sort(key=lambda b: b.nbytes)
            self._sizes = [b.nbytes for b in self._idle]

    @property
    def idle_nbytes(self) -> int:
        """Bytes of the idle buffers."""
        with self._lock:
            return sum(b.nbytes for b in self._idle)
