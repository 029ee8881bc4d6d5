"""Grammar compilation: a constraint -> an xgrammar CompiledGrammar, on a thread pool.

Compiles are cached by the constraint's key (`StructuredOutputs.key`), as futures, so a
burst of requests with one schema compiles it once and every later request finds it
done. A failed compile is cached too: the same bad schema fails fast.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from aioengine.errors import InvalidRequestError
from aioengine.sampling_params import StructuredOutputs

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "; users need the rest.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
               "choice": "choice", "grammar": "grammar",
               "structural_tag": "structural tag"}


class GrammarCompileError(InvalidRequestError):
    """The schema, regex or grammar of a request does not compile (HTTP 400)."""


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices`. JSON string literals are
    valid EBNF literals in xgrammar's dialect, so json.dumps does the escaping."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompileCache:
    """Compiles constraints for one tokenizer; thread-safe, futures cached by key.

    `TokenizerInfo` is built lazily on the first compile (in the pool): an engine that
    never sees a constrained request never pays for it.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_workers: int = 2, max_entries: int = 512) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="aioengine-grammar")
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._max_entries = max_entries
        self.compile_seconds: list[float] = []  # one per compile actually run

    def submit(self, constraint: StructuredOutputs) -> Future:
        """The compile future of `constraint` (a cache hit, or a new compile)."""
        key = constraint.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._compile, constraint)
            self._cache[key] = future
            while len(self._cache) > self._max_entries:
                oldest, f = next(iter(self._cache.items()))
                if not f.done():
                    break  # never drop a compile in flight: someone waits on it
                del self._cache[oldest]
            return future

    def compile(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        """Blocks until compiled; raises GrammarCompileError for a bad constraint."""
        return self.submit(constraint).result()

    async def compile_async(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        """Awaits the compile without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(constraint))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _compile(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        compiler = self._get_compiler()
        kind = constraint.key[0]
        start = time.perf_counter()
        try:
            grammar = _compile_one(compiler, constraint)
        except (RuntimeError, ValueError, TypeError) as e:  # InvalidStructuralTagError too
            message = _XGR_PREFIX.sub("", str(e).strip()).splitlines()[0] if str(e) else repr(e)
            raise GrammarCompileError(
                f"invalid {_KIND_NAMES[kind]}: {message}",
                "structured_outputs") from None
        self.compile_seconds.append(time.perf_counter() - start)
        return grammar


def _compile_one(compiler: xgr.GrammarCompiler,
                 constraint: StructuredOutputs) -> xgr.CompiledGrammar:
    # Compact JSON (no free whitespace): a small model cannot wander into endless
    # whitespace, and fixed separators give jump-forward more to skip.
    if constraint.json is not None:
        return compiler.compile_json_schema(json.dumps(constraint.json), any_whitespace=False)
    if constraint.json_object:
        # strict_mode=False: any properties are allowed (strict would mean `{}` only).
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                            strict_mode=False)
    if constraint.regex is not None:
        return compiler.compile_regex(constraint.regex)
    if constraint.choice is not None:
        return compiler.compile_grammar(choice_grammar(tuple(constraint.choice)))
    if constraint.structural_tag is not None:
        return compiler.compile_structural_tag(json.dumps(constraint.structural_tag))
    assert constraint.grammar is not None
    return compiler.compile_grammar(constraint.grammar)
