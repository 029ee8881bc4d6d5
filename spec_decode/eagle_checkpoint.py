"""Reading an EAGLE-1 / EAGLE-3 draft head's checkpoint (spec_decode/eagle.py's loader):
`read_checkpoint` gives an EagleCheckpoint, its config and weights (in the EAGLE repo's or
vLLM's names) read and checked against the target, with the draft architecture, aux layers
and head options they imply; the checkpoint then copies its weights into the head built
from it and gives the draft-to-target vocabulary map. Every way a checkpoint can fail the
target is a SpeculativeConfigError naming speculative_config.model."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import torch
from torch import Tensor, nn

from aioengine.config import ConfigError
from aioengine.model.arch import ModelArchConfig
from aioengine.model.llama import has_param, layer_weight_table, copy_param_rows
from aioengine.model.loader import ModelLoadError, safetensors_files

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


@dataclasses.dataclass(frozen=True)
class EagleCheckpoint:
    """A draft head's checkpoint, checked against the target: the EagleHead options it
    implies (what the weights hold decides the optional parts; configs disagree on
    "bias") and its tensors under canonical names (_canonical_name)."""

    path: str
    method: str  # "eagle" or "eagle3"
    arch: ModelArchConfig  # the head's one layer
    aux_layer_ids: tuple[int, ...]  # EAGLE-3's target layers; () for EAGLE-1
    fc_bias: bool
    input_layernorm: bool
    draft_vocab_size: int | None  # its own lm_head's vocabulary; None: the target's head
    norm_before_residual: bool
    tensors: dict[str, Tensor]

    def copy_weights(self, head: nn.Module) -> None:
        """Copies every tensor into the head built from this checkpoint (fusing q/k/v and
        gate/up); SpeculativeConfigError for an unknown, misshapen or missing one."""
        fc = self.tensors.get("fc.weight")
        if fc is not None and has_param(head, "fc.weight"):
            expected = head.get_parameter("fc.weight").shape[-1]
            if fc.shape[-1] != expected:
                h = self.arch.hidden_size
                what = (f"{len(self.aux_layer_ids)} aux layers {list(self.aux_layer_ids)} x "
                        f"hidden size {h}" if self.method == "eagle3"
                        else f"2 x hidden size {h}")
                raise SpeculativeConfigError(f"{_FIELD}: fc.weight takes {fc.shape[-1]} "
                                             f"inputs, expected {expected} ({what})")
        _copy_weights(head, self.method, self.arch, self.tensors, self.path)

    def draft_to_target(self) -> Tensor | None:
        """[draft_vocab] int64 on the CPU: the target id of each draft id (d + d2t[d]);
        None where the draft vocabulary is the target's, in order."""
        return _draft_to_target(self.tensors.get("d2t"), self.draft_vocab_size,
                                self.arch.vocab_size, self.path)


def read_checkpoint(path: str, method: str, target: ModelArchConfig) -> EagleCheckpoint:
    """The `method` head's checkpoint in `path` (config.json + weights), checked against
    `target`: hidden size, vocabulary, draft vocabulary and aux layers."""
    cfg = _read_config(path)
    tensors = {_canonical_name(n, method): t for n, t in _read_weights(path).items()}
    eagle3 = method == "eagle3"
    arch = _draft_arch(cfg, target, path)
    arch = dataclasses.replace(arch, attention_bias="layers.0.self_attn.q_proj.bias" in tensors)
    draft_vocab = int(cfg.get("draft_vocab_size") or arch.vocab_size)  # EAGLE-3's
    if eagle3 and not 0 < draft_vocab <= arch.vocab_size:
        raise SpeculativeConfigError(f"{_FIELD}: draft_vocab_size {draft_vocab} does not fit "
                                     f"the target's vocabulary of {arch.vocab_size}")
    # EAGLE-3 without an lm_head of its own (a full vocabulary) reads the target's.
    own_head = eagle3 and ("lm_head.weight" in tensors or draft_vocab < arch.vocab_size)
    return EagleCheckpoint(
        path=path, method=method, arch=arch,
        aux_layer_ids=_aux_layer_ids(cfg, target, path) if eagle3 else (),
        fc_bias="fc.bias" in tensors,
        input_layernorm=eagle3 or "layers.0.input_layernorm.weight" in tensors,
        draft_vocab_size=draft_vocab if own_head else None,
        norm_before_residual=bool(cfg.get("norm_before_residual", False)), tensors=tensors)


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
def _copy_weights(head: nn.Module, method: str, arch: ModelArchConfig,
                  tensors: dict[str, Tensor], path: str) -> None:
    """Copies every checkpoint tensor into its parameter of `head` (an EagleHead of
    `arch`), fusing q/k/v and gate/up; raises for an unknown, misshapen or missing one.
    d2t is read by _draft_to_target."""
    table = {"fc.weight": ("fc.weight", None), "fc.bias": ("fc.bias", None),
             "layers.0.hidden_norm.weight": ("hidden_norm", None),
             "norm.weight": ("norm", None), "lm_head.weight": ("lm_head.weight", None)}
    table.update({f"layers.0.{name}": (f"layer.{param}", rows)
                  for name, (param, rows) in layer_weight_table(arch).items()})
    table = {name: t for name, t in table.items() if has_param(head, t[0])}
    unknown = []
    for name, tensor in tensors.items():
        if (name in _IGNORED or name.endswith("rotary_emb.inv_freq")
                or (name == "d2t" and method == "eagle3")):
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
                if method == "eagle" and any(n.startswith("midlayer.") for n in unknown)
                else "")
        raise SpeculativeConfigError(f"{_FIELD}: unexpected weight(s) for a {method} "
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
