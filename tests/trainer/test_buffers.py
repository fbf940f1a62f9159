"""``BufferPool``: a buffer is lent again only once nothing refers to it (views, tensors)."""

from __future__ import annotations

import numpy as np
import torch

from refpipe.trainer.buffers import BufferPool


def test_a_buffer_is_lent_again_once_nothing_refers_to_it_and_never_while_a_view_or_tensor_does():
    pool = BufferPool()
    a = pool.empty((4, 3), np.int32)
    assert a.shape == (4, 3) and a.dtype == np.int32 and a.flags.c_contiguous and a.flags.writeable
    first = a.ctypes.data
    view = a[1:]
    del a
    pool.reclaim()
    b = pool.empty((4, 3), np.int32)  # a's memory is still seen through `view`: a new buffer
    assert b.ctypes.data != first
    del view
    pool.reclaim()
    c = pool.empty((2, 5), np.float32)  # 40 bytes fit a's 48 (b is still held: not idle)
    assert c.ctypes.data == first
    c[:] = 1.5
    kept = torch.from_numpy(c)  # what a train callback could keep
    del c
    pool.reclaim()
    d = pool.empty((2, 5), np.float32)
    d[:] = -1
    assert d.ctypes.data not in (first, b.ctypes.data) and kept.tolist() == [[1.5] * 5] * 2
    del kept, d
    pool.reclaim()  # idle: a's buffer (48 bytes asked, 54 allocated) and d's (40, 45); b is still held
    assert pool.idle_nbytes == 54 + 45
    e = pool.empty((50,), np.uint8)  # fits a's buffer only
    assert e.ctypes.data == first and pool.idle_nbytes == 45
    f = pool.empty((60,), np.uint8)  # fits none: d's buffer, too small, is freed before a new one is made
    assert f.ctypes.data not in (first, b.ctypes.data) and pool.idle_nbytes == 0
    del e
    pool.reclaim()
    assert pool.idle_nbytes == 54
    pool.reclaim()  # an idle buffer nothing took until the next reclaim is freed: idle is what was found last
    assert pool.idle_nbytes == 0
