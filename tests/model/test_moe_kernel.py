"""Routing and the grouped expert MLP (aioengine/model/moe.py) against a per-token reference:
a loop over tokens and their top-k experts, each expert's weights as plain float32."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from aioengine.kernels import cpu_gemm
from aioengine.model.moe import SparseMoeBlock, expert_counts, route
from aioengine.model.moe_config import MoeSpec
from aioengine.model.ops import CpuOps, TorchOps

CPU = torch.device("cpu")
H = 64


def _block(spec: MoeSpec, storage: str, pack: bool, seed: int = 0) -> SparseMoeBlock:
    """A block with seeded random weights, converted to `storage`, packed if asked."""
    block = SparseMoeBlock(spec, H, CpuOps(), torch.float32, CPU)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        for lin in block.stored_linears():
            lin.convert(storage)
            if pack:
                lin.pack()
    return block


def _dense(lin) -> torch.Tensor:
    """The float32 weight a Linear multiplies by (int8: q * scale)."""
    w = lin.dense_weight().float()
    return w if lin.scales is None else w * lin.scales[:, None]


def _reference(block: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    """Token by token, expert by expert: sum_j w_j * down(silu(gate x) * up x)."""
    spec = block.spec
    logits = x @ block.gate.dense_weight().t()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(logits[t].double(), -1)
        top = torch.topk(probs, spec.top_k).indices
        weights = probs[top] / (probs[top].sum() if spec.renormalize else 1.0)
        for e, w in zip(top.tolist(), weights.tolist()):
            expert = block.experts[e]
            gate, up = (x[t] @ _dense(expert.gate_up_proj).t()).chunk(2)
            out[t] += w * (F.silu(gate) * up) @ _dense(expert.down_proj).t()
        if block.shared_expert is not None:
            s = block.shared_expert
            gate, up = (x[t] @ _dense(s.gate_up_proj).t()).chunk(2)
            y = (F.silu(gate) * up) @ _dense(s.down_proj).t()
            out[t] += torch.sigmoid(x[t] @ block.shared_expert_gate.dense_weight().t()) * y
    return out


def test_route_families() -> None:
    """Mixtral's softmax over the top-k logits equals softmax-all, top-k, renormalised;
    without renormalising the weights are the full softmax's probabilities."""
    logits = torch.randn(7, 8, generator=torch.Generator().manual_seed(1))
    weights, ids = route(logits, 2, renormalize=True)
    top = logits.topk(2, dim=-1)
    torch.testing.assert_close(ids, top.indices)
    torch.testing.assert_close(weights, torch.softmax(top.values, -1))
    weights, ids = route(logits, 3, renormalize=False)
    torch.testing.assert_close(weights, torch.softmax(logits, -1).gather(1, ids))
    assert torch.all(weights.sum(-1) < 1)


def test_expert_counts_sort_pairs_by_expert() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3]])
    order, counts = expert_counts(ids, 5)
    assert counts == [2, 1, 0, 3, 0]
    assert ids.reshape(-1)[order].tolist() == [0, 0, 1, 3, 3, 3]
    assert (order // 2).tolist() == [0, 2, 1, 0, 1, 2]  # each expert's tokens in order


CASES = {
    "top2_of_8": MoeSpec(8, 2, 48, renormalize=True),
    "top1": MoeSpec(8, 1, 48, renormalize=True),
    "top_all": MoeSpec(4, 4, 32, renormalize=False),
    "top3_shared": MoeSpec(6, 3, 40, renormalize=True, shared_intermediate_size=56),
}
@pytest.mark.parametrize("storage", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 3, 17])
def test_grouped_experts_match_per_token_reference(case: str, storage: str, pack: bool,
                                                   num_tokens: int) -> None:
    """Every storage, packed for the any-M GEMM or not, 1 / 3 / 17 tokens (with 1 and 3
    tokens most of 8 experts get none)."""
    if pack and not cpu_gemm.can_pack(torch.empty(16, 16)):
        pytest.skip("CPU kernels not built")
    spec = CASES[case]
    block = _block(spec, storage, pack)
    x = torch.randn(num_tokens, H, generator=torch.Generator().manual_seed(num_tokens))
    with torch.inference_mode():
        out = block(x)
        if storage != "bfloat16":  # exact products (int8: q * s), float32 sums
            torch.testing.assert_close(out, _reference(block, x), atol=1e-4, rtol=1e-4)
            return
        # bf16: x (and, unpacked, each product's result) rounded to bf16 as oneDNN does,
        # except the packed GEMM of a build without vdpbf16ps: compare with that tolerance.
        ref = _reference(block, x)
        torch.testing.assert_close(out, ref, atol=0.02 * ref.abs().max().item(), rtol=0.02)


def test_each_routed_expert_runs_once_and_empty_experts_never(monkeypatch) -> None:
    """Grouped: one gate_up product per expert that has tokens, over all of them at once."""
    spec = MoeSpec(8, 2, 48, renormalize=True)
    block = _block(spec, "bfloat16", pack=False)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(3))
    calls: dict[int, list[int]] = {}
    for e, expert in enumerate(block.experts):
        real = expert.gate_up_proj.forward

        def spy(inp, e=e, real=real):
            calls.setdefault(e, []).append(inp.shape[0])
            return real(inp)

        monkeypatch.setattr(expert.gate_up_proj, "forward", spy)
    with torch.inference_mode():
        _, ids = route(block.gate(x), 2, True)
        block(x)
    _, counts = expert_counts(ids, 8)
    assert calls == {e: [n] for e, n in enumerate(counts) if n}
    assert 0 in counts  # 10 pairs over 8 experts: some expert has none here


def test_a_tokens_output_does_not_depend_on_its_batch() -> None:
    """Packed weights: each row's bits are the same alone and among 16 others."""
    if not cpu_gemm.can_pack(torch.empty(16, 16)):
        pytest.skip("CPU kernels not built")
    block = _block(CASES["top3_shared"], "bfloat16", pack=True)
    x = torch.randn(17, H, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        together = block(x)
        alone = torch.cat([block(x[i:i + 1]) for i in range(17)])
    assert torch.equal(together, alone)


def test_torch_ops_and_cpu_ops_agree() -> None:
    block = _block(CASES["top2_of_8"], "float32", pack=False)
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        a = block(x)
        block.ops = TorchOps()
        torch.testing.assert_close(block(x), a, atol=1e-5, rtol=1e-5)


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError, match="top_k"):
        MoeSpec(4, 5, 32, renormalize=True)
    with pytest.raises(ValueError, match="top_k"):
        MoeSpec(4, 0, 32, renormalize=True)
