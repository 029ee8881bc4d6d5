"""Reasoning parsers over outputs written the way thinking models write them: the split
of a finished output, and a stream split at every position joining to that split."""
from __future__ import annotations

import copy

import pytest

from aioengine.errors import ConfigError
from aioengine.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from aioengine.sampling_params import StructuredOutputs
from tiny_models import bundled_tokenizer


@pytest.fixture(scope="module")
def thinking_tokenizer():
    tok = copy.deepcopy(bundled_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    return tok


R1 = "Let me add 2 and 2. That is 4.\n</think>\n\nThe answer is 4."
QWEN_OPEN = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"
QWEN_CLOSED_IN_OUTPUT = "<think>\n\n</think>\n\nHi there."
CASES = [
    # (parser, in_reasoning from the prompt, output, reasoning, content)
    ("deepseek_r1", True, R1, "Let me add 2 and 2. That is 4.\n", "\n\nThe answer is 4."),
    # The prompt closed thinking (starts_in_reasoning False): all answer, as qwen3.
    ("deepseek_r1", False, "Plain answer", "", "Plain answer"),
    ("deepseek_r1", True, "<think>" + R1, "Let me add 2 and 2. That is 4.\n",
     "\n\nThe answer is 4."),
    ("deepseek_r1", True, "Still thinking when cut", "Still thinking when cut", ""),
    ("qwen3", False, QWEN_OPEN, "\nThe user greets me.\n", "\n\nHello! How can I help?"),
    ("qwen3", False, "  " + QWEN_OPEN, "\nThe user greets me.\n", "\n\nHello! How can I help?"),
    ("qwen3", False, QWEN_CLOSED_IN_OUTPUT, "\n\n", "\n\nHi there."),
    ("qwen3", False, "No thinking here </think> at all", "", "No thinking here </think> at all"),
    ("qwen3", False, "<thin", "", "<thin"),
    ("qwen3", True, "The template opened it.</think>Answer", "The template opened it.",
     "Answer"),
    ("qwen3", False, "", "", ""),
    ("qwen3", True, "a </think b </think> c", "a </think b ", " c"),
]


@pytest.mark.parametrize("name,in_reasoning,text,reasoning,content", CASES)
def test_extract(thinking_tokenizer, name, in_reasoning, text, reasoning, content) -> None:
    split = get_reasoning_parser(name, thinking_tokenizer).extract(text, in_reasoning)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("name,in_reasoning,text,reasoning,content", CASES)
def test_stream_at_every_split_equals_extract(thinking_tokenizer, name, in_reasoning, text,
                                              reasoning, content) -> None:
    parser = get_reasoning_parser(name, thinking_tokenizer)
    for cut in range(len(text) + 1):
        for pieces in ([text[:cut], text[cut:]], list(text[:cut]) + [text[cut:]]):
            stream = parser.stream(in_reasoning)
            splits = [stream.feed(p) for p in pieces] + [stream.finish()]
            assert "".join(s.reasoning for s in splits) == reasoning, (cut, pieces)
            assert "".join(s.content for s in splits) == content, (cut, pieces)


def test_reasoning_is_sent_as_it_comes(thinking_tokenizer) -> None:
    """Text is held back only while it may still be a tag."""
    stream = get_reasoning_parser("deepseek_r1", thinking_tokenizer).stream(True)
    assert stream.feed("Think").reasoning == "Think"
    assert stream.feed("ing </th").reasoning == "ing "
    split = stream.feed("ink>Done")
    assert (split.reasoning, split.content) == ("", "Done")


def test_prompt_decides_where_qwen3_starts(thinking_tokenizer) -> None:
    parser = get_reasoning_parser("qwen3", thinking_tokenizer)
    ids = thinking_tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    assert parser.starts_in_reasoning(ids)
    closed = thinking_tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n",
                                       add_special_tokens=False)
    assert not parser.starts_in_reasoning(closed)
    plain = thinking_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    assert not parser.starts_in_reasoning(plain)
    r1 = get_reasoning_parser("deepseek_r1", thinking_tokenizer)
    assert r1.starts_in_reasoning(plain) and r1.starts_in_reasoning(ids)
    assert not r1.starts_in_reasoning(closed)  # vLLM's is_reasoning_end of the prompt


def test_constrain_answer_gates_where_the_output_starts(thinking_tokenizer) -> None:
    """The gate's start agrees with starts_in_reasoning: in the reasoning (end id only),
    answer at once (constraint unchanged), or the output decides (both ids)."""
    def ids(text: str) -> list[int]:
        return thinking_tokenizer.encode(text, add_special_tokens=False)

    opened, closed, plain = ids("a\n<think>\n"), ids("a<think>\n\n</think>\n\n"), ids("a\n")
    constraint = StructuredOutputs(json_object=True)
    qwen3 = get_reasoning_parser("qwen3", thinking_tokenizer)
    r1 = get_reasoning_parser("deepseek_r1", thinking_tokenizer)
    start, end = qwen3.start_token_id, qwen3.end_token_id
    gates = {(p.name, name): (c.reasoning_end_token_id, c.reasoning_start_token_id)
             for p in (qwen3, r1)
             for name, prompt in (("opened", opened), ("closed", closed), ("plain", plain))
             for c in [p.constrain_answer(constraint, prompt)]}
    assert gates == {("qwen3", "opened"): (end, None), ("qwen3", "closed"): (None, None),
                     ("qwen3", "plain"): (end, start), ("deepseek_r1", "opened"): (end, None),
                     ("deepseek_r1", "closed"): (None, None),
                     ("deepseek_r1", "plain"): (end, None)}
    assert qwen3.constrain_answer(constraint, closed) is constraint
    assert qwen3.constrain_answer(constraint, opened).key == constraint.key  # same grammar


def test_a_tokenizer_without_think_tokens_is_refused() -> None:
    for name in REASONING_PARSERS:
        with pytest.raises(ConfigError, match="does not reason"):
            get_reasoning_parser(name, bundled_tokenizer())
    with pytest.raises(ConfigError, match="unknown reasoning parser"):
        get_reasoning_parser("nope", bundled_tokenizer())


def test_reasoning_token_count(thinking_tokenizer) -> None:
    """usage's reasoning_tokens: the tokens up to the first `</think>`, tags included."""
    parser = get_reasoning_parser("qwen3", thinking_tokenizer)
    start, end = parser.start_token_id, parser.end_token_id
    assert parser.stream(True).count_tokens([5, 6, end, 7]) == 3
    assert parser.stream(True).count_tokens([5, 6]) == 2  # never closed: all reasoning
    assert parser.stream(False).count_tokens([start, 5, end, 7, 8]) == 3
    assert parser.stream(False).count_tokens([5, end, 7]) == 0
    assert parser.stream(True).count_tokens([]) == 0
