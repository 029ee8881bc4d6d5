"""Request bodies -> SamplingParams (aioengine/server/protocol.py): a field the body leaves out
takes the model's default, else SamplingParams' own; the body always wins."""
from __future__ import annotations

from dataclasses import asdict

import pytest

from aioengine.server.protocol import (ApiError, build_sampling_params, chat_sampling_params,
                                       completion_sampling_params)
from aioengine.sampling_params import SamplingParams


def test_an_empty_body_is_sampling_params_defaults() -> None:
    params, echo = completion_sampling_params({})
    assert asdict(params) == asdict(SamplingParams()) and not echo
    # chat: no max_tokens = up to the context (the engine resolves None per prompt)
    assert asdict(chat_sampling_params({})) == asdict(SamplingParams(max_tokens=None))


def test_nulls_are_left_out() -> None:
    body = {name: None for name in asdict(SamplingParams()) if name != "max_tokens"}
    assert asdict(build_sampling_params(body, 5, None)) == asdict(SamplingParams(max_tokens=5))


def test_model_defaults_then_the_body() -> None:
    model = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 8}
    params = chat_sampling_params({"top_p": 0.5, "presence_penalty": 0.5}, model)
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.5, 20)
    assert params.presence_penalty == 0.5 and params.max_tokens == 8
    assert params.min_p == SamplingParams().min_p  # neither sets it
    # completions: SamplingParams' max_tokens, capped by the model's; null = the context
    assert completion_sampling_params({}, model)[0].max_tokens == 8
    assert completion_sampling_params({}, {"max_tokens": 64})[0].max_tokens == 16
    assert completion_sampling_params({"max_tokens": None}, model)[0].max_tokens is None


@pytest.mark.parametrize("parse", [lambda b: completion_sampling_params(b)[0],
                                   chat_sampling_params])
def test_max_tokens_below_one_is_a_400_naming_it(parse) -> None:
    with pytest.raises(ApiError) as info:
        parse({"max_tokens": 0})
    assert (info.value.status, info.value.param) == (400, "max_tokens")
    assert info.value.message == "max_tokens must be >= 1, got 0"


def test_every_body_field_is_read() -> None:
    """Each field a body may set reaches SamplingParams (none is dropped on the way)."""
    body = {"n": 2, "temperature": 0.5, "top_p": 0.5, "top_k": 3, "min_p": 0.1,
            "presence_penalty": 0.1, "frequency_penalty": 0.2, "repetition_penalty": 1.1,
            "logit_bias": {"4": 1.0}, "seed": 9, "min_tokens": 2, "stop": "x",
            "stop_token_ids": [5], "ignore_eos": True, "include_stop_str_in_output": True,
            "skip_special_tokens": False, "spaces_between_special_tokens": False}
    params = build_sampling_params(body, 7, 1, prompt_logprobs=2)
    expected = SamplingParams(**{**body, "logit_bias": {4: 1.0}}, max_tokens=7, logprobs=1,
                              prompt_logprobs=2)
    assert asdict(params) == asdict(expected)
