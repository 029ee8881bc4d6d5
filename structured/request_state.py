"""Per-sample grammar state: one xgrammar GrammarMatcher, advanced with every output token.

The matcher depends only on the sample's output tokens, never on its KV cache, so
preemption (recompute) and prefix caching leave it untouched. Each sample of an n > 1
request has its own state, created with the request: forks start from the same
(empty-output) position and then diverge.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import xgrammar as xgr

from aioengine.request import Request, RequestStatus


@dataclass
class StructuredStats:
    """Counters shared by every state of one engine (for stats() and the benchmark)."""

    num_requests: int = 0
    num_tokens_accepted: int = 0
    # Tokens appended by jump-forward: each is one forward step its request did not take.
    num_jump_forward_tokens: int = 0
    num_jump_forwards: int = 0
    num_rejected: int = 0


@dataclass(eq=False)
class StructuredRequestState:
    grammar: Future  # of xgr.CompiledGrammar (GrammarCompileCache.submit)
    encode: Callable[[str], list[int]]  # text -> token ids, no special tokens
    jump_forward: bool
    stats: StructuredStats = field(default_factory=StructuredStats)
    _matcher: xgr.GrammarMatcher | None = None

    def is_ready(self) -> bool:
        """The grammar compiled (or failed): the scheduler may admit the request."""
        return self.grammar.done()

    @property
    def error(self) -> str | None:
        """The compile error, once the compile has failed."""
        if not self.grammar.done() or self.grammar.exception() is None:
            return None
        return str(self.grammar.exception())

    @property
    def matcher(self) -> xgr.GrammarMatcher:
        if self._matcher is None:
            self._matcher = xgr.GrammarMatcher(self.grammar.result())
        return self._matcher

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()) -> None:
        """Allowed next tokens into `bitmask[row]`; a terminated matcher allows only its
        stop tokens (xgrammar's own convention), which end the request anyway. With
        `drafts` (valid ones: num_valid_drafts), the tokens allowed after them."""
        matcher = self.matcher
        for token_id in drafts:
            if not matcher.accept_token(token_id):
                raise RuntimeError(f"draft token {token_id} was validated but is rejected")
        matcher.fill_next_token_bitmask(bitmask, row)
        if drafts:
            matcher.rollback(len(drafts))

    def num_valid_drafts(self, drafts: Sequence[int]) -> int:
        """How many leading draft tokens the grammar accepts from here (matcher unchanged)."""
        matcher, num_valid = self.matcher, 0
        for token_id in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            num_valid += 1
        if num_valid:
            matcher.rollback(num_valid)
        return num_valid

    def accept(self, token_id: int) -> bool:
        """Advances with a sampled token; False if the grammar rejects it (which the mask
        prevents, short of a fully masked row)."""
        ok = self.matcher.accept_token(token_id)
        if ok:
            self.stats.num_tokens_accepted += 1
        else:
            self.stats.num_rejected += 1
        return ok

    def advance(self, request: Request, token_id: int, max_extra: int) -> list[int]:
        """After `token_id` was appended to `request`'s output: advances the matcher and
        returns jump-forward tokens to append too (at most `max_extra`). Ends the request
        with "stop" when the grammar completes, with an error if the token is rejected."""
        if not self.accept(token_id):
            request.status = RequestStatus.FINISHED_ERROR
            request.error = f"token {token_id} does not match the request's grammar"
            return []
        if self.is_terminated:
            request.status = RequestStatus.FINISHED_STOPPED
            return []
        return self.jump_forward_tokens(max_extra)

    def jump_forward_tokens(self, max_tokens: int) -> list[int]:
        """Tokens forced by the grammar from here (at most `max_tokens`), already accepted
        by the matcher: the caller appends them to the output unsampled.

        The forced string is tokenized on its own and accepted token by token, stopping
        at the first token the matcher rejects (a token boundary the grammar does not
        allow): whatever was accepted is a valid prefix of the forced string.
        """
        if not self.jump_forward or max_tokens <= 0 or self.matcher.is_terminated():
            return []
        forced = self.matcher.find_jump_forward_string()
        if not forced:
            return []
        accepted: list[int] = []
        for token_id in self.encode(forced)[:max_tokens]:
            if not self.matcher.accept_token(token_id):
                break
            accepted.append(token_id)
        if accepted:
            self.stats.num_jump_forwards += 1
            self.stats.num_jump_forward_tokens += len(accepted)
        return accepted
