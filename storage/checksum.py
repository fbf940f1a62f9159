"""CRC-32C (Castagnoli), refpipe's one checksum: the chunk format's (Zarr v3 ``crc32c`` codec, and each array's block
crcs), the step file's per-stream checksums and the ledger records'.

Computed by ``fastcrc`` (the Rust ``crc-fast`` crate: folding with VPCLMULQDQ on AVX-512 CPUs, PCLMULQDQ or the
ARMv8 CRC instructions elsewhere, detected at run time), which releases the GIL. Measured on this project's AMD EPYC
(one core, 256 KiB pieces in cache, CPU time): 46 GiB/s, against 23 GiB/s for the ``crc32c`` package (SSE4.2
``crc32`` instructions). The page-cache read it follows runs at ~12 GiB/s there, so a fetch that checks every byte
it reads takes ~1.25x the read alone (``bench/trainer_fetch.py``, ``read_crc32c_vs_limit`` ~0.8).
"""

from __future__ import annotations

import fastcrc

from refpipe.storage.store import Bytes


def crc32c(data: Bytes, value: int = 0) -> int:
    """CRC-32C of ``data`` (a C-contiguous buffer, read as bytes), continuing ``value``: the CRC-32C of the bytes
    before it (0: none), so ``crc32c(b, crc32c(a)) == crc32c(a + b)``.

    Raises:
        ValueError: ``data`` is not C-contiguous.
    """
    return fastcrc.crc32.iscsi(data, value)  # type: ignore[arg-type]  # numpy's stubs: ndarray is a Buffer only from 3.12
