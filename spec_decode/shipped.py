"""Draft heads shipped with the package (spec_decode/heads/), and filling in what a
speculative_config leaves out for them: `{"method": "eagle3"}` on the bundled
SmolLM2-135M-Instruct uses the head trained for it (docs/eagle-head.md), with the number
of draft tokens its config.json recommends (`n_predict`, as vLLM reads it)."""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

from aioengine.model.arch import ModelArchConfig
from aioengine.spec_decode.config import SpeculativeConfig
from aioengine.spec_decode.eagle import SpeculativeConfigError

HEADS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "heads")


@dataclass(frozen=True)
class ShippedHead:
    directory: str  # under HEADS_DIR
    method: str
    target_name: str  # matched case-insensitively in the target's file or directory name
    # The target's shape: (hidden_size, num_hidden_layers, vocab_size, heads, kv heads)
    target_shape: tuple[int, int, int, int, int]


SHIPPED_HEADS = (
    ShippedHead("smollm2-135m-instruct-eagle3", "eagle3", "smollm2-135m-instruct",
                (576, 30, 49152, 9, 3)),
)


def shipped_head(method: str, model_path: str, arch: ModelArchConfig) -> str | None:
    """The directory of the shipped `method` head for this target, if one ships."""
    name = os.path.basename(os.path.normpath(model_path)).lower()
    shape = (arch.hidden_size, arch.num_hidden_layers, arch.vocab_size,
             arch.num_attention_heads, arch.num_key_value_heads)
    for head in SHIPPED_HEADS:
        path = os.path.join(HEADS_DIR, head.directory)
        if (head.method == method and head.target_name in name and head.target_shape == shape
                and os.path.isfile(os.path.join(path, "config.json"))):
            return path
    return None


def resolve_speculative_config(config: SpeculativeConfig | None, model_path: str,
                               arch: ModelArchConfig) -> SpeculativeConfig | None:
    """`config` with the draft head (`model`) and `num_speculative_tokens` filled in where
    they were left out: the shipped head for the target, and its config's n_predict."""
    if config is not None and config.method == "auto":
        return _resolve_auto(config, model_path, arch)
    if config is None or not config.uses_draft_head:
        return config
    model = config.model
    if model is None:
        model = shipped_head(config.method, model_path, arch)
        if model is None:
            raise SpeculativeConfigError(
                f"speculative_config.model is required for method {config.method!r}: no "
                f"{config.method} head ships for {os.path.basename(model_path)} (heads ship "
                f"for {[h.target_name for h in SHIPPED_HEADS if h.method == config.method]}); "
                "train one with `aioengine train-eagle --model MODEL -o DIR`")
    k = config.num_speculative_tokens
    if k is None:
        k = _n_predict(model)
        if k is None:
            raise SpeculativeConfigError(
                "speculative_config.num_speculative_tokens is required: the draft head's "
                f"config.json in {model} has no n_predict")
    return dataclasses.replace(config, model=model, num_speculative_tokens=k)


def _resolve_auto(config: SpeculativeConfig, model_path: str,
                  arch: ModelArchConfig) -> SpeculativeConfig:
    """auto's head: the `model` given (its n_predict required), else the eagle3 head shipped
    for the target, else none (auto then drafts by suffix and n-gram only). A request's
    drafts are at most the longer of k and the head's chain."""
    model = config.model or shipped_head("eagle3", model_path, arch)
    if model is None:
        return config
    k_head = config.head_num_speculative_tokens or _n_predict(model)
    if k_head is None:
        raise SpeculativeConfigError(
            "speculative_config.head_num_speculative_tokens is required: the draft head's "
            f"config.json in {model} has no n_predict")
    k = max(config.num_speculative_tokens or 0, k_head)
    return dataclasses.replace(config, model=model, head_num_speculative_tokens=k_head,
                               num_speculative_tokens=k)


def _n_predict(model: str) -> int | None:
    try:
        with open(os.path.join(model, "config.json")) as f:
            value = json.load(f).get("n_predict")
    except (OSError, ValueError, AttributeError):
        return None  # load_eagle_head reports the unreadable config
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 \
        else None
