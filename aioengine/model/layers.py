"""Projections: `Linear`, which owns its weight in a storage format, and `linear`, the
matmul it runs (vLLM's names and semantics); the embedding lookup and the LM head.

A `Linear` whose weight is packed at load (`Linear.pack`, wherever the CPU kernels are
built) runs the any-M GEMM of `aioengine.kernels.cpu_gemm` for every row count; `linear`
is the path of a weight left unpacked (no kernels, CUDA, fp16): a chunked `bmm` for few
float32 rows on the CPU, oneDNN for many, and the plain torch op otherwise, the reference
the kernels are tested against. The norms and activations between projections are the
device ops' (`aioengine.model.ops`).

A model builds every projection through a `LinearFactory` (`ProjectionSpec` says which
one): a feature that needs to wrap projections (LoRA) supplies the factory when the model is
built, instead of patching a built model.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aioengine.kernels import cpu_blocks, cpu_gemm, cpu_gemm_w8a8
from aioengine.kernels.int8_rows import quantize_dequantize_blocks, quantize_int8_rows
from aioengine.model import hugepages


# Up to this many rows a CPU float32 matmul is a gemv over chunks of weight rows (`linear`);
# with a oneDNN-packed weight at hand, up to PACKED_GEMV_MAX_ROWS.
GEMV_MAX_ROWS = 4
PACKED_GEMV_MAX_ROWS = 2
_ROWS_PER_CHUNK = 3072


@functools.lru_cache(maxsize=None)
def _num_chunks(n: int) -> int:
    """At least 4 chunks (2 threads, some balance), about 3,072 weight rows each for wide
    outputs (the LM head: 16), and a divisor of n; 1 means do not split."""
    c = min(16, max(4, n // _ROWS_PER_CHUNK))
    while n % c:
        c -= 1
    return c


def _onednn_linear() -> Callable[..., Tensor] | None:
    """oneDNN's fp32 matmul (the op inductor emits for CPU linears), when this torch has it."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_ONEDNN_LINEAR = _onednn_linear()


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           packed: Tensor | None = None, scales: Tensor | None = None,
           act_quant: bool = False) -> Tensor:
    """x [M, K] @ weight [N, K]^T (* scales [N]) (+ bias) -> [M, N] in x's dtype.

    `weight` is float32, bf16 or fp16, or int8 with per-row `scales`: weight-only, or with
    `act_quant` W8A8 (x quantized per row: `_w8a8_linear` at any row count, the packed
    GEMM's bits; a W8A8 weight the kernels read is packed, `Linear.pack`), or a GGUF's Q4_1
    blocks (`_q4_1_linear`, likewise). `F.linear` on the CPU goes to MKL, which on these
    AMD cores runs fp32 at ~140 GFLOP/s and threads few-row products badly (a 1-row product
    streams the weight at a third of the memory bandwidth). This is the path of a weight
    left unpacked (no CPU kernels, CUDA, fp16; a weight the kernels read is packed at load,
    `Linear.pack`, and takes the any-M GEMM instead: there is no row-major C kernel). So
    with float32 x on the CPU:
    - a float32 weight, up to GEMV_MAX_ROWS rows (PACKED_GEMV_MAX_ROWS with `packed`;
      decode of a few requests): one `bmm` over chunks of the weight's rows (a view, no
      copy), so every thread streams whole chunks;
    - otherwise oneDNN's matmul: float32 on `packed` (the weight reordered once into
      oneDNN's blocked layout, `pack_linear_weight`) when the model has it; bf16 weights
      take x rounded to bf16 and give a bf16 result (oneDNN accumulates in fp32); int8
      weights are widened for the call (weight-only, `_int8_linear`).
    Measured over SmolLM2-135M's 30 layers of weights, 2 cores: 1 row 40 -> 17 ms
    (F.linear -> chunked gemv); 32 rows 87 (F.linear) -> 62 (oneDNN) -> 52 ms (packed); 512
    rows 725 -> 541 -> 526 ms; the LM head at 32 rows 33 -> 13 -> 10 ms.
    """
    if act_quant:
        return _w8a8_linear(x, weight, bias, scales)
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return _torch_linear(x, weight, bias, scales)
    m, (n, k) = x.shape[0], weight.shape
    # Packed oneDNN already beats the chunked gemv from 3-4 rows on (4 rows: 19.5 vs 25.5 ms).
    gemv_max_rows = GEMV_MAX_ROWS if packed is None else PACKED_GEMV_MAX_ROWS
    if weight.dtype != torch.float32:
        return _torch_linear(x, weight, bias, scales)
    if m <= gemv_max_rows and (c := _num_chunks(n)) > 1:
        # [c, N/c, K] @ [c, K, M] -> [c, N/c, M] = out^T. One row is already in order; the
        # view keeps the usual strides (a transposed [1, N] would pass as contiguous with
        # strides (1, 1), and MKL's bmm then takes a slow path on it: 4x per layer).
        out = torch.bmm(weight.view(c, n // c, k), x.t().expand(c, k, m))
        out = out.view(1, n) if m == 1 else out.view(n, m).t().contiguous()
        return out if bias is None else out.add_(bias)
    if _ONEDNN_LINEAR is not None:
        return _ONEDNN_LINEAR(x, weight if packed is None else packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _torch_linear(x: Tensor, weight: Tensor, bias: Tensor | None,
                  scales: Tensor | None) -> Tensor:
    """In the weight's float dtype (x and the result rounded to it, fp32 sums: oneDNN's
    bf16 matmul), the result in x's dtype; int8 weights as `_int8_linear`, Q4_1 blocks as
    `_q4_1_linear`."""
    if weight.dtype == torch.int8:
        return _int8_linear(x, weight, bias, scales)
    if weight.dtype == torch.uint8:
        return _q4_1_linear(x.float(), weight, bias).to(x.dtype)
    b = None if bias is None else bias.to(weight.dtype)
    return F.linear(x.to(weight.dtype), weight, b).to(x.dtype)


def dequantize_q4_1(blocks: Tensor) -> Tensor:
    """GGUF Q4_1 rows [N, K / 32 * 20] (per block: fp16 d, fp16 m, 16 bytes of nibbles,
    byte j = weight j low, weight j + 16 high) -> float32 [N, K], w = d q + m."""
    n = blocks.shape[0]
    b = blocks.view(n, -1, 20)
    d = b[..., 0:2].contiguous().view(torch.float16).float()  # [N, nb, 1]
    m = b[..., 2:4].contiguous().view(torch.float16).float()
    qs = b[..., 4:]
    q = torch.cat((qs & 0x0F, qs >> 4), dim=-1).float()  # [N, nb, 32]
    return (q * d + m).view(n, -1)


def _q4_1_linear(x: Tensor, blocks: Tensor, bias: Tensor | None) -> Tensor:
    """The GGUF's Q4_1 weights where no kernel takes them (no CPU kernels, blocks not
    packed): dequantized for this call (transient), x quantized per 32-block and back: the
    GEMM's arithmetic up to float rounding."""
    out = F.linear(quantize_dequantize_blocks(x), dequantize_q4_1(blocks))
    return out if bias is None else out.add_(bias)


def _int8_linear(x: Tensor, weight: Tensor, bias: Tensor | None,
                 scales: Tensor | None) -> Tensor:
    """Weight-only int8: q widened to x's dtype (exact: |q| <= 127), then one matmul and a
    per-row scale: the packed GEMM's arithmetic (x unrounded, float32 sums), so a request's
    tokens do not depend on how many others share its step. The widened copy lives for this
    call only: resident memory stays the int8 bytes."""
    assert scales is not None, "an int8 weight needs its scales"
    out = F.linear(x, weight.to(x.dtype)).mul_(scales.to(x.dtype))
    return out if bias is None else out.add_(bias)


def _w8a8_linear(x: Tensor, weight: Tensor, bias: Tensor | None,
                 scales: Tensor | None) -> Tensor:
    """W8A8: x quantized per row (`quantize_int8_rows`), int8 x int8 -> int32 products
    summed exactly (`torch._int_mm`, ~0.7-0.8 TOPS here against ~0.3-0.4 TFLOP/s for
    oneDNN's bf16 matmul), then (acc * s_x) * s_w (+ bias). Integer sums are exact, so the
    packed GEMM (`cpu_gemm`, GEMM_W8A8P) gives the same bits for any row: a request's
    tokens do not depend on how many others share its step."""
    assert scales is not None, "an int8 weight needs its scales"
    xq, x_scales = quantize_int8_rows(x)
    out = torch._int_mm(xq, weight.t()).float().mul_(x_scales[:, None]).mul_(scales)
    if bias is not None:
        out.add_(bias)
    return out.to(x.dtype)


# The row count oneDNN tunes a packed weight's layout for (any count works): decode batches.
_PACK_FOR_ROWS = 32


def pack_linear_weight(weight: Tensor) -> Tensor | None:
    """`weight` [N, K] reordered for oneDNN's matmul (a copy in its own layout), or None
    where `linear` would not use it (not float32 on the CPU, or no oneDNN)."""
    if _ONEDNN_LINEAR is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACK_FOR_ROWS)


# Storage formats a Linear's weight can take: int8 is weight-only, w8a8 the same int8
# weights with activations quantized per row for every product.
WEIGHT_STORAGES = ("float32", "bfloat16", "float16", "int8", "w8a8")
_FLOAT_STORAGE = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                  "float16": torch.float16}


@dataclass(frozen=True)
class ProjectionSpec:
    """Which projection a LinearFactory is asked for."""

    layer_idx: int
    name: str  # "qkv_proj" | "o_proj" | "gate_up_proj" | "down_proj"
    slices: tuple[int, ...]  # output sizes of the fused slices: (q, k, v), (gate, up), (out,)


# Takes the freshly built base Linear and returns the module the layer holds (the base
# itself, or a wrapper whose forward adds to the base's output).
LinearFactory = Callable[[ProjectionSpec, "Linear"], nn.Module]


def _param(*shape: int, dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    # Uninitialised: every parameter is overwritten by load_weights (which checks that). In
    # huge pages on the CPU: decode streams every weight once per token (hugepages.py).
    return nn.Parameter(hugepages.empty(shape, dtype, device), requires_grad=False)


class Linear(nn.Module):
    """y = x W^T (+ b): one projection (q/k/v fused, gate/up fused, o, down, the LM head),
    owning its weight in a storage format: float32 (with an optional oneDNN-packed copy),
    bf16, fp16, int8 with per-output-row scales (weight-only, or w8a8 with `act_quant`), or
    a GGUF's own blocks (`blocks`: cpu_blocks' packed panels, one part per run of rows of
    one block type). Callers never branch on the format: `forward` and the fused decode's
    pointer table (FusedCpuDecodeExecutor, `kernel_format`) read it from here.

    Built in the activations' dtype; `use_float_storage` / `use_block_storage` first
    replace the (untouched) weight by one in its storage format, which the loader fills
    tensor by tensor (`load_weights`: float rows copied in, converting; blocks packed into
    their place, `load_block_rows`); `convert` moves a loaded weight to another format."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param(out_features, in_features, dtype=dtype, device=device)
        self.bias = _param(out_features, dtype=dtype, device=device) if bias else None
        self.scales: Tensor | None = None  # int8: [out_features] float32
        self.act_quant = False  # w8a8: x quantized per row for every product
        self.packed: Tensor | None = None  # float32: oneDNN's blocked copy
        # A GGUF's blocks: `weight` is then uint8 [layout.nbytes], the parts' panels.
        self.blocks: cpu_blocks.BlockLayout | None = None

    def forward(self, x: Tensor) -> Tensor:
        if self.blocks is not None:
            return self._block_forward(x)
        if self.is_packed:
            return self._packed_forward(x)
        return linear(x, self.weight, self.bias, self.packed, self.scales, self.act_quant)

    @property
    def is_packed(self) -> bool:
        """Whether the weight is held panel-packed ([N / 16, ..., ...], cpu_gemm)."""
        return self.weight.dim() == 3

    def _packed_forward(self, x: Tensor) -> Tensor:
        """The any-M GEMM on the packed weight (every row count, one arithmetic per
        output element); anything it does not take (another dtype, no kernels since) runs
        the torch path on the weight unpacked for the call."""
        rows = x.reshape(-1, self.in_features)
        if rows.dtype == torch.float32 and rows.device.type == "cpu":
            out = cpu_gemm.gemm(rows.contiguous(), self.weight, self.out_features, self.bias,
                                self.scales)
            if out is not None:
                return out.view(*x.shape[:-1], self.out_features)
        dense = self.dense_weight()
        if dense.dtype == torch.bfloat16:  # the GEMM's arithmetic: x not rounded to bf16
            dense = dense.to(x.dtype)
        return linear(x, dense, self.bias, None, self.scales, self.act_quant)

    def _block_forward(self, x: Tensor) -> Tensor:
        """cpu_blocks' GEMM on the packed blocks (x quantized per 32-block), else its torch
        reference (the weight dequantized for the call)."""
        assert self.blocks is not None
        rows = x.reshape(-1, self.in_features).float().contiguous()
        out = cpu_blocks.gemm(rows, self.weight, self.blocks, self.bias)
        if out is None:
            out = cpu_blocks.reference_linear(rows, self.weight, self.blocks, self.bias)
        return out.view(*x.shape[:-1], self.out_features).to(x.dtype)

    def dense_weight(self) -> Tensor:
        """The weight as [out_features, in_features] in its storage dtype (a copy when
        packed; blocks dequantized to float32, a transient copy)."""
        if self.blocks is not None:
            return cpu_blocks.dequantize_weight(self.weight, self.blocks)
        if self.is_packed:
            return cpu_gemm.unpack_weight(self.weight, self.out_features, self.in_features)
        return self.weight

    @property
    def storage(self) -> str:
        """One of WEIGHT_STORAGES, or a GGUF block type ("q4_k"; "mixed:q4_k+q6_k" for a
        weight of parts of several types: BlockLayout.storage)."""
        if self.blocks is not None:
            return self.blocks.storage
        return "w8a8" if self.act_quant else str(self.weight.dtype).removeprefix("torch.")

    def use_float_storage(self, dtype: torch.dtype) -> None:
        """Replaces the (not yet loaded) weight by an uninitialised one in `dtype`, which the
        loader fills row range by row range, converting as it copies: the weights are never
        held in another dtype first. The bias keeps the activations' dtype."""
        self.packed, self.scales, self.act_quant, self.blocks = None, None, False, None
        if self.weight.dtype != dtype or self.weight.dim() != 2:
            self.weight = _param(self.out_features, self.in_features, dtype=dtype,
                                 device=self.weight.device)

    def use_block_storage(self, layout: cpu_blocks.BlockLayout) -> None:
        """Replaces the weight by room for a GGUF's blocks in `layout` (uninitialised, in huge
        pages: `load_block_rows` packs the file's blocks into it)."""
        if (layout.n, layout.k) != (self.out_features, self.in_features):
            raise ValueError(f"block layout [{layout.n}, {layout.k}] for a Linear "
                             f"[{self.out_features}, {self.in_features}]")
        self.packed, self.scales, self.act_quant, self.blocks = None, None, False, layout
        self.weight = _param(layout.nbytes, dtype=torch.uint8, device=self.weight.device)

    @torch.no_grad()
    def load_block_rows(self, first_row: int, blocks: Tensor, block_type: str) -> None:
        """Packs a file's blocks uint8 [rows, row_bytes] (rows in HF order) as this weight's
        rows first_row .. first_row + rows, in place. ValueError where they are not one
        part's rows of that type, starting on a panel (a multiple of 16 into the part)."""
        assert self.blocks is not None, "use_block_storage first"
        rows, start = blocks.shape[0], 0
        for part in self.blocks.parts:
            if start <= first_row < start + part.rows:
                break
            start += part.rows
        else:
            raise ValueError(f"row {first_row} is outside the weight's {self.blocks.n} rows")
        k = self.in_features
        if (part.block_type != block_type or (first_row - start) % cpu_blocks.PANEL
                or first_row + rows > start + part.rows
                or blocks.shape[1] != cpu_blocks.row_bytes(k, block_type)):
            raise ValueError(f"{block_type} blocks {tuple(blocks.shape)} at row {first_row} do "
                             f"not fit the weight's {part.block_type} part of rows "
                             f"[{start}, {start + part.rows})")
        panel_bytes = cpu_blocks.packed_nbytes(cpu_blocks.PANEL, k, block_type)
        offset = part.offset + (first_row - start) // cpu_blocks.PANEL * panel_bytes
        nbytes = cpu_blocks.packed_nbytes(rows, k, block_type)
        cpu_blocks.pack_blocks(blocks, block_type, out=self.weight.data[offset:offset + nbytes])

    @property
    def kernel_format(self) -> int | None:
        """The C kernels' code for this weight (cpu_gemm.packed_format; a one-part block
        weight's BlockFormat.code); None where no single C format reads it (a weight left
        unpacked: no row-major kernel; blocks of several types): the fused decode then
        declines."""
        if self.blocks is not None:
            parts = self.blocks.parts
            return cpu_blocks.BLOCK_TYPES[parts[0].block_type].code if len(parts) == 1 else None
        return cpu_gemm.packed_format(self.weight) if self.is_packed else None

    @torch.no_grad()
    def convert(self, storage: str) -> None:
        """The weight into `storage` (WEIGHT_STORAGES), computed from the loaded weight;
        the loaded copy is freed. The bias stays in the activations' dtype."""
        if storage not in WEIGHT_STORAGES:
            raise ValueError(f"unknown weight storage {storage!r}; known: {WEIGHT_STORAGES}")
        self.packed = None
        w = self.dense_weight()
        self.blocks = None
        self.act_quant = storage == "w8a8"
        if storage in ("int8", "w8a8"):
            q, self.scales = quantize_int8_rows(w)
            new = hugepages.empty(tuple(q.shape), torch.int8, w.device).copy_(q)
        else:
            dtype = _FLOAT_STORAGE[storage]
            if self.bias is not None and dtype != self.bias.dtype:
                # The bias as the low-precision matmul adds it (in its dtype), so the GEMM
                # and oneDNN add the same value (idempotent: a weight loaded in `dtype`
                # passes here once for this).
                self.bias.copy_(self.bias.to(dtype))
            if w.dtype == dtype:
                if w is not self.weight:  # unpacked, or dequantized blocks
                    self.weight = nn.Parameter(w, requires_grad=False)
                return
            new = hugepages.empty(tuple(w.shape), dtype, w.device).copy_(w)
        self.weight = nn.Parameter(new, requires_grad=False)

    def pack(self) -> int:
        """Repacks the weight in place into the any-M GEMM's panels where the CPU kernels
        read its storage (float32, bf16, int8 weight-only, W8A8, Q4_1 blocks: cpu_gemm), so every
        row count takes one kernel and one arithmetic; else, for float32 on the CPU, adds the
        oneDNN-packed copy `linear` uses for many-row products. Returns the bytes added
        (the panels' padding, or the copy)."""
        if self.is_packed or self.blocks is not None:
            return 0
        w = self.weight
        if self.act_quant and cpu_gemm.can_pack(w):  # W8A8 panels (cpu_gemm_w8a8)
            shape = cpu_gemm_w8a8.packed_shape(*w.shape)
            packed = cpu_gemm_w8a8.pack_w8a8(w, hugepages.empty(shape, torch.int8, w.device))
            self.weight, self.packed = nn.Parameter(packed, requires_grad=False), None
            return packed.numel() - w.numel()
        if not self.act_quant and cpu_gemm.can_pack(w):
            before = w.numel() * w.element_size()
            packed = cpu_gemm.pack_weight(
                w, hugepages.empty(cpu_gemm.packed_shape(w), w.dtype, w.device))
            self.weight, self.packed = nn.Parameter(packed, requires_grad=False), None
            return packed.numel() * packed.element_size() - before
        packed = pack_linear_weight(w)
        self.packed = packed
        return 0 if packed is None else packed.numel() * packed.element_size()

    def nbytes(self) -> int:
        """Resident bytes: the weight, its scales, bias and packed copy."""
        return sum(t.numel() * t.element_size()
                   for t in (self.weight, self.scales, self.bias, self.packed) if t is not None)


# After a bf16 LM head, each row's top candidates are recomputed in float32.
LOGITS_REFINE_TOP = 16


def lm_head_logits(x: Tensor, head: Linear) -> Tensor:
    """Logits [N, V] in float32 from the final hidden states x [N, H].

    A bf16 matmul's result is bf16: logits of 10-20 come in steps of 1/16, so near-ties
    become exact ties, broken by token id (SmolLM2 then answers "What is the capital of
    France?" with "L'Étoile..." instead of "The capital of France is Paris."). So with bf16
    weights each row's LOGITS_REFINE_TOP largest logits are recomputed as float32 sums of
    the same bf16 products: argmax, top-k and the head of the distribution at float32
    resolution, the tail in bf16 (an unpacked head's: oneDNN's matmul at every row count)."""
    logits = head(x).float()
    w = head.weight
    if head.is_packed or w.dtype != torch.bfloat16 or x.dtype != torch.float32:
        return logits  # packed: the GEMM's sums are float32 sums of unrounded x already
    top = logits.topk(min(LOGITS_REFINE_TOP, logits.shape[1]), dim=-1).indices  # [N, k]
    xb = x.to(torch.bfloat16).float().unsqueeze(-1)  # [N, H, 1], as the matmul rounds it
    exact = torch.bmm(w[top].float(), xb).squeeze(-1)  # [N, k]
    if head.bias is not None:
        exact += head.bias[top]
    return logits.scatter_(1, top, exact)


def embed(input_ids: Tensor, table: Linear, dtype: torch.dtype) -> Tensor:
    """The rows of an embedding matrix held as a Linear [V, H] (any storage) for input_ids
    [T], as [T, H] in `dtype`."""
    if table.blocks is not None:
        return cpu_blocks.gather_rows(table.weight, table.blocks, input_ids).to(dtype)
    if table.is_packed:
        rows = cpu_gemm.packed_rows(table.weight, input_ids, table.in_features).to(dtype)
    else:
        rows = table.weight.index_select(0, input_ids).to(dtype)
    if table.scales is not None:
        rows.mul_(table.scales.index_select(0, input_ids).to(dtype)[:, None])
    return rows
