"""Loading a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`)
into a LoRAModel: per (layer, module) the A [r, in] and B [out, r] matrices in the engine's
dtype, with the scaling (lora_alpha / r, or / sqrt(r) for rsLoRA) folded into B.

Everything is checked before anything is kept: a module we cannot apply (embeddings, the LM
head, DoRA, modules_to_save, trained biases), a rank above max_lora_rank, a shape that is
not the base model's, a missing or corrupt file raise LoRAError naming it, and nothing is
half-loaded.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from torch import Tensor

from aioengine.errors import InvalidRequestError, NotFoundError

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# The projections an adapter may target, by their Hugging Face (PEFT) module names.
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")
_KEY_RE = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\."
                     r"(\w+)\.lora_(A|B)\.weight$")


# adapter_config.json options that change what the adapter computes beyond x A^T B^T:
# refused when set.
_UNSUPPORTED_OPTIONS = {
    "use_dora": "DoRA", "alora_invocation_tokens": "activated LoRA",
    "target_parameters": "LoRA on parameters", "layer_replication": "layer replication",
    "trainable_token_indices": "trainable tokens", "lora_bias": "LoRA biases",
    "use_qalora": "QA-LoRA"}


class LoRAError(InvalidRequestError):
    """An adapter that cannot be loaded or used (HTTP 400)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "lora_path")


class LoRANotFoundError(NotFoundError):
    """An adapter directory or file that does not exist (HTTP 404)."""


@dataclass
class LoRAModel:
    """One loaded adapter. `lora_id` is unique to this load (LoRARequest.lora_int_id)."""

    name: str
    lora_id: int
    path: str
    rank: int  # the largest rank among its modules
    # (layer index, PEFT module name) -> (A [r, in], B [out, r] * scaling)
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = field(repr=False)
    stamp: tuple[int, int] = (0, 0)  # the weights file's (size, mtime_ns) when loaded

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)


def file_stamp(path: str) -> tuple[int, int]:
    st = os.stat(os.path.join(path, WEIGHTS_FILE))
    return st.st_size, st.st_mtime_ns


def load_adapter(name: str, lora_id: int, path: str,
                 module_shapes: dict[tuple[int, str], tuple[int, int]], max_rank: int,
                 dtype: torch.dtype = torch.float32) -> LoRAModel:
    """Reads and checks the adapter at `path` against the base model's projections
    (`module_shapes`: (layer, PEFT module name) -> (in_features, out_features))."""
    config = _read_config(path)
    tensors = _read_weights(path)
    pairs: dict[tuple[int, str], dict[str, Tensor]] = {}
    for key, tensor in tensors.items():
        m = _KEY_RE.match(key)
        if m is None:
            raise LoRAError(f"adapter {name!r}: {_why_unsupported(key)} ({key!r} in {WEIGHTS_FILE})")
        layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
        if module not in SUPPORTED_MODULES:
            raise LoRAError(f"adapter {name!r}: module {module!r} is not supported; supported: "
                            f"{', '.join(SUPPORTED_MODULES)}")
        if (layer, module) not in module_shapes:
            raise LoRAError(f"adapter {name!r}: {key!r} does not exist in the base model "
                            f"(a different base model?)")
        pairs.setdefault((layer, module), {})[ab] = tensor
    if not pairs:
        raise LoRAError(f"adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    weights: dict[tuple[int, str], tuple[Tensor, Tensor]] = {}
    max_seen = 0
    for (layer, module), ab in sorted(pairs.items()):
        where = f"layers.{layer}.{module}"
        if set(ab) != {"A", "B"}:
            raise LoRAError(f"adapter {name!r}: {where} has lora_{''.join(ab)} but not both A and B")
        a, b = ab["A"], ab["B"]
        in_features, out_features = module_shapes[(layer, module)]
        r = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, r):
            raise LoRAError(
                f"adapter {name!r}: {where} has A {tuple(a.shape)} and B {tuple(b.shape)}; the "
                f"base model needs A [r, {in_features}] and B [{out_features}, r] (a different "
                f"base model?)")
        if r > max_rank:
            raise LoRAError(f"adapter {name!r}: rank {r} of {where} is above max_lora_rank "
                            f"{max_rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoRAError(f"adapter {name!r}: {where} has non-finite weights")
        scaling = _scaling(config, f"model.layers.{layer}.{module}", r)
        weights[(layer, module)] = (a.to(dtype).contiguous(),
                                    (b.to(torch.float64) * scaling).to(dtype).contiguous())
        max_seen = max(max_seen, r)
    return LoRAModel(name=name, lora_id=lora_id, path=path, rank=max_seen, weights=weights,
                     stamp=file_stamp(path))


def _read_config(path: str) -> dict:
    if not os.path.isdir(path):
        raise LoRANotFoundError(f"no LoRA adapter directory at {path!r}")
    file = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(file):
        raise LoRANotFoundError(f"no {CONFIG_FILE} in {path!r}")
    try:
        with open(file, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAError(f"{file}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise LoRAError(f"{file}: expected a JSON object")
    problems = []
    if config.get("peft_type", "LORA") != "LORA":
        problems.append(f"peft_type {config.get('peft_type')!r} (only LORA)")
    problems += [f"{key} ({what})" for key, what in _UNSUPPORTED_OPTIONS.items()
                 if config.get(key)]
    if config.get("modules_to_save"):
        problems.append(f"modules_to_save {config['modules_to_save']}")
    if config.get("bias", "none") != "none":
        problems.append(f"bias {config['bias']!r} (trained biases)")
    if config.get("fan_in_fan_out"):
        problems.append("fan_in_fan_out")
    targets = config.get("target_modules") or []
    if isinstance(targets, list):
        problems += [f"target module {t!r}" for t in targets if t not in SUPPORTED_MODULES]
    if problems:
        raise LoRAError(f"{file}: not supported: {'; '.join(problems)}; LoRA on "
                        f"{', '.join(SUPPORTED_MODULES)} is")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise LoRAError(f"{file}: {key} must be a positive number, got {value!r}")
    return config


def _read_weights(path: str) -> dict[str, Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = os.path.join(path, WEIGHTS_FILE)
    if not os.path.isfile(file):
        other = " (adapter_model.bin is not read: save with safetensors)" if os.path.isfile(
            os.path.join(path, "adapter_model.bin")) else ""
        raise LoRANotFoundError(f"no {WEIGHTS_FILE} in {path!r}{other}")
    try:
        return load_file(file)
    except (SafetensorError, OSError, ValueError, RuntimeError) as e:
        raise LoRAError(f"{file}: cannot be read ({e})") from None


def _why_unsupported(key: str) -> str:
    if "lora_magnitude_vector" in key:
        return "DoRA is not supported"
    if "embed_tokens" in key or "lora_embedding" in key:
        return "LoRA on the embeddings is not supported"
    if "lm_head" in key:
        return "LoRA on the LM head is not supported"
    return "an unsupported tensor"


def _pattern_value(patterns: dict, module: str) -> object | None:
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name's suffix."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return None


def _scaling(config: dict, module: str, r: int) -> float:
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module)
    alpha = float(config["lora_alpha"] if alpha is None else alpha)
    return alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
