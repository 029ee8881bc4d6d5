"""Structured output on the bundled model through LLM: every output matches its constraint,
at temperature 0 and at temperature 1 over many seeds (n > 1 samples fork, each with its
own matcher), with preemption, logprobs and unconstrained neighbours."""
from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest

from aioengine import LLM, SamplingParams
from aioengine.errors import InvalidRequestError
from aioengine.sampling_params import StructuredOutputs

pytestmark = pytest.mark.slow

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": {"type": "string", "minLength": 1, "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["name", "age"]},
        "city": {"type": "string", "maxLength": 12}}, "required": ["person", "city"]},
    "array": {"type": "object", "properties": {
        "primes": {"type": "array", "items": {"type": "integer", "minimum": 2, "maximum": 97},
                   "minItems": 1, "maxItems": 4}}, "required": ["primes"]},
    "enum": {"type": "object", "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "string", "enum": ["S", "M", "L"]},
        "in_stock": {"type": "boolean"}}, "required": ["color", "size", "in_stock"]},
    "bounded_numbers": {"type": "object", "properties": {
        "celsius": {"type": "number", "minimum": -50, "maximum": 50},
        "count": {"type": "integer", "exclusiveMinimum": 0, "maximum": 10}},
        "required": ["celsius", "count"]},
}
PROMPTS = {
    "nested": "Describe a person and their city as JSON.",
    "array": "List a few prime numbers as JSON.",
    "enum": "Describe a T-shirt in stock as JSON.",
    "bounded_numbers": "Give today's temperature and a count as JSON.",
}
# A small EBNF language, parsed independently with Python's own parser below.
ARITHMETIC = ('root ::= num " " op " " num\n'
              'op ::= "+" | "-" | "*"\n'
              'num ::= [1-9] [0-9]?')
NUM_SEEDS = 4


def chat(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def constrained(temperature: float, seed: int | None = None, n: int = 1, max_tokens: int = 80,
                **constraint: object) -> SamplingParams:
    return SamplingParams(temperature=temperature, seed=seed, n=n, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputs(**constraint))


@pytest.fixture(scope="module")
def llm() -> LLM:
    # float32: seeded samples are compared alone and in other batches, which only float32
    # repeats exactly (see tests/e2e/test_server_chat.py's server fixture).
    return LLM(num_kv_blocks=512, max_num_seqs=64, dtype="float32")


def texts(out) -> list[str]:
    for c in out.outputs:
        assert c.finish_reason == "stop", (c.text, c.finish_reason)
    return [c.text for c in out.outputs]


def test_json_schemas_validate_greedy_and_sampled(llm: LLM) -> None:
    prompts, params = [], []
    for name, schema in SCHEMAS.items():
        prompts.append(chat(PROMPTS[name]))
        params.append(constrained(0.0, json=schema))
        prompts.append(chat(PROMPTS[name]))  # n samples fork from one prompt
        params.append(constrained(1.0, seed=100, n=NUM_SEEDS, json=schema))
    outs = llm.generate(prompts, params)
    for (name, schema), greedy, sampled in zip(SCHEMAS.items(), outs[::2], outs[1::2]):
        for text in texts(greedy) + texts(sampled):
            jsonschema.validate(json.loads(text), schema)
        assert len(set(texts(sampled))) > 1, name  # the samples really are random


def test_json_object_regex_choice_and_grammar(llm: LLM) -> None:
    regex = r"[A-Z][a-z]{2,8} (19|20)[0-9]{2}"
    choices = ["Paris", "London", "Berlin", "New York"]
    cases = [
        ("A name and a year:", {"regex": regex}, lambda t: re.fullmatch(regex, t) is not None),
        (chat("What is the capital of France?"), {"choice": choices}, lambda t: t in choices),
        ("Some arithmetic:", {"grammar": ARITHMETIC}, _is_arithmetic),
    ]
    prompts, params = [], []
    for prompt, constraint, _ in cases:
        prompts += [prompt, prompt]
        params += [constrained(0.0, max_tokens=120, **constraint),
                   constrained(1.0, seed=7, n=NUM_SEEDS, max_tokens=120, **constraint)]
    outs = llm.generate(prompts, params)
    for i, (_, constraint, check) in enumerate(cases):
        for text in texts(outs[2 * i]) + texts(outs[2 * i + 1]):
            assert check(text), (constraint, text)


def test_json_object_outputs_parse(llm: LLM) -> None:
    """Any object is allowed, so a sampled one may run to max_tokens (then it is cut short,
    finish_reason "length"); every one that ends, ends as a parsable object."""
    prompt = chat('Reply with a JSON object with keys "name" and "age" for a cat.')
    greedy, sampled = llm.generate([prompt, prompt], [
        constrained(0.0, json_object=True),
        constrained(1.0, seed=7, n=NUM_SEEDS, json_object=True)])
    assert isinstance(json.loads(texts(greedy)[0]), dict)
    stopped = [c.text for c in sampled.outputs if c.finish_reason == "stop"]
    assert len(stopped) >= NUM_SEEDS // 2
    for text in stopped:
        assert isinstance(json.loads(text), dict)
    for c in sampled.outputs:
        assert c.text.startswith("{") and c.finish_reason in ("stop", "length")


def _is_arithmetic(text: str) -> bool:
    tree = ast.parse(text, mode="eval").body
    return (isinstance(tree, ast.BinOp) and isinstance(tree.op, (ast.Add, ast.Sub, ast.Mult))
            and all(isinstance(x, ast.Constant) and 1 <= x.value <= 99
                    for x in (tree.left, tree.right)))


def test_unconstrained_outputs_do_not_depend_on_constrained_neighbours(llm: LLM) -> None:
    plain = [chat("Write a haiku about the sea."), chat("Name three colors.")]
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=24)
    alone = llm.generate(plain, [greedy, seeded])
    neighbours = [chat(PROMPTS["nested"]), "A name and a year:"]
    mixed = llm.generate(
        [neighbours[0], plain[0], neighbours[1], plain[1]],
        [constrained(1.0, seed=3, n=3, json=SCHEMAS["nested"]), greedy,
         constrained(0.0, regex=r"[a-z]+ [0-9]{4}"), seeded])
    assert [o.outputs[0].token_ids for o in alone] == [mixed[1].outputs[0].token_ids,
                                                        mixed[3].outputs[0].token_ids]
    jsonschema.validate(json.loads(mixed[0].outputs[0].text), SCHEMAS["nested"])


def test_jump_forward_saves_steps_and_keeps_outputs_valid(llm: LLM) -> None:
    manager = llm.core.structured
    schema = SCHEMAS["enum"]
    params = constrained(1.0, seed=11, n=2, json=schema)
    try:
        for jump_forward in (False, True):
            manager.jump_forward = jump_forward
            before = manager.stats.num_jump_forward_tokens
            out = llm.generate(chat(PROMPTS["enum"]), params)[0]
            for text in texts(out):
                jsonschema.validate(json.loads(text), schema)
            saved = manager.stats.num_jump_forward_tokens - before
            # Keys, separators and braces are forced: several per sample.
            assert (saved >= 2 * 4) if jump_forward else saved == 0
    finally:
        manager.jump_forward = True


def test_logprobs_are_reported_after_masking(llm: LLM, bundled_tokenizer) -> None:
    choices = ["yes", "no"]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5,
                            structured_outputs=StructuredOutputs(choice=choices))
    out = llm.generate(chat("Is the sky blue?"), params)[0].outputs[0]
    assert out.text in choices and out.finish_reason == "stop"
    first = out.logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if lp.logprob > float("-inf")}
    assert all(any(c.startswith(bundled_tokenizer.decode([t])) for c in choices)
               for t in finite)
    # Under the masked distribution the allowed tokens hold (almost) all the mass.
    assert sum(2.718281828 ** lp for lp in finite.values()) > 0.99


def test_invalid_constraints_raise_before_anything_is_queued(llm: LLM) -> None:
    for constraint in ({"regex": "(unclosed"}, {"json": {"type": "nope"}},
                       {"grammar": "root ::= missing"}):
        with pytest.raises(InvalidRequestError) as e:
            llm.generate("Hi", [constrained(0.0, **constraint)])
        assert e.value.param == "structured_outputs"
    assert not llm.core.has_unfinished_requests()
    llm.core.kv_cache_manager.check_integrity()


def test_preemption_keeps_matchers_in_step(llm: LLM) -> None:
    """A cache so small that samples are preempted and recomputed: the matcher state depends
    only on output tokens, so greedy outputs equal the roomy engine's."""
    small = LLM(num_kv_blocks=10, block_size=16, max_num_seqs=8)
    prompts = [chat(PROMPTS[name]) for name in SCHEMAS]
    params = [constrained(0.0, json=schema) for schema in SCHEMAS.values()]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    outs = small.generate(prompts, params)
    assert small.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == expected
    for out, schema in zip(outs, SCHEMAS.values()):
        jsonschema.validate(json.loads(texts(out)[0]), schema)


def test_a_grammar_that_ends_before_min_tokens_ends_the_request(llm: LLM) -> None:
    """min_tokens bans the stop tokens, and a finished grammar allows only them: the grammar
    wins (the stop tokens come back for that row) and the request stops with the complete
    match, instead of sampling from a row with every token masked (finish_reason "error")."""
    ab = StructuredOutputs(regex="ab")
    params = [SamplingParams(temperature=0.0, max_tokens=10, min_tokens=5, structured_outputs=ab),
              SamplingParams(temperature=1.0, seed=3, max_tokens=10, min_tokens=5,
                             structured_outputs=ab),
              SamplingParams(temperature=0.0, max_tokens=6, min_tokens=5)]  # no grammar
    outs = llm.generate(["Say ab:", "Say ab:", "Say ab:"], params)
    for out in outs[:2]:
        assert out.outputs[0].text == "ab" and out.outputs[0].finish_reason == "stop"
    assert len(outs[2].outputs[0].token_ids) >= 5  # min_tokens alone still holds
