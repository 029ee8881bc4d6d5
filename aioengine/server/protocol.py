"""Request bodies of the OpenAI API -> validated Python values and SamplingParams.

Every caller mistake becomes an `ApiError` (HTTP status + OpenAI error body with `param`),
raised before any request reaches the engine. Unknown fields are ignored: OpenAI clients
send extras. A JSON `null` means "not given" for every optional field.
"""
from __future__ import annotations

from dataclasses import dataclass
from dataclasses import fields as dataclass_fields
from typing import Any, Callable, Mapping

import orjson

from aioengine.errors import InvalidRequestError
from aioengine.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputs

_MISSING = object()
_DEFAULT_MAX_TOKENS: int = next(f.default for f in dataclass_fields(SamplingParams)
                                if f.name == "max_tokens")  # type: ignore[assignment]


class ApiError(Exception):
    """An error answered as `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | int | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 503

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    @classmethod
    def invalid(cls, e: InvalidRequestError, param: str | None = None) -> ApiError:
        """A 400 from the engine's own validation (its `param`, unless overridden)."""
        return cls(400, str(e), param or e.param)


def error_body(status: int, message: str, type: str, param: str | None = None,
               code: str | int | None = None) -> dict[str, Any]:
    return ApiError(status, message, param, type, code).body()


def parse_json_object(raw: bytes) -> dict[str, Any]:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    return json_object(body)


def json_object(body: Any) -> dict[str, Any]:
    """`body` if the parsed request body is a JSON object, else a 400."""
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# ---- typed field access ---------------------------------------------------------------

def _type_error(name: str, expected: str, value: Any) -> ApiError:
    return ApiError(400, f"{name} must be {expected}, got {type(value).__name__} {value!r:.80}",
                    name)


def _get_exact(body: dict, name: str, default: Any, kind: type, expected: str) -> Any:
    """body[name] if it is a `kind`; `default` when absent or null; else a 400."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise _type_error(name, expected, value)
    return value


def get_bool(body: dict, name: str, default: bool | None) -> bool | None:
    return _get_exact(body, name, default, bool, "a boolean")


def get_int(body: dict, name: str, default: int | None, lo: int | None = None,
            hi: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    # JSON 3.0 is accepted as 3 (some clients send floats); True is not an integer here.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _type_error(name, "an integer", value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ApiError(400, f"{name} must be {bounds}, got {value}", name)
    return value


def get_float(body: dict, name: str, default: float | None) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _type_error(name, "a number", value)
    return float(value)


def get_str(body: dict, name: str, default: str | None) -> str | None:
    return _get_exact(body, name, default, str, "a string")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def get_int_list(body: dict, name: str) -> list[int] | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise _type_error(name, "a list of integers", value)
    return value


def get_stop(body: dict) -> list[str]:
    value = body.get("stop")
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise _type_error("stop", "a string or a list of strings", value)
    if any(not s for s in value):
        raise ApiError(400, "stop strings must not be empty", "stop")
    return value


def get_logit_bias(body: dict) -> dict[int, float] | None:
    value = body.get("logit_bias")
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _type_error("logit_bias", "an object of token id -> bias", value)
    bias = {}
    for key, b in value.items():
        try:
            token = int(key)
        except ValueError:
            raise ApiError(400, f"logit_bias key {key!r} is not a token id", "logit_bias") from None
        if isinstance(b, bool) or not isinstance(b, (int, float)):
            raise _type_error("logit_bias", "an object of token id -> number", b)
        bias[token] = float(b)
    return bias


# ---- shared request fields ------------------------------------------------------------

@dataclass
class StreamSpec:
    stream: bool
    include_usage: bool


def get_stream(body: dict) -> StreamSpec:
    stream = bool(get_bool(body, "stream", False))
    options = body.get("stream_options")
    if options is None:
        return StreamSpec(stream, False)
    if not stream:
        raise ApiError(400, "stream_options is only allowed when stream is true",
                       "stream_options")
    if not isinstance(options, dict):
        raise _type_error("stream_options", "an object", options)
    include = options.get("include_usage")
    if include is not None and not isinstance(include, bool):
        raise _type_error("stream_options", "an object with a boolean include_usage", options)
    return StreamSpec(stream, bool(include))


def get_priority(body: dict) -> int:
    return get_int(body, "priority", 0)  # type: ignore[return-value]


# ---- structured output ------------------------------------------------------------------

_GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
                  "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _response_format(value: Any) -> dict[str, Any] | None:
    """OpenAI's response_format -> StructuredOutputs fields (None for "text")."""
    name = "response_format"
    if not isinstance(value, dict):
        raise _type_error(name, "an object", value)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ApiError(400, "response_format of type json_schema needs json_schema.schema, "
                           "a JSON schema object", name)
        return {"json": spec["schema"]}
    raise ApiError(400, "response_format.type must be 'text', 'json_object' or 'json_schema', "
                   f"got {kind!r:.80}", name)


def _structured_outputs_object(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _type_error("structured_outputs", "an object", value)
    unsupported = sorted(k for k in ("grammar_lark",) if value.get(k) is not None)
    if unsupported:
        raise ApiError(400, f"structured_outputs.{unsupported[0]} is not supported",
                       "structured_outputs")
    return {k: value[k] for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)}


def structured_outputs_field(body: dict) -> str | None:
    """The request field that carries the constraint (for error messages' `param`)."""
    for name in ("response_format", "structured_outputs", *_GUIDED_FIELDS):
        value = body.get(name)
        if value is not None and not (name == "response_format" and isinstance(value, dict)
                                      and value.get("type") == "text"):
            return name
    return None


def get_structured_outputs(body: dict) -> StructuredOutputs | None:
    """The constraint of a request, from `response_format`, vLLM's `structured_outputs`
    object or its older `guided_*` fields. More than one constraint is a 400."""
    found: list[tuple[str, dict[str, Any]]] = []
    if body.get("response_format") is not None:
        fields = _response_format(body["response_format"])
        if fields:
            found.append(("response_format", fields))
    if body.get("structured_outputs") is not None:
        fields = _structured_outputs_object(body["structured_outputs"])
        if fields:
            found.append(("structured_outputs", fields))
    for name, key in _GUIDED_FIELDS.items():
        if body.get(name) is not None:
            found.append((name, {key: body[name]}))
    constraints = [(name, k) for name, fields in found for k in fields]
    if len(constraints) > 1:
        listed = ", ".join(f"{name}.{k}" if name != f"guided_{k}" else name
                           for name, k in constraints)
        raise ApiError(400, f"a request may have one output constraint, got {len(constraints)}: "
                       f"{listed}", constraints[1][0])
    if not found:
        return None
    name, fields = found[0]
    if "choice" in fields and not isinstance(fields["choice"], list):
        raise _type_error(name, "a list of strings (choice)", fields["choice"])
    try:
        return StructuredOutputs(**fields)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), name) from None
    except TypeError as e:
        raise ApiError(400, f"{name}: {e}", name) from None


def build_sampling_params(body: dict, max_tokens: int | None, logprobs: int | None,
                          prompt_logprobs: int | None = None,
                          defaults: Mapping[str, Any] | None = None) -> SamplingParams:
    """The fields completions and chat share, plus vLLM's extras. `max_tokens=None` means
    up to the context (the engine resolves it per prompt). A field the body leaves out or
    sends null takes the model's default (`defaults`: aioengine/generation_config.py), else
    SamplingParams' own: no default is restated here."""
    get_str(body, "user", None)  # accepted and type-checked, not used
    given = {
        "n": get_int(body, "n", None, lo=1, hi=128),
        "temperature": get_float(body, "temperature", None),
        "top_p": get_float(body, "top_p", None),
        "top_k": get_int(body, "top_k", None, lo=-1),
        "min_p": get_float(body, "min_p", None),
        "presence_penalty": get_float(body, "presence_penalty", None),
        "frequency_penalty": get_float(body, "frequency_penalty", None),
        "repetition_penalty": get_float(body, "repetition_penalty", None),
        "logit_bias": get_logit_bias(body),
        # torch generators take 64-bit seeds; sample i of n uses seed + i.
        "seed": get_int(body, "seed", None, lo=-(1 << 63), hi=(1 << 63) - 1),
        "min_tokens": get_int(body, "min_tokens", None, lo=0),
        "stop": get_stop(body),
        "stop_token_ids": get_int_list(body, "stop_token_ids"),
        "ignore_eos": get_bool(body, "ignore_eos", None),
        "include_stop_str_in_output": get_bool(body, "include_stop_str_in_output", None),
        "skip_special_tokens": get_bool(body, "skip_special_tokens", None),
        "spaces_between_special_tokens": get_bool(body, "spaces_between_special_tokens", None),
    }
    # max_tokens is resolved per route (None is a value there: up to the context).
    fields = {name: value for name, value in (defaults or {}).items() if name != "max_tokens"}
    fields.update((name, value) for name, value in given.items() if value is not None)
    try:
        return SamplingParams(**fields, max_tokens=max_tokens, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs,
                              structured_outputs=get_structured_outputs(body))
    except InvalidRequestError as e:
        raise ApiError.invalid(e) from None


def completion_sampling_params(body: dict, defaults: Mapping[str, Any] | None = None
                               ) -> tuple[SamplingParams, bool]:
    """SamplingParams of a /v1/completions body, and `echo` (`defaults`: the model's)."""
    # vLLM's default: SamplingParams' max_tokens when the body has none (at most the model's
    # default, as vLLM caps it); an explicit null = the context. SamplingParams checks >= 1.
    if "max_tokens" in body:
        max_tokens = get_int(body, "max_tokens", None)
    else:
        max_tokens = _DEFAULT_MAX_TOKENS
        if (defaults or {}).get("max_tokens") is not None:
            max_tokens = min(max_tokens, defaults["max_tokens"])
    logprobs = get_int(body, "logprobs", None, lo=0, hi=MAX_LOGPROBS)
    echo = bool(get_bool(body, "echo", False))
    params = build_sampling_params(body, max_tokens, logprobs,
                                   prompt_logprobs=logprobs if echo else None,
                                   defaults=defaults)
    return params, echo


def chat_sampling_params(body: dict, defaults: Mapping[str, Any] | None = None
                         ) -> SamplingParams:
    """SamplingParams of a /v1/chat/completions body (max_tokens defaults to the model's
    default, else the context; `defaults`: the model's)."""
    max_tokens = get_int(body, "max_completion_tokens", None, lo=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", None)  # SamplingParams checks >= 1
    if max_tokens is None:
        max_tokens = (defaults or {}).get("max_tokens")
    want_logprobs = bool(get_bool(body, "logprobs", False))
    top_logprobs = get_int(body, "top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top_logprobs is not None and not want_logprobs:
        raise ApiError(400, "top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (top_logprobs or 0) if want_logprobs else None
    return build_sampling_params(body, max_tokens, logprobs, defaults=defaults)


def _is_id_list(value: Any, check_length: Callable[[int], None] | None) -> bool:
    """Whether `value` is a non-empty list of token ids; `check_length(len)` is called
    before its ids are walked, so a list far over the context costs nothing to refuse."""
    if not isinstance(value, list) or not value or not _is_int(value[0]):
        return False
    if check_length is not None:
        check_length(len(value))
    return all(_is_int(t) for t in value)


def parse_completion_prompts(body: dict, check_length: Callable[[int], None] | None = None
                             ) -> list[str | list[int]]:
    """`prompt` as a string, list of strings, list of token ids, or list of such lists."""
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise ApiError(400, "prompt is required", "prompt")
    if isinstance(prompt, str):
        prompts: list = [prompt]
    elif _is_id_list(prompt, check_length):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or p == [] or _is_id_list(p, check_length) for p in prompt):
        prompts = list(prompt)
    elif isinstance(prompt, list) and not prompt:
        raise ApiError(400, "prompt must not be empty", "prompt")
    else:
        raise _type_error("prompt", "a string, a list of strings, a list of token ids or a "
                          "list of token id lists", prompt)
    if any(len(p) == 0 for p in prompts):
        raise ApiError(400, "prompt must not be empty", "prompt")
    return prompts
