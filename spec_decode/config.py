"""`speculative_config`: vLLM's dict, validated into a frozen SpeculativeConfig.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5}
    {"method": "eagle3", "num_speculative_tokens": 3, "model": "/path/to/draft"}
    {"method": "eagle3"}   (the head shipped for the target, its n_predict draft tokens:
                            filled in by spec_decode.shipped once the target is known)
    {"method": "eagle3", "tree": {"depth": 4, "top_k": 4, "num_nodes": 8}}
                           (EAGLE-2 dynamic tree drafting: spec_decode/tree.py)
    {"method": "eagle3", "quantization": "none"}   (the head's weights in the target's
                           dtype; left out: int8 on the CPU, see HEAD_QUANTIZATIONS)
    {"method": "suffix", "num_speculative_tokens": 8, "suffix_decoding_max_tree_depth": 24,
     "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
     "suffix_decoding_min_token_prob": 0.1}   (suffix decoding, spec_decode/suffix.py:
                           vLLM's names and defaults; k is the cap on a draft's length)
    {"method": "auto"}     (ours: per request and step the draft with the best expected
                           gain of suffix decoding, n-gram lookup and the draft head (the
                           `model` given, else the one shipped for the target, else none):
                           spec_decode/auto.py; takes the suffix, n-gram and head fields,
                           and head_num_speculative_tokens, the head's chain (left out:
                           its n_predict))

Every error is a ConfigError naming the offending field, raised at engine start-up.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, fields
from typing import Any

from aioengine.errors import ConfigError
from aioengine.spec_decode.tree import TreeConfig

METHODS = ("ngram", "eagle", "eagle3", "suffix", "auto")
# EngineArgs.speculative_config left out: per request, drafts only where they pay.
DEFAULT_SPECULATIVE_CONFIG = "auto"
DRAFT_HEAD_METHODS = ("eagle", "eagle3")
MAX_SPECULATIVE_TOKENS = 16
# Methods whose k left out is DEFAULT_SUFFIX_SPECULATIVE_TOKENS and may be up to
# MAX_SUFFIX_SPECULATIVE_TOKENS (auto's k caps its suffix and n-gram drafts).
SUFFIX_K_METHODS = ("suffix", "auto")
# Suffix drafts are cheap to make and their length adapts per step (0..k), so k may be
# larger: a cap on the longest draft, not a length every step verifies.
MAX_SUFFIX_SPECULATIVE_TOKENS = 32
# k left out for suffix decoding. vLLM takes the tree depth (24); on a CPU every verified
# row costs a share of a step, and drafts are rarely kept past their 8th token
# (docs/benchmarks.md, "Speculative decoding": k = 8 beat k = 16 on the extraction set).
DEFAULT_SUFFIX_SPECULATIVE_TOKENS = 8
# A tree's nodes (and its depth, top_k) per request and step.
MAX_TREE_NODES = 64
# vLLM's default when neither prompt_lookup_min nor prompt_lookup_max is given.
DEFAULT_PROMPT_LOOKUP = 5
# A draft head drafts only in steps of at most this many running requests, unless the
# config says otherwise: serving W1 at 32 streams with the shipped head, interleaved, was
# 0.79-0.88x of no speculation when it always drafted and 1.01-1.13x with this limit
# (docs/eagle-head.md); one request alone always drafts.
DEFAULT_HEAD_DISABLE_BY_BATCH_SIZE = 8
# A draft head's weight storage (`quantization`; left out: "auto"). A head only guesses and
# verification is exact, so its storage changes speed and acceptance, never the output.
# auto: int8 weight-only (one scale per output row) where the CPU kernels run it, else the
# target's dtype: on the bundled model a k=2 propose took 1.96 ms instead of 2.38 in bf16,
# acceptance the same (1.635 vs 1.631, docs/eagle-head.md); none: the target's dtype.
HEAD_QUANTIZATIONS = ("auto", "int8", "none")


def speculative_config_dict(value: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """`speculative_config` as vLLM's dict (None: off). Text is vLLM's JSON object, JSON
    null or "none" (off), or a method's bare name ("auto", "ngram", "suffix"), its other
    fields left out; a dict or None is itself (checked by SpeculativeConfig.parse)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if text.lower() == "none":
        return None
    if text in METHODS:
        return {"method": text}
    try:
        return json.loads(text)
    except ValueError as e:
        raise ConfigError(f"speculative_config is not valid JSON: {e}") from None


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    # None (eagle, eagle3 only) until resolve_speculative_config reads the head's n_predict.
    num_speculative_tokens: int | None
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    # The draft head's directory (eagle, eagle3); None: the head shipped for the target.
    model: str | None = None
    # Steps with more running requests than this verify no drafts (vLLM's
    # disable_by_batch_size): at large batches the forward is compute-bound and drafts
    # only add work. None = always speculate. Left out of the dict: None for n-gram,
    # DEFAULT_HEAD_DISABLE_BY_BATCH_SIZE for a draft head (eagle, eagle3).
    disable_by_batch_size: int | None = None
    # Draft heads only: draft a tree (EAGLE-2) instead of a chain; None = a chain.
    tree: TreeConfig | None = None
    # Draft heads only: their weights' storage (HEAD_QUANTIZATIONS); None for n-gram.
    quantization: str | None = None
    # Suffix decoding only (spec_decode/suffix.py), vLLM's names and defaults: the trees'
    # depth (a match plus its draft), finished requests kept in the global tree (0: none),
    # a draft's length at most max_spec_factor * the match's, and the least empirical
    # probability a drafted token may have.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Ours, not vLLM's: the global tree's bound in bytes (oldest requests evicted first).
    suffix_decoding_max_cached_bytes: int = 256 * 2**20
    # auto only: the draft head's chain length; left out, the head's n_predict (filled in
    # by shipped.resolve_speculative_config with `model`).
    head_num_speculative_tokens: int | None = None

    @property
    def uses_draft_head(self) -> bool:
        """Drafts from a head over the target's hidden states (eagle, eagle3, auto with a
        head), which needs lookahead KV slots and the target's aux layers; n-gram and
        suffix drafts are read off token ids."""
        if self.method == "auto":
            return self.model is not None
        return self.method in DRAFT_HEAD_METHODS

    @property
    def draft_methods(self) -> tuple[str, ...]:
        """The names a draft's method may have (the per-position counters' `method` label):
        the config's method, or auto's suffix, ngram and its head's eagle3."""
        if self.method != "auto":
            return (self.method,)
        return ("suffix", "ngram") + (("eagle3",) if self.model is not None else ())

    @property
    def head_tokens(self) -> int:
        """The draft head's chain length (0 without a head)."""
        if self.method == "auto":
            return self.head_num_speculative_tokens or 0
        return (self.num_speculative_tokens or 0) if self.uses_draft_head else 0

    @classmethod
    def parse(cls, value: dict[str, Any] | str | SpeculativeConfig | None,
              ) -> SpeculativeConfig | None:
        """From the dict (or its JSON text, as `--speculative-config` takes it)."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = speculative_config_dict(value)
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ConfigError("speculative_config must be a JSON object / dict")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ConfigError(f"speculative_config has unknown field(s) {unknown}; "
                              f"known: {sorted(known)}")
        method = value.get("method")
        if method not in METHODS:
            raise ConfigError(f"speculative_config.method must be one of {list(METHODS)}, "
                              f"got {method!r}")
        k = value.get("num_speculative_tokens")
        if method in SUFFIX_K_METHODS and k is None:
            k = DEFAULT_SUFFIX_SPECULATIVE_TOKENS
        k_max = (MAX_SUFFIX_SPECULATIVE_TOKENS if method in SUFFIX_K_METHODS
                 else MAX_SPECULATIVE_TOKENS)
        if (k is not None or method == "ngram") and (not _is_int(k) or not 1 <= k <= k_max):
            raise ConfigError("speculative_config.num_speculative_tokens must be an integer in "
                              f"[1, {k_max}], got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not _is_int(v) or v < 1):
                raise ConfigError(f"speculative_config.{name} must be an integer >= 1, got {v!r}")
        # vLLM: one given sets the other; neither gives 5 and 5.
        lo, hi = lo or hi or DEFAULT_PROMPT_LOOKUP, hi or lo or DEFAULT_PROMPT_LOOKUP
        if lo > hi:
            raise ConfigError(f"speculative_config.prompt_lookup_min ({lo}) must be <= "
                              f"prompt_lookup_max ({hi})")
        model = value.get("model")
        suffix = _parse_suffix(value, method)
        head_k = value.get("head_num_speculative_tokens")
        if head_k is not None and method != "auto":
            raise ConfigError(f"speculative_config.head_num_speculative_tokens is only used "
                              f"by method 'auto', not {method!r}")
        if head_k is not None and (not _is_int(head_k)
                                   or not 1 <= head_k <= MAX_SPECULATIVE_TOKENS):
            raise ConfigError("speculative_config.head_num_speculative_tokens must be an "
                              f"integer in [1, {MAX_SPECULATIVE_TOKENS}], got {head_k!r}")
        head_methods = DRAFT_HEAD_METHODS + ("auto",)
        if method not in head_methods:
            if model is not None:
                raise ConfigError(f"speculative_config.model is not used by method {method!r}")
        elif model is not None and (not isinstance(model, str) or not model):
            raise ConfigError(f"speculative_config.model (the draft head's directory) must "
                              f"be a path, got {model!r}")
        elif model is not None and not os.path.isdir(model):
            raise ConfigError(f"speculative_config.model: no directory {model!r}")
        # Left out: a draft head's default (key given as null: speculate at any batch).
        limit = value.get("disable_by_batch_size", DEFAULT_HEAD_DISABLE_BY_BATCH_SIZE
                          if method in DRAFT_HEAD_METHODS else None)
        if limit is not None and (not _is_int(limit) or limit < 1):
            raise ConfigError("speculative_config.disable_by_batch_size must be an integer "
                              f">= 1, got {limit!r}")
        if method == "auto" and value.get("tree") is not None:
            raise ConfigError("speculative_config.tree is not used by method 'auto' (its "
                              "head drafts chains)")
        tree = _parse_tree(value.get("tree"), method)
        quantization = _parse_quantization(value.get("quantization"), method)
        if tree is not None:  # a tree's depth is the longest run of drafts it verifies
            if k is not None and k != tree.depth:
                raise ConfigError(f"speculative_config.num_speculative_tokens ({k}) must equal "
                                  f"tree.depth ({tree.depth}) or be left out")
            k = tree.depth
        return cls(method=method, num_speculative_tokens=k, prompt_lookup_min=lo,
                   prompt_lookup_max=hi, model=model, disable_by_batch_size=limit,
                   tree=tree, quantization=quantization, head_num_speculative_tokens=head_k,
                   **suffix)


def _parse_suffix(value: dict[str, Any], method: str) -> dict[str, Any]:
    """The suffix_decoding_* fields given, checked (suffix decoding only)."""
    given = {name: v for name, v in value.items() if name.startswith("suffix_decoding_")}
    if given and method not in SUFFIX_K_METHODS:
        raise ConfigError(f"speculative_config.{sorted(given)[0]} is only used by method "
                          f"'suffix', not {method!r}")
    for name, v in given.items():
        if name == "suffix_decoding_max_spec_factor":
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            want = "a number > 0"
        elif name == "suffix_decoding_min_token_prob":
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= 1
            want = "a number in [0, 1]"
        else:
            least = 0 if name == "suffix_decoding_max_cached_requests" else 1
            ok, want = _is_int(v) and v >= least, f"an integer >= {least}"
        if not ok:
            raise ConfigError(f"speculative_config.{name} must be {want}, got {v!r}")
    return given


def _parse_quantization(value: object, method: str) -> str | None:
    if method not in DRAFT_HEAD_METHODS + ("auto",):
        if value is not None:
            raise ConfigError(f"speculative_config.quantization is not used by method "
                              f"{method!r}")
        return None
    if value is None:
        return "auto"
    if value not in HEAD_QUANTIZATIONS:
        raise ConfigError(f"speculative_config.quantization (the draft head's weights) must "
                          f"be one of {list(HEAD_QUANTIZATIONS)}, got {value!r}")
    return str(value)


def _parse_tree(value: object, method: str) -> TreeConfig | None:
    if value is None or isinstance(value, TreeConfig):
        return value
    if method not in DRAFT_HEAD_METHODS:
        raise ConfigError("speculative_config.tree needs a draft head (method eagle / eagle3)")
    if not isinstance(value, dict):
        raise ConfigError("speculative_config.tree must be an object with depth, top_k and "
                          f"num_nodes, got {value!r}")
    names = [f.name for f in fields(TreeConfig)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ConfigError(f"speculative_config.tree has unknown field(s) {unknown}; "
                          f"known: {names}")
    for name in names:
        v = value.get(name)
        if not _is_int(v) or not 1 <= v <= MAX_TREE_NODES:
            raise ConfigError(f"speculative_config.tree.{name} must be an integer in "
                              f"[1, {MAX_TREE_NODES}], got {v!r}")
    tree = TreeConfig(**value)
    if tree.num_nodes < tree.depth:
        raise ConfigError(f"speculative_config.tree.num_nodes ({tree.num_nodes}) must be >= "
                          f"depth ({tree.depth})")
    return tree


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
