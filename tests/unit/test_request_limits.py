"""The request budget's checks that need no server: the JSON depth scan (the figure a parser
would reach, for any split into pieces, with strings and escapes that hold brackets), the
schema depth of StructuredOutputs, and run-batch's line depth."""
from __future__ import annotations

import json
import random

import pytest

from aioengine.sampling_params import (MAX_SCHEMA_DEPTH, SamplingParams, SamplingParamsError,
                                       StructuredOutputs, nesting_depth)
from aioengine.server import request_limits
from aioengine.server.batch import LineError, parse_line
from aioengine.server.protocol import ApiError
from aioengine.server.request_limits import RequestLimits, check_request, json_depth

_STRINGS = ["", "a", '"', "\\", "\\\\", '\\"[', "]}", "[{", "x\\", "\u2603["]


def _random_value(rng: random.Random, level: int = 0) -> object:
    r = rng.random()
    if level > 7 or r < 0.3:
        return rng.choice([1, -2.5, None, True, *_STRINGS])
    if r < 0.65:
        return [_random_value(rng, level + 1) for _ in range(rng.randint(0, 3))]
    return {rng.choice(_STRINGS): _random_value(rng, level + 1) for _ in range(rng.randint(0, 3))}


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1 << 20])
def test_json_depth_is_the_nesting_a_parser_sees(piece: int,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(request_limits, "_DEPTH_PIECE_BYTES", piece)
    rng = random.Random(48)
    for _ in range(600):
        value = _random_value(rng)
        raw = json.dumps(value).encode()
        assert json_depth(raw) == nesting_depth(value), raw


def test_json_depth_of_a_deep_body_is_counted_without_parsing() -> None:
    raw = b'{"pad": "' + b"[" * (1 << 20) + b'", "junk": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    assert json_depth(raw) == 20_001


def _deep_schema(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_nested_past_the_bound_is_a_typed_error_not_a_recursion_error() -> None:
    # 2 dict levels per schema level; a 1,000-level schema broke deepcopy and jsonschema.
    with pytest.raises(SamplingParamsError, match="nests deeper"):
        StructuredOutputs(json=_deep_schema(1000))
    ok = StructuredOutputs(json=_deep_schema(MAX_SCHEMA_DEPTH // 2 - 1))
    params = SamplingParams(structured_outputs=ok)
    assert params.clone().structured_outputs is ok  # shared, never copied per request


@pytest.mark.parametrize("body,field", [
    ({"stop": ["x"] * 1025}, "stop"),
    ({"stop": ["y" * 40_000, "z" * 30_000]}, "stop"),
    ({"stop_sequences": ["x"] * 2000}, "stop_sequences"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": "d" * 300_000}}]},
     "tools"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"schema": {"enum": ["v" * 300_000]}}}},
     "response_format"),
    ({"guided_regex": "a" * 300_000}, "guided_regex"),
    ({"text": {"format": {"type": "json_schema", "schema": {"enum": ["v" * 300_000]}}}}, "text"),
])
def test_over_a_limit_is_a_400_naming_the_field(body: dict, field: str) -> None:
    with pytest.raises(ApiError) as e:
        check_request(body, RequestLimits())
    assert e.value.status == 400 and e.value.param == field
    assert "--max-" in e.value.message


def test_at_the_limits_passes() -> None:
    check_request({"stop": ["x"] * 1024, "logit_bias": {str(i): 1 for i in range(300)},
                   "tools": [{"type": "function", "function": {"name": f"f{i}"}}
                             for i in range(128)]}, RequestLimits())


def test_a_batch_line_nested_too_deep_is_a_line_error() -> None:
    raw = (b'{"custom_id": "a", "url": "/v1/completions", "body": {"prompt": "x", "junk": '
           + b"[" * 100 + b"]" * 100 + b"}}")
    with pytest.raises(LineError, match="--max-json-depth"):
        parse_line(raw, 1, {"/v1/completions": None}, max_depth=64)
