"""Per-sample grammar state: one xgrammar GrammarMatcher, advanced with every output token.

The matcher depends only on the sample's output tokens, never on its KV cache, so
preemption (recompute) and prefix caching leave it untouched. Each sample of an n > 1
request has its own state, created with the request: forks start from the same
(empty-output) position and then diverge.

With a reasoning gate (reasoning_gate.py), the matcher sees only the answer's tokens:
before it, every token is allowed and none is matched, nothing is jumped forward and the
grammar cannot end the output.
"""
from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import xgrammar as xgr

from aioengine.request import Request, RequestStatus
from aioengine.structured.reasoning_gate import Phase, ReasoningGate


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
    gate: ReasoningGate | None = None  # None: the whole output is constrained
    _matcher: xgr.GrammarMatcher | None = None
    _probe: torch.Tensor | None = None  # a one-row bitmask for forced_text

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
    def in_answer(self) -> bool:
        """The matcher is live: no gate, or the gate's reasoning is over."""
        return self.gate is None or self.gate.in_answer

    @property
    def is_terminated(self) -> bool:
        """The grammar accepted a stop token: the output is complete."""
        return self.in_answer and self.matcher.is_terminated()

    def fill_bitmask(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int] = ()) -> None:
        """Allowed next tokens into `bitmask[row]`; a terminated matcher allows only its
        stop tokens (xgrammar's own convention), which end the request anyway. With
        `drafts` (valid ones: num_valid_drafts), the tokens allowed after them. Inside
        the reasoning every token is allowed; where the output may still open it, the
        grammar's first tokens and the gate's `<think>`."""
        if self.gate is None or self.gate.in_answer:
            self._fill_matcher(bitmask, row, drafts)
            return
        phase, answer_drafts = self.gate.walk(drafts)
        if phase is Phase.REASONING:
            bitmask[row].fill_(-1)
            return
        self._fill_matcher(bitmask, row, answer_drafts)
        if phase is Phase.EITHER:
            assert self.gate.start_token_id is not None
            _allow_token(bitmask, row, self.gate.start_token_id)

    def _fill_matcher(self, bitmask: torch.Tensor, row: int, drafts: Sequence[int]) -> None:
        matcher = self.matcher
        for token_id in drafts:
            if not matcher.accept_token(token_id):
                raise RuntimeError(f"draft token {token_id} was validated but is rejected")
        if drafts and matcher.is_terminated():
            # The drafts end with the stop token that completes the output (a valid draft
            # may: num_valid_drafts), so this row's token is never used; xgrammar refuses
            # to fill a mask after a stop token, so the row gets its convention by hand.
            bitmask[row].fill_(0)
            for token_id in matcher.stop_token_ids:
                _allow_token(bitmask, row, token_id)
        else:
            matcher.fill_next_token_bitmask(bitmask, row)
        if drafts:
            matcher.rollback(len(drafts))

    def num_valid_drafts(self, drafts: Sequence[int], room: int | None = None) -> int:
        """How many leading draft tokens are worth verifying from here (matcher unchanged):
        those the grammar accepts, up to (not with) the first that jump-forward tokens
        would follow, given `room` tokens the request may still produce (None: no bound);
        reasoning tokens are all valid.

        The step after such a draft's row ends the request's run there (append_run), so
        its later rows would be dropped; worse, a seeded request would draw for them from
        its generator where sampling without drafts appends the forced tokens undrawn, and
        its text would then depend on the drafts (worker/verify.py seeded_chain_tokens).
        Left out, the draft's own row samples that token and the forced ones follow it as
        without speculation."""
        def after(i: int) -> int | None:  # the room once drafts[:i] are output
            return None if room is None else room - i

        if self.gate is not None and not self.gate.in_answer:
            phase = self.gate.phase
            for i, token_id in enumerate(drafts):
                phase, to_matcher = self.gate.next_phase(phase, token_id)
                if to_matcher:  # the answer starts here: the grammar takes the rest
                    return i + self._num_valid_matched(drafts[i:], after(i))
                if phase is Phase.ANSWER and self._forces_tokens(after(i + 1)):
                    return i  # the end of reasoning, which the answer's forced start follows
            return len(drafts)
        return self._num_valid_matched(drafts, room)

    def _num_valid_matched(self, drafts: Sequence[int], room: int | None) -> int:
        matcher, num_valid = self.matcher, 0
        for token_id in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token_id):
                break
            after = None if room is None else room - num_valid - 1
            if self._forces_tokens(after):
                matcher.rollback(1)
                break
            num_valid += 1
        if num_valid:
            matcher.rollback(num_valid)
        return num_valid

    def _forces_tokens(self, room: int | None) -> bool:
        """Whether jump_forward_tokens(room) would append tokens here (matcher unchanged)."""
        forced = self._accept_forced(JUMP_FORWARD_MAX_BYTES if room is None else room)
        if forced:
            self.matcher.rollback(len(forced))
        return bool(forced)

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
        with "stop" when the grammar completes, with an error if the token is rejected.
        A reasoning token only moves the gate; the answer's first forced tokens follow
        `</think>` at once."""
        if self.gate is not None and not self.gate.in_answer and not self.gate.step(token_id):
            return self.jump_forward_tokens(max_extra) if self.gate.in_answer else []
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

        The forced string is found byte by byte (`forced_text`), never with xgrammar's
        `find_jump_forward_string`: that follows the grammar without a bound, so a grammar
        with no finite output (`root ::= "a" root`) looped forever on the event loop,
        growing memory until the OOM killer came (issue 27). It is then tokenized on its
        own and accepted token by token, stopping at the first token the matcher rejects
        (a token boundary the grammar does not allow).
        """
        if not self.in_answer:
            return []
        accepted = self._accept_forced(max_tokens)
        if accepted:
            self.stats.num_jump_forwards += 1
            self.stats.num_jump_forward_tokens += len(accepted)
        return accepted

    def _accept_forced(self, max_tokens: int) -> list[int]:
        """jump_forward_tokens' tokens, accepted by the matcher, without its counters (or
        its check that the answer has begun: drafts may begin it)."""
        if not self.jump_forward or max_tokens <= 0 or self.matcher.is_terminated():
            return []
        forced = self.forced_text(min(max_tokens * JUMP_FORWARD_BYTES_PER_TOKEN,
                                      JUMP_FORWARD_MAX_BYTES))
        if not forced:
            return []
        accepted: list[int] = []
        for token_id in self.encode(forced)[:max_tokens]:
            if not self.matcher.accept_token(token_id):
                break
            accepted.append(token_id)
        return accepted

    def forced_text(self, max_bytes: int) -> str:
        """The text the grammar forces from here, at most `max_bytes` bytes (whole UTF-8
        characters only); the matcher is left unchanged.

        A byte is forced when the matcher cannot end here and every token the bitmask
        allows starts with it (every byte a model can emit starts some token). Each byte
        costs one bitmask fill (3-20 us on SmolLM2's vocabulary)."""
        first_bytes = getattr(self.grammar.result(), "first_bytes", None)
        if first_bytes is None:
            return ""
        matcher, forced = self.matcher, bytearray()
        if self._probe is None:
            self._probe = xgr.allocate_token_bitmask(1, len(first_bytes))
        try:
            while len(forced) < max_bytes and not matcher.is_completed():
                matcher.fill_next_token_bitmask(self._probe, 0)
                byte = first_bytes.only_first_byte(self._probe[0].numpy())
                if byte is None or not matcher.accept_string(bytes((byte,))):
                    break
                forced.append(byte)
        finally:
            if forced:
                matcher.rollback(len(forced))  # each accept_string is one rollback step
        return _whole_characters(bytes(forced))


def _allow_token(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Sets `token_id`'s bit in `bitmask[row]` (int32 words, bit 31 the sign bit)."""
    word, bit = divmod(token_id, 32)
    value = int(bitmask[row, word]) | (1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value


# Bounds of one jump-forward: bytes per token of room, and bytes in all (each byte is a
# bitmask fill on the event loop, ~36 us on 2 shared EPYC cores: 128 bytes ~5 ms).
JUMP_FORWARD_BYTES_PER_TOKEN = 16
JUMP_FORWARD_MAX_BYTES = 128


class FirstByteTable:
    """Per tokenizer (built once, in the compile pool): each token's first byte, and for
    each byte the bitmask of tokens that do NOT start with it, so "does every allowed
    token start with this byte" is one AND over the bitmask row."""

    def __init__(self, decoded_vocab: list[bytes]) -> None:
        self.first = np.array([d[0] if d else -1 for d in decoded_vocab], dtype=np.int16)
        num_words = (len(self.first) + 31) // 32
        self.others = np.empty((256, num_words), dtype=np.int32)
        padded = np.full(num_words * 32, -2, dtype=np.int16)
        padded[:len(self.first)] = self.first
        for byte in range(256):
            bits = np.packbits(padded != byte, bitorder="little")
            self.others[byte] = bits.view(np.int32)

    def __len__(self) -> int:
        return len(self.first)

    def only_first_byte(self, row: np.ndarray) -> int | None:
        """The byte every token allowed by the bitmask `row` starts with; None if they
        differ (or none is allowed, or an allowed token has no text)."""
        words = np.flatnonzero(row)
        if not len(words):
            return None
        lo, hi = int(words[0]), int(words[-1])
        low, high = int(row[lo]) & 0xFFFFFFFF, int(row[hi]) & 0xFFFFFFFF
        byte = int(self.first[lo * 32 + (low & -low).bit_length() - 1])
        last = min(hi * 32 + high.bit_length() - 1, len(self.first) - 1)
        if byte < 0 or int(self.first[last]) != byte:
            return None  # the common case in free text, without a pass over the row
        return None if np.bitwise_and(row, self.others[byte]).any() else byte


def _whole_characters(data: bytes) -> str:
    """The longest prefix of `data` made of whole UTF-8 characters ("" if it starts
    inside one: the model completes that character itself)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data[:e.start].decode("utf-8")
