"""``storage.checksum.crc32c`` against the published CRC-32C check value and two independent implementations."""

import crc32c as crc32c_package
import google_crc32c
import numpy as np
import pytest

from refpipe.storage.checksum import crc32c


def test_check_value_and_chaining_match_other_implementations():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720, B.4; the CRC catalogue)
    assert crc32c(b"") == 0 and crc32c(b"", 0x1234) == 0x1234
    data = np.random.default_rng(3).integers(0, 256, (1 << 20) + 13, dtype=np.uint8)
    whole = crc32c(data)
    assert whole == crc32c_package.crc32c(data) == int(google_crc32c.value(data.tobytes()))
    # continued piece by piece, at cuts that split words, as a fetch computes it while it reads
    crc = 0
    for start in range(0, data.nbytes, 100_003):
        crc = crc32c(memoryview(data)[start : start + 100_003], crc)
    assert crc == whole
    assert crc32c(np.arange(6, dtype="<i4").reshape(2, 3)) == crc32c(np.arange(6, dtype="<i4").tobytes())


def test_a_strided_array_is_refused():
    with pytest.raises(ValueError, match="not C-contiguous"):
        crc32c(np.arange(10, dtype=np.int32)[::2])
