"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from aioengine.errors import InvalidRequestError

MAX_LOGPROBS = 20
# Temperatures below this are treated as greedy: dividing logits by ~0 overflows to inf
# and the softmax turns into NaN (vLLM uses the same epsilon).
GREEDY_TEMPERATURE = 1e-5
# What torch.Generator.manual_seed accepts.
_SEED_MIN, _SEED_MAX = -(1 << 63), (1 << 64) - 1


class SamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range. `param` names the offending field."""


_CONSTRAINT_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# Nesting of a schema or structural tag: far beyond any real schema, and far below what the
# recursive code that reads one (the compiler, json.dumps, jsonschema) can follow.
MAX_SCHEMA_DEPTH = 128


def nesting_depth(value: Any) -> int:
    """Levels of dicts and lists in `value`, walked without recursion (a value nested
    thousands deep is measured, not a RecursionError)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = (item.values() if isinstance(item, dict)
                    else item if isinstance(item, list) else None)
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children
                     if isinstance(child, (dict, list)))
    return deepest


@dataclass(frozen=True)
class StructuredOutputs:
    """A constraint on the output (vLLM's names); exactly one field must be set.

    `json` is a JSON schema (a dict, or its JSON text); `regex` must full-match; `choice`
    is a list of allowed outputs; `grammar` is an EBNF grammar (xgrammar's GBNF dialect,
    start rule `root`); `json_object` asks for any JSON object; `structural_tag` is an
    xgrammar structural tag (a dict or its JSON text: free text with tagged, schema-checked
    regions, e.g. tool calls). Compilation (and so the
    check that a schema, regex or grammar is valid) happens in `aioengine.structured`.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: tuple[str, ...] | list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    # The reasoning gate (set by the server's --reasoning-parser, never from a body): the
    # constraint applies to the answer only, from the token after the output's first
    # `reasoning_end_token_id`. With `reasoning_start_token_id` too, the output may open its
    # reasoning with that token as its first token, else the constraint starts at once.
    # Not part of `key`: the compiled grammar is the same.
    reasoning_end_token_id: int | None = None
    reasoning_start_token_id: int | None = None

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINT_KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object, structural_tag; got {given or 'none'}", "structured_outputs")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if isinstance(value, str):
                try:
                    object.__setattr__(self, name, json.loads(value))
                except ValueError as e:
                    raise SamplingParamsError(f"structured_outputs.{name} is not valid JSON: "
                                              f"{e}", "structured_outputs") from None
            if getattr(self, name) is not None and not isinstance(getattr(self, name), dict):
                raise SamplingParamsError(f"structured_outputs.{name} must be a JSON object",
                                          "structured_outputs")
            if nesting_depth(getattr(self, name)) > MAX_SCHEMA_DEPTH:
                raise SamplingParamsError(f"structured_outputs.{name} nests deeper than "
                                          f"{MAX_SCHEMA_DEPTH} levels", "structured_outputs")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(f"structured_outputs.{name} must be a non-empty "
                                          "string", "structured_outputs")
        if self.choice is not None:
            if (isinstance(self.choice, str) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise SamplingParamsError("structured_outputs.choice must be a non-empty list "
                                          "of non-empty strings", "structured_outputs")
            object.__setattr__(self, "choice", tuple(self.choice))

    def __deepcopy__(self, memo: dict) -> StructuredOutputs:
        # Immutable by contract (frozen; its schema is only ever read): SamplingParams.clone
        # shares it rather than copying a schema per request.
        return self

    @property
    def key(self) -> tuple[str, Any]:
        """Hashable identity of the constraint: the compile cache's key."""
        if self.json is not None:
            return ("json", json.dumps(self.json, sort_keys=True))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.choice is not None:
            return ("choice", self.choice)
        if self.grammar is not None:
            return ("grammar", self.grammar)
        if self.structural_tag is not None:
            return ("structural_tag", json.dumps(self.structural_tag, sort_keys=True))
        return ("json_object", True)


@dataclass
class SamplingParams:
    """What to sample and when to stop, with vLLM's names and defaults.

    `temperature == 0` means greedy. `top_k in (0, -1)` disables top-k. `logprobs`/
    `prompt_logprobs` ask for that many top alternatives per position (plus the chosen
    token's own logprob). `seed` makes the request's samples independent of the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputs | None = None
    # Filled by the engine from the model's generation config (EOS and friends).
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                   StructuredOutputs):
            raise SamplingParamsError("structured_outputs must be a StructuredOutputs",
                                      "structured_outputs")
        self._validate()

    def clone(self) -> SamplingParams:
        """A deep copy: the engine fills its own (max_tokens, stop ids) per request."""
        return copy.deepcopy(self)

    def _validate(self) -> None:
        def check(ok: bool, param: str, message: str) -> None:
            if not ok:
                raise SamplingParamsError(f"{param} {message}", param)

        check(isinstance(self.n, int) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n}")
        check(self.temperature >= 0.0, "temperature", f"must be >= 0, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.top_k >= 0, "top_k", f"must be -1 (disabled) or >= 1, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(-2.0 <= value <= 2.0, name, f"must be in [-2, 2], got {value}")
        check(self.repetition_penalty > 0.0, "repetition_penalty",
              f"must be > 0, got {self.repetition_penalty}")
        check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens",
              f"must be >= 1, got {self.max_tokens}")
        check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= MAX_LOGPROBS, name,
                  f"must be in [0, {MAX_LOGPROBS}], got {value}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop",
              "must be non-empty strings")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
              "stop_token_ids", "must be non-negative integers")
        if self.logit_bias:
            check(all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()), "logit_bias",
                  "values must be in [-100, 100]")
        check(self.seed is None or (isinstance(self.seed, int)
                                    and _SEED_MIN <= self.seed <= _SEED_MAX - (self.n - 1)),
              "seed", f"must be an integer in [{_SEED_MIN}, {_SEED_MAX - (self.n - 1)}] "
              f"(sample i of n uses seed + i), got {self.seed}")

    def validate_vocab(self, vocab_size: int) -> None:
        """Checks token ids the request names against the model's vocabulary."""
        for tok in self.logit_bias or {}:
            if not 0 <= tok < vocab_size:
                raise SamplingParamsError(
                    f"logit_bias key {tok} is outside the vocabulary [0, {vocab_size})",
                    "logit_bias")
        for tok in self.stop_token_ids or []:
            if tok >= vocab_size:
                raise SamplingParamsError(
                    f"stop_token_ids entry {tok} is outside the vocabulary [0, {vocab_size})",
                    "stop_token_ids")

    @property
    def reads_output_tokens(self) -> bool:
        """Whether the sampler's logits depend on which tokens this request generated so far
        (the penalties), beyond their number (min_tokens). Such a request cannot be sampled
        before its previous token is known (async_scheduler's steps ahead) and is never
        the plain argmax (sample.is_plain_greedy). The one list of those fields:
        tests/unit/test_sampling_params.py checks it against the sampler."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0
                or self.presence_penalty != 0.0)

    @property
    def greedy(self) -> bool:
        """Temperatures below GREEDY_TEMPERATURE take the argmax (the sampler's rule)."""
        return self.temperature < GREEDY_TEMPERATURE
