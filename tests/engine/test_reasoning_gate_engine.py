"""The structured feature's reasoning gate inside the engine, with and without speculative
decoding: on a tiny thinking model whose prompt opens `<think>`, a regex constrains only the
tokens after the output's first `</think>`; greedy output with n-gram drafts (which cross
the end of the reasoning) equals the output without them; blocks are all released."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from aioengine import LLM, SamplingParams
from aioengine.sampling_params import StructuredOutputs
from tests.engine.conftest import assert_blocks_released
from tests.thinking_models import make_thinking_model_dir

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}
REGEX = "[a-f ]{12}"
LETTERS = "ab cd ef ab cd ef"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_thinking_model_dir(tmp_path_factory.mktemp("think") / "m", "qwen3",
                                   arch="llama")


def run(model_dir: Path, spec: dict | None, end_bias: float) -> tuple[list[int], LLM]:
    llm = LLM(str(model_dir), dtype="float32", max_model_len=512, speculative_config=spec)
    tok = llm.tokenizer
    start, end = tok.convert_tokens_to_ids(["<think>", "</think>"])
    letters = tok.encode(LETTERS, add_special_tokens=False)
    # The prompt holds letters after a `</think>` (so drafts after one are letters) and
    # ends inside a reasoning block the "template" opened.
    prompt = letters + [end] + letters + [start]
    bias = {t: 5.0 for t in letters} | {end: end_bias}
    constraint = StructuredOutputs(regex=REGEX, reasoning_end_token_id=end)
    params = SamplingParams(temperature=0.0, max_tokens=30, logit_bias=bias,
                            structured_outputs=constraint)
    out = llm.generate([prompt], params)[0].outputs[0]
    assert_blocks_released(llm.core)
    ids = out.token_ids
    if end in ids:  # the answer, after the first `</think>`, matches the regex
        answer = tok.decode(ids[ids.index(end) + 1:], skip_special_tokens=True)
        if out.finish_reason == "stop":
            assert re.fullmatch(REGEX, answer), (answer, out.text)
        else:
            assert re.fullmatch(r"[a-f ]*", answer), (answer, out.text)
    return ids, llm


@pytest.mark.parametrize("end_bias", [100.0, 7.0, 0.0])
def test_gate_with_and_without_drafts(model_dir: Path, end_bias: float) -> None:
    plain, _ = run(model_dir, None, end_bias)
    drafted, llm = run(model_dir, NGRAM, end_bias)
    assert drafted == plain
    assert llm.core.stats()["spec_decode_num_drafts"] > 0


def test_the_answer_is_constrained_only_after_the_reasoning(model_dir: Path) -> None:
    """With `</think>` first, all the rest is the regex; the gate never constrained the
    `</think>` itself (the regex does not allow it)."""
    ids, llm = run(model_dir, None, 100.0)
    end = llm.tokenizer.convert_tokens_to_ids("</think>")
    assert ids[0] == end and end not in ids[1:]


def test_the_reasoning_is_not_constrained(model_dir: Path) -> None:
    """Without the bias the model never closes the reasoning here: its output is free text
    the regex would not allow (the grammar never saw it)."""
    ids, llm = run(model_dir, None, 0.0)
    assert llm.tokenizer.convert_tokens_to_ids("</think>") not in ids
    assert not re.fullmatch(r"[a-f ]*", llm.tokenizer.decode(ids, skip_special_tokens=True))
