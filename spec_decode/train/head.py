"""The EAGLE-3 head as a trainable torch module, with training-time test (TTT), and its
export in the published EAGLE-3 format that `spec_decode.eagle.load_eagle_head` reads.

The formulas are those of EagleHead (see spec_decode/eagle.py), with the engine's reference
math (aioengine.model.ops.TorchOps' RMSNorm, rotary.apply_rope); here over a padded batch
[B, T] of whole sequences. Draft step j at origin t (the target's hidden state at t, the
token at t + 1 + j, RoPE position t + j) predicts the token at t + 2 + j. Step 0 reads
fc(aux states); step j > 0 reads step j - 1's own output hidden state at the same origin,
and attends to what the engine's chain attends to: the step-0 keys at positions <= t (the
head's KV written while catching up over the target's states) and the keys of steps
1..j at this origin (its own chain).
"""
from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from aioengine.model.arch import ModelArchConfig
from aioengine.model.ops import TorchOps
from aioengine.model.rotary import apply_rope, rope_inv_freq

_REF = TorchOps()  # differentiable: plain torch ops

# Checkpoint name -> attribute, in the EAGLE-3 spelling (the layer is "midlayer.").
_LINEARS = {"fc": "fc", "midlayer.self_attn.q_proj": "q_proj",
            "midlayer.self_attn.k_proj": "k_proj", "midlayer.self_attn.v_proj": "v_proj",
            "midlayer.self_attn.o_proj": "o_proj", "midlayer.mlp.gate_proj": "gate_proj",
            "midlayer.mlp.up_proj": "up_proj", "midlayer.mlp.down_proj": "down_proj"}
_NORMS = {"midlayer.input_layernorm": "input_layernorm",
          "midlayer.hidden_norm": "hidden_norm",
          "midlayer.post_attention_layernorm": "post_attention_layernorm", "norm": "norm"}


class TrainableEagle3(nn.Module):
    """EAGLE-3 draft layer over a frozen embedding and a frozen draft LM head.

    `embed` [V, H] is the target's embedding; `draft_ids` [Vd] the target ids of the draft
    vocabulary in increasing order (None: the whole vocabulary); the LM head starts as, and
    stays, the target's rows for them."""

    def __init__(self, arch: ModelArchConfig, aux_layer_ids: tuple[int, ...], embed: Tensor,
                 lm_head: Tensor, draft_ids: Tensor | None, max_positions: int = 4096) -> None:
        super().__init__()
        h, a = arch.hidden_size, len(aux_layer_ids)
        self.arch, self.aux_layer_ids = arch, tuple(aux_layer_ids)
        self.num_heads, self.num_kv_heads = arch.num_attention_heads, arch.num_key_value_heads
        self.head_dim, self.eps = arch.head_dim, arch.rms_norm_eps
        self.fc = nn.Linear(a * h, h, bias=False)
        self.q_proj = nn.Linear(2 * h, arch.q_size, bias=False)
        self.k_proj = nn.Linear(2 * h, arch.kv_size, bias=False)
        self.v_proj = nn.Linear(2 * h, arch.kv_size, bias=False)
        self.o_proj = nn.Linear(arch.q_size, h, bias=False)
        self.gate_proj = nn.Linear(h, arch.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, arch.intermediate_size, bias=False)
        self.down_proj = nn.Linear(arch.intermediate_size, h, bias=False)
        for name in _NORMS.values():
            setattr(self, name, nn.Parameter(torch.ones(h)))
        self.register_buffer("embed", embed.detach().float(), persistent=False)
        rows = lm_head if draft_ids is None else lm_head[draft_ids]
        self.register_buffer("lm_head", rows.detach().float().contiguous(), persistent=False)
        self.register_buffer("draft_ids", draft_ids, persistent=False)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32),
                            rope_inv_freq(arch).float())
        self.register_buffer("cos", freqs.cos(), persistent=False)
        self.register_buffer("sin", freqs.sin(), persistent=False)

    @property
    def draft_vocab_size(self) -> int:
        return self.lm_head.shape[0]

    def _norm(self, x: Tensor, weight: Tensor) -> Tensor:
        return _REF.rms_norm(x.float(), weight, self.eps)

    def _rope(self, x: Tensor, positions: Tensor) -> Tensor:
        """x [B, heads, T, D] rotated by positions [T] (neox halves, as RotaryEmbedding)."""
        return apply_rope(x.float(), self.cos[positions], self.sin[positions])  # cos [T, D/2]

    def _heads(self, x: Tensor, n: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, n, self.head_dim).transpose(1, 2)

    def forward(self, aux: Tensor, input_ids: Tensor, num_steps: int) -> list[Tensor]:
        """aux [B, T, A * H] (the target's aux states at each position), input_ids [B, T]
        (the sequences) -> per draft step j < num_steps, the normed hidden states [B, T, H]
        the LM head reads (`logits`) at each origin t, predicting the token at t + 2 + j.
        Positions past a sequence read token 0: the caller masks them out."""
        b, t, _ = aux.shape
        group = self.num_heads // self.num_kv_heads
        scale = self.head_dim ** -0.5
        hidden = self.fc(aux.to(self.fc.weight.dtype))
        base = torch.arange(t, device=aux.device)
        keys: list[tuple[Tensor, Tensor]] = []  # (k, v) of steps >= 1 at each origin
        k0 = v0 = None
        out = []
        for j in range(num_steps):
            ids = F.pad(input_ids[:, 1 + j:], (0, 1 + j))  # the token at t + 1 + j
            emb = self.embed[ids]
            x = torch.cat((self._norm(emb, self.input_layernorm),
                           self._norm(hidden, self.hidden_norm)), dim=-1)
            pos = (base + j).clamp(max=self.cos.shape[0] - 1)
            q = self._rope(self._heads(self.q_proj(x), self.num_heads), pos)
            k = self._rope(self._heads(self.k_proj(x), self.num_kv_heads), pos)
            v = self._heads(self.v_proj(x), self.num_kv_heads).float()
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            if j == 0:
                k0, v0 = k, v
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
            else:
                keys.append((k, v))
                o = _attend_chain(q, k0, v0, keys, scale)
            o = self.o_proj(o.transpose(1, 2).reshape(b, t, -1).to(x.dtype))
            residual = hidden + o
            mlp_in = self._norm(residual, self.post_attention_layernorm)
            hidden = residual + self.down_proj(
                F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in))
            out.append(self._norm(hidden, self.norm))
        return out

    def logits(self, normed: Tensor) -> Tensor:
        """Draft-vocabulary logits (float32) of forward's normed hidden states."""
        return (normed @ self.lm_head.t().to(normed.dtype)).float()

    def state_for_export(self) -> dict[str, Tensor]:
        """The head's tensors under the published EAGLE-3 names (float32; d2t, t2d)."""
        out = {f"{name}.weight": getattr(self, attr).weight.detach()
               for name, attr in _LINEARS.items()}
        out.update({f"{name}.weight": getattr(self, attr).detach()
                    for name, attr in _NORMS.items()})
        out["lm_head.weight"] = self.lm_head
        vocab = self.arch.vocab_size
        ids = (self.draft_ids if self.draft_ids is not None
               else torch.arange(vocab, device=self.lm_head.device))
        out["d2t"] = ids - torch.arange(len(ids), device=ids.device)
        t2d = torch.zeros(vocab, dtype=torch.bool, device=ids.device)
        t2d[ids] = True
        out["t2d"] = t2d
        return out


def _attend_chain(q: Tensor, k0: Tensor, v0: Tensor, chain: list[tuple[Tensor, Tensor]],
                  scale: float) -> Tensor:
    """Attention of step j's queries [B, h, T, D] over the step-0 keys at positions <= t
    and, at the same origin t only, the keys of steps 1..j (`chain`, in order)."""
    t = q.shape[2]
    scores = (q @ k0.transpose(-1, -2)) * scale
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    diag = torch.stack([(q * k).sum(-1) * scale for k, _ in chain], dim=-1)  # [B, h, T, j]
    weights = torch.softmax(torch.cat((scores, diag), dim=-1), dim=-1)
    out = weights[..., :t] @ v0
    vs = torch.stack([v for _, v in chain], dim=-2)  # [B, h, T, j, D]
    return out + (weights[..., t:].unsqueeze(-1) * vs).sum(-2)


def head_config(arch: ModelArchConfig, aux_layer_ids: tuple[int, ...],
                draft_vocab_size: int, n_predict: int, extra: dict | None = None) -> dict:
    """config.json of an exported head: a one-layer LlamaConfig with EAGLE-3's fields;
    n_predict: the draft tokens used when speculative_config does not say (vLLM's field)."""
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": arch.hidden_size, "intermediate_size": arch.intermediate_size,
        "num_attention_heads": arch.num_attention_heads,
        "num_key_value_heads": arch.num_key_value_heads, "head_dim": arch.head_dim,
        "num_hidden_layers": 1, "rms_norm_eps": arch.rms_norm_eps,
        "rope_theta": arch.rope_theta, "rope_scaling": arch.rope_scaling,
        "max_position_embeddings": arch.max_position_embeddings,
        "vocab_size": arch.vocab_size, "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": arch.hidden_size, "tie_word_embeddings": False,
        "n_predict": n_predict, "hidden_act": "silu", "attention_bias": False,
        "norm_before_residual": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids),
                         "use_aux_hidden_state": True},
    }
    if extra:
        cfg["aioengine"] = extra
    return cfg


def export_head(model: TrainableEagle3, out_dir: str, dtype: torch.dtype = torch.bfloat16,
                n_predict: int = 4, extra: dict | None = None) -> None:
    """Writes config.json + model.safetensors (floating tensors in `dtype`)."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous().cpu()
               for k, v in model.state_for_export().items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors.tmp"))
    os.replace(os.path.join(out_dir, "model.safetensors.tmp"),
               os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(head_config(model.arch, model.aux_layer_ids, model.draft_vocab_size,
                              n_predict, extra), f, indent=1)


def load_exported_head(head_dir: str, arch: ModelArchConfig, embed: Tensor, lm_head: Tensor,
                       ) -> tuple[TrainableEagle3, Tensor]:
    """An exported head (export_head's files) as a TrainableEagle3 in eval mode, its
    weights as stored (bf16) in float32, and t2d [V] (each target id's draft id, -1
    outside the draft vocabulary): what the trainer's evaluate takes."""
    from safetensors.torch import load_file

    with open(os.path.join(head_dir, "config.json")) as f:
        config = json.load(f)
    tensors = load_file(os.path.join(head_dir, "model.safetensors"))
    aux = tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    d2t = tensors["d2t"].long()
    draft_ids = torch.arange(len(d2t)) + d2t
    model = TrainableEagle3(arch, aux, embed, lm_head, draft_ids)
    _copy_trained(model, tensors)
    t2d = torch.full((arch.vocab_size,), -1, dtype=torch.long)
    t2d[draft_ids] = torch.arange(len(draft_ids))
    return model.eval(), t2d


def _copy_trained(model: TrainableEagle3, tensors: dict[str, Tensor]) -> None:
    """The trained tensors (fc, the layer, the norms) of an exported head into `model`."""
    with torch.no_grad():
        for name, attr in _LINEARS.items():
            getattr(model, attr).weight.copy_(tensors[f"{name}.weight"].float())
        for name, attr in _NORMS.items():
            getattr(model, attr).copy_(tensors[f"{name}.weight"].float())


def init_from_head(model: TrainableEagle3, head_dir: str) -> None:
    """Starts `model` from an exported head's trained tensors (fine-tuning it on new
    data). The LM head is not among them: it is the target's rows for the draft vocabulary
    in either head, so the two may differ in their draft vocabularies. Raises ValueError
    when the head was trained for other aux layers or another shape."""
    from safetensors.torch import load_file

    with open(os.path.join(head_dir, "config.json")) as f:
        config = json.load(f)
    aux = tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    if aux != model.aux_layer_ids:
        raise ValueError(f"{head_dir}: aux layers {aux}, the data's {model.aux_layer_ids}")
    tensors = load_file(os.path.join(head_dir, "model.safetensors"))
    for name, attr in _LINEARS.items():
        have, want = tensors[f"{name}.weight"].shape, getattr(model, attr).weight.shape
        if have != want:
            raise ValueError(f"{head_dir}: {name} is {tuple(have)}, the target's head "
                             f"{tuple(want)}")
    _copy_trained(model, tensors)
