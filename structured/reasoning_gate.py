"""The reasoning gate: a thinking model's grammar constrains its answer only.

A request served with a reasoning parser (aioengine/reasoning_parsers.py) writes
`reasoning </think> answer`; its constraint (StructuredOutputs) then carries the think
token ids and the matcher sees only the tokens after the output's first `</think>`. Until
then every token is allowed and none reaches the matcher (vLLM's `reasoning_ended`, with
the decision moved here, into the structured feature: the scheduler and runner only call
its hooks and never learn about reasoning).

Phases of one sample's output, in order:
    EITHER    -> the first token decides: `<think>` opens REASONING, any other token is
                 the answer's first (the matcher's mask, plus `<think>`)
    REASONING -> free until `</think>` (not given to the matcher), then ANSWER
    ANSWER    -> the grammar, from its first token
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass


class Phase(enum.Enum):
    EITHER = "either"
    REASONING = "reasoning"
    ANSWER = "answer"


@dataclass(eq=False)
class ReasoningGate:
    """One sample's phase. Invariant: the matcher has seen exactly the output tokens
    after the phase became ANSWER."""

    end_token_id: int
    start_token_id: int | None = None  # set: the output starts in EITHER, else REASONING
    phase: Phase = Phase.ANSWER

    def __post_init__(self) -> None:
        if self.phase is Phase.ANSWER:  # not given: where the output starts
            self.phase = Phase.REASONING if self.start_token_id is None else Phase.EITHER

    @property
    def in_answer(self) -> bool:
        return self.phase is Phase.ANSWER

    def next_phase(self, phase: Phase, token_id: int) -> tuple[Phase, bool]:
        """The phase after `token_id` is output in `phase`, and whether the matcher takes
        the token (it takes every answer token, and only those)."""
        if phase is Phase.ANSWER:
            return phase, True
        if phase is Phase.EITHER:
            if token_id == self.start_token_id:
                return Phase.REASONING, False
            return Phase.ANSWER, True
        return (Phase.ANSWER if token_id == self.end_token_id else Phase.REASONING), False

    def step(self, token_id: int) -> bool:
        """Advances by an output token; True if the matcher is to take it."""
        self.phase, to_matcher = self.next_phase(self.phase, token_id)
        return to_matcher

    def walk(self, tokens: Sequence[int]) -> tuple[Phase, list[int]]:
        """The phase after `tokens` (drafts), and those of them the matcher would take;
        the gate itself is left unchanged."""
        phase, answer = self.phase, []
        for token_id in tokens:
            phase, to_matcher = self.next_phase(phase, token_id)
            if to_matcher:
                answer.append(token_id)
        return phase, answer
