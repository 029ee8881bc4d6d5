"""Speculative decoding: proposers (n-gram, EAGLE), the rejection sampler, the config.
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
    is loaded (its projections stored in `dtype`, as the target's) and checked against the
    target here: errors are ConfigErrors naming the `speculative_config` field. For EAGLE-3
    the target is told to hand out the head's auxiliary layers."""
    if config is None:
        return None
    from aioengine.spec_decode.proposer import NgramProposer
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                             config.num_speculative_tokens)
    from aioengine.spec_decode.eagle import load_eagle_head
    from aioengine.spec_decode.eagle_proposer import EagleProposer
    assert config.model is not None  # SpeculativeConfig.parse checked
    head = load_eagle_head(config.model, config.method, loaded.arch, dtype, device)
    if head.aux_layer_ids:
        loaded.model.aux_hidden_state_layers = head.aux_layer_ids
    return EagleProposer(head, loaded.model, config.num_speculative_tokens, num_blocks,
                         block_size)


def num_lookahead_tokens(config: SpeculativeConfig | None) -> int:
    """KV slots a step needs past its tokens for the proposer (a draft head's chain)."""
    return config.num_speculative_tokens if config and config.method != "ngram" else 0
