"""One decoder layer of the Llama-family model, as its `LayerSpec` describes it: the
attention (q/k/v as one matmul, RoPE from a precomputed table, the backend's paged
attention, or soft-capped attention for Gemma 2), the norms in the family's style, and the
MLP (dense gate/up + down, or a sparse mixture of experts, `moe.py`). Every projection can
be wrapped through a `LinearFactory` (LoRA). The EAGLE draft head runs `attention_mlp`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aioengine.model.attention import AttentionBackend, AttentionMetadata
from aioengine.model.layer_spec import LayerSpec
from aioengine.model.layers import Linear, LinearFactory, ProjectionSpec, _param
from aioengine.model.moe import SparseMoeBlock
from aioengine.model.ops import TorchOps
from aioengine.model.rotary import RopeStep
from aioengine.model.softcap_attention import softcap_attention


class LlamaDecoderLayer(nn.Module):
    """One decoder layer as its LayerSpec describes it.

    The base projections (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`: `Linear`s,
    whose weights the loader fills and the fused executor reads) are registered modules;
    forward calls what `linear_factory` made of each (the base itself without one).
    `qkv_input_size` (default: hidden size) and `input_layernorm=False` serve draft heads
    whose attention reads something else than the residual stream."""

    def __init__(self, spec: LayerSpec, ops: TorchOps, dtype: torch.dtype,
                 device: torch.device, linear_factory: LinearFactory | None = None, *,
                 qkv_input_size: int | None = None, input_layernorm: bool = True) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        kw = {"dtype": dtype, "device": device}
        self.spec, self.ops = spec, ops
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, d
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.eps, self.scale = spec.rms_norm_eps, spec.scale
        pre, post = spec.norm_style != "post", spec.norm_style != "pre"
        self.input_layernorm = _param(h, **kw) if input_layernorm and pre else None
        self.qkv_proj = Linear(qkv_input_size or h, self.q_size + 2 * self.kv_size,
                               spec.attention_bias, **kw)
        # Per head (Qwen3, Gemma 3) or over the whole projection (OLMo 2).
        q_norm, k_norm = (self.q_size, self.kv_size) if spec.qk_norm_whole else (d, d)
        qk_norm = spec.qk_norm or spec.qk_norm_whole
        self.q_norm = _param(q_norm, **kw) if qk_norm else None
        self.k_norm = _param(k_norm, **kw) if qk_norm else None
        self.o_proj = Linear(self.q_size, h, False, **kw)
        self.post_attention_layernorm = _param(h, **kw) if pre else None  # before the MLP
        # Norms of the attention and MLP outputs, before each residual add (Gemma, OLMo 2).
        self.attn_out_norm = _param(h, **kw) if post else None
        self.mlp_out_norm = _param(h, **kw) if post else None
        # A sparse MLP (moe.py) replaces the dense one where the spec has one.
        self.mlp = None if spec.moe is None else SparseMoeBlock(spec.moe, h, ops, dtype, device)
        dense = self.mlp is None
        self.gate_up_proj = Linear(h, 2 * spec.intermediate_size, False, **kw) if dense else None
        self.down_proj = Linear(spec.intermediate_size, h, False, **kw) if dense else None
        slices = {"qkv_proj": (self.q_size, self.kv_size, self.kv_size), "o_proj": (h,),
                  "gate_up_proj": (spec.intermediate_size,) * 2, "down_proj": (h,)}
        bases = self.projections()
        # A tuple, not attributes: a wrapper is not registered twice under the layer.
        self._run: tuple[nn.Module, ...] = bases if linear_factory is None else tuple(
            linear_factory(ProjectionSpec(spec.layer_idx, name, slices[name]), base)
            for name, base in zip(slices, bases))

    def projections(self) -> tuple[Linear, ...]:
        """The base projections (qkv, o, and the dense MLP's gate_up, down)."""
        if self.gate_up_proj is None or self.down_proj is None:
            return self.qkv_proj, self.o_proj
        return self.qkv_proj, self.o_proj, self.gate_up_proj, self.down_proj

    def stored_linears(self) -> list[Linear]:
        """Every Linear held in the model's storage format: the projections and, in a
        sparse layer, its experts'."""
        return [*self.projections(), *(self.mlp.stored_linears() if self.mlp else ())]

    def forward(self, x: Tensor, residual: Tensor | None, rope: RopeStep, kv_cache: Tensor,
                meta: AttentionMetadata, attn: AttentionBackend) -> tuple[Tensor, Tensor]:
        """x: the previous layer's MLP output (the embeddings for the first layer, with
        residual None), not yet added to the residual stream. Returns this layer's MLP
        output and the residual stream, the pair the next layer takes (vLLM's layout: each
        residual add is fused into the RMSNorm that follows it)."""
        if self.input_layernorm is None:  # no input norm: attention reads the stream
            residual = x if residual is None else x + residual
            return self.attention_mlp(residual, residual, rope, kv_cache, meta, attn)
        if residual is None:
            h, residual = self.ops.rms_norm(x, self.input_layernorm, self.eps), x
        else:
            h, residual = self.ops.fused_add_rms_norm(x, residual, self.input_layernorm,
                                                      self.eps)
        return self.attention_mlp(h, residual, rope, kv_cache, meta, attn)

    def attention_mlp(self, h: Tensor, residual: Tensor, rope: RopeStep | None,
                      kv_cache: Tensor, meta: AttentionMetadata,
                      attn: AttentionBackend) -> tuple[Tensor, Tensor]:
        """The layer from its attention on: h is the attention's input (normed), residual
        the stream it is added to. Returns (MLP output, residual stream), not yet added.
        rope None: the layer applies no RoPE (SmolLM3's NoPE layers)."""
        qkv_proj, o_proj = self._run[:2]
        spec, t = self.spec, h.shape[0]
        qkv = qkv_proj(h)
        # q and k heads side by side, [T, Hq + Hkv, D], so RoPE runs once for both.
        qk_size = self.q_size + self.kv_size
        if spec.qk_norm_whole:  # OLMo 2: RMSNorm over all of q and all of k
            qk = torch.cat((F.rms_norm(qkv[:, :self.q_size], (self.q_size,), self.q_norm,
                                       self.eps),
                            F.rms_norm(qkv[:, self.q_size:qk_size], (self.kv_size,),
                                       self.k_norm, self.eps)), dim=1)
            qk = qk.view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        else:
            qk = qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim)
        v = qkv[:, qk_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not spec.qk_norm_whole:  # Qwen3: per-head q/k norm
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat((self._head_norm(q, self.q_norm), self._head_norm(k, self.k_norm)),
                           dim=1)
        if rope is not None:
            qk = rope(qk)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        if spec.attn_logit_softcapping is not None:
            o = softcap_attention(q, k, v, kv_cache, meta, self.scale, spec.sliding_window,
                                  spec.attn_logit_softcapping)
        else:
            o = attn.forward(q, k, v, kv_cache, meta, self.scale, spec.sliding_window)
        o = self._output(o_proj(o.view(t, self.q_size)), self.attn_out_norm)
        if self.post_attention_layernorm is None:
            h = residual = o + residual
        else:
            h, residual = self.ops.fused_add_rms_norm(o, residual,
                                                      self.post_attention_layernorm, self.eps)
        if self.mlp is not None:
            return self._output(self.mlp(h), self.mlp_out_norm), residual
        gate_up_proj, down_proj = self._run[2:]
        return self._output(down_proj(self._act(gate_up_proj(h))), self.mlp_out_norm), residual

    def _act(self, gate_up: Tensor) -> Tensor:
        if self.spec.hidden_act == "silu":
            return self.ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)  # gelu_pytorch_tanh (GeGLU, Gemma)
        return F.gelu(gate, approximate="tanh") * up

    def _head_norm(self, x: Tensor, weight: Tensor) -> Tensor:
        """x [T, heads, D] with each head RMS-normed by weight [D]: the ops' row kernel over
        the T * heads rows, so the layer path rounds as the fused decode kernel does."""
        t, n, d = x.shape
        return self.ops.rms_norm(x.reshape(t * n, d), weight, self.eps).view(t, n, d)

    def _output(self, x: Tensor, norm: Tensor | None) -> Tensor:
        """An attention or MLP output as it is added to the residual stream: normed
        (Gemma, OLMo 2), scaled (Granite's residual_multiplier)."""
        if norm is not None:
            x = self.ops.rms_norm(x, norm, self.eps)
        if self.spec.residual_multiplier != 1.0:
            x = x * self.spec.residual_multiplier
        return x
