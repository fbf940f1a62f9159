"""The compiled distinct-id check of rows of eight one-byte ids (router replay's usual top-8 of at most 256
experts): ``first_repeated_octet``. Imported only by ``pipeline.field_checks.repeated_rows`` when it meets such rows,
so only the processes that keep them pay numba's import; compiled once, then loaded from numba's on-disk cache
(``cache=True``: next to this module) by every later process.

Per row ``v`` (a uint64 of eight ids), for each rotation ``r`` of 8, 16, 24 and 32 bits, ``v ^ rotate(v, r)`` has a
zero byte exactly where byte ``i`` equals byte ``i + r/8 (mod 8)``; the four rotations cover all 28 slot pairs. A
zero byte is found with the exact any-zero-byte test ``(y - 0x01..01) & ~y & 0x80..80`` (Hacker's Delight, 6-1).
Rows are scanned in blocks of 512 with no branch per row (the loop vectorizes); a block with a hit is scanned again
for its first row. The kernels are module-level functions over module constants: numba caches a closure per
process (a miss, a new compile and a new cache file each time).
"""

from __future__ import annotations

import numba
import numpy as np

_ONES = np.uint64(0x0101010101010101)
_HIGHS = np.uint64(0x8080808080808080)
_BLOCK = 512


@numba.njit(cache=True, nogil=True)
def _has_repeat(v: np.uint64) -> np.uint64:
    hit = np.uint64(0)
    for r in (8, 16, 24, 32):
        y = v ^ ((v << np.uint64(r)) | (v >> np.uint64(64 - r)))
        hit |= (y - _ONES) & ~y & _HIGHS
    return hit


@numba.njit(cache=True, nogil=True)
def first_repeated_octet(rows: np.ndarray) -> int:
    """Index of the first uint64 of ``rows`` ([n] uint64, aligned; eight one-byte ids each) holding a byte twice, or
    -1."""
    n = rows.shape[0]
    for start in range(0, n, _BLOCK):
        end, hit = min(n, start + _BLOCK), np.uint64(0)
        for i in range(start, end):
            hit |= _has_repeat(rows[i])
        if hit:
            for i in range(start, end):
                if _has_repeat(rows[i]):
                    return i
    return -1


__all__ = ["first_repeated_octet"]
