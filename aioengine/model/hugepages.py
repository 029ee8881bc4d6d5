"""Large CPU tensors backed by transparent huge pages (2 MB) where Linux offers them.

Decode on the CPU streams every weight once per token. With 4 KB pages that is ~130,000
pages per token for SmolLM2-135M, each a TLB miss and a point where the cores' stream
prefetchers stop; with 2 MB pages the same products read 34 GB/s instead of 29 on the
2-core VM this was measured on (a `sum()` of a 4 KB-paged buffer: 32). Most kernels only
give huge pages to memory that asks for them (`transparent_hugepage/enabled = madvise`), so
`empty` maps fresh anonymous memory and asks, with madvise(MADV_HUGEPAGE), before anything
touches it. Not through torch's allocator: malloc serves blocks of up to 32 MB from memory
it has used before once a process has freed a few large ones (glibc's moving mmap
threshold), and pages already touched stay 4 KB. Elsewhere (another OS, a tensor under
1 MB, a GPU) it is plain `torch.empty`.
"""
from __future__ import annotations

import math
import mmap

import torch
from torch import Tensor

HUGE_PAGE = 2 << 20
# From this size on a tensor gets huge pages: at most half of its last huge page is unused
# (SmolLM2's 1.3 MB o_proj: 0.7 MB of 2, 21 MB over 30 layers).
MIN_BYTES = 1 << 20
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def maps_fresh(nbytes: int, device: torch.device) -> bool:
    """Whether `empty` gives `nbytes` on `device` a fresh anonymous mapping of its own,
    whose pages the kernel hands out zero-filled on first touch."""
    return (torch.device(device).type == "cpu" and nbytes >= MIN_BYTES
            and _MADV_HUGEPAGE is not None)


def empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Tensor:
    """An uninitialised contiguous tensor, like torch.empty; on the CPU under Linux, and of
    at least MIN_BYTES, one that starts on a 2 MB boundary of its own anonymous mapping,
    which asked for huge pages before first use. The mapping is 2 MB larger than the
    rounded-up tensor, for the alignment (the slack is never touched: address space, not
    memory), and lives as long as the tensor or any view of it."""
    numel = math.prod(shape)
    itemsize = dtype.itemsize
    nbytes = numel * itemsize
    if not maps_fresh(nbytes, device):
        return torch.empty(shape, dtype=dtype, device=device)
    length = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
    mapping = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mapping, dtype=torch.uint8)  # holds a reference to the mapping
    start = -raw.data_ptr() % HUGE_PAGE  # a multiple of the 4 KB page: mmap is page-aligned
    try:
        mapping.madvise(_MADV_HUGEPAGE, start, length)
    except OSError:  # THP not compiled in: ordinary pages, still a valid tensor
        pass
    return raw[start:start + nbytes].view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
          touch: bool = False) -> Tensor:
    """A zero tensor from `empty`: a fresh mapping's pages are left to the kernel, which
    zero-fills each on first touch (nothing written now, nothing resident until used),
    unless `touch`, which writes them all now; anything else is zeroed here."""
    tensor = empty(shape, dtype, device)
    if touch or not maps_fresh(math.prod(shape) * dtype.itemsize, device):
        tensor.zero_()
    return tensor
