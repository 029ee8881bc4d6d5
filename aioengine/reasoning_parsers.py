"""Reasoning parsers: a thinking model's output split into its reasoning and its answer
(vLLM's `--reasoning-parser`, the names and tags vLLM uses).

A model that thinks writes `<think> reasoning </think> answer`. Where the chat template
opens the block itself (DeepSeek-R1 and its distills, Qwen3's 2507 thinking models), the
output starts inside it and only `</think>` is generated; where the template closes it
(Qwen3 with `enable_thinking: false`), the output is all answer.

Where the output starts is decided by the prompt's last think tag, then the parser:
- the prompt's last think tag is `</think>` (the template closed thinking, as Qwen3's does
  with `enable_thinking: false`): outside the reasoning, for both parsers (vLLM's
  `is_reasoning_end` of the prompt);
- `deepseek_r1`: otherwise inside the reasoning (vLLM's rule: R1 models often omit
  `<think>`, the template having written it);
- `qwen3`: inside the reasoning when the prompt's last think tag is `<think>`; with no tag
  in the prompt, the output decides: opening with `<think>` puts it inside.
In every case an output that opens with `<think>` (leading whitespace allowed) starts
inside the reasoning: the tag is dropped.
Inside the reasoning, everything up to the first `</think>` is reasoning and the rest is
the answer. An output that never closes the block (cut by max_tokens) is all reasoning:
this is what a stream has sent by then, and `extract` agrees with the stream (for any split
of a text into deltas, the deltas joined equal `extract(text)`; tested).

The answer alone goes on to the tool-call parser and is what structured output constrains:
`constrain_answer` puts the think token ids on a request's constraint, and the structured
feature's reasoning gate (structured/reasoning_gate.py) starts the grammar after the
output's first `</think>` token, agreeing with the split above token for token.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from aioengine.errors import ConfigError
from aioengine.sampling_params import StructuredOutputs

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningSplit", "ReasoningStream",
           "get_reasoning_parser"]


@dataclass
class ReasoningSplit:
    """A piece of output: its reasoning and its answer text (each '' when none)."""
    reasoning: str = ""
    content: str = ""


def _partial_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`: text that
    may still become the tag, held back until the next delta decides."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningStream:
    """Text deltas of one output in, ReasoningSplits out. States: 'start' (waiting for the
    first non-space text to say whether a `<think>` opens), 'reasoning', 'content'. Text is
    decided once no later text can change the decision."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool) -> None:
        self.parser = parser
        self.state = "start"
        # Where an output that does not open with `<think>` is: a leading `<think>` is
        # dropped in either case (R1 distills sometimes write the one the template wrote).
        self.default = "reasoning" if in_reasoning else "content"
        self.buf = ""

    def count_tokens(self, token_ids: list[int]) -> int:
        """The reasoning's share of an output's token ids (usage's reasoning_tokens): up to
        and including the first `</think>` when the output starts inside the reasoning or
        its first token is `<think>`; all of them when it never closes; 0 otherwise."""
        if not token_ids or (self.default == "content"
                             and token_ids[0] != self.parser.start_token_id):
            return 0
        try:
            return token_ids.index(self.parser.end_token_id) + 1
        except ValueError:
            return len(token_ids)

    def feed(self, delta: str) -> ReasoningSplit:
        self.buf += delta
        return self._advance(final=False)

    def finish(self) -> ReasoningSplit:
        return self._advance(final=True)

    def _advance(self, final: bool) -> ReasoningSplit:
        out = ReasoningSplit()
        start, end = self.parser.start_tag, self.parser.end_tag
        if self.state == "start":
            body = self.buf.lstrip()
            if body.startswith(start):
                self.buf, self.state = body[len(start):], "reasoning"
            elif start.startswith(body) and not final:
                return out  # whitespace or a partial `<think>`: not decided yet
            else:
                self.state = self.default
        if self.state == "reasoning":
            cut = self.buf.find(end)
            if cut < 0:
                cut = len(self.buf) - (0 if final else _partial_tag_len(self.buf, end))
                out.reasoning, self.buf = self.buf[:cut], self.buf[cut:]
                return out
            out.reasoning, self.buf = self.buf[:cut], self.buf[cut + len(end):]
            self.state = "content"
        out.content, self.buf = self.buf, ""
        return out


class ReasoningParser:
    name: ClassVar[str]
    start_tag: ClassVar[str] = "<think>"
    end_tag: ClassVar[str] = "</think>"
    # Whether every output starts inside the reasoning whatever the prompt says.
    always_starts_in_reasoning: ClassVar[bool] = False

    def __init__(self, tokenizer: Any) -> None:
        """Checks that the tokenizer writes the tags as single tokens (a model that cannot
        think has none: a ConfigError at start-up, not text parsed at random)."""
        self.tokenizer = tokenizer
        vocab = tokenizer.get_vocab()
        missing = [t for t in (self.start_tag, self.end_tag) if t not in vocab]
        if missing:
            raise ConfigError(
                f"--reasoning-parser {self.name}: the tokenizer has no {' or '.join(missing)} "
                f"token, so this model does not reason in {self.name}'s format")
        self.start_token_id: int = vocab[self.start_tag]
        self.end_token_id: int = vocab[self.end_tag]
        # Special tags are dropped by skip_special_tokens: requests keep special tokens
        # in their text then (Qwen3's and the R1 distills' tags are not special).
        special = set(getattr(tokenizer, "all_special_ids", ()))
        self.tags_are_special = bool(special & {self.start_token_id, self.end_token_id})

    def last_tag(self, prompt_ids: list[int]) -> int | None:
        """The prompt's last think token (start_token_id or end_token_id), None if none."""
        for token_id in reversed(prompt_ids):
            if token_id in (self.start_token_id, self.end_token_id):
                return token_id
        return None

    def starts_in_reasoning(self, prompt_ids: list[int]) -> bool:
        """Whether an output of this prompt starts inside a reasoning block (module doc):
        the prompt's last think tag is `<think>`, or for deepseek_r1 is not `</think>`."""
        last = self.last_tag(prompt_ids)
        if last == self.end_token_id:
            return False
        return self.always_starts_in_reasoning or last == self.start_token_id

    def constrain_answer(self, constraint: StructuredOutputs,
                         prompt_ids: list[int]) -> StructuredOutputs:
        """`constraint` applied to the answer of an output of `prompt_ids`: from the
        token after the first `</think>` when the output starts inside the reasoning; from
        the first token when the prompt closed thinking; and where the output decides
        (qwen3, no tag in the prompt), `<think>` allowed as its first token too."""
        if self.starts_in_reasoning(prompt_ids):
            start = None
        elif self.last_tag(prompt_ids) is None:
            start = self.start_token_id
        else:
            return constraint
        return dataclasses.replace(constraint, reasoning_end_token_id=self.end_token_id,
                                   reasoning_start_token_id=start)

    def stream(self, in_reasoning: bool) -> ReasoningStream:
        """`in_reasoning`: starts_in_reasoning(prompt_ids) of the output's prompt."""
        return ReasoningStream(self, in_reasoning)

    def extract(self, text: str, in_reasoning: bool) -> ReasoningSplit:
        stream = self.stream(in_reasoning)
        first, rest = stream.feed(text), stream.finish()
        return ReasoningSplit(first.reasoning + rest.reasoning, first.content + rest.content)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    always_starts_in_reasoning = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    try:
        cls = REASONING_PARSERS[name]
    except KeyError:
        raise ConfigError(f"unknown reasoning parser {name!r}; "
                          f"choose from {', '.join(sorted(REASONING_PARSERS))}") from None
    return cls(tokenizer)
