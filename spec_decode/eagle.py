"""EAGLE-1 and EAGLE-3 draft heads over aioengine's paged KV cache, and their loader.

Both are one Llama decoder layer that reads the target's hidden states besides the token
embeddings (the target's own embedding matrix: the heads' copies are ignored), with RoPE
and the paged cache of aioengine's attention backend. The conventions, as vLLM
(llama_eagle.py, llama_eagle3.py) and the EAGLE repo (eagle/model/cnets1.py, cnets.py)
implement them:

    EAGLE-1  hidden = the target's FINAL-NORMED hidden states [T, H] (what its LM head reads)
             x = fc([embed(ids), hidden])         fc: [H, 2H] (+ bias where stored)
             a = input_layernorm(x) if the checkpoint has one, else x (EAGLE-1 heads have
                 none on layer 0; vLLM always skips it there)
             x = x + attn(a); x = x + mlp(post_attention_layernorm(x))
             -> (x, x): no final norm, the target's LM head reads x as is.
    EAGLE-3  hidden = the target's aux hidden states side by side [T, len(aux) * H]: entry
             i the residual stream INTO target layer aux_layer_ids[i] (= transformers'
             output_hidden_states[i]; 0 = the embeddings), in increasing layer order (vLLM
             captures them in its layer loop); or a previous draft step's next_hidden [T, H]
             h = fc(hidden) if its width is not H, else hidden     fc: [H, len(aux) * H]
             a = [input_layernorm(embed(ids)), hidden_norm(h)]      (embeddings first)
             x = h + attn(a) (residual = h; hidden_norm(h) with norm_before_residual)
             x = x + mlp(post_attention_layernorm(x))
             -> (norm(x), x): its own lm_head [draft_vocab, H] reads norm(x) (the target's
             when the checkpoint has none), draft id d is target id d + d2t[d].

Checkpoints: a directory with config.json and *.safetensors, or the EAGLE repo's
pytorch_model.bin (read with torch.load(weights_only=True): tensors only, no code runs).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import Tensor, nn

from aioengine import envs
from aioengine.model import hugepages, layers
from aioengine.model.arch import ModelArchConfig
from aioengine.model.attention import AttentionMetadata, TorchAttentionBackend
from aioengine.model.layer_spec import layer_specs
# The checkpoint's reading lives in eagle_checkpoint.py; its error and aux-layer default are
# re-exported here, where callers have always found them.
from aioengine.spec_decode.eagle_checkpoint import (SpeculativeConfigError, default_aux_layer_ids,
                                                    read_checkpoint)
from aioengine.spec_decode.eagle_fused import FusedEagleStep
from aioengine.model.layers import Linear, _param, lm_head_logits
from aioengine.model.decoder_layer import LlamaDecoderLayer
from aioengine.model.loader import activation_dtype
from aioengine.model.ops import select_ops
from aioengine.model.rotary import RopeStep, RotaryEmbedding

EAGLE_METHODS = ("eagle", "eagle3")
__all__ = ["EAGLE_METHODS", "EagleHead", "SpeculativeConfigError", "default_aux_layer_ids",
           "load_eagle_head"]


class EagleHead(nn.Module):
    """One EAGLE-1 or EAGLE-3 draft layer (see the module docstring for the formulas).

    `input_hidden_size` is the width of the target hidden states forward takes: H for
    EAGLE-1, len(aux_layer_ids) * H for EAGLE-3 (forward also takes width H there: a
    previous draft step's next_hidden, fc already applied)."""

    def __init__(self, method: str, arch: ModelArchConfig, *, aux_layer_ids: tuple[int, ...],
                 fc_bias: bool, input_layernorm: bool, draft_vocab_size: int | None,
                 norm_before_residual: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        h = arch.hidden_size
        kw = {"dtype": dtype, "device": device}
        eagle3 = method == "eagle3"
        self.method, self.arch, self.hidden_size = method, arch, h
        self.dtype, self.device = dtype, device
        self.eps = arch.rms_norm_eps
        self.aux_layer_ids = aux_layer_ids
        self.input_hidden_size = h * max(len(aux_layer_ids), 1) if eagle3 else h
        self.norm_before_residual = norm_before_residual
        # EAGLE-3 without aux states (eagle_config.use_aux_hidden_state = false) has no fc.
        has_fc = not eagle3 or bool(aux_layer_ids)
        self.fc = Linear(2 * h if not eagle3 else self.input_hidden_size, h, fc_bias,
                         **kw) if has_fc else None
        self.ops = select_ops(device)
        # The target's decoder layer code, as EAGLE heads are: Llama layers with full
        # attention and no q/k norms; EAGLE-3's q/k/v read [embeddings, hidden] side by side.
        spec = dataclasses.replace(layer_specs(arch)[0], qk_norm=False, sliding_window=None)
        self.layer = LlamaDecoderLayer(spec, self.ops, dtype, device,
                                       qkv_input_size=2 * h if eagle3 else None,
                                       input_layernorm=input_layernorm)
        self.hidden_norm = _param(h, **kw) if eagle3 else None
        self.norm = _param(h, **kw) if eagle3 else None
        self.lm_head = Linear(h, draft_vocab_size, False, **kw) if draft_vocab_size else None
        # [draft_vocab] int64: target id of each draft id (d + d2t[d]); None = the identity.
        self.draft_to_target: Tensor | None = None
        self.rotary = RotaryEmbedding(arch, dtype, device)
        self.attn_backend = TorchAttentionBackend()
        # The fused C step (eagle_fused.py), set by load_eagle_head once the weights are in
        # their final storage; None: the torch path only.
        self.fused: FusedEagleStep | None = None

    def linears(self) -> list[Linear]:
        lins = [self.fc, *self.layer.projections(), self.lm_head]
        return [lin for lin in lins if lin is not None]

    def make_kv_cache(self, num_blocks: int, block_size: int,
                      dtype: torch.dtype | None = None) -> Tensor:
        """The head's one layer of KV cache, [2, num_blocks, block_size, Hkv, D], zeros
        as llama.make_kv_caches makes them, for the same reason: on the CPU a fresh mapping
        whose pages the kernel zeroes on first touch. Zeroed here, it was resident at once
        (781 MiB in float32 beside the bundled model's default 31,798 blocks, doubling a
        server's RSS at start-up); written at once with AIOENGINE_CPU_KV_PREFAULT=1."""
        shape = (2, num_blocks, block_size, self.arch.num_key_value_heads, self.arch.head_dim)
        dtype = dtype or self.dtype
        return hugepages.zeros(shape, dtype, self.device, envs.AIOENGINE_CPU_KV_PREFAULT)

    def forward(self, input_ids: Tensor, hidden: Tensor, positions: Tensor, kv_cache: Tensor,
                attn_metadata: AttentionMetadata, embed: Linear) -> tuple[Tensor, Tensor]:
        """input_ids/positions [T], hidden [T, input_hidden_size] (EAGLE-3: or [T, H]) ->
        (logits_hidden [T, H] for compute_logits, next_hidden [T, H] for the next draft
        step). Writes this step's K/V into kv_cache. `embed` is the target's embedding."""
        h = self.hidden_size
        emb = layers.embed(input_ids, embed, self.dtype)
        hidden = hidden.to(self.dtype)
        if self.method == "eagle":
            if hidden.shape[-1] != h:
                raise ValueError(f"EAGLE-1 takes hidden states of width {h}, "
                                 f"got {hidden.shape[-1]}")
            x = self.fc(torch.cat((emb, hidden), dim=-1))
            ln = self.layer.input_layernorm
            residual, attn_in = x, (x if ln is None else self.ops.rms_norm(x, ln, self.eps))
        else:
            if hidden.shape[-1] != h:
                if self.fc is None or hidden.shape[-1] != self.input_hidden_size:
                    raise ValueError(f"EAGLE-3 takes hidden states of width {h} or "
                                     f"{self.input_hidden_size}, got {hidden.shape[-1]}")
                hidden = self.fc(hidden)
            else:
                hidden = hidden.clone()  # the residual: fused_add_rms_norm writes into it
            fused = None if self.fused is None else self.fused.run(
                emb, hidden, positions, kv_cache, attn_metadata)
            if fused is not None:
                return fused
            normed = self.ops.rms_norm(hidden, self.hidden_norm, self.eps)
            residual = normed if self.norm_before_residual else hidden
            attn_in = torch.cat((self.ops.rms_norm(emb, self.layer.input_layernorm, self.eps),
                                 normed), dim=-1)
        # The target's own layer code from its attention on.
        out, residual = self.layer.attention_mlp(
            attn_in, residual, RopeStep(self.rotary, positions, self.ops), kv_cache,
            attn_metadata, self.attn_backend)
        if self.method == "eagle":
            x = out + residual
            return x, x
        return self.ops.fused_add_rms_norm(out, residual, self.norm, self.eps)

    def draft_argmax(self, hidden: Tensor, target_lm_head: Linear) -> Tensor:
        """logits_hidden [N, H] -> the target id [N] of the most likely draft token:
        compute_logits' argmax without scattering a reduced vocabulary into the target's,
        and without lm_head_logits' float32 refinement of bf16 near-ties (a draft is a
        guess: a near-tie guessed wrong costs a rejected draft, never a wrong token)."""
        head = self.lm_head if self.lm_head is not None else target_lm_head
        best = head(hidden).argmax(dim=1)
        if self.lm_head is None:
            return best
        return best if self.draft_to_target is None else self.draft_to_target[best]

    def draft_topk(self, hidden: Tensor, target_lm_head: Linear, k: int,
                   ) -> tuple[Tensor, Tensor]:
        """logits_hidden [N, H] -> (log-probabilities [N, k] float32, target ids [N, k]) of
        the k most likely draft tokens, best first (tree drafting's candidates)."""
        head = self.lm_head if self.lm_head is not None else target_lm_head
        top = torch.log_softmax(head(hidden).float(), dim=1).topk(k, dim=1)
        ids = top.indices
        if self.lm_head is not None and self.draft_to_target is not None:
            ids = self.draft_to_target[ids]
        return top.values, ids

    def compute_logits(self, hidden: Tensor, target_lm_head: Linear) -> Tensor:
        """logits_hidden [N, H] -> float32 logits [N, V_target]: through the head's own
        lm_head where it has one (a reduced vocabulary scattered through d2t, the target
        tokens outside it -inf), else the target's LM head."""
        if self.lm_head is None:
            return lm_head_logits(hidden, target_lm_head)
        logits = lm_head_logits(hidden, self.lm_head)
        if self.draft_to_target is None:
            return logits
        out = logits.new_full((logits.shape[0], self.arch.vocab_size), float("-inf"))
        return out.index_copy_(1, self.draft_to_target, logits)


def load_eagle_head(path: str, method: str, target_arch: ModelArchConfig,
                    dtype: torch.dtype, device: torch.device, *,
                    storage: str | None = None) -> EagleHead:
    """The draft head in `path` (config.json + weights in the EAGLE / vLLM formats) for
    `target_arch`; projections stored in `storage` (layers.WEIGHT_STORAGES; default
    `dtype`), computing in activation_dtype(dtype) (float32 on the CPU), as the target.
    Raises SpeculativeConfigError naming speculative_config.model for a missing directory
    or weights, a head that does not fit the target (hidden size, vocabulary, d2t, aux
    layers) and unknown, missing or misshapen weights."""
    if method not in EAGLE_METHODS:
        raise SpeculativeConfigError(f"speculative_config.method must be one of "
                                     f"{list(EAGLE_METHODS)} for a draft head, got {method!r}")
    from aioengine.model.registry import EAGLE_TARGET_ARCHITECTURES

    if target_arch.architecture not in EAGLE_TARGET_ARCHITECTURES:
        # A head is built as the target's layer: another family's options would leak in.
        raise SpeculativeConfigError(
            f"speculative_config.method {method!r}: EAGLE heads are supported for "
            f"{', '.join(sorted(EAGLE_TARGET_ARCHITECTURES))} targets, not "
            f"{target_arch.architecture} (use method 'ngram')")
    ckpt = read_checkpoint(path, method, target_arch)
    compute = activation_dtype(dtype, device)
    head = EagleHead(method, ckpt.arch, aux_layer_ids=ckpt.aux_layer_ids,
                     fc_bias=ckpt.fc_bias, input_layernorm=ckpt.input_layernorm,
                     draft_vocab_size=ckpt.draft_vocab_size,
                     norm_before_residual=ckpt.norm_before_residual,
                     dtype=compute, device=device)
    ckpt.copy_weights(head)
    head.draft_to_target = ckpt.draft_to_target()
    if head.draft_to_target is not None:
        head.draft_to_target = head.draft_to_target.to(device)
    storage = storage or str(dtype).removeprefix("torch.")
    for lin in head.linears():
        if storage != str(compute).removeprefix("torch."):
            lin.convert(storage)
        lin.pack()
    head.fused = FusedEagleStep(head)
    return head.eval()
