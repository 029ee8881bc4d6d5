"""Large CPU tensors backed by transparent huge pages (2 MB) where Linux offers them.

Decode on the CPU streams every weight once per token. With 4 KB pages that is ~130,000
pages per token for SmolLM2-135M, each a TLB miss and a point where the cores' stream
prefetchers stop; with 2 MB pages the same products read 34 GB/s instead of 29 on the
2-core VM this was measured on (a `sum()` of a 4 KB-paged buffer: 32). Most kernels only
give huge pages to memory that asks for them (`transparent_hugepage/enabled = madvise`), so
`empty` asks, with madvise(MADV_HUGEPAGE) on the tensor's memory before anything touches it.
Elsewhere (another OS, THP off, a tensor under 1 MB, a GPU) it is plain `torch.empty`.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import math
import sys

import torch
from torch import Tensor

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20
# From this size on a tensor gets huge pages: at most half of its last huge page is unused
# (SmolLM2's 1.3 MB o_proj: 0.7 MB of 2, 21 MB over 30 layers).
MIN_BYTES = 1 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


@functools.lru_cache(maxsize=1)
def _madvise():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised contiguous tensor, like torch.empty; on the CPU under Linux, and of
    at least MIN_BYTES, one that starts on a 2 MB boundary and whose memory asked for huge
    pages before first use: a view into an allocation 4 MB larger, for the boundary and for
    the last huge page (the slack is never touched, so it costs address space, not
    memory)."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    madvise = _madvise()
    if torch.device(device).type != "cpu" or numel * itemsize < MIN_BYTES or madvise is None:
        return torch.empty(shape, dtype=dtype, device=device)
    slack = 2 * HUGE_PAGE // itemsize
    buf = torch.empty(numel + slack, dtype=dtype, device=device)
    start = -buf.data_ptr() % HUGE_PAGE  # bytes to the first 2 MB boundary
    if start % itemsize:  # cannot happen for CPU allocations (64-byte aligned)
        return buf[:numel].view(shape)
    # The whole tensor rounded up to huge pages: inside the allocation, thanks to the slack.
    length = -(-numel * itemsize // HUGE_PAGE) * HUGE_PAGE
    if madvise(buf.data_ptr() + start, length, _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) failed: errno %d", ctypes.get_errno())
    offset = start // itemsize
    return buf[offset:offset + numel].view(shape)
