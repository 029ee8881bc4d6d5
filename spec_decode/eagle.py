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
import json
import os
from typing import Any

import torch
from torch import Tensor, nn

from aioengine.config import ConfigError
from aioengine.model import hugepages, layers
from aioengine.model.arch import ModelArchConfig
from aioengine.model.attention import AttentionMetadata, TorchAttentionBackend
from aioengine.model.layer_spec import layer_specs
from aioengine.spec_decode.eagle_fused import FusedEagleStep
from aioengine.model.layers import Linear, _param, lm_head_logits
from aioengine.model.decoder_layer import LlamaDecoderLayer
from aioengine.model.llama import _has_param, _layer_weight_table, copy_param_rows
from aioengine.model.loader import ModelLoadError, activation_dtype, safetensors_files
from aioengine.model.ops import select_ops
from aioengine.model.rotary import RopeStep, RotaryEmbedding

EAGLE_METHODS = ("eagle", "eagle3")
_FIELD = "speculative_config.model"
# Checkpoint tensors we do not use: the heads' copies of the target's embedding (the
# target's own is passed in), t2d (the inverse of d2t), RoPE tables (recomputed).
_IGNORED = ("embed_tokens.weight", "t2d")


class SpeculativeConfigError(ConfigError):
    """The speculative_config's draft head cannot be used with this target model."""


def default_aux_layer_ids(num_layers: int) -> tuple[int, ...]:
    """vLLM's EAGLE-3 default (2, L // 2, L - 3) for a target of L layers, clamped into
    [0, L) and deduplicated for tiny targets (L = 4 -> (1, 2)); sorted, the order vLLM
    concatenates them in."""
    return tuple(sorted({min(max(i, 0), num_layers - 1)
                         for i in (2, num_layers // 2, num_layers - 3)}))


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
        """The head's one layer of KV cache, [2, num_blocks, block_size, Hkv, D], zeroed
        (as llama.make_kv_caches, for the same reason)."""
        shape = (2, num_blocks, block_size, self.arch.num_key_value_heads, self.arch.head_dim)
        return hugepages.empty(shape, dtype or self.dtype, self.device).zero_()

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
                    dtype: torch.dtype, device: torch.device) -> EagleHead:
    """The draft head in `path` (config.json + weights in the EAGLE / vLLM formats) for
    `target_arch`; projections stored in `dtype`, computing in activation_dtype (float32
    on the CPU), as the target. Raises SpeculativeConfigError naming speculative_config.model
    for a missing directory or weights, a head that does not fit the target (hidden size,
    vocabulary, d2t, aux layers) and unknown, missing or misshapen weights."""
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
    cfg = _read_config(path)
    tensors = {_canonical_name(n, method): t for n, t in _read_weights(path).items()}
    eagle3 = method == "eagle3"
    arch = _draft_arch(cfg, target_arch, path)
    # What the checkpoint holds decides the optional parts (configs disagree on "bias").
    arch = dataclasses.replace(arch, attention_bias="layers.0.self_attn.q_proj.bias" in tensors)
    draft_vocab = int(cfg.get("draft_vocab_size") or arch.vocab_size)  # EAGLE-3's
    if eagle3 and not 0 < draft_vocab <= arch.vocab_size:
        raise SpeculativeConfigError(f"{_FIELD}: draft_vocab_size {draft_vocab} does not fit "
                                     f"the target's vocabulary of {arch.vocab_size}")
    # EAGLE-3 without an lm_head of its own (a full vocabulary) reads the target's.
    own_head = eagle3 and ("lm_head.weight" in tensors or draft_vocab < arch.vocab_size)
    compute = activation_dtype(dtype, device)
    head = EagleHead(
        method, arch, aux_layer_ids=_aux_layer_ids(cfg, target_arch, path) if eagle3 else (),
        fc_bias="fc.bias" in tensors,
        input_layernorm=eagle3 or "layers.0.input_layernorm.weight" in tensors,
        draft_vocab_size=draft_vocab if own_head else None,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
        dtype=compute, device=device)
    fc = tensors.get("fc.weight")
    if head.fc is not None and fc is not None and fc.shape[-1] != head.fc.in_features:
        what = (f"{len(head.aux_layer_ids)} aux layers {list(head.aux_layer_ids)} x hidden "
                f"size {arch.hidden_size}" if eagle3 else f"2 x hidden size {arch.hidden_size}")
        raise SpeculativeConfigError(f"{_FIELD}: fc.weight takes {fc.shape[-1]} inputs, "
                                     f"expected {head.fc.in_features} ({what})")
    _copy_weights(head, tensors, path)
    head.draft_to_target = _draft_to_target(tensors.get("d2t"), draft_vocab if own_head
                                            else None, arch.vocab_size, path)
    if head.draft_to_target is not None:
        head.draft_to_target = head.draft_to_target.to(device)
    storage = str(dtype).removeprefix("torch.")
    for lin in head.linears():
        if storage != str(compute).removeprefix("torch."):
            lin.convert(storage)
        lin.pack()
    head.fused = FusedEagleStep(head)
    return head.eval()


def _read_config(path: str) -> dict[str, Any]:
    if not os.path.isdir(path):
        raise SpeculativeConfigError(f"{_FIELD}: no directory {path!r}")
    file = os.path.join(path, "config.json")
    try:
        with open(file) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise SpeculativeConfigError(f"{_FIELD}: {path!r} has no config.json") from None
    except ValueError as e:
        raise SpeculativeConfigError(f"{_FIELD}: {file} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise SpeculativeConfigError(f"{_FIELD}: {file} is not a JSON object")
    return cfg


def _read_weights(path: str) -> dict[str, Tensor]:
    """All tensors of the head (a few hundred MB at most: read at once)."""
    names = os.listdir(path)
    if any(n.endswith(".safetensors") or n == "model.safetensors.index.json" for n in names):
        from safetensors.torch import load_file

        try:
            files = safetensors_files(path)
        except ModelLoadError as e:
            raise SpeculativeConfigError(f"{_FIELD}: {e}") from None
        return {k: v for file in files for k, v in load_file(file).items()}
    if "pytorch_model.bin" in names:  # the EAGLE repo's heads
        try:
            state = torch.load(os.path.join(path, "pytorch_model.bin"), map_location="cpu",
                               weights_only=True)
        except Exception as e:  # any unreadable or non-tensor pickle
            raise SpeculativeConfigError(f"{_FIELD}: cannot read {path}/pytorch_model.bin "
                                         f"as tensors: {e}") from None
        if isinstance(state, dict) and all(isinstance(v, Tensor) for v in state.values()):
            return state
        raise SpeculativeConfigError(f"{_FIELD}: {path}/pytorch_model.bin is not a state dict")
    raise SpeculativeConfigError(f"{_FIELD}: {path!r} has no weights (*.safetensors or "
                                 "pytorch_model.bin)")


def _canonical_name(name: str, method: str) -> str:
    """Checkpoint name -> the EAGLE-1 spelling of the layer ("layers.0."): EAGLE-3's
    "midlayer." is the same layer (vLLM renames it alike); a "model." prefix is dropped."""
    name = name.removeprefix("model.")
    if method == "eagle3" and name.startswith("midlayer."):
        return "layers.0." + name.removeprefix("midlayer.")
    return name


def _draft_arch(cfg: dict[str, Any], target: ModelArchConfig, path: str) -> ModelArchConfig:
    """The head's layer shape from its LlamaConfig-like config, checked against the target."""
    from transformers import AutoConfig

    fields = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
    try:  # architectures (LlamaForCausalLMEagle3, ...) dropped: the model_type decides
        arch = ModelArchConfig.from_hf_config(
            AutoConfig.for_model(cfg.get("model_type", "llama"), **fields))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise SpeculativeConfigError(f"{_FIELD}: unsupported draft config in {path}: {e}") from e
    for name, ours, theirs in (("hidden_size", arch.hidden_size, target.hidden_size),
                               ("target_hidden_size", cfg.get("target_hidden_size",
                                                              target.hidden_size),
                                target.hidden_size),
                               ("vocab_size", arch.vocab_size, target.vocab_size)):
        if ours != theirs:
            raise SpeculativeConfigError(f"{_FIELD}: the draft head's {name} {ours} differs "
                                         f"from the target model's {theirs}")
    if arch.num_hidden_layers != 1:
        raise SpeculativeConfigError(f"{_FIELD}: draft heads of one layer are supported, "
                                     f"got num_hidden_layers {arch.num_hidden_layers}")
    if arch.qk_norm:
        raise SpeculativeConfigError(f"{_FIELD}: draft heads with q/k norms are not supported")
    # RoPE's table covers the target's positions (for default and llama3 RoPE the angle of
    # a position does not depend on max_position_embeddings: EAGLE-3 configs say 2048).
    return dataclasses.replace(arch, max_position_embeddings=max(
        arch.max_position_embeddings, target.max_position_embeddings))


def _aux_layer_ids(cfg: dict[str, Any], target: ModelArchConfig, path: str) -> tuple[int, ...]:
    """EAGLE-3's target layers, read where vLLM reads them (top level, then eagle_config),
    else vLLM's default; () when eagle_config.use_aux_hidden_state is false."""
    eagle_config = cfg.get("eagle_config") or {}
    if not eagle_config.get("use_aux_hidden_state", True):
        return ()
    ids = (cfg.get("eagle_aux_hidden_state_layer_ids")
           or eagle_config.get("eagle_aux_hidden_state_layer_ids"))
    num_layers = target.num_hidden_layers
    if not ids:
        return default_aux_layer_ids(num_layers)
    if not isinstance(ids, list) or not all(
            isinstance(i, int) and 0 <= i < num_layers for i in ids):
        raise SpeculativeConfigError(f"{_FIELD}: eagle_aux_hidden_state_layer_ids {ids!r} in "
                                     f"{path} must be layer ids in [0, {num_layers})")
    return tuple(sorted(set(ids)))


@torch.no_grad()
def _copy_weights(head: EagleHead, tensors: dict[str, Tensor], path: str) -> None:
    """Copies every checkpoint tensor into its parameter (fusing q/k/v and gate/up); raises
    for an unknown, misshapen or missing one. d2t is read by _draft_to_target."""
    table = {"fc.weight": ("fc.weight", None), "fc.bias": ("fc.bias", None),
             "layers.0.hidden_norm.weight": ("hidden_norm", None),
             "norm.weight": ("norm", None), "lm_head.weight": ("lm_head.weight", None)}
    table.update({f"layers.0.{name}": (f"layer.{param}", rows)
                  for name, (param, rows) in _layer_weight_table(head.arch).items()})
    table = {name: t for name, t in table.items() if _has_param(head, t[0])}
    unknown = []
    for name, tensor in tensors.items():
        if (name in _IGNORED or name.endswith("rotary_emb.inv_freq")
                or (name == "d2t" and head.method == "eagle3")):
            continue
        if name not in table:
            unknown.append(name)
            continue
        param_name, rows = table[name]
        try:
            copy_param_rows(head.get_parameter(param_name), rows, tensor, name)
        except ValueError as e:
            raise SpeculativeConfigError(f"{_FIELD}: {e}") from None
    if unknown:
        hint = (" (an EAGLE-3 head? speculative_config.method 'eagle3' reads it)"
                if head.method == "eagle" and any(n.startswith("midlayer.") for n in unknown)
                else "")
        raise SpeculativeConfigError(f"{_FIELD}: unexpected weight(s) for a {head.method} "
                                     f"head in {path}: {sorted(unknown)[:5]}{hint}")
    missing = sorted(set(table) - set(tensors))
    if missing:
        raise SpeculativeConfigError(f"{_FIELD}: {path} is missing weight(s) {missing[:5]}")


def _draft_to_target(d2t: Tensor | None, draft_vocab: int | None, vocab_size: int,
                     path: str) -> Tensor | None:
    """Target id of each draft id (d + d2t[d]), checked to be distinct ids of the target's
    vocabulary; None where the draft vocabulary is the target's, in order."""
    if draft_vocab is None:
        return None
    if d2t is None:
        if draft_vocab < vocab_size:
            raise SpeculativeConfigError(f"{_FIELD}: a draft vocabulary of {draft_vocab} < "
                                         f"{vocab_size} tokens needs the d2t map in {path}")
        return None
    if tuple(d2t.shape) != (draft_vocab,) or d2t.dtype.is_floating_point:
        raise SpeculativeConfigError(f"{_FIELD}: d2t must be [{draft_vocab}] integers, got "
                                     f"{tuple(d2t.shape)} {d2t.dtype}")
    targets = torch.arange(draft_vocab) + d2t.long()
    if targets.min() < 0 or targets.max() >= vocab_size or targets.unique().numel() < draft_vocab:
        raise SpeculativeConfigError(f"{_FIELD}: d2t maps draft ids outside the target's "
                                     f"vocabulary of {vocab_size} or onto one id twice")
    if draft_vocab == vocab_size and bool((d2t == 0).all()):
        return None
    return targets
