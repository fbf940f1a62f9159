"""A step file's container at the byte level: zip end records, stored members, their checksums, ``.npy`` headers.

A step file is a zip of stored (uncompressed) members (APPNOTE.TXT, PKWARE's zip specification)
holding ``.npy`` arrays (numpy's ``.npy`` format 1.0 or 2.0). ``pipeline.step_file`` reads its
header and streams through these helpers: one ranged read of its last bytes says whether it is
whole (``refpipe ls``), and every member is a view of the file's own bytes (no copy, nothing
allocated from a size the file declares).
"""

from __future__ import annotations

import functools
import io
import struct
import zipfile
from collections.abc import Mapping

import numpy as np

from refpipe.storage.checksum import crc32c

_END = struct.Struct("<4s4H2LH")
"""Zip's end of central directory record (APPNOTE 4.3.16): signature, disk numbers, entry counts, central
directory size and offset, comment length; ``encode_step_file`` writes it last, with no comment."""
_ZIP64_LOCATOR = struct.Struct("<4sLQL")
_ZIP64_END = struct.Struct("<4sQ2H2L4Q")
_LOCAL = struct.Struct("<4s5H3L2H")
"""Zip's local file header (APPNOTE 4.3.7): signature, version, flags, method, time, date, crc-32, sizes, name and
extra field lengths; the member's bytes follow its name and extra field."""
TAIL_NBYTES = _ZIP64_END.size + _ZIP64_LOCATOR.size + _END.size
"""Bytes at the end of a step file that ``damage_from_tail`` judges it by (98: the zip64 end records too)."""


def damage_from_tail(tail: bytes, nbytes: int) -> str | None:
    """Whether a step file is whole, judged by its last bytes only (``refpipe ls``: one ranged read per step).

    Args:
        tail: the file's last ``min(TAIL_NBYTES, nbytes)`` bytes.
        nbytes: the file's size in bytes (from the listing).

    Returns:
        None when its zip end record is the file's last bytes and says its central directory ends right before
        it (a zip64 end record and locator, written when the counts or offsets overflow, likewise); else what is
        wrong, e.g. ``no zip end record in its last 22 bytes (5136 bytes: truncated or foreign)``. A file cut
        anywhere loses that record; damage inside the members is found by reading it (``StepFile.read``).
    """
    record = tail[-_END.size:]
    if nbytes < _END.size or record[:4] != b"PK\x05\x06" or record[-2:] != b"\0\0":  # no comment after it
        return f"no zip end record in its last {_END.size} bytes ({nbytes} bytes: truncated or foreign)"
    *_, entries, cd_size, cd_offset, _ = _END.unpack(record)
    end = nbytes - _END.size
    if entries == 0xFFFF or 0xFFFFFFFF in (cd_size, cd_offset):
        end, cd_size, cd_offset = _zip64_directory(tail, end)
    if end < 0 or cd_offset + cd_size != end:
        return (f"its central directory (offset {cd_offset}, {cd_size} bytes) does not end where its end record "
                f"starts (byte {end} of {nbytes}): truncated or foreign")
    return None


def _zip64_directory(tail: bytes, end: int) -> tuple[int, int, int]:
    """``(start of the zip64 end record, central directory size, offset)`` from the records before the end record
    at ``end``; ``(-1, 0, 0)`` when they are not where zipfile writes them."""
    locator = tail[-_END.size - _ZIP64_LOCATOR.size:-_END.size]
    record = tail[-TAIL_NBYTES:-_END.size - _ZIP64_LOCATOR.size]
    if len(record) < _ZIP64_END.size or locator[:4] != b"PK\x06\x07" or record[:4] != b"PK\x06\x06":
        return -1, 0, 0
    start = end - _ZIP64_LOCATOR.size - _ZIP64_END.size
    if _ZIP64_LOCATOR.unpack(locator)[2] != start:
        return -1, 0, 0
    *_, cd_size, cd_offset = _ZIP64_END.unpack(record)
    return start, cd_size, cd_offset


def member_bytes(data: memoryview, info: zipfile.ZipInfo) -> memoryview:
    """The bytes of a stored member as a view of the file's ``data``, found as ``zipfile.ZipFile.open`` finds them:
    its local file header at ``info.header_offset`` must carry the central directory's name.

    Raises:
        ValueError: no local file header there, another name in it, or the member ends past the file.
    """
    start = info.header_offset
    if start + _LOCAL.size > len(data) or data[start : start + 4] != b"PK\x03\x04":
        raise ValueError(f"member {info.filename}: no local file header at byte {start}")
    *_, name_nbytes, extra_nbytes = _LOCAL.unpack_from(data, start)
    begin = start + _LOCAL.size + name_nbytes + extra_nbytes
    if data[start + _LOCAL.size : start + _LOCAL.size + name_nbytes] != info.filename.encode():
        raise ValueError(f"member {info.filename}: its local file header at byte {start} names another member")
    if begin + info.compress_size > len(data):
        raise ValueError(f"member {info.filename}: bytes [{begin}, {begin + info.compress_size}) end past the file "
                         f"({len(data)} bytes)")
    return data[begin : begin + info.compress_size]


def stream_member(data: memoryview, zf: zipfile.ZipFile, member: str, dtype: str, num_tokens: int,
            crcs: Mapping[str, int]) -> np.ndarray:
    """The read-only ``[num_tokens]`` array of one stream member, a view of the file's ``data``: checked once
    (its crc32c against the header's, then its ``.npy`` header, dtype, shape and byte count).

    Raises:
        ValueError: what is wrong, naming the member.
    """
    info = zf.NameToInfo.get(member)
    if info is None:
        raise ValueError(f"member {member} is missing")
    body = member_bytes(data, info)
    if member not in crcs:
        raise ValueError(f"member {member} has no crc32c in the header (stream_crc32c)")
    crc = crc32c(body)
    if crc != crcs[member]:
        raise ValueError(f"member {member}: crc32c {crc:#010x}, the header records {crcs[member]:#010x} "
                         f"(corrupted step file)")
    start = npy_data_offset(body, dtype, num_tokens)
    if start is None:
        got_dtype, shape = npy_header(io.BytesIO(body))
        raise ValueError(f"{member} is {got_dtype.str} {list(shape)}, expected {dtype} [{num_tokens}]")
    itemsize = np.dtype(dtype).itemsize
    if len(body) - start != num_tokens * itemsize:
        raise ValueError(f"member {member} holds {len(body) - start} bytes of data, expected "
                         f"{num_tokens * itemsize} ({dtype} [{num_tokens}])")
    return np.frombuffer(body, dtype, num_tokens, start)


def npy_data_offset(data: memoryview, dtype: str, num_tokens: int) -> int | None:
    """Where the array of a ``.npy`` member starts if its header declares ``dtype [num_tokens]`` (C order),
    else None. The header ``encode_step_file`` writes is compared byte for byte (parsing it costs ~20 us a
    stream, per micro batch on the trainer's fetch path); any other header is parsed (``npy_header``).

    Raises:
        ValueError: not a ``.npy`` header.
    """
    expected = npy_header_bytes(dtype, num_tokens)
    if data[: len(expected)] == expected:
        return len(expected)
    f = io.BytesIO(data)
    got_dtype, shape = npy_header(f)
    return f.tell() if (got_dtype.str, shape) == (dtype, (num_tokens,)) else None


@functools.lru_cache(maxsize=256)
def npy_header_bytes(dtype: str, num_tokens: int) -> bytes:
    """The ``.npy`` 1.0 header ``np.lib.format.write_array`` writes for a C-order ``dtype [num_tokens]``."""
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {"descr": dtype, "fortran_order": False, "shape": (num_tokens,)})
    return f.getvalue()


def npy_header(f: io.BytesIO) -> tuple[np.dtype, tuple[int, ...]]:
    """dtype and shape a ``.npy`` member declares (format 1.0 or 2.0, C order), read before any allocation.

    Raises:
        ValueError: not such a header.
    """
    version = np.lib.format.read_magic(f)
    if version not in ((1, 0), (2, 0)):
        raise ValueError(f".npy format {version}: expected (1, 0) or (2, 0)")
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, fortran_order, dtype = read(f)
    if fortran_order and len(shape) > 1:
        raise ValueError("Fortran order: expected C order")
    return dtype, shape
