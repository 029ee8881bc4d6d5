"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

The model is built once from its architecture: one `LayerSpec` per layer
(`aioengine.model.layer_spec`), each `LlamaDecoderLayer` built from its spec with the
model's device ops (`aioengine.model.ops`, chosen once: no layer asks which device it runs
on) and every projection made through an optional `LinearFactory` (how LoRA wraps them).
Executors run the layers (`aioengine.model.executors`): layer by layer (the reference), or,
for decode steps of a few requests on the CPU, all of them in one C call, when that
executor supports the step and every layer's features. The EAGLE draft head runs this
layer's own `attention_mlp`.

Written for few Python ops per layer: q/k/v are one matmul, gate/up are one matmul, RoPE
reads a precomputed cos/sin table, each residual add is fused into the RMSNorm after it, and
SiLU-and-mul is one op. Weights arrive with Hugging Face names through `load_weights`,
which fuses them into our layout. The layer itself is `decoder_layer.py`.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from aioengine import envs
from aioengine.kernels import cpu_blocks, cpu_decode
from aioengine.model import hugepages
from aioengine.model.arch import ModelArchConfig, UnsupportedModelError
from aioengine.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from aioengine.model.decoder_layer import LlamaDecoderLayer
from aioengine.model.executors import FusedCpuDecodeExecutor, LayerwiseExecutor
from aioengine.model.layer_spec import (LAYER_CODE_FEATURES, MLP_FEATURES, LayerSpec,
                                        layer_specs, smallest_window, unsupported)
from aioengine.model.layers import Linear, LinearFactory, _param, embed, lm_head_logits
from aioengine.model.moe import moe_weight_table
from aioengine.model.ops import TorchOps, select_ops
from aioengine.model.rotary import RopeStep, RotaryEmbedding, rope_inv_freq
from aioengine.model.families import split_fused_checkpoint


class TensorSource(Protocol):
    """A checkpoint tensor read on demand (gguf_loader.GGUFTensor): its stored blocks, or
    its float32 values."""
    block_type: str | None  # cpu_blocks' type of its blocks; None: not run natively

    def blocks(self) -> Tensor: ...

    def dequantized(self) -> Tensor: ...


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 attn_backend: AttentionBackend | None = None, *,
                 linear_factory: LinearFactory | None = None,
                 lora_source: cpu_decode.LoRADecodeSource | None = None,
                 ops: TorchOps | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.ops = ops or select_ops(device)
        self.layer_specs = layer_specs(arch)
        kw = {"dtype": dtype, "device": device}
        # The embedding matrix is a Linear [V, H] too: tied, the LM head *is* it (one tensor,
        # loaded and stored once, in the projections' storage format).
        self.embed_tokens = Linear(arch.hidden_size, arch.vocab_size, False, **kw)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, self.ops, dtype, device,
                                                      linear_factory)
                                    for spec in self.layer_specs)
        self.norm = _param(arch.hidden_size, **kw)
        self.lm_head = (self.embed_tokens if arch.tie_word_embeddings
                        else Linear(arch.hidden_size, arch.vocab_size, False, **kw))
        self.rotary = RotaryEmbedding(arch, dtype, device)
        # The local layers' own RoPE table (Gemma 3), None where every layer uses `rotary`.
        self.rotary_local = (RotaryEmbedding(arch, dtype, device, local=True)
                             if arch.local_rope_theta is not None else None)
        self._layer_weights = layer_weight_table(arch)
        # Multi-LoRA: the step's adapter slots for the fused decode kernel (the source that
        # made linear_factory's wrappers). None: no adapters, at no cost.
        self.lora_source = lora_source
        self.attn_backend = attn_backend or TorchAttentionBackend()
        self.layerwise = LayerwiseExecutor(self)
        self.fused_decode = FusedCpuDecodeExecutor(self)
        self.last_executor = ""  # the executor of the last forward (the step profile's)
        # EAGLE-3 (vLLM's aux_hidden_state_layers): the layers whose input residual stream
        # `forward` returns beside the hidden states; set once by the engine. Empty: forward
        # returns the hidden states alone, at no cost.
        self.aux_hidden_state_layers: tuple[int, ...] = ()

    @property
    def attn_backend(self) -> AttentionBackend:
        return self._attn_backend

    @attn_backend.setter
    def attn_backend(self, backend: AttentionBackend) -> None:
        """Refuses (UnsupportedModelError) a backend that lacks a feature of the layers; one
        without sliding windows is taken with max_model_len capped at the smallest window
        (full attention is sliding-window attention up to the window's length)."""
        missing = unsupported(self.layer_specs, backend.SUPPORTED_FEATURES | {"sliding_window"}
                              | MLP_FEATURES | LAYER_CODE_FEATURES)
        if missing:
            raise UnsupportedModelError(
                f"{self.arch.architecture}: the {type(backend).__name__} does not implement "
                f"{', '.join(sorted(missing))}")
        self._attn_backend = backend

    @property
    def max_model_len(self) -> int:
        """The longest sequence this model computes exactly with its attention backend."""
        window = smallest_window(self.layer_specs)
        if window is not None and "sliding_window" not in self.attn_backend.SUPPORTED_FEATURES:
            return min(self.arch.max_model_len, window)
        return self.arch.max_model_len

    @property
    def cuda_graph_safe(self) -> bool:
        """Whether a decode step's forward can be captured in a CUDA graph: not where a
        layer's soft-capped attention loops over the requests on the host (Gemma 2)."""
        return all(spec.attn_logit_softcapping is None for spec in self.layer_specs)

    @property
    def use_fused_decode(self) -> bool:
        return self.fused_decode.enabled

    @use_fused_decode.setter
    def use_fused_decode(self, enabled: bool) -> None:
        self.fused_decode.enabled = enabled

    def forward(self, input_ids: Tensor, positions: Tensor, kv_caches: list[Tensor],
                attn_metadata: AttentionMetadata,
                before_layers: Callable[[], None] | None = None,
                ) -> Tensor | tuple[Tensor, Tensor]:
        """input_ids/positions [T] -> final-normed hidden states [T, H]. `before_layers()`
        is called after the embedding lookup, right before the layers: on the fused decode
        path nothing between the two lets go of the GIL until the C kernel does.

        With aux_hidden_state_layers set, (hidden, aux): aux [T, L * H] float32 holds side by
        side, for each listed layer i in the given order, the residual stream into layer i
        before its input norm (the embeddings for i = 0; Hugging Face's
        output_hidden_states[i]). Raises ValueError for an index outside [0, num_layers)."""
        x = embed(input_ids, self.embed_tokens, self.dtype)
        if self.arch.embedding_multiplier != 1.0:  # Gemma: sqrt(hidden); Granite
            x = x * self.arch.embedding_multiplier
        aux_layers = self.aux_hidden_state_layers
        aux: Tensor | None = None
        aux_index: Tensor | None = None
        if aux_layers:  # allocated before before_layers(): these let go of the GIL
            if not all(0 <= i < len(self.layers) for i in aux_layers):
                raise ValueError(f"aux_hidden_state_layers {aux_layers}: layer indices must be "
                                 f"in [0, {len(self.layers)})")
            aux = torch.empty((x.shape[0], len(aux_layers) * self.arch.hidden_size),
                              dtype=torch.float32, device=x.device)
            aux_index = torch.tensor(aux_layers, dtype=torch.int64)
        if before_layers is not None:
            before_layers()
        fused = self.fused_decode
        if fused.supports(x, attn_metadata) and fused.run(x, positions, kv_caches,
                                                          attn_metadata, aux, aux_index):
            self.last_executor, hidden = fused.name, x
        else:
            self.last_executor = self.layerwise.name
            hidden = self.layerwise.run(x, positions, kv_caches, attn_metadata, aux)
        return hidden if aux is None else (hidden, aux)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, H] -> logits [N, V] in float32 (divided by Granite's logits_scaling,
        soft-capped by Gemma 2's final_logit_softcapping)."""
        logits = lm_head_logits(hidden, self.lm_head)
        arch = self.arch
        if arch.logits_scaling != 1.0:
            logits = logits / arch.logits_scaling
        if arch.final_logit_softcapping is not None:
            cap = arch.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def layer_ropes(self, positions: Tensor) -> list[RopeStep | None]:
        """Each layer's RoPE for one step: the model's, the local layers' own (Gemma 3), or
        None for a layer without RoPE (SmolLM3)."""
        main = RopeStep(self.rotary, positions, self.ops)
        local = (RopeStep(self.rotary_local, positions, self.ops)
                 if self.rotary_local is not None else main)
        return [None if not spec.use_rope else local if spec.local_rope else main
                for spec in self.layer_specs]

    def linears(self) -> list[Linear]:
        """Every projection and the embedding / LM head, each once."""
        out = [p for layer in self.layers for p in layer.stored_linears()]
        out.append(self.embed_tokens)
        if self.lm_head is not self.embed_tokens:
            out.append(self.lm_head)
        return out

    @torch.no_grad()
    def convert_weights(self, storage: str) -> None:
        """Every projection and the embedding / LM head into `storage` (layers.WEIGHT_STORAGES:
        float32, bfloat16, float16, int8), computed from the loaded weights; a GGUF's blocks
        keep their own types. Norms, biases, RoPE tables and the activations keep the
        model's dtype."""
        self.fused_decode.reset()  # raw pointers to the old weights
        for lin in self.linears():
            if lin.blocks is None:
                lin.convert(storage)

    def allocate_weights(self, dtype: torch.dtype) -> None:
        """Every projection and the embedding / LM head not held as blocks gets an empty
        weight in `dtype` (Linear.use_float_storage) for load_weights to fill: a checkpoint
        is converted tensor by tensor as it is copied in, never held in another dtype."""
        self.fused_decode.reset()
        for lin in self.linears():
            if lin.blocks is None:
                lin.use_float_storage(dtype)

    def plan_block_storage(self, tensor_types: dict[str, str | None]) -> list[str]:
        """Gives each projection and the embedding / LM head whose checkpoint tensors
        (HF name -> block type, None for a type not run natively) are all blocks the
        kernels run a block layout (Linear.use_block_storage): a fused weight keeps one
        part per run of slices of one type (a Q4_K_M file's v in Q6_K beside q, k in Q4_K).
        A Linear that cannot (a slice of another type, a slice not starting on a panel of
        16 rows) stays dense. Returns the HF names of the tensors of dense Linears."""
        self.fused_decode.reset()
        slices: dict[str, list[tuple[int, int, str, str | None]]] = {}
        for name, block_type in tensor_types.items():
            target = self._locate(name)
            if target is None or not target[0].endswith("weight"):
                continue
            param, rows = target
            n = self.get_parameter(param).shape[0]
            start, end = rows if rows is not None else (0, n)
            slices.setdefault(param.removesuffix(".weight"), []).append(
                (start, end, name, block_type))
        modules = dict(self.named_modules())
        dense: list[str] = []
        for module_name, parts in slices.items():
            lin = modules[module_name]
            parts.sort()
            layout = _block_layout(lin, parts) if isinstance(lin, Linear) else None
            if layout is None:
                dense.extend(name for _, _, name, _ in parts)
            else:
                lin.use_block_storage(layout)
        return dense

    def stored_state(self) -> tuple[dict[str, Any], list[tuple[str, Tensor]]]:
        """What the model holds once loaded, for the start-up cache: per Linear of
        `linears()` (by position) its storage (block layout, w8a8) and its weight as held
        (blocks' panels, packed panels, int8 with its scales), and every other parameter
        (norms, biases) by name. `restore_stored_state` puts it back into a fresh model."""
        layouts: dict[str, Any] = {}
        tensors: list[tuple[str, Tensor]] = []
        for i, lin in enumerate(self.linears()):
            layouts[str(i)] = {"act_quant": lin.act_quant, "blocks": None if lin.blocks is None
                               else [[p.block_type, p.rows] for p in lin.blocks.parts]}
            tensors.append((f"linear.{i}.weight", lin.weight))
            if lin.scales is not None:
                tensors.append((f"linear.{i}.scales", lin.scales))
        weights = {id(lin.weight) for lin in self.linears()}
        tensors += [(f"param.{name}", p) for name, p in self.named_parameters()
                    if id(p) not in weights]
        return layouts, tensors

    @torch.no_grad()
    def restore_stored_state(self, layouts: dict[str, Any], shapes: dict[str, tuple[
            torch.dtype, tuple[int, ...]]], read: Callable[[str, Tensor], Tensor]) -> None:
        """`stored_state` back: each Linear's weight allocated as held (in huge pages) and
        filled by `read(name, out)`; every other parameter read into place. Raises
        ValueError where the cached state does not fit this model."""
        self.fused_decode.reset()
        linears = self.linears()
        if len(layouts) != len(linears):
            raise ValueError(f"cached state of {len(layouts)} Linears for {len(linears)}")
        for i, lin in enumerate(linears):
            layout, key = layouts[str(i)], f"linear.{i}"
            dtype, shape = shapes[f"{key}.weight"]
            lin.packed, lin.scales, lin.blocks = None, None, None
            if layout["blocks"] is not None:
                lin.blocks = cpu_blocks.layout_for([tuple(p) for p in layout["blocks"]],
                                                   lin.in_features)
            lin.act_quant = bool(layout["act_quant"])
            lin.weight = nn.Parameter(read(f"{key}.weight", hugepages.empty(
                shape, dtype, self.device)), requires_grad=False)
            if f"{key}.scales" in shapes:
                dtype, shape = shapes[f"{key}.scales"]
                lin.scales = read(f"{key}.scales", torch.empty(shape, dtype=dtype))
        weights = {id(lin.weight) for lin in linears}
        for name, p in self.named_parameters():
            if id(p) not in weights:
                read(f"param.{name}", p.data)

    @torch.no_grad()
    def pack_weights(self) -> int:
        """Adds a oneDNN-packed copy of every float32 projection and of the LM head (kept
        beside the plain weights, which the few-row path, the embedding and reloads use);
        returns the bytes added, 0 where `linear` would not use packed weights. Call after
        loading."""
        added = 0
        for lin in self.linears():
            if lin is self.embed_tokens and lin is not self.lm_head:
                continue  # only looked up by row
            added += lin.pack()
        return added

    def weight_bytes(self) -> int:
        """Resident bytes of every parameter in its storage format, packed copies included."""
        lin_params = {id(t) for lin in self.linears() for t in (lin.weight, lin.bias)
                      if t is not None}
        rest = sum(p.numel() * p.element_size() for p in self.parameters()
                   if id(p) not in lin_params)
        return rest + sum(lin.nbytes() for lin in self.linears())

    def set_rope_freq_factors(self, factors: Tensor) -> None:
        """Divides the RoPE frequencies by per-frequency factors (GGUF's `rope_freqs`, which
        is how llama.cpp stores llama3 scaling)."""
        base = rope_inv_freq(self.arch)
        if factors.shape != base.shape:
            raise ValueError(f"rope_freqs has shape {tuple(factors.shape)}, "
                             f"expected {tuple(base.shape)}")
        self.rotary.set_inv_freq(base / factors.float().cpu(), self.device)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, Tensor | TensorSource]]) -> None:
        """Loads Hugging Face-named tensors (all of them, in one call), fusing q/k/v and gate/up.

        Raises ValueError for an unknown name, a shape mismatch, or any parameter (or part of
        a fused one) left unloaded.
        """
        self.fused_decode.reset()  # raw pointers to the parameters: rebuilt on next use
        self._check_loaded(self._copy_weights(weights),
                           [name for name, _ in self.named_parameters()], "weight(s)")

    def _copy_weights(self, weights: Iterable[tuple[str, Tensor | TensorSource]]
                      ) -> dict[str, int]:
        """Copies each HF-named tensor into its parameter (or its rows of a fused one);
        returns how many tensors went into each parameter. A TensorSource (a GGUF tensor read
        in place) goes in as blocks where its Linear holds blocks, else dequantized."""
        parts_loaded: dict[str, int] = {}
        arch = self.arch
        block_linears = {id(lin.weight): lin for lin in self.linears() if lin.blocks is not None}
        for fused_name, fused in weights:
            if not isinstance(fused, Tensor):
                # Only plan_block_storage's Linears take blocks; it never plans a fused
                # checkpoint tensor (Phi-3's), which is split below once dequantized.
                target = self._locate(fused_name) if block_linears else None
                lin = None if target is None else block_linears.get(
                    id(self.get_parameter(target[0])))
                if lin is not None:
                    name, rows = target
                    lin.load_block_rows(0 if rows is None else rows[0], fused.blocks(),
                                        fused.block_type)
                    parts_loaded[name] = parts_loaded.get(name, 0) + 1
                    continue
                fused = fused.dequantized()
            for hf_name, tensor in split_fused_checkpoint(  # Phi-3's fused tensors
                    fused_name, fused, arch.q_size, arch.kv_size, arch.intermediate_size):
                target = self._locate(hf_name)
                if target is None:
                    continue
                name, rows = target
                if arch.norm_weight_offset and name.endswith("norm"):  # Gemma: 1 + w
                    tensor = tensor.float() + arch.norm_weight_offset
                copy_param_rows(self.get_parameter(name), rows, tensor, hf_name)
                parts_loaded[name] = parts_loaded.get(name, 0) + 1
        return parts_loaded

    def _check_loaded(self, parts_loaded: dict[str, int], names: list[str], what: str) -> None:
        """Raises ValueError naming the parameters among `names` left (partly) unloaded."""
        missing = [name for name in names if parts_loaded.get(name, 0)
                   < self._PARTS.get(".".join(name.split(".")[-2:]), 1)]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} {what}: {shown}")

    # Fused parameters and how many checkpoint tensors fill each.
    _PARTS = {"qkv_proj.weight": 3, "qkv_proj.bias": 3, "gate_up_proj.weight": 2}
    _LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")

    def _locate(self, hf_name: str) -> tuple[str, tuple[int, int] | None] | None:
        """HF name -> (our parameter name, row range inside it or None); None = ignore."""
        if hf_name.endswith("rotary_emb.inv_freq"):
            return None  # recomputed from the config
        if hf_name == "model.embed_tokens.weight":
            return "embed_tokens.weight", None
        if hf_name == "model.norm.weight":
            return "norm", None
        if hf_name == "lm_head.weight":
            # Tied checkpoints sometimes store the head too; it equals the embedding.
            return None if self.arch.tie_word_embeddings else ("lm_head.weight", None)
        m = self._LAYER_RE.match(hf_name)
        if m is None or int(m.group(1)) >= self.arch.num_hidden_layers:
            raise ValueError(f"unexpected weight {hf_name!r}")
        layer, rest = int(m.group(1)), m.group(2)
        target = self._layer_weights.get(rest)
        if target is None or not has_param(self.layers[layer], target[0]):
            raise ValueError(f"unexpected weight {hf_name!r} for {self.arch.architecture}")
        return f"layers.{layer}.{target[0]}", target[1]


def _block_layout(lin: Linear, parts: list[tuple[int, int, str, str | None]]
                  ) -> cpu_blocks.BlockLayout | None:
    """The layout of a Linear whose checkpoint slices (start, end, name, block type), sorted,
    cover its rows: adjacent slices of one type merged into a part. None where a slice is
    not run natively, the slices leave rows uncovered, or one starts off a panel boundary
    (each slice is packed on its own, into whole panels)."""
    if any(t is None for *_, t in parts) or parts[0][0] != 0 or parts[-1][1] != lin.out_features:
        return None
    merged: list[tuple[str, int]] = []
    for (start, end, _, block_type), prev_end in zip(parts, [0] + [p[1] for p in parts]):
        if start != prev_end or start % cpu_blocks.PANEL:
            return None
        if merged and merged[-1][0] == block_type:
            merged[-1] = (block_type, merged[-1][1] + end - start)
        else:
            merged.append((block_type, end - start))
    try:
        return cpu_blocks.layout_for(merged, lin.in_features)
    except ValueError:  # k not a whole number of the type's blocks
        return None


def copy_param_rows(param: Tensor, rows: tuple[int, int] | None, tensor: Tensor,
                    name: str) -> None:
    """Copies a checkpoint tensor into `param` (or its row range of a fused parameter);
    ValueError naming `name` on a shape mismatch."""
    dest = param if rows is None else param.narrow(0, rows[0], rows[1] - rows[0])
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)


def has_param(module: nn.Module, dotted: str) -> bool:
    """module.<dotted> exists and is not None (a bias or norm the architecture lacks is)."""
    obj: object = module
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return True


def layer_weight_table(arch: ModelArchConfig) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """HF name inside a layer -> (our parameter, row range for fused ones)."""
    q, kv, inter = arch.q_size, arch.kv_size, arch.intermediate_size
    if arch.norm_style != "pre":  # Gemma, OLMo 2: the HF names of the output norms
        norms = {"post_attention_layernorm.weight": ("attn_out_norm", None),
                 "pre_feedforward_layernorm.weight": ("post_attention_layernorm", None),
                 "post_feedforward_layernorm.weight": ("mlp_out_norm", None)}
    else:
        norms = {"post_attention_layernorm.weight": ("post_attention_layernorm", None)}
    return moe_weight_table(arch.moe) | norms | {
        "input_layernorm.weight": ("input_layernorm", None),
        "self_attn.q_proj.weight": ("qkv_proj.weight", (0, q)),
        "self_attn.k_proj.weight": ("qkv_proj.weight", (q, q + kv)),
        "self_attn.v_proj.weight": ("qkv_proj.weight", (q + kv, q + 2 * kv)),
        "self_attn.q_proj.bias": ("qkv_proj.bias", (0, q)),
        "self_attn.k_proj.bias": ("qkv_proj.bias", (q, q + kv)),
        "self_attn.v_proj.bias": ("qkv_proj.bias", (q + kv, q + 2 * kv)),
        "self_attn.o_proj.weight": ("o_proj.weight", None),
        "self_attn.q_norm.weight": ("q_norm", None),
        "self_attn.k_norm.weight": ("k_norm", None),
        "mlp.gate_proj.weight": ("gate_up_proj.weight", (0, inter)),
        "mlp.up_proj.weight": ("gate_up_proj.weight", (inter, 2 * inter)),
        "mlp.down_proj.weight": ("down_proj.weight", None),
    }


def make_kv_caches(arch: ModelArchConfig, num_blocks: int | Sequence[int], block_size: int,
                   dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """One `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer
    (`num_blocks` per layer where KV cache groups give layers different pools).

    All zeros, but not written here where that is free: padded decode reads touch slots no
    request wrote, and although their attention weight is 0, a NaN left in uninitialised
    memory would still poison 0 * NaN. On the CPU under Linux a cache of at least
    hugepages.MIN_BYTES is a fresh anonymous mapping of its own (hugepages.empty, in huge
    pages like the weights: decode attention streams the context's K/V), which the kernel
    fills with zeros page by page on first touch, so nothing is written at start-up and a
    page becomes resident only once a request writes K/V into it (issue 27: zeroing 4.3 GB
    took 12 s). Anything else (a GPU, a small cache, another OS) is zeroed here, and with
    AIOENGINE_CPU_KV_PREFAULT=1 the fresh pages too (first touch can stall a step, envs.py).
    """
    counts = ([num_blocks] * arch.num_hidden_layers if isinstance(num_blocks, int)
              else list(num_blocks))
    caches = []
    for n in counts:
        shape = (2, n, block_size, arch.num_key_value_heads, arch.head_dim)
        caches.append(hugepages.zeros(shape, dtype, device, envs.AIOENGINE_CPU_KV_PREFAULT))
    return caches


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers (K and V)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * arch.num_key_value_heads * arch.head_dim * itemsize
    return per_layer * arch.num_hidden_layers
