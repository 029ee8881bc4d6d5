"""The Triton grouped MoE MLP (kernels/triton/moe.py) against its plain-torch spec and the
CPU path's grouped experts, under the interpreter on the CPU (natively on CUDA)."""
from __future__ import annotations

import pytest
import torch

from aioengine.kernels.triton import fused_moe, fused_moe_ref, moe_align
from aioengine.model.moe import route

from tests.kernels.conftest import DTYPES, assert_close


def test_moe_align_groups_pairs_by_expert_in_blocks() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    pairs, block_expert = moe_align(ids, 5, block_m=4)
    pad = 6  # T * k: no pair
    # expert 0: pairs 1, 4; expert 1: pair 3; expert 3: pairs 0, 2, 5; 2 and 4 own no block.
    assert pairs.tolist()[:12] == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert all(p == pad for p in pairs.tolist()[12:])
    assert block_expert.tolist()[:3] == [0, 1, 3]
    assert all(e == 5 for e in block_expert.tolist()[3:])
    assert pairs.numel() == 4 * block_expert.numel()


CASES = [(1, 8, 2), (5, 8, 1), (33, 8, 2), (7, 4, 4), (19, 6, 3)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_experts,top_k", CASES)
def test_fused_moe_matches_reference(device: torch.device, dtype: torch.dtype, num_tokens: int,
                                     num_experts: int, top_k: int) -> None:
    """Hidden 48 and intermediate 40 (not multiples of the blocks); few tokens leave most
    experts empty; top-k = all experts too."""
    gen = torch.Generator().manual_seed(num_tokens * 10 + top_k)
    h, inter = 48, 40
    x = torch.randn(num_tokens, h, generator=gen)
    w13 = torch.randn(num_experts, 2 * inter, h, generator=gen) * 0.2
    w2 = torch.randn(num_experts, h, inter, generator=gen) * 0.2
    router = torch.randn(num_experts, h, generator=gen)
    weights, ids = route(x @ router.t(), top_k, renormalize=True)
    args = [t.to(device=device, dtype=dtype) for t in (x, w13, w2)]
    out = fused_moe(*args, weights.to(device), ids.to(device))
    assert_close(out, fused_moe_ref(*args, weights.to(device), ids.to(device)), dtype,
                 fp32_tol=1e-4, fp16_tol=1e-2)


def test_fused_moe_matches_the_cpu_blocks_grouped_experts(device: torch.device) -> None:
    """The model's SparseMoeBlock (float32, torch ops) and the kernel on its stacked
    weights give the same MLP output."""
    from aioengine.model.moe import SparseMoeBlock
    from aioengine.model.moe_config import MoeSpec
    from aioengine.model.ops import TorchOps

    spec = MoeSpec(6, 2, 40, renormalize=False)
    block = SparseMoeBlock(spec, 48, TorchOps(), torch.float32, torch.device("cpu"))
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    x = torch.randn(11, 48, generator=gen)
    w13 = torch.stack([e.gate_up_proj.weight for e in block.experts])
    w2 = torch.stack([e.down_proj.weight for e in block.experts])
    with torch.inference_mode():
        expected = block(x)
        weights, ids = route(block.gate(x), 2, renormalize=False)
        out = fused_moe(x.to(device), w13.to(device), w2.to(device), weights.to(device),
                        ids.to(device))
    assert_close(out, expected, torch.float32, fp32_tol=1e-4)


def _seeded_block(ops, device: torch.device, seed: int = 9):
    from aioengine.model.moe import SparseMoeBlock
    from aioengine.model.moe_config import MoeSpec

    spec = MoeSpec(6, 2, 40, renormalize=True, shared_intermediate_size=24)
    block = SparseMoeBlock(spec, 48, ops, torch.float32, device)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_((torch.randn(p.shape, generator=gen) * 0.3).to(device))
    return block


def test_the_block_runs_the_kernel_under_triton_ops(device: torch.device,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """With Triton's ops the model's block stacks its experts once (their Linears then
    hold views of the stacks: no second copy) and runs fused_moe: the same output as the
    block on torch ops with the same weights, the shared expert included."""
    from aioengine.model import ops as model_ops

    calls = []
    real = model_ops.TritonOps.fused_moe

    def spy(self, *args):
        calls.append(args[0].shape[0])
        return real(self, *args)

    monkeypatch.setattr(model_ops.TritonOps, "fused_moe", spy)
    fused = _seeded_block(model_ops.TritonOps(), device)
    reference = _seeded_block(model_ops.TorchOps(), device)
    x = torch.randn(13, 48, generator=torch.Generator().manual_seed(1)).to(device)
    with torch.inference_mode():
        expected = reference(x)
        out = fused(x)
        again = fused(x[:3])
    assert calls == [13, 3]
    assert_close(out, expected, torch.float32, fp32_tol=1e-4)
    assert_close(again, expected[:3], torch.float32, fp32_tol=1e-4)
    w13, w2 = fused._stacks
    assert w13.shape == (6, 80, 48) and w2.shape == (6, 48, 40)
    expert = fused.experts[4]
    assert expert.gate_up_proj.weight.data_ptr() == w13[4].data_ptr()
    assert expert.down_proj.weight.data_ptr() == w2[4].data_ptr()


def test_experts_the_kernel_cannot_read_keep_their_linears(device: torch.device) -> None:
    """int8 experts: no stacks, the grouped Linears, the torch block's output."""
    from aioengine.model.ops import TorchOps, TritonOps

    blocks = [_seeded_block(ops, device) for ops in (TritonOps(), TorchOps())]
    for block in blocks:
        for mlp in block.experts:
            for lin in (mlp.gate_up_proj, mlp.down_proj):
                lin.convert("int8")
    x = torch.randn(5, 48, generator=torch.Generator().manual_seed(2)).to(device)
    with torch.inference_mode():
        out, expected = blocks[0](x), blocks[1](x)
    assert blocks[0]._stacks == ()
    assert_close(out, expected, torch.float32)
