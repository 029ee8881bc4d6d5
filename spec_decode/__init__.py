"""Speculative decoding: proposers (n-gram, suffix, EAGLE), the rejection sampler, the config.
See README.md in this folder. The engine's one entry point is `make_proposer`."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from aioengine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from aioengine.model.loader import LoadedModel
    from aioengine.spec_decode.proposer import Proposer

__all__ = ["SpeculativeConfig", "make_proposer", "num_lookahead_tokens"]


def make_proposer(config: SpeculativeConfig | None, loaded: LoadedModel, num_blocks: int,
                  block_size: int, dtype: torch.dtype, device: torch.device,
                  ) -> Proposer | None:
    """The runner's proposer for `config` (None = no speculative decoding). An EAGLE head
    is loaded (its projections stored as `head_weight_storage` says) and checked against the
    target here: errors are ConfigErrors naming the `speculative_config` field. For EAGLE-3
    the target is told to hand out the head's auxiliary layers."""
    if config is None:
        return None
    from aioengine.spec_decode.proposer import NgramProposer
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                             config.num_speculative_tokens)
    if config.method == "suffix":
        return _suffix_proposer(config, config.num_speculative_tokens)
    if config.method == "auto":
        return _auto_proposer(config, loaded, num_blocks, block_size, dtype, device)
    from aioengine.spec_decode.eagle_proposer import EagleProposer
    assert config.model is not None  # SpeculativeConfig.parse checked
    head = _load_head(config, config.method, loaded, dtype, device)
    if config.tree is not None:
        _check_tree_support(loaded)
    return EagleProposer(head, loaded.model, config.num_speculative_tokens, num_blocks,
                         block_size, tree=config.tree)


def _suffix_proposer(config: SpeculativeConfig, k: int | None) -> Proposer:
    from aioengine.spec_decode.suffix import SuffixParams, SuffixProposer
    assert k is not None  # parse fills it in
    return SuffixProposer(SuffixParams(
        num_speculative_tokens=k,
        max_tree_depth=config.suffix_decoding_max_tree_depth,
        max_cached_requests=config.suffix_decoding_max_cached_requests,
        max_spec_factor=config.suffix_decoding_max_spec_factor,
        min_token_prob=config.suffix_decoding_min_token_prob,
        max_cached_bytes=config.suffix_decoding_max_cached_bytes))


def _load_head(config: SpeculativeConfig, method: str, loaded: LoadedModel,
               dtype: torch.dtype, device: torch.device):
    from aioengine.spec_decode.eagle import load_eagle_head
    assert config.model is not None
    head = load_eagle_head(config.model, method, loaded.arch, dtype, device,
                           storage=head_weight_storage(config.quantization, dtype, device))
    if head.aux_layer_ids:
        loaded.model.aux_hidden_state_layers = head.aux_layer_ids
    return head


def _auto_proposer(config: SpeculativeConfig, loaded: LoadedModel, num_blocks: int,
                   block_size: int, dtype: torch.dtype, device: torch.device) -> Proposer:
    """auto: suffix decoding and n-gram lookup with k drafts at most (the config's own k,
    before the head's chain raised it), and the head (eagle3) where one was resolved."""
    from aioengine.spec_decode.auto import AutoProposer
    from aioengine.spec_decode.eagle_proposer import EagleProposer
    from aioengine.spec_decode.ngram import NgramLookup
    k = config.num_speculative_tokens
    assert k is not None
    head = None
    if config.model is not None:
        k_head = config.head_tokens
        head = EagleProposer(_load_head(config, "eagle3", loaded, dtype, device), loaded.model,
                             k_head, num_blocks, block_size)
    return AutoProposer(_suffix_proposer(config, k),
                        NgramLookup(config.prompt_lookup_min, config.prompt_lookup_max, k),
                        head)


def head_weight_storage(quantization: str | None, dtype: torch.dtype,
                        device: torch.device) -> str:
    """The draft head's weight storage (layers.WEIGHT_STORAGES) for its config's
    `quantization` (config.HEAD_QUANTIZATIONS) and the target's dtype. Fail closed: auto
    takes int8 only where the packed CPU kernels run it."""
    from aioengine.kernels import cpu_build

    target = str(dtype).removeprefix("torch.")
    if quantization == "int8":
        return "int8"
    if quantization in (None, "auto") and device.type == "cpu" and cpu_build.load() is not None:
        return "int8"
    return target


def _check_tree_support(loaded: LoadedModel) -> None:
    """Tree drafts attend through a tree mask: only attention backends with
    SUPPORTS_TREE_MASK honour it, and only layers that attend through the backend (no
    soft-capping) with one KV cache group (no sliding windows). Anything else: refused."""
    from aioengine.spec_decode.eagle import SpeculativeConfigError
    model = loaded.model
    backend = type(model.attn_backend)
    if not backend.SUPPORTS_TREE_MASK:
        raise SpeculativeConfigError(f"speculative_config.tree: the {backend.__name__} "
                                     "attention backend has no tree attention mask")
    if any(spec.attn_logit_softcapping is not None or spec.sliding_window is not None
           for spec in model.layer_specs):
        raise SpeculativeConfigError("speculative_config.tree: not with sliding-window or "
                                     "soft-capped attention layers")


def num_lookahead_tokens(config: SpeculativeConfig | None) -> int:
    """KV slots a step needs past its tokens for the proposer (a draft head's chain; a
    tree's head rows, from the position after up to `depth` accepted drafts)."""
    if config is None or not config.uses_draft_head:
        return 0
    if config.tree is not None:
        return config.tree.depth + config.tree.num_head_rows
    return config.head_tokens
