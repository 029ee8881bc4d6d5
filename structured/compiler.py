"""Grammar compilation: a constraint -> an xgrammar CompiledGrammar, in worker processes.

Compiles are cached by the constraint's key (`StructuredOutputs.key`), as futures, so a
burst of requests with one schema compiles it once and every later request finds it
done. An invalid constraint's failure is cached too: the same bad schema fails fast.

Bounds (issue 27): xgrammar compiles are C++ and cannot be interrupted, and some small
inputs compile for minutes (a 40,000-value enum takes 11 s on 2 EPYC cores, growing
~quadratically; `{"pattern": "[a-z0-9]{0,8000}"}` takes 47 s). So
- constraints above a documented size (MAX_ENUM_VALUES enum / choice values,
  MAX_CONSTRAINT_CHARS of schema, regex or grammar text, MAX_REGEX_REPEAT items that a
  regex's bounded repetitions expand to, in a regex or a schema's "pattern") are refused
  up front (400): no compile starts;
- the cache is bounded in bytes (`CompiledGrammar.memory_size_bytes`) as well as entries,
  and xgrammar's own (unbounded) compiler cache is off: ours is the only one.

Isolation (issue 48): a compile runs in a worker process (structured/compile_worker.py),
so it can be stopped, and one request's compile never spends another's budget:
- the budget (`--structured-outputs-compile-timeout`) starts when the compile starts in a
  worker, not when it is queued; past it the worker is killed (the core is free at once),
  the waiters get a 400 naming the budget, and the key is forgotten: a timeout is not the
  constraint's result (the machine may just have been busy), the next request tries again;
- a compile whose waiters have all left (`compile_async` cancelled: the server cancels a
  handler whose client disconnects) is abandoned: dequeued, or its worker killed. Only
  `compile_async` callers count as waiters; `submit` hands out the future itself, so a
  compile someone `submit`ted always runs to its end (or its budget);
- `max_workers` general workers take queued compiles first come, first served, and one
  more worker takes only small ones (`compile_cost` <= SMALL_COMPILE_COST: a choice, a
  short regex, a schema of a few KB): slow compiles, hostile or not, can hold every
  general worker for a budget each, and a small compile still starts at once.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
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
from aioengine.structured.compile_worker import CompileWorker, WorkerDied
from aioengine.structured.request_state import FirstByteTable

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
# The small-compile worker's bound (compile_cost): a 4 KB schema without long patterns
# compiles in well under a second; a choice of a few words in milliseconds.
SMALL_COMPILE_COST = 4096

# A job's states; every change happens under GrammarCompileCache._lock.
QUEUED, RUNNING, DONE, STOPPED = "queued", "running", "done", "stopped"


class GrammarCompileError(InvalidRequestError):
    """The schema, regex or grammar of a request does not compile (HTTP 400)."""


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose language is exactly `choices`. JSON string literals are
    valid EBNF literals in xgrammar's dialect, so json.dumps does the escaping."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(eq=False)
class _Job:
    """One constraint's compile: queued, running in a worker, or done (its future)."""
    constraint: StructuredOutputs
    small: bool
    future: Future = field(default_factory=Future)
    state: str = QUEUED
    waiters: int = 0  # compile_async callers awaiting it now
    pinned: bool = False  # handed out by submit(): never abandoned
    worker: CompileWorker | None = None
    timer: threading.Timer | None = None


class GrammarCompileCache:
    """Compiles constraints for one tokenizer; thread-safe, futures cached by key.

    `TokenizerInfo` and the workers are made on the first compile: an engine that never
    sees a constrained request never pays for them. Every compiled grammar carries
    `first_bytes` (a FirstByteTable), which bounded jump-forward reads.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_workers: int = 2, max_entries: int = 512,
                 compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
                 max_cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        if compile_timeout_s <= 0:
            raise ValueError(f"compile_timeout_s must be > 0, got {compile_timeout_s}")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._stop_token_ids = sorted(stop_token_ids)
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # a job queued, or shut down
        self._queue: deque[_Job] = deque()
        self._cache: OrderedDict[tuple, _Job] = OrderedDict()
        self._max_workers = max_workers
        self._workers: list[CompileWorker] = []
        self._closed = False
        self._info: xgr.TokenizerInfo | None = None
        self._info_json: str | None = None
        self._first_bytes: FirstByteTable | None = None
        self._max_entries = max_entries
        self._max_cache_bytes = max_cache_bytes
        self.compile_timeout_s = compile_timeout_s
        self.compile_seconds: list[float] = []  # one per compile actually run
        self.num_timeouts = 0
        self.num_abandoned = 0

    @property
    def cache_bytes(self) -> int:
        """Bytes held by the cached compiled grammars (xgrammar's estimate)."""
        with self._lock:
            return sum(_grammar_bytes(job.future) for job in self._cache.values())

    @property
    def worker_pids(self) -> list[int | None]:
        """The workers' process ids (None: not running); the last one is the small one."""
        return [w.pid for w in self._workers]

    # ---- callers ----------------------------------------------------------------------

    def submit(self, constraint: StructuredOutputs) -> Future:
        """The compile future of `constraint` (a cache hit, or a new compile). It fails
        with GrammarCompileError when the constraint is invalid or too large, or its
        compile runs past the budget. The compile is never abandoned (see compile_async)."""
        job = self._job(constraint)
        job.pinned = True
        return job.future

    def compile(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        """Blocks until compiled; raises GrammarCompileError for a bad constraint."""
        return self.submit(constraint).result()

    async def compile_async(self, constraint: StructuredOutputs) -> xgr.CompiledGrammar:
        """Awaits the compile without blocking the event loop. Cancelling the await (the
        client left) abandons the compile if nobody else awaits or holds it."""
        job = self._job(constraint, waiter=True)
        try:
            return await asyncio.wrap_future(job.future)
        finally:
            self._leave(job)

    def shutdown(self) -> None:
        """Fails queued compiles, kills the workers; the driving threads then exit."""
        with self._lock:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            self._work.notify_all()
        for job in queued:
            _fail(job.future, GrammarCompileError("the engine is shutting down",
                                                  "structured_outputs"))
        for worker in self._workers:
            worker.kill()

    # ---- the cache and the queue ------------------------------------------------------

    def _job(self, constraint: StructuredOutputs, waiter: bool = False) -> _Job:
        """The cached job of `constraint`, or a new one queued (or failed, if too large).
        The size checks run outside the lock (a 256 KiB schema takes milliseconds)."""
        key = constraint.key
        with self._lock:
            if (job := self._hit(key, waiter)) is not None:
                return job
        job = _Job(constraint, small=compile_cost(constraint) <= SMALL_COMPILE_COST)
        job.future.set_running_or_notify_cancel()  # cancel() is not how it stops
        try:
            check_constraint_size(constraint)
            refused = None
        except GrammarCompileError as e:
            refused = e
        with self._lock:
            if (hit := self._hit(key, waiter)) is not None:  # another thread was first
                return hit
            job.waiters += waiter
            self._cache[key] = job
            if refused is None and self._closed:
                refused = GrammarCompileError("the engine is shutting down",
                                              "structured_outputs")
            if refused is not None:
                job.state = DONE
                job.future.set_exception(refused)
                return job
            self._queue.append(job)
            self._start_workers()
            self._work.notify_all()
        return job

    def _hit(self, key: tuple, waiter: bool) -> _Job | None:
        """Under the lock: the cached job of `key` (counted as awaited), or None."""
        job = self._cache.get(key)
        if job is not None:
            self._cache.move_to_end(key)
            job.waiters += waiter
        return job

    def _leave(self, job: _Job) -> None:
        """A compile_async caller is done with `job`; the last one to leave an unfinished,
        unpinned compile abandons it (dequeued, or its worker killed)."""
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.pinned or job.state not in (QUEUED, RUNNING):
                return
            if job.state == QUEUED:
                self._queue.remove(job)
            self._stop(job)
            self.num_abandoned += 1
        _fail(job.future, GrammarCompileError("abandoned: no request waits for it",
                                              "structured_outputs"))

    def _stop(self, job: _Job) -> None:
        """Under the lock: `job` ends unfinished (abandoned or out of budget). Its worker
        is killed, and its key forgotten, so the next request compiles afresh."""
        was_running, job.state = job.state == RUNNING, STOPPED
        if job.timer is not None:
            job.timer.cancel()
        if was_running and job.worker is not None:
            job.worker.kill()
        if self._cache.get(job.constraint.key) is job:
            del self._cache[job.constraint.key]

    def _next_job(self, small_only: bool) -> _Job | None:
        """Blocks for the first queued job this worker may take (None: shut down)."""
        with self._lock:
            while not self._closed:
                for job in self._queue:
                    if job.small or not small_only:
                        self._queue.remove(job)
                        job.state = RUNNING
                        return job
                self._work.wait()
            return None

    def _evict(self) -> None:
        """Drops least recently used finished entries past max_entries or max_cache_bytes
        (never a compile queued or running: someone waits on it)."""
        with self._lock:
            total = sum(_grammar_bytes(job.future) for job in self._cache.values())
            for key in list(self._cache):
                if len(self._cache) <= self._max_entries and total <= self._max_cache_bytes:
                    break
                job = self._cache[key]
                if job.state != DONE:
                    continue
                total -= _grammar_bytes(job.future)
                del self._cache[key]

    # ---- the workers ------------------------------------------------------------------

    def _start_workers(self) -> None:
        """Under the lock, once: max_workers general workers and one small-only worker,
        each driven by its own daemon thread."""
        if self._workers:
            return
        for i in range(self._max_workers + 1):
            small_only = i == self._max_workers
            worker = CompileWorker(f"aioengine-grammar-{'small' if small_only else i}")
            self._workers.append(worker)
            threading.Thread(target=self._drive, args=(worker, small_only), daemon=True,
                             name=worker.name).start()

    def _drive(self, worker: CompileWorker, small_only: bool) -> None:
        """A worker's thread: (re)start the process, take a job, run it, repeat. Starting
        is not budgeted: a killed worker is replaced before the next job is taken."""
        while not self._closed:
            try:
                worker.start(self._tokenizer_info_json())
            except Exception as e:  # noqa: BLE001 - fail one job, not every waiter forever
                if (job := self._next_job(small_only)) is not None:
                    self._finish(job, ("failed", 0.0, f"no compile worker: {e!r}"))
                threading.Event().wait(1.0)
                continue
            job = self._next_job(small_only)
            if job is None:
                break
            self._run(worker, job)
        worker.reap()

    def _run(self, worker: CompileWorker, job: _Job) -> None:
        with self._lock:
            if job.state != RUNNING:  # abandoned between taking it and here
                return
            job.worker = worker
            job.timer = threading.Timer(self.compile_timeout_s, self._time_out, (job,))
            job.timer.daemon = True
            job.timer.start()  # the budget starts now, not when it was queued
        method, text = request_text(job.constraint)
        try:
            outcome: tuple[str, float, str] | None = worker.compile(method, text)
        except WorkerDied:  # killed for its budget, or from outside (the OOM killer)
            worker.reap()  # so the loop forks a fresh one before the next job
            outcome = None
        self._finish(job, outcome)

    def _finish(self, job: _Job, outcome: tuple[str, float, str] | None) -> None:
        with self._lock:
            if job.state != RUNNING:  # out of budget or abandoned: already answered
                return
            job.state = DONE
            if job.timer is not None:
                job.timer.cancel()
        self._resolve(job, outcome)

    def _resolve(self, job: _Job, outcome: tuple[str, float, str] | None) -> None:
        """Answers a finished compile: the grammar, or why not. Only an invalid input's
        error stays cached; a crashed worker's is forgotten like a timeout."""
        kind = _KIND_NAMES[job.constraint.key[0]]
        if outcome is None or outcome[0] == "failed":
            with self._lock:
                if self._cache.get(job.constraint.key) is job:
                    del self._cache[job.constraint.key]
            detail = "the compile worker died" if outcome is None else outcome[2]
            _fail(job.future, GrammarCompileError(
                f"compiling the {kind} failed ({detail}); try again", "structured_outputs"))
            return
        status, seconds, payload = outcome
        self.compile_seconds.append(seconds)
        if status == "invalid":
            _fail(job.future, GrammarCompileError(f"invalid {kind}: {payload}",
                                                  "structured_outputs"))
            return
        try:
            grammar = xgr.CompiledGrammar.deserialize_json(payload, self._info)
        except Exception as e:  # noqa: BLE001 - this thread must live on: forget, fail
            self._resolve(job, ("failed", seconds, f"deserializing it: {e!r}"))
            return
        grammar.first_bytes = self._first_bytes
        job.future.set_result(grammar)
        self._evict()

    def _time_out(self, job: _Job) -> None:
        with self._lock:
            if job.state != RUNNING:
                return
            self._stop(job)
            self.num_timeouts += 1
        kind = _KIND_NAMES[job.constraint.key[0]]
        _fail(job.future, GrammarCompileError(
            f"compiling the {kind} took longer than the {self.compile_timeout_s:g} s "
            f"budget (--structured-outputs-compile-timeout); simplify it",
            "structured_outputs"))

    def _tokenizer_info_json(self) -> str:
        """The serialized TokenizerInfo the workers start from (built once, here: the
        server keeps it to deserialize grammars, and the FirstByteTable from it)."""
        with self._lock:
            if self._info_json is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer, vocab_size=self._vocab_size,
                    stop_token_ids=self._stop_token_ids)
                self._first_bytes = FirstByteTable(info.decoded_vocab)
                self._info, self._info_json = info, info.serialize_json()
            return self._info_json


def _fail(future: Future, error: BaseException) -> None:
    if not future.done():
        try:
            future.set_exception(error)
        except Exception:  # noqa: BLE001 - resolved in between
            pass


def _grammar_bytes(future: Future) -> int:
    if not future.done() or future.exception() is not None:
        return 0
    return future.result().memory_size_bytes


def request_text(constraint: StructuredOutputs) -> tuple[str, str]:
    """(method, text) for compile_worker.compile_text."""
    if constraint.json is not None:
        return "json_schema", json.dumps(constraint.json)
    if constraint.json_object:
        return "json_object", ""
    if constraint.regex is not None:
        return "regex", constraint.regex
    if constraint.choice is not None:
        return "grammar", choice_grammar(tuple(constraint.choice))
    if constraint.structural_tag is not None:
        return "structural_tag", json.dumps(constraint.structural_tag)
    assert constraint.grammar is not None
    return "grammar", constraint.grammar


def compile_cost(constraint: StructuredOutputs) -> int:
    """A rough size of the compile: characters of its text, plus the items its patterns'
    bounded repetitions expand to, plus its enum values. Only compares to
    SMALL_COMPILE_COST (the small-compile worker's bound)."""
    method, text = request_text(constraint)
    cost = len(text)
    if constraint.regex is not None:
        cost += regex_repeat_items(constraint.regex)
    elif constraint.json is not None:
        cost += sum(regex_repeat_items(p) for p in _schema_patterns(constraint.json))
        cost += _count_enum_values(constraint.json)
    return cost


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
