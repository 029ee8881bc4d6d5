"""lora_shrink / lora_expand against their torch references, in the slot layout of
aioengine.lora.layers (and the references against LinearWithLoRA's torch path)."""
from __future__ import annotations

import pytest
import torch

from aioengine.kernels.triton import (lora_expand, lora_expand_ref, lora_shrink,
                                      lora_shrink_ref, lora_token_groups)
from aioengine.lora.kernels import (CpuLoRAKernel, TorchLoRAKernel, TritonLoRAKernel,
                                    select_lora_kernel)
from aioengine.lora.layers import LinearWithLoRA, LoRAStep
from aioengine.model.layers import Linear

from tests.kernels.conftest import DTYPES, assert_close

# qkv of 4 heads over 2 KV heads, head_dim 16: three slices of different widths.
QKV = (64, 32, 32)
GATE_UP = (96, 96)


def lora_slots(slice_sizes: tuple[int, ...], k_dim: int, ranks: list[list[int]],
               max_rank: int, dtype: torch.dtype, seed: int = 0):
    """lora_a [L, S, R, K], lora_b [L, R, N], ranks [L, S]; the rows past each rank hold
    NaN (the engine zeroes them; the kernels must not read them at all)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots, num_slices = len(ranks), len(slice_sizes)
    lora_a = 0.3 * torch.randn(num_slots, num_slices, max_rank, k_dim, generator=gen)
    lora_b = 0.3 * torch.randn(num_slots, max_rank, sum(slice_sizes), generator=gen)
    for slot, slot_ranks in enumerate(ranks):
        off = 0
        for s, (r, n) in enumerate(zip(slot_ranks, slice_sizes)):
            lora_a[slot, s, r:] = float("nan")
            lora_b[slot, r:, off:off + n] = float("nan")
            off += n
    return lora_a.to(dtype), lora_b.to(dtype), torch.tensor(ranks, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slices,ranks", [(QKV, [[8, 8, 8], [4, 0, 2], [0, 0, 0]]),
                                          (GATE_UP, [[3, 16], [16, 16], [1, 0]])],
                         ids=["qkv", "gate_up"])
def test_shrink_and_expand(slices, ranks, dtype, device) -> None:
    k_dim, max_rank = 80, 16
    lora_a, lora_b, ranks_t = lora_slots(slices, k_dim, ranks, max_rank, dtype)
    gen = torch.Generator().manual_seed(1)
    # 19 tokens (more than one row block), slots interleaved, some on the base model.
    slots = torch.tensor([1, -1, 0, 0, 2, 1, -1, 0, 1, 1, 0, 2, -1, 0, 0, 1, 0, 0, 1],
                         dtype=torch.int32)
    x = torch.randn(len(slots), k_dim, generator=gen).to(dtype)
    y = torch.randn(len(slots), sum(slices), generator=gen).to(dtype)
    u_ref = lora_shrink_ref(x, lora_a, ranks_t, slots)
    y_ref = lora_expand_ref(y.clone(), u_ref, lora_b, ranks_t, slots, slices)

    to = dict(device=device)
    x, y, slots_d = x.to(**to), y.to(**to), slots.to(**to)
    lora_a, lora_b = lora_a.to(**to), lora_b.to(**to)
    groups = lora_token_groups(slots_d, len(ranks))
    u = lora_shrink(x, lora_a, ranks_t, slots_d, groups)
    assert_close(u, u_ref, torch.float32, fp32_tol=1e-5 if dtype == torch.float32 else 5e-3)
    lora_expand(y, u_ref.to(device), lora_b, ranks_t, slots_d, slices, groups)
    assert_close(y, y_ref, dtype, fp16_tol=2e-2)
    assert torch.equal(y[slots_d < 0].cpu(), y_ref[slots < 0])  # base-model rows untouched


def test_token_groups() -> None:
    slots = torch.tensor([2, -1, 0, 2, -1, 0, 0], dtype=torch.int32)
    order, counts, starts = lora_token_groups(slots, num_slots=4)
    assert counts.tolist() == [3, 0, 2, 0]
    assert starts.tolist() == [2, 5, 5, 7]
    assert order[2:5].tolist() == [2, 5, 6] and order[5:7].tolist() == [0, 3]


def test_references_match_the_lora_layer() -> None:
    """The references in the engine's own shapes give LinearWithLoRA's torch path."""
    k_dim, max_rank, ranks = 48, 8, [[8, 3, 0], [2, 2, 2]]
    torch.manual_seed(0)
    base = Linear(k_dim, sum(QKV), False, torch.float32, torch.device("cpu"))
    base.weight.data.normal_()
    step = LoRAStep()
    layer = LinearWithLoRA(base, QKV, max_loras=2, max_rank=max_rank, step=step)
    assert isinstance(layer.kernel, TorchLoRAKernel)  # the torch form, not the C kernel
    for slot, slot_ranks in enumerate(ranks):
        layer.set_slot(slot, [None if r == 0 else
                              (torch.randn(r, k_dim), torch.randn(n, r))
                              for r, n in zip(slot_ranks, QKV)])
    token_slots = [1, -1, 0, 1, 0]
    step.set(token_slots, torch.device("cpu"))
    x = torch.randn(len(token_slots), k_dim)
    expected = layer(x)
    slots = torch.tensor(token_slots, dtype=torch.int32)
    u = lora_shrink_ref(x, layer.lora_a, layer.ranks, slots)
    got = lora_expand_ref(base(x), u, layer.lora_b, layer.ranks, slots, QKV)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_the_device_chooses_the_lora_kernel() -> None:
    assert isinstance(select_lora_kernel(torch.device("cuda")), TritonLoRAKernel)
    assert isinstance(select_lora_kernel(torch.device("cpu")), CpuLoRAKernel)


@pytest.mark.parametrize("token_slots", [[1, -1, 0, 1, 0], [0] * 20 + [1] * 3],
                         ids=["mixed", "grouped"])
def test_the_triton_kernel_runs_the_lora_layer(device, token_slots) -> None:
    """LinearWithLoRA with the Triton kernel (as LoRAManager builds it on CUDA) gives its
    torch form, the step's groups built once for every projection."""
    k_dim, max_rank, ranks = 48, 8, [[8, 3, 0], [2, 2, 2]]
    torch.manual_seed(0)
    base = Linear(k_dim, sum(QKV), False, torch.float32, device)
    base.weight.data.normal_()
    step = LoRAStep()
    layers = [LinearWithLoRA(base, QKV, max_loras=2, max_rank=max_rank, step=step,
                             kernel=kernel) for kernel in (TorchLoRAKernel(), TritonLoRAKernel())]
    for slot, slot_ranks in enumerate(ranks):
        pairs = [None if r == 0 else (torch.randn(r, k_dim), torch.randn(n, r))
                 for r, n in zip(slot_ranks, QKV)]
        for layer in layers:
            layer.set_slot(slot, pairs)
    step.set(token_slots, device)
    x = torch.randn(len(token_slots), k_dim, device=device)
    expected, got = (layer(x) for layer in layers)
    assert step._device_groups is not None  # the Triton kernel ran (it built the groups)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
