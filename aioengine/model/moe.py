"""The sparse MLP of a mixture-of-experts layer (Mixtral, Qwen3-MoE, Qwen2-MoE).

    router      gate Linear [E, H], kept in the activations' dtype (`RouterLinear`: routing
                decisions are not quantized), packed like the rest; softmax over all E logits in float32, top-k, renormalised
                when the family says so (`route`)
    experts     E SwiGLU MLPs, each a pair of `layers.Linear`s (gate_up [2I, H], down
                [H, I]) in the model's storage format: float32, bf16 or int8 weight-only
                per-row, and on the CPU panel-packed for the any-M GEMM exactly like a dense
                projection (`LlamaForCausalLM.linears` lists them)
    shared      Qwen2-MoE: one more SwiGLU MLP on every token, scaled by
                sigmoid(shared_expert_gate(x))

`grouped_experts` runs the experts grouped: the (token, expert) pairs are sorted by expert,
each expert with tokens runs ONE gate_up and ONE down product over all of its tokens (its
weights read once per step, whatever the batch), experts without tokens are skipped, and
each result row, times its routing weight, is added back into its token's row. A token's
k contributions are summed in expert order whatever else shares the step, so its output
does not depend on the batch.

Where the device ops have a fused MoE kernel (Triton on CUDA: `ops.fused_moe`), the block
stacks its experts' weights once, on its first forward, into [E, 2I, H] and [E, H, I]
tensors (each expert's Linear then holds a view of its slice: no second copy) and runs the
kernel instead; experts in any other storage than plain dense weights in the activations'
dtype (int8, packed) keep the grouped Linears.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

from aioengine.model.layers import Linear
from aioengine.model.moe_config import MoeSpec
from aioengine.model.ops import TorchOps


def route(logits: Tensor, top_k: int, renormalize: bool) -> tuple[Tensor, Tensor]:
    """Router logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64):
    softmax over all experts in float32, the k largest, divided by their sum when
    `renormalize` (Mixtral's softmax over the top-k logits is the same distribution)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class RouterLinear(Linear):
    """A Linear that keeps its loaded dtype whatever the model's storage (the router and
    the shared expert's gate: a few rows, whose rounding would move routing decisions)."""

    @torch.no_grad()
    def convert(self, storage: str) -> None:
        return None

    def use_float_storage(self, dtype: torch.dtype) -> None:
        """Keeps the activations' dtype: the loader allocates every other weight in the
        model's storage before loading, this one is loaded as it was built."""
        return None


class ExpertMLP(nn.Module):
    """One SwiGLU MLP: down(silu(gate(x)) * up(x)), gate and up fused in one Linear."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.intermediate_size = intermediate_size
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, False, **kw)
        self.down_proj = Linear(intermediate_size, hidden_size, False, **kw)

    def forward(self, x: Tensor, ops: TorchOps) -> Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


def expert_counts(ids: Tensor, num_experts: int) -> tuple[Tensor, list[int]]:
    """Flattened (token, slot) pairs sorted by expert: (order [T*k] into ids.view(-1),
    tokens per expert [E]). The sort is stable, so each expert's tokens stay in order."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def grouped_experts(x: Tensor, weights: Tensor, ids: Tensor, experts: nn.ModuleList,
                    ops: TorchOps) -> Tensor:
    """sum_j weights[t, j] * experts[ids[t, j]](x[t]) for every token t of x [T, H]: one
    product per routed expert over all of its tokens; experts with no token skipped."""
    top_k = ids.shape[1]
    order, counts = expert_counts(ids, len(experts))
    tokens = order // top_k
    pair_weights = weights.reshape(-1).index_select(0, order).to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for expert, n in zip(experts, counts):
        if n == 0:
            continue
        rows = tokens[start:start + n]
        y = expert(x.index_select(0, rows), ops)
        out.index_add_(0, rows, y.mul_(pair_weights[start:start + n, None]))
        start += n
    return out


@torch.no_grad()
def stack_experts(experts: nn.ModuleList, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """(w13 [E, 2I, H], w2 [E, H, I]) with each expert's Linears re-pointed at views of
    their slices; () when some expert's weights are not plain dense `dtype` matrices
    without bias (int8, packed: those keep their own Linears)."""
    lins = [(e.gate_up_proj, e.down_proj) for e in experts]
    if any(lin.is_packed or lin.scales is not None or lin.bias is not None
           or lin.weight.dtype != dtype for pair in lins for lin in pair):
        return ()
    w13 = torch.stack([gate_up.weight for gate_up, _ in lins])
    w2 = torch.stack([down.weight for _, down in lins])
    for i, (gate_up, down) in enumerate(lins):
        gate_up.weight = nn.Parameter(w13[i], requires_grad=False)
        down.weight = nn.Parameter(w2[i], requires_grad=False)
    return w13, w2


class SparseMoeBlock(nn.Module):
    """The MoE MLP of one layer: router, experts, optional shared expert (see module doc)."""

    def __init__(self, spec: MoeSpec, hidden_size: int, ops: TorchOps, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        kw = {"dtype": dtype, "device": device}
        self.spec, self.ops = spec, ops
        self.gate = RouterLinear(hidden_size, spec.num_experts, False, **kw)
        self.experts = nn.ModuleList(ExpertMLP(hidden_size, spec.intermediate_size, **kw)
                                     for _ in range(spec.num_experts))
        self.shared_expert: ExpertMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if spec.shared_intermediate_size:
            self.shared_expert = ExpertMLP(hidden_size, spec.shared_intermediate_size, **kw)
            self.shared_expert_gate = RouterLinear(hidden_size, 1, False, **kw)
        # The fused kernel's stacked weights (w13, w2); () once declined; None: not tried.
        self._stacks: tuple[Tensor, ...] | None = None

    def forward(self, x: Tensor) -> Tensor:
        """x [T, H] (the post-attention norm's output) -> the MLP output [T, H]."""
        weights, ids = route(self.gate(x), self.spec.top_k, self.spec.renormalize)
        out = self._fused_experts(x, weights, ids)
        if out is None:
            out = grouped_experts(x, weights, ids, self.experts, self.ops)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x, self.ops)
            out.add_(shared.mul_(torch.sigmoid(self.shared_expert_gate(x))))
        return out

    def _fused_experts(self, x: Tensor, weights: Tensor, ids: Tensor) -> Tensor | None:
        """The experts through the ops' fused kernel, or None (no kernel, or experts it
        cannot read)."""
        if not self.ops.has_fused_moe:
            return None
        if self._stacks is None:
            self._stacks = stack_experts(self.experts, x.dtype)
        if not self._stacks:
            return None
        w13, w2 = self._stacks
        return self.ops.fused_moe(x, w13, w2, weights, ids)

    def stored_linears(self) -> list[Linear]:
        """Every Linear of the block, for conversion to the model's storage and packing:
        the experts' (and the shared expert's) projections convert, the router and the
        shared expert's gate (`RouterLinear`) keep their dtype and are only packed."""
        mlps = [*self.experts] + ([self.shared_expert] if self.shared_expert else [])
        gates = [self.gate] + ([self.shared_expert_gate] if self.shared_expert_gate else [])
        return gates + [lin for mlp in mlps for lin in (mlp.gate_up_proj, mlp.down_proj)]


def moe_weight_table(spec: MoeSpec | None) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """HF name inside a layer -> (our parameter, row range) for the sparse MLP's weights,
    under both families' names (Mixtral's block_sparse_moe.experts.N.w1/w3/w2, Qwen's
    mlp.experts.N.gate_proj/up_proj/down_proj); empty for a dense model."""
    if spec is None:
        return {}
    inter = spec.intermediate_size
    gate, up = (0, inter), (inter, 2 * inter)
    table: dict[str, tuple[str, tuple[int, int] | None]] = {
        "block_sparse_moe.gate.weight": ("mlp.gate.weight", None),
        "mlp.gate.weight": ("mlp.gate.weight", None),
    }
    for e in range(spec.num_experts):
        ours = f"mlp.experts.{e}"
        for prefix, names in ((f"block_sparse_moe.experts.{e}", ("w1", "w3", "w2")),
                              (f"mlp.experts.{e}", ("gate_proj", "up_proj", "down_proj"))):
            table[f"{prefix}.{names[0]}.weight"] = (f"{ours}.gate_up_proj.weight", gate)
            table[f"{prefix}.{names[1]}.weight"] = (f"{ours}.gate_up_proj.weight", up)
            table[f"{prefix}.{names[2]}.weight"] = (f"{ours}.down_proj.weight", None)
    if spec.shared_intermediate_size:
        s = spec.shared_intermediate_size
        table.update({
            "mlp.shared_expert.gate_proj.weight": ("mlp.shared_expert.gate_up_proj.weight",
                                                   (0, s)),
            "mlp.shared_expert.up_proj.weight": ("mlp.shared_expert.gate_up_proj.weight",
                                                 (s, 2 * s)),
            "mlp.shared_expert.down_proj.weight": ("mlp.shared_expert.down_proj.weight", None),
            "mlp.shared_expert_gate.weight": ("mlp.shared_expert_gate.weight", None),
        })
    return table
