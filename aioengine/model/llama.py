"""Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a paged KV cache.

Written for few Python ops per layer: q/k/v are one matmul, gate/up are one matmul, RoPE
reads a precomputed cos/sin table, each residual add is fused into the RMSNorm after it, and
SiLU-and-mul is one op (`aioengine.model.layers`, with C kernels on the CPU; RoPE in
`aioengine.model.rotary`). On the CPU (float32 activations, weights in any storage of
`layers.Linear`), a decode step of up to FUSED_DECODE_MAX_TOKENS requests runs all decoder
layers in one C call instead (`cpu_kernels.llama_decode`); the layer path is its reference.
Weights arrive with Hugging Face names through `load_weights`, which fuses them into our
layout.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aioengine.kernels import cpu as cpu_kernels
from aioengine.model import hugepages
from aioengine.model.arch import ModelArchConfig
from aioengine.model.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from aioengine.model.layers import (Linear, _param, embed, fused_add_rms_norm, lm_head_logits,
                                    rms_norm, silu_and_mul)
from aioengine.model.rotary import RopeStep, RotaryEmbedding, rope_inv_freq


# Decode-only steps of up to this many tokens run the decoder layers in one C call where it
# applies (LlamaForCausalLM.use_fused_decode). Forward + LM head on 2 cores, against the
# layer path in the same process: 1 token 20.4-21.8 -> 17.5-18.1 ms (the ~4 ms of per-layer
# Python and op dispatch gone), 2 tokens 25.8 -> 21.1, 4 tokens 33.4-33.8 -> 23.8-28.4,
# 8 tokens 37.6 -> 34.2; at 12 they are even (oneDNN's GEMM takes over), at 16 the layer
# path wins (52.6 vs 58.1).
FUSED_DECODE_MAX_TOKENS = 8


class LlamaDecoderLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h, d = arch.hidden_size, arch.head_dim
        kw = {"dtype": dtype, "device": device}
        self.num_heads, self.num_kv_heads, self.head_dim = (
            arch.num_attention_heads, arch.num_key_value_heads, d)
        self.q_size, self.kv_size = arch.q_size, arch.kv_size
        self.eps = arch.rms_norm_eps
        self.input_layernorm = _param(h, **kw)
        self.qkv_proj = Linear(h, self.q_size + 2 * self.kv_size, arch.attention_bias, **kw)
        self.q_norm = _param(d, **kw) if arch.qk_norm else None
        self.k_norm = _param(d, **kw) if arch.qk_norm else None
        self.o_proj = Linear(self.q_size, h, False, **kw)
        self.post_attention_layernorm = _param(h, **kw)
        self.gate_up_proj = Linear(h, 2 * arch.intermediate_size, False, **kw)
        self.down_proj = Linear(arch.intermediate_size, h, False, **kw)
        self.scale = d ** -0.5

    def projections(self) -> tuple[Linear, Linear, Linear, Linear]:
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    def forward(self, x: Tensor, residual: Tensor | None, rope: RopeStep, kv_cache: Tensor,
                meta: AttentionMetadata, attn: AttentionBackend) -> tuple[Tensor, Tensor]:
        """x: the previous layer's MLP output (the embeddings for the first layer, with
        residual None), not yet added to the residual stream. Returns this layer's MLP
        output and the residual stream, the pair the next layer takes (vLLM's layout: each
        residual add is fused into the RMSNorm that follows it)."""
        t = x.shape[0]
        if residual is None:
            h, residual = rms_norm(x, self.input_layernorm, self.eps), x
        else:
            h, residual = fused_add_rms_norm(x, residual, self.input_layernorm, self.eps)
        qkv = self.qkv_proj(h)
        # q and k heads side by side, [T, Hq + Hkv, D], so RoPE runs once for both.
        qk_size = self.q_size + self.kv_size
        qk = qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3: per-head RMSNorm of q and k before RoPE
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((F.rms_norm(q, (self.head_dim,), self.q_norm, self.eps),
                            F.rms_norm(k, (self.head_dim,), self.k_norm, self.eps)), dim=1)
        q, k = rope(qk).split([self.num_heads, self.num_kv_heads], dim=1)
        o = attn.forward(q, k, v, kv_cache, meta, self.scale)
        o = self.o_proj(o.view(t, self.q_size))
        h, residual = fused_add_rms_norm(o, residual, self.post_attention_layernorm, self.eps)
        return self.down_proj(silu_and_mul(self.gate_up_proj(h))), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, arch: ModelArchConfig, dtype: torch.dtype, device: torch.device,
                 attn_backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.arch = arch
        self.dtype = dtype
        self.device = device
        self.attn_backend = attn_backend or TorchAttentionBackend()
        kw = {"dtype": dtype, "device": device}
        # The embedding matrix is a Linear [V, H] too: tied, the LM head *is* it (one tensor,
        # loaded and stored once, in the projections' storage format).
        self.embed_tokens = Linear(arch.hidden_size, arch.vocab_size, False, **kw)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(arch, dtype, device) for _ in range(arch.num_hidden_layers))
        self.norm = _param(arch.hidden_size, **kw)
        self.lm_head = (self.embed_tokens if arch.tie_word_embeddings
                        else Linear(arch.hidden_size, arch.vocab_size, False, **kw))
        self.rotary = RotaryEmbedding(arch, dtype, device)
        self._layer_weights = _layer_weight_table(arch)
        # Decode steps of a few tokens through cpu_kernels.llama_decode (off: layer by layer).
        self.use_fused_decode = True
        # (the KV caches' data pointers, the pointer table llama_decode reads) for the last
        # kv_caches seen: built once, the weights being updated in place. Whatever replaces
        # a parameter tensor (rather than copying into it) must reset it to None.
        self._decode_table: tuple[tuple[int, ...], Tensor] | None = None
        # EAGLE-3 (vLLM's aux_hidden_state_layers): the layers whose input residual stream
        # `forward` returns beside the hidden states; set once by the engine. Empty: forward
        # returns the hidden states alone, at no cost.
        self.aux_hidden_state_layers: tuple[int, ...] = ()
        # Multi-LoRA (aioengine.lora wraps the projections and sets this): the step's
        # adapter slots for the fused decode kernel. None: no adapters, at no cost.
        self.lora: cpu_kernels.LoRADecodeSource | None = None

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
        aux_layers = self.aux_hidden_state_layers
        aux: Tensor | None = None
        aux_index: Tensor | None = None
        h = self.arch.hidden_size
        if aux_layers:  # allocated before before_layers(): these let go of the GIL
            if not all(0 <= i < len(self.layers) for i in aux_layers):
                raise ValueError(f"aux_hidden_state_layers {aux_layers}: layer indices must be "
                                 f"in [0, {len(self.layers)})")
            aux = torch.empty((x.shape[0], len(aux_layers) * h), dtype=torch.float32,
                              device=x.device)
            aux_index = torch.tensor(aux_layers, dtype=torch.int64)
        if before_layers is not None:
            before_layers()
        if self._fused_decode(x, positions, kv_caches, attn_metadata, aux, aux_index):
            return x if aux is None else (x, aux)
        rope = RopeStep(self.rotary, positions)
        residual: Tensor | None = None
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            if aux is not None and i in aux_layers:
                # What the layer's input norm sees: x + residual (vLLM's hidden + residual).
                stream = x if residual is None else x + residual
                for j, listed in enumerate(aux_layers):
                    if listed == i:
                        aux[:, j * h:(j + 1) * h] = stream
            x, residual = layer(x, residual, rope, kv_cache, attn_metadata, self.attn_backend)
        if residual is None:  # no layers
            hidden = rms_norm(x, self.norm, self.arch.rms_norm_eps)
        else:
            hidden = fused_add_rms_norm(x, residual, self.norm, self.arch.rms_norm_eps)[0]
        return hidden if aux is None else (hidden, aux)

    def _fused_decode(self, x: Tensor, positions: Tensor, kv_caches: list[Tensor],
                      meta: AttentionMetadata, aux: Tensor | None = None,
                      aux_index: Tensor | None = None) -> bool:
        """Runs the layers and the final norm on x in place through the C decode kernel when
        the step is decode-only, small, and on the default attention backend with its C
        kernel (float32 on the CPU); False, having done nothing, otherwise. aux/aux_index:
        forward's aux output and its layer indices (int64), filled by the kernel too."""
        num_tokens = x.shape[0]
        backend = self.attn_backend
        if not (self.use_fused_decode and 0 < num_tokens <= FUSED_DECODE_MAX_TOKENS
                and meta.num_decodes == meta.num_reqs == meta.num_actual_tokens == num_tokens
                and type(backend) is TorchAttentionBackend and backend.use_cpu_kernel
                and x.device.type == "cpu" and x.dtype == torch.float32 and self.layers):
            return False
        table = self._decode_layer_table(kv_caches)
        if table is None:
            return False
        arch = self.arch
        _, num_blocks, block_size, _, _ = kv_caches[0].shape
        return cpu_kernels.llama_decode(
            x, table, self.norm, num_heads=arch.num_attention_heads,
            num_kv_heads=arch.num_key_value_heads, head_dim=arch.head_dim,
            intermediate_size=arch.intermediate_size, eps=arch.rms_norm_eps,
            scale=self.layers[0].scale, positions=positions, cos=self.rotary.cos,
            sin=self.rotary.sin, slot_mapping=meta.slot_mapping,
            block_tables=meta.block_tables, seq_lens=meta.seq_lens, num_blocks=num_blocks,
            block_size=block_size,
            weight_format=self.layers[0].qkv_proj.gemv_format, aux=aux, aux_layers=aux_index,
            lora=None if self.lora is None else self.lora.decode_args())

    def _decode_layer_table(self, kv_caches: list[Tensor]) -> Tensor | None:
        key = tuple(c.data_ptr() for c in kv_caches)
        if self._decode_table is None or self._decode_table[0] != key:
            arch = self.arch
            kv_shape = (arch.num_key_value_heads, arch.head_dim)
            if (len(kv_caches) != len(self.layers) or len({c.shape for c in kv_caches}) != 1
                    or kv_caches[0].dim() != 5 or kv_caches[0].shape[-2:] != kv_shape):
                return None
            table = cpu_kernels.decode_layer_table([
                {"input_norm": layer.input_layernorm, "qkv": layer.qkv_proj.weight,
                 "qkv_scales": layer.qkv_proj.scales, "qkv_bias": layer.qkv_proj.bias,
                 "q_norm": layer.q_norm, "k_norm": layer.k_norm, "o": layer.o_proj.weight,
                 "o_scales": layer.o_proj.scales, "post_norm": layer.post_attention_layernorm,
                 "gate_up": layer.gate_up_proj.weight,
                 "gate_up_scales": layer.gate_up_proj.scales, "down": layer.down_proj.weight,
                 "down_scales": layer.down_proj.scales, "kv_cache": cache}
                for layer, cache in zip(self.layers, kv_caches)])
            if table is None:
                return None
            self._decode_table = (key, table)
        return self._decode_table[1]

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """hidden [N, H] -> logits [N, V] in float32."""
        return lm_head_logits(hidden, self.lm_head)

    def linears(self) -> list[Linear]:
        """Every projection and the embedding / LM head, each once."""
        out = [p for layer in self.layers for p in layer.projections()]
        out.append(self.embed_tokens)
        if self.lm_head is not self.embed_tokens:
            out.append(self.lm_head)
        return out

    @torch.no_grad()
    def convert_weights(self, storage: str) -> None:
        """Every projection and the embedding / LM head into `storage` (layers.WEIGHT_STORAGES:
        float32, bfloat16, float16, int8), computed from the loaded weights. Norms, biases,
        RoPE tables and the activations keep the model's dtype."""
        self._decode_table = None  # raw pointers to the old weights
        for lin in self.linears():
            lin.convert(storage)

    @torch.no_grad()
    def load_q4_1_blocks(self, blocks: Iterable[tuple[str, Tensor]]) -> None:
        """The projections' weights from a GGUF's own Q4_1 blocks (HF-named, as
        gguf_loader.iter_gguf_q4_1_blocks yields them), fused as load_weights fuses rows;
        the embedding / LM head become int8 (their file format, Q8_0, is not read as is).
        Raises ValueError for a projection the blocks leave unfilled."""
        self._decode_table = None
        projections = [lin for layer in self.layers for lin in layer.projections()]
        for lin in projections:
            lin.use_q4_1_storage()
        names = {id(p): n for n, p in self.named_parameters()}
        self._check_loaded(self._copy_weights(blocks),
                           [names[id(lin.weight)] for lin in projections], "Q4_1 blocks")
        self.embed_tokens.convert("int8")
        if self.lm_head is not self.embed_tokens:
            self.lm_head.convert("int8")

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
    def load_weights(self, weights: Iterable[tuple[str, Tensor]]) -> None:
        """Loads Hugging Face-named tensors (all of them, in one call), fusing q/k/v and gate/up.

        Raises ValueError for an unknown name, a shape mismatch, or any parameter (or part of
        a fused one) left unloaded.
        """
        self._decode_table = None  # raw pointers to the parameters: rebuilt on next use
        self._check_loaded(self._copy_weights(weights),
                           [name for name, _ in self.named_parameters()], "weight(s)")

    def _copy_weights(self, weights: Iterable[tuple[str, Tensor]]) -> dict[str, int]:
        """Copies each HF-named tensor into its parameter (or its rows of a fused one);
        returns how many tensors went into each parameter."""
        parts_loaded: dict[str, int] = {}
        for hf_name, tensor in weights:
            target = self._locate(hf_name)
            if target is None:
                continue
            name, rows = target
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
        if target is None or not _has_param(self.layers[layer], target[0]):
            raise ValueError(f"unexpected weight {hf_name!r} for {self.arch.architecture}")
        return f"layers.{layer}.{target[0]}", target[1]


def copy_param_rows(param: Tensor, rows: tuple[int, int] | None, tensor: Tensor,
                    name: str) -> None:
    """Copies a checkpoint tensor into `param` (or its row range of a fused parameter);
    ValueError naming `name` on a shape mismatch."""
    dest = param if rows is None else param.narrow(0, rows[0], rows[1] - rows[0])
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"{name}: shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
    dest.copy_(tensor)


def _has_param(module: nn.Module, dotted: str) -> bool:
    """module.<dotted> exists and is not None (a bias or norm the architecture lacks is)."""
    obj: object = module
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return False
    return True


def _layer_weight_table(arch: ModelArchConfig) -> dict[str, tuple[str, tuple[int, int] | None]]:
    """HF name inside a layer -> (our parameter, row range for fused ones)."""
    q, kv, inter = arch.q_size, arch.kv_size, arch.intermediate_size
    return {
        "input_layernorm.weight": ("input_layernorm", None),
        "post_attention_layernorm.weight": ("post_attention_layernorm", None),
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


def make_kv_caches(arch: ModelArchConfig, num_blocks: int, block_size: int,
                   dtype: torch.dtype, device: torch.device) -> list[Tensor]:
    """One `[2, num_blocks, block_size, num_kv_heads, head_dim]` tensor per layer.

    Zeroed, not empty: padded decode reads touch slots no request wrote, and although their
    attention weight is 0, a NaN left in uninitialised memory would still poison 0 * NaN.
    In huge pages on the CPU, like the weights: decode attention streams the context's K/V.
    """
    shape = (2, num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
    return [hugepages.empty(shape, dtype, device).zero_()
            for _ in range(arch.num_hidden_layers)]


def kv_cache_bytes_per_block(arch: ModelArchConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes over all layers (K and V)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * arch.num_key_value_heads * arch.head_dim * itemsize
    return per_layer * arch.num_hidden_layers
