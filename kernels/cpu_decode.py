"""The fused decode step's wrappers (`kernels/cpu/llama_decode.c`, `lora.c`): the layer
table built once from a model's layers (the decode_layer structs of
`kernels/cpu/decode_layer.h`, mirrored in `cpu_layout.py`), `llama_decode` (all decoder
layers and the final norm of a decode step in one call), and the LoRA shrink/expand
kernels it and the layerwise path share. Each returns None / False, having done nothing,
where it does not apply (the caller keeps its torch path), as in `cpu.py`.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from aioengine.kernels.cpu import KV_CACHE_DTYPES, _f32_rows, load
from aioengine.kernels import cpu_blocks, cpu_gemm
from aioengine.kernels.cpu_layout import (LORA_TABLE_WIDTH, PROJ_MAX_PARTS, DecodeLayer,
                                          DecodeStep, ProjWeight)


# What one decoder layer hands the kernel: decode_layer's fields (kernels/cpu/decode_layer.h),
# the projections as DecodeProjection.
DECODE_LAYER_FIELDS = tuple(name for name, _ in DecodeLayer._fields_)
_DECODE_LAYER_KEYS = frozenset(DECODE_LAYER_FIELDS)
_PROJECTIONS = ("qkv", "o", "gate_up", "down")
# The weight format codes the kernel reads: the packed GEMM_*P (gemm.h; the row-major codes
# 0-4 are retired, projection.h) and a GGUF's block formats.
_BLOCK_CODES = frozenset(f.code for f in cpu_blocks.BLOCK_TYPES.values())
# Block formats by the x they read (cpu_blocks.x_group): a projection's parts share one.
_X_GROUP = {f.code: cpu_blocks.x_group(f.name) for f in cpu_blocks.BLOCK_TYPES.values()}
_WEIGHT_FORMAT_CODES = frozenset((*cpu_gemm.PACKED_FORMATS.values(), cpu_gemm.GEMM_W8A8P,
                                  cpu_gemm.GEMM_BF16T, *_BLOCK_CODES))
# The ones a model may lack (null pointers for the kernel).
_OPTIONAL_DECODE_FIELDS = frozenset({"qkv_bias", "q_norm", "k_norm"})


@dataclass(frozen=True)
class DecodePart:
    """One part of a projection weight (decode_layer.h's proj_part): `rows` output rows in
    format `fmt` at address `data`, with per-row scales at `scales` (int8) or None."""

    data: int
    fmt: int
    rows: int
    scales: int | None = None


@dataclass(frozen=True)
class DecodeProjection:
    """A projection weight as llama_decode reads it: its parts in output-row order (every
    part but the last whole 16-row panels; all reading x in one form: every block format
    shares one) and the tensors holding them (the table keeps them alive)."""

    parts: tuple[DecodePart, ...]
    owners: tuple[Tensor, ...]

    @property
    def out_features(self) -> int:
        return sum(p.rows for p in self.parts)

    def fill(self, w: ProjWeight) -> None:
        """Into the mirror struct."""
        w.num_parts = len(self.parts)
        for slot, part in zip(w.parts, self.parts):
            slot.data, slot.scales, slot.rows, slot.fmt = (part.data, part.scales, part.rows,
                                                           part.fmt)


def _projection_ok(weight: Tensor, scales: Tensor | None) -> bool:
    """A projection weight the kernel reads: panel-packed (gemm.h, cpu_gemm.pack_weight;
    int8 with its scales [n], one per output row of the panels). A row-major weight [N, K]
    is not: the caller keeps its torch path."""
    return (weight.dim() == 3 and weight.device.type == "cpu" and weight.is_contiguous()
            and weight.dtype in cpu_gemm.PACKED_FORMATS
            and (scales is not None) == (weight.dtype == torch.int8)
            and (scales is None or scales.dim() == 1 and _f32_rows(scales)
                 and -(-scales.shape[0] // cpu_gemm.PANEL) == weight.shape[0]))


def packed_projection(weight: Tensor, scales: Tensor | None,
                      rows: int) -> DecodeProjection | None:
    """A panel-packed weight of `rows` output rows (cpu_gemm.pack_weight, or W8A8 panels;
    int8 with its scales [rows]) as one part; None where the kernel does not read it."""
    if not (_projection_ok(weight, scales) and 0 < rows <= weight.shape[0] * cpu_gemm.PANEL
            and (scales is None or scales.shape[0] == rows)):
        return None
    part = DecodePart(weight.data_ptr(), cpu_gemm.packed_format(weight), rows,
                      None if scales is None else scales.data_ptr())
    return DecodeProjection((part,), (weight,) if scales is None else (weight, scales))


def block_projection(data: Tensor, layout: cpu_blocks.BlockLayout) -> DecodeProjection | None:
    """A GGUF block weight (uint8 [layout.nbytes], the parts' panels back to back,
    cpu_blocks.BlockLayout) with one part per BlockPart; None where the kernel does not read
    it (more than PROJ_MAX_PARTS parts, the buffer not as the layout says)."""
    parts = layout.parts
    if not (data.dtype == torch.uint8 and data.dim() == 1 and data.device.type == "cpu"
            and data.is_contiguous() and data.numel() >= layout.nbytes
            and 0 < len(parts) <= PROJ_MAX_PARTS
            and all(p.rows % cpu_gemm.PANEL == 0 for p in parts[:-1])):
        return None
    base = data.data_ptr()
    return DecodeProjection(tuple(
        DecodePart(base + p.offset, cpu_blocks.BLOCK_TYPES[p.block_type].code, p.rows)
        for p in parts), (data,))


class _KernelLinear(Protocol):
    """What decode_projection reads of a projection (aioengine.model.layers.Linear)."""

    weight: Tensor
    scales: Tensor | None
    out_features: int

    @property
    def kernel_format(self) -> int | None: ...


def decode_projection(linear: _KernelLinear) -> DecodeProjection | None:
    """A Linear's weight as llama_decode reads it: its BlockLayout's parts for a GGUF block
    weight (`linear.blocks`), else its packed weight as one part; None where no kernel
    format reads it (a weight left unpacked), so the table declines."""
    layout = getattr(linear, "blocks", None)
    if layout is not None:
        return block_projection(linear.weight, layout)
    if linear.kernel_format is None:
        return None
    return packed_projection(linear.weight, linear.scales, linear.out_features)


@dataclass(eq=False)
class DecodeLayerTable:
    """What llama_decode reads of a model's layers: `layers`, the decode_layer structs (raw
    pointers: keep the tensors alive, and rebuild the table if any is replaced), and `step`,
    the decode_step pointing at them that each llama_decode call with this table refreshes
    and passes (so one step at a time per table, as per set of KV caches it points at)."""

    layers: ctypes.Array
    step: DecodeStep

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _decode_layer_ok(layer: dict, kv_dtypes: set) -> bool:
    """Every entry of `layer` one the kernel reads; collects the KV cache's dtype."""
    for name in DECODE_LAYER_FIELDS:
        t = layer[name]
        if name == "kv_cache":
            if not (t is not None and t.dtype in KV_CACHE_DTYPES and t.device.type == "cpu"
                    and t.is_contiguous()):
                return False
            kv_dtypes.add(t.dtype)
        elif name in _PROJECTIONS:
            if not (isinstance(t, DecodeProjection) and _parts_ok(t.parts)):
                return False
        elif not (t is None and name in _OPTIONAL_DECODE_FIELDS
                  or t is not None and _f32_rows(t)):
            return False
    return True


def _parts_ok(parts: tuple[DecodePart, ...]) -> bool:
    """1..PROJ_MAX_PARTS parts in formats the kernel reads, several only in block formats
    reading x alike (one x form: proj_x_form), every part but the last whole panels."""
    return (0 < len(parts) <= PROJ_MAX_PARTS
            and all(p.fmt in _WEIGHT_FORMAT_CODES and p.rows > 0 for p in parts)
            and (len(parts) == 1 or all(p.fmt in _BLOCK_CODES for p in parts)
                 and len({_X_GROUP[p.fmt] for p in parts}) == 1)
            and all(p.rows % cpu_gemm.PANEL == 0 for p in parts[:-1]))


def decode_layer_table(layers: list[dict]) -> DecodeLayerTable | None:
    """The decode_layer structs llama_decode takes, one per layer from a dict keyed by
    DECODE_LAYER_FIELDS: the projections as DecodeProjection (decode_projection; None
    declines), each in its own format or parts of several; biases and q/k norms may be
    None. None when anything does not fit: a projection no kernel format reads, KV caches
    not all of one of KV_CACHE_DTYPES, anything else not float32; all contiguous on the
    CPU. Raises ValueError for a dict with a key too many or too few."""
    kv_dtypes: set = set()
    for layer in layers:
        if layer.keys() != _DECODE_LAYER_KEYS:
            raise ValueError(f"decode_layer_table: unknown keys "
                             f"{sorted(layer.keys() - _DECODE_LAYER_KEYS)}, missing keys "
                             f"{sorted(_DECODE_LAYER_KEYS - layer.keys())}")
        if not _decode_layer_ok(layer, kv_dtypes):
            return None
    if len(kv_dtypes) > 1:
        return None
    table = (DecodeLayer * len(layers))()
    for row, layer in zip(table, layers):
        for name in DECODE_LAYER_FIELDS:
            t = layer[name]
            if name in _PROJECTIONS:
                t.fill(getattr(row, name))
            else:
                setattr(row, name, None if t is None else t.data_ptr())
    return DecodeLayerTable(table, DecodeStep(
        layers=ctypes.addressof(table), num_layers=len(layers),
        kv_bf16=int(kv_dtypes == {torch.bfloat16})))


def _set_aux(step: DecodeStep, aux: Tensor | None, aux_layers: Tensor | None, t: int,
             hidden: int) -> bool:
    """The step's auxiliary outputs into `step`; False where they do not fit."""
    if aux is None and aux_layers is None:
        step.aux = step.aux_layers = None  # NULL: no aux output
        step.num_aux = 0
        return True
    if not (aux is not None and aux_layers is not None and aux_layers.dim() == 1
            and aux_layers.device.type == "cpu"
            and aux_layers.dtype == torch.int64 and aux_layers.is_contiguous()
            and aux.shape == (t, aux_layers.shape[0] * hidden) and _f32_rows(aux)):
        return False
    indices = aux_layers.tolist()  # a few: cheaper than tensor ops
    if indices and not 0 <= min(indices) <= max(indices) < step.num_layers:
        raise ValueError(f"llama_decode: aux layer indices {indices} outside "
                         f"[0, {step.num_layers})")
    step.aux, step.aux_layers, step.num_aux = aux.data_ptr(), aux_layers.data_ptr(), len(indices)
    return True


def _set_lora(step: DecodeStep, lora: LoRADecodeArgs | None, t: int) -> bool:
    """The step's adapter slots into `step`; False where they do not fit."""
    if lora is None:
        step.lora = step.token_slots = None
        step.lora_rank = step.lora_bf16 = 0
        return True
    if not (lora.table.dtype == torch.int64 and lora.table.is_contiguous()
            and lora.table.shape == (step.num_layers, LORA_TABLE_WIDTH)
            and lora.token_slots.dtype == torch.int32 and lora.token_slots.shape == (t,)
            and lora.token_slots.is_contiguous()):
        return False
    step.lora, step.token_slots = lora.table.data_ptr(), lora.token_slots.data_ptr()
    step.lora_rank, step.lora_bf16 = lora.max_rank, int(lora.bf16)
    return True


def llama_decode(x: Tensor, layer_table: DecodeLayerTable, final_norm: Tensor, *,
                 num_heads: int, num_kv_heads: int, head_dim: int, intermediate_size: int,
                 eps: float, scale: float, positions: Tensor, cos: Tensor, sin: Tensor,
                 slot_mapping: Tensor, block_tables: Tensor, seq_lens: Tensor,
                 num_blocks: int, block_size: int,
                 aux: Tensor | None = None, aux_layers: Tensor | None = None,
                 lora: LoRADecodeArgs | None = None,
                 eagle: EagleDecodeArgs | None = None,
                 tree_copies: tuple[Tensor, Tensor] | None = None) -> bool:
    """Runs every decoder layer and the final norm for a decode step of T single-token rows
    (one per request, or several of one request: each row's K/V are written before any row
    attends), in place: x [T, H] goes in as the embeddings and comes out as the final-normed
    hidden states; each layer's K/V are written into its cache (kernels/cpu/llama_decode.c).

    layer_table from `decode_layer_table`; positions and slot_mapping [T] int64;
    block_tables [T, max_blocks] and seq_lens [T] int32 (AttentionMetadata's); cos/sin
    [max_positions, head_dim / 2].
    aux [T, L * H] float32 with aux_layers [L] int64 (each in [0, num_layers)), or both
    None: aux[:, j*H:(j+1)*H] receives the residual stream into layer aux_layers[j] (the
    embeddings for 0), before its input norm. `lora`: the step's adapter slots (each
    token's update added to every projection, as `lora_apply` computes it), or None.
    `eagle`: the table is an EAGLE-3 draft layer's (x the embeddings; see EagleDecodeArgs),
    without aux or lora. `tree_copies`: (src, dst) [S] int64 slots, a tree verification
    step's (TreeKernelRows' src_slots / dst_slots): in every layer, after the step's K/V
    are written and before any row attends, slot src[i]'s K/V are copied to dst[i].
    Raises IndexError, writing nothing, for a slot outside the caches; ValueError for a
    layer index out of range. Returns False, changing nothing, when the kernel does not
    apply or is not built.
    """
    t = x.shape[0]
    if not (x.dim() == 2 and _f32_rows(x, final_norm, cos, sin)
            and type(layer_table) is DecodeLayerTable
            and positions.dtype == slot_mapping.dtype == torch.int64
            and positions.shape == slot_mapping.shape == (t,)
            and positions.is_contiguous() and slot_mapping.is_contiguous()
            and block_tables.dtype == seq_lens.dtype == torch.int32
            and block_tables.dim() == 2 and block_tables.shape[0] == t
            and block_tables.is_contiguous() and seq_lens.shape == (t,)
            and seq_lens.is_contiguous() and cos.shape[-1] * 2 == head_dim):
        return False
    step = layer_table.step
    if not (_set_aux(step, aux, aux_layers, t, x.shape[1]) and _set_lora(step, lora, t)
            and _set_eagle(step, eagle, x, aux is None and lora is None)
            and _set_tree_copies(step, tree_copies)):
        return False
    lib = load()
    if lib is None:
        return False
    step.final_norm, step.hidden, step.num_heads = final_norm.data_ptr(), x.shape[1], num_heads
    step.num_kv_heads, step.head_dim, step.intermediate = num_kv_heads, head_dim, intermediate_size
    step.eps, step.scale = eps, scale
    step.cos_table, step.sin_table = cos.data_ptr(), sin.data_ptr()
    step.num_threads, step.x, step.num_tokens = torch.get_num_threads(), x.data_ptr(), t
    step.positions, step.slot_mapping = positions.data_ptr(), slot_mapping.data_ptr()
    step.block_tables, step.table_stride = block_tables.data_ptr(), block_tables.shape[1]
    step.seq_lens, step.num_blocks, step.block_size = seq_lens.data_ptr(), num_blocks, block_size
    rc = lib.llama_decode(step)
    if rc > 0:
        raise IndexError(f"llama_decode: {rc} slot(s) outside the cache's "
                         f"{num_blocks * block_size} slots")
    if rc == -2:  # never for a table decode_layer_table built at the model's widths
        raise ValueError("llama_decode: a projection weight the kernel does not read (its "
                         "format, or parts whose rows do not add up to the model's widths)")
    if rc < 0:
        raise MemoryError("llama_decode: out of memory for its buffers")
    return True


def _set_tree_copies(step: DecodeStep, copies: tuple[Tensor, Tensor] | None) -> bool:
    """A tree step's scratch slot copies into `step`; False where they do not fit."""
    if copies is None:
        step.tree_src = step.tree_dst = None
        step.num_tree_copies = 0
        return True
    src, dst = copies
    if not (src.dtype == dst.dtype == torch.int64 and src.dim() == 1 and src.shape == dst.shape
            and src.device.type == dst.device.type == "cpu"
            and src.is_contiguous() and dst.is_contiguous()):
        return False
    step.tree_src, step.tree_dst = src.data_ptr(), dst.data_ptr()
    step.num_tree_copies = src.shape[0]
    return True


@dataclass
class EagleDecodeArgs:
    """An EAGLE-3 draft layer's extra inputs (decode_layer.h's eagle_* fields): `hidden`
    [T, H] float32, the hidden states the head reads, overwritten with the final residual
    stream (the next draft's hidden state); `hidden_norm` [H] float32; whether the
    residual stream starts from the normed hidden states."""

    hidden: Tensor
    hidden_norm: Tensor
    norm_before_residual: bool = False


def _set_eagle(step: DecodeStep, eagle: EagleDecodeArgs | None, x: Tensor,
               plain: bool) -> bool:
    """The draft layer's inputs into `step`; False where they do not fit (not one layer,
    not float32 rows like x, or with aux / lora)."""
    if eagle is None:
        step.eagle_hidden = step.eagle_hidden_norm = None
        step.eagle_norm_before_residual = 0
        return True
    if not (plain and step.num_layers == 1 and eagle.hidden.shape == x.shape
            and eagle.hidden_norm.shape == x.shape[1:]
            and _f32_rows(eagle.hidden, eagle.hidden_norm)):
        return False
    step.eagle_hidden, step.eagle_hidden_norm = (eagle.hidden.data_ptr(),
                                                 eagle.hidden_norm.data_ptr())
    step.eagle_norm_before_residual = int(eagle.norm_before_residual)
    return True


@dataclass
class LoRADecodeArgs:
    """What llama_decode needs to apply a step's adapters: `table` [num_layers,
    LORA_TABLE_WIDTH] int64, per layer the (a, bt, ranks) pointers of qkv, o, gate_up and
    down in lora_layer's order (kernels/cpu/decode_layer.h; LinearWithLoRA's lora_a, lora_b,
    ranks: float32, or bf16 with `bf16`, / int32, contiguous on the CPU); `token_slots` [T]
    int32 (-1: the base model); `max_rank`, the slots' padded rank R."""

    table: Tensor
    token_slots: Tensor
    max_rank: int
    bf16: bool = False


@dataclass(frozen=True)
class LoRAKernelSlots:
    """One projection's adapter slots as `lora_apply` takes them, checked once: lora_a
    [L, S, R, K], lora_b [L, R, N] (B transposed) float32 or bf16, ranks [L, S] int32, slices [S]
    int64 (the slices' output sizes), contiguous on the CPU. The tensors must stay alive
    and in place (their pointers are kept)."""

    pointers: tuple[int, int, int, int]
    bf16: bool
    num_slots: int
    num_slices: int
    rank: int
    in_features: int
    out_features: int


def lora_kernel_slots(lora_a: Tensor, lora_b: Tensor, ranks: Tensor,
                      slices: Tensor) -> LoRAKernelSlots | None:
    """The slots' kernel arguments; None where `lora_apply` cannot take them."""
    if not (lora_a.dim() == 4 and lora_b.dim() == 3 and lora_a.dtype == lora_b.dtype
            and lora_a.dtype in (torch.float32, torch.bfloat16)
            and lora_a.device.type == lora_b.device.type == "cpu"
            and lora_a.is_contiguous() and lora_b.is_contiguous() and ranks.dtype == torch.int32 and ranks.is_contiguous()
            and slices.dtype == torch.int64 and slices.is_contiguous()):
        return None
    num_slots, s, r, k = lora_a.shape
    n = lora_b.shape[2]
    if (lora_b.shape[:2] != (num_slots, r) or ranks.shape != (num_slots, s)
            or slices.shape != (s,) or int(slices.sum()) != n):
        return None
    return LoRAKernelSlots((lora_a.data_ptr(), lora_b.data_ptr(), ranks.data_ptr(),
                            slices.data_ptr()), lora_a.dtype == torch.bfloat16, num_slots, s, r,
                           k, n)


class LoRADecodeSource(Protocol):
    """Whatever applies adapters to a model's projections (aioengine.lora.LoRAManager), as
    LlamaForCausalLM asks it for the fused decode kernel's arguments."""

    def decode_args(self) -> LoRADecodeArgs | None:
        """The current step's adapter slots for llama_decode; None when no token has one."""


def lora_apply(y: Tensor, x: Tensor, slots: LoRAKernelSlots, token_slots: Tensor) -> bool:
    """y [T, N] += each token's adapter update for x [T, K] in place (kernels/cpu/lora.c);
    token_slots [T] int32 contiguous on the CPU, each -1 (none) or a slot < L (the caller's
    invariant). Returns False, changing nothing, where it does not apply (float32
    contiguous CPU rows) or the kernels are not built."""
    t = y.shape[0]
    if not (y.dim() == x.dim() == 2 and x.shape[0] == t and y.shape[1] == slots.out_features
            and x.shape[1] == slots.in_features and token_slots.shape[0] == t
            and _f32_rows(y, x)):
        return False
    lib = load()
    if lib is None:
        return False
    a, b, ranks, slices = slots.pointers
    if lib.lora_apply_f32(y.data_ptr(), x.data_ptr(), a, b, int(slots.bf16), ranks, slices,
                          token_slots.data_ptr(), t, slots.num_slices, slots.rank,
                          slots.in_features, slots.out_features, slots.num_slots,
                          torch.get_num_threads()) != 0:
        raise MemoryError("lora_apply: out of memory for its buffers")
    return True
