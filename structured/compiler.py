"""Grammar compilation: a constraint -> an xgrammar CompiledGrammar, on a thread pool.

Compiles are cached by the constraint's key (`StructuredOutputs.key`), as futures, so a
burst of requests with one schema compiles it once and every later request finds it
done. A failed compile is cached too: the same bad schema fails fast.

Bounds (issue 27): xgrammar compiles are C++ and cannot be interrupted, and some small
inputs compile for minutes (a 40,000-value enum takes 11 s on 2 EPYC cores, growing
~quadratically; `{"pattern": "[a-z0-9]{0,8000}"}` takes 47 s). So
- constraints above a documented size (MAX_ENUM_VALUES enum / choice values,
  MAX_CONSTRAINT_CHARS of schema, regex or grammar text, MAX_REGEX_REPEAT items that a
  regex's bounded repetitions expand to, in a regex or a schema's "pattern") are refused
  up front (400): no compile starts, so none is left running past its budget;
- every compile has a time budget (`--structured-outputs-compile-timeout`): past it the
  compile's future fails with a 400 naming the budget, the key stays failed (a retry
  fails fast instead of starting another compile), and the grammar, when the C++ call
  finally returns, is dropped rather than cached;
- the cache is bounded in bytes (`CompiledGrammar.memory_size_bytes`) as well as entries,
  and xgrammar's own (unbounded) compiler cache is off: ours is the only one.
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

try:  # Python's own regex parser, to count a pattern's repetitions (3.11+ names first)
    from re import _constants as sre_constants  # type: ignore[attr-defined]
    from re import _parser as sre_parse  # type: ignore[attr-defined]
except ImportError:  # Python 3.10
    import sre_constants  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

from aioengine.errors import InvalidRequestError
from aioengine.sampling_params import StructuredOutputs
from aioengine.structured.request_state import FirstByteTable

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:123: "; users need the rest.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\]\s+\S+:\d+:\s*")
_KIND_NAMES = {"json": "JSON schema", "json_object": "JSON object", "regex": "regex",
               "choice": "choice", "grammar": "grammar",
               "structural_tag": "structural tag"}

# Up-front size limits: a 10,000-value enum compiles in ~1 s on 2 EPYC cores; 40,000 in 11 s.
MAX_ENUM_VALUES = 10_000
MAX_CONSTRAINT_CHARS = 256 * 1024
# xgrammar expands a bounded repetition x{m,n} into n copies of x, ~quadratic in time:
# "[a-z0-9]{0,4000}" compiles in 0.8 s on 2 Zen 5 cores (5 s on Zen 3), {0,8000} in 3 s
# (47 s on Zen 3). Nested bounds multiply.
MAX_REGEX_REPEAT = 4096
DEFAULT_COMPILE_TIMEOUT_S = 10.0
DEFAULT_CACHE_BYTES = 256 * 1024 * 1024

class GrammarCompileError(InvalidRequestError):
    """The schema, regex or grammar of a request does not compile (HTTP 400)."""


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices`. JSON string literals are
    valid EBNF literals in xgrammar's dialect, so json.dumps does the escaping."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompileCache:
    """Compiles constraints for one tokenizer; thread-safe, futures cached by key.

    `TokenizerInfo` is built lazily on the first compile (in the pool): an engine that
    never sees a constrained request never pays for it. Every compiled grammar carries
    `first_bytes` (a FirstByteTable), which bounded jump-forward reads.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_workers: int = 2, max_entries: int = 512,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 max_cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._pool = ThreadPoolExecutor(max_workers=max_workers,
                                        thread_name_prefix="aioengine-grammar")
        self._lock = threading.Lock()
        self._compiler: xgr.GrammarCompiler | None = None
        self._first_bytes: FirstByteTable | None = None
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._max_entries = max_entries
        self._max_cache_bytes = max_cache_bytes
        self.compile_timeout_s = compile_timeout_s
        self.compile_seconds: list[float] = []  # one per compile actually run
        self.num_timeouts = 0

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the cached compiled grammars (xgrammar's estimate)."""
        with self._lock:
            return sum(_grammar_bytes(f) for f in self._cache.values())

    def submit(self, constraint: StructuredOutputs) -> Future:
        """The compile future of `constraint` (a cache hit, or a new compile). It fails
        with GrammarCompileError when the constraint is too large or its compile runs
        past the budget."""
        key = constraint.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = Future()
            future.set_running_or_notify_cancel()
            self._cache[key] = future
        try:
            check_constraint_size(constraint)
        except GrammarCompileError as e:
            future.set_exception(e)
            return future
        timer = threading.Timer(self.compile_timeout_s, self._time_out, (future, constraint))
        timer.daemon = True
        timer.start()
        self._pool.submit(self._run, constraint, future, timer)
        return future

    def compile(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        """Blocks until compiled; raises GrammarCompileError for a bad constraint."""
        return self.submit(constraint).result()

    async def compile_async(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        """Awaits the compile without blocking the event loop."""
        return await asyncio.wrap_future(self.submit(constraint))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, constraint: StructuredOutputs, future: Future,
             timer: threading.Timer) -> None:
        """Pool task: compiles and resolves `future`, unless the budget already failed it
        (then the grammar is dropped: nobody may use a compile that took too long)."""
        try:
            grammar = self._compile(constraint)
        except BaseException as e:  # noqa: BLE001 - handed to the waiters
            timer.cancel()
            if not future.done():
                try:
                    future.set_exception(e)
                except Exception:  # noqa: BLE001 - the budget failed it first
                    pass
            return
        timer.cancel()
        try:
            future.set_result(grammar)
        except Exception:  # noqa: BLE001 - timed out: drop it, the key stays failed
            return
        self._evict()

    def _time_out(self, future: Future, constraint: StructuredOutputs) -> None:
        if future.done():
            return
        if self._compiler is None:  # the one-time TokenizerInfo build is not the request's
            timer = threading.Timer(self.compile_timeout_s, self._time_out, (future, constraint))
            timer.daemon = True
            timer.start()
            return
        self.num_timeouts += 1
        kind = _KIND_NAMES[constraint.key[0]]
        try:
            future.set_exception(GrammarCompileError(
                f"compiling the {kind} took longer than the {self.compile_timeout_s:g} s "
                f"budget (--structured-outputs-compile-timeout); simplify it",
                "structured_outputs"))
        except Exception:  # noqa: BLE001 - the compile finished in between
            pass

    def _evict(self) -> None:
        """Drops least recently used finished entries past max_entries or max_cache_bytes
        (never a compile in flight: someone waits on it)."""
        with self._lock:
            total = sum(_grammar_bytes(f) for f in self._cache.values())
            for key in list(self._cache):
                if len(self._cache) <= self._max_entries and total <= self._max_cache_bytes:
                    break
                f = self._cache[key]
                if not f.done():
                    continue
                total -= _grammar_bytes(f)
                del self._cache[key]

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids)
                self._first_bytes = FirstByteTable(info.decoded_vocab)
                # Our cache is the only one: xgrammar's is unbounded by default.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1,
                                                     cache_enabled=False)
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
        grammar.first_bytes = self._first_bytes
        return grammar


def _grammar_bytes(future: Future) -> int:
    if not future.done() or future.exception() is not None:
        return 0
    return future.result().memory_size_bytes


def check_constraint_size(constraint: StructuredOutputs) -> None:
    """Refuses constraints whose compile would be unbounded (HTTP 400, up front)."""
    if constraint.choice is not None:
        values, text = len(constraint.choice), sum(len(c) for c in constraint.choice)
    else:
        source = constraint.json if constraint.json is not None else (
            constraint.structural_tag if constraint.structural_tag is not None else None)
        values = _count_enum_values(source) if source is not None else 0
        text = len(json.dumps(source)) if source is not None else len(
            constraint.regex or constraint.grammar or "")
    if values > MAX_ENUM_VALUES:
        raise GrammarCompileError(
            f"structured outputs allow at most {MAX_ENUM_VALUES} enum/choice values "
            f"(compiling more is unbounded), got {values}", "structured_outputs")
    if text > MAX_CONSTRAINT_CHARS:
        raise GrammarCompileError(
            f"the {_KIND_NAMES[constraint.key[0]]} is {text} characters; at most "
            f"{MAX_CONSTRAINT_CHARS} are allowed", "structured_outputs")
    patterns = [constraint.regex] if constraint.regex is not None else _schema_patterns(
        constraint.json)
    for pattern in patterns:
        if (items := regex_repeat_items(pattern)) > MAX_REGEX_REPEAT:
            raise GrammarCompileError(
                f"the pattern {pattern[:60]!r} repeats to {items} items; at most "
                f"{MAX_REGEX_REPEAT} are allowed (bounded repetitions compile in time "
                "that grows with their square)", "structured_outputs")


def regex_repeat_items(pattern: str) -> int:
    """How many items `pattern` expands to when every bounded repetition x{m,n} becomes
    n copies of x (nested bounds multiply; an unbounded one counts once); 0 when Python's
    parser does not read it (xgrammar then judges it)."""
    try:
        parsed = sre_parse.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return 0
    return _expanded_items(parsed)


_REPEATS = {sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT,
            getattr(sre_constants, "POSSESSIVE_REPEAT", sre_constants.MAX_REPEAT)}


def _expanded_items(items: Any) -> int:
    total = 0
    for op, arg in items:
        if op in _REPEATS:
            lo, hi, sub = arg
            copies = max(lo, 1) if hi == sre_constants.MAXREPEAT else hi
            total += copies * max(_expanded_items(sub), 1)
        elif op == sre_constants.SUBPATTERN:
            total += _expanded_items(arg[-1])
        elif op == sre_constants.BRANCH:
            total += sum(_expanded_items(branch) for branch in arg[1])
        else:
            total += 1
    return total


def _schema_patterns(node: Any) -> list[str]:
    """Every "pattern" string anywhere in a JSON schema (iterative)."""
    patterns, stack = [], [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("pattern"), str):
                patterns.append(item["pattern"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return patterns


def _count_enum_values(node: Any) -> int:
    """Enum list entries anywhere in a JSON schema (iterative: no recursion limit)."""
    count, stack = 0, [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            enum = item.get("enum")
            if isinstance(enum, list):
                count += len(enum)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


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
