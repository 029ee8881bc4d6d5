"""PoolingParams (vLLM's name): how a prefill-only ("pooling") request turns the final
hidden states of its prompt into one vector, and the per-request accumulator the scheduler
folds each prefill chunk's share into.

    last  the hidden state of the last prompt token (a decoder LLM's usual embedding)
    mean  the mean over every prompt token
    cls   the hidden state of the first token

The vectors are L2-normalised unless `normalize=False` (vLLM's embedding default).
`mean` and `cls` need every prompt position computed, so such requests never read cached
prefixes (their own blocks are still cached for others); `last` reads them, since the
prefix cache never covers a prompt's last token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from aioengine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

POOLING_TYPES = ("last", "mean", "cls")


@dataclass(frozen=True)
class PoolingParams:
    """`pooling_type`: one of POOLING_TYPES; `normalize`: L2-normalise the vector."""

    pooling_type: str = "last"
    normalize: bool = True

    def __post_init__(self) -> None:
        if self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"unknown pooling type {self.pooling_type!r}; choose one of "
                f"{', '.join(POOLING_TYPES)}", "pooling_type")
        if not isinstance(self.normalize, bool):
            raise InvalidRequestError("normalize must be a boolean", "normalize")

    @property
    def reads_cached_prefix(self) -> bool:
        """Whether a prefix-cache hit may skip computing prompt positions."""
        return self.pooling_type == "last"


@dataclass
class PoolingState:
    """What the chunks computed so far contribute: the running float32 sum (mean), the
    first token's row (cls) or the last token's (last). Reset when a preempted request
    starts over."""

    params: PoolingParams
    partial: torch.Tensor | None = None

    def add(self, chunk: torch.Tensor | None) -> None:
        """Folds one chunk's share (see `chunk_share`) in."""
        if chunk is None:
            return
        if self.params.pooling_type == "mean" and self.partial is not None:
            self.partial = self.partial + chunk
        else:
            self.partial = chunk

    def finish(self, num_prompt_tokens: int) -> torch.Tensor:
        """The pooled float32 vector of the whole prompt."""
        import torch

        if self.partial is None:
            raise RuntimeError("a pooling request finished without its hidden states")
        vector = self.partial
        if self.params.pooling_type == "mean":
            vector = vector / num_prompt_tokens
        if self.params.normalize:
            vector = torch.nn.functional.normalize(vector, p=2.0, dim=-1)
        return vector


def chunk_share(params: PoolingParams, hidden: torch.Tensor, start: int,
                num_prompt_tokens: int) -> torch.Tensor | None:
    """One prefill chunk's share of the pooled vector: `hidden` [n, H] are the final-normed
    hidden states of prompt positions start .. start + n - 1. A float32 copy (the step's
    activations are reused); None when the chunk holds nothing this pooling reads."""
    import torch

    n = hidden.shape[0]
    if params.pooling_type == "mean":
        return hidden.to(torch.float32).sum(dim=0)
    if params.pooling_type == "cls":
        return hidden[0].to(torch.float32).clone() if start == 0 else None
    if start + n == num_prompt_tokens:
        return hidden[n - 1].to(torch.float32).clone()
    return None
