"""hugepages.empty: large CPU tensors start on a 2 MB boundary and ask for huge pages;
hugepages.zeros: their pages left for the kernel to zero on first touch, unless touched."""
from __future__ import annotations

import gc
import re
import sys

import pytest
import torch

from aioengine.model import hugepages

CPU = torch.device("cpu")


def _thp_mode() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return re.search(r"\[(\w+)\]", f.read()).group(1)
    except (OSError, AttributeError):
        return None


def _mapping_kb(address: int, field: str = "AnonHugePages") -> int:
    """`field` (kB) of the mapping that holds `address`, from /proc/self/smaps."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
            if m:
                inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
            elif inside and line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


@pytest.mark.parametrize("shape,dtype", [((3072, 576), torch.float32), ((576, 576), torch.float32),
                                         ((5, 300_001), torch.float16)])
def test_large_tensors_are_aligned_views_that_work_like_empty(shape, dtype) -> None:
    t = hugepages.empty(shape, dtype, CPU)
    assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    if sys.platform.startswith("linux"):
        assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t.fill_(3)  # every byte is ours to write
    assert bool((t == 3).all())


def test_small_tensors_are_plain_empty() -> None:
    t = hugepages.empty((100, 100), torch.float32, CPU)  # 40 KB
    assert t.shape == (100, 100) and t.untyped_storage().nbytes() == 40_000


def test_the_mapping_lives_as_long_as_a_view() -> None:
    t = hugepages.empty((1 << 19,), torch.float32, CPU)[100:200]
    gc.collect()
    t.fill_(2)
    assert bool((t == 2).all())


@pytest.mark.skipif(_thp_mode() not in ("always", "madvise"),
                    reason="transparent huge pages are off on this machine")
def test_large_tensors_get_huge_pages() -> None:
    # As in a process that has run a while: freeing large blocks raises glibc's mmap
    # threshold, and malloc then serves 16 MB from memory already touched (4 KB pages).
    for _ in range(3):
        torch.empty(30 << 18).fill_(0)
    t = hugepages.empty((4 << 20,), torch.float32, CPU)  # 16 MB
    t.fill_(1)
    assert _mapping_kb(t.data_ptr()) >= 8 * 1024


@pytest.mark.parametrize("shape", [(100, 100), (8 << 20,)])
def test_zeros_are_zero_touched_or_not(shape) -> None:
    for touch in (False, True):
        t = hugepages.zeros(shape, torch.float32, CPU, touch=touch)
        assert t.shape == shape and not bool(t.any())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_zeros_are_resident_only_when_touched() -> None:
    """A 32 MB KV-sized tensor costs no memory until used; touched, all of it at once
    (AIOENGINE_CPU_KV_PREFAULT)."""
    lazy = hugepages.zeros((8 << 20,), torch.float32, CPU)
    eager = hugepages.zeros((8 << 20,), torch.float32, CPU, touch=True)
    assert _mapping_kb(lazy.data_ptr(), "Rss") < 1024
    assert _mapping_kb(eager.data_ptr(), "Rss") >= 32 * 1024
