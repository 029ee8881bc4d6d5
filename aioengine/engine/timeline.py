"""Per-step timeline of the engine loop, for `aioengine bench profile`.

    loop:    |schedule|fill+process N-1|..wait..|update|idle|schedule| ...
    worker:           |prepare|  forward  |sample|propose|
                      <---------- step N ------->

`process` (detokenize + stream of the previous step) and grammar filling run on the loop
while the worker runs the step: the overlap is the share of that loop work hidden behind
the worker. With async scheduling the worker runs steps back to back and the loop's
schedule, update and wait of one step all fall inside the worker's next step. Recording costs a few perf_counter() calls per step; it is off unless enabled.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields

from aioengine.sched.scheduler_output import SchedulerOutput

PHASES = ("schedule", "prepare", "forward", "sample", "propose", "process", "wait", "update",
          "idle")


def step_rows(scheduler_output: SchedulerOutput) -> tuple[int, int]:
    """(decode rows, draft tokens) of a step: requests computing one token or one and its
    drafts, and those drafts; the rest of its tokens are prompt (prefill) tokens."""
    rows = [s for s in scheduler_output.scheduled if s.num_new_tokens == 1 or s.spec_token_ids]
    return len(rows), sum(len(s.spec_token_ids) for s in rows if s.spec_token_ids)


def step_kind(scheduler_output: SchedulerOutput) -> str:
    """decode (every request computes one token, or one and its drafts), prefill (none
    does) or mixed. (A small prompt chunk computed as decode rows is still prefill here.)"""
    decodes, _ = step_rows(scheduler_output)
    if decodes == len(scheduler_output.scheduled):
        return "decode"
    return "prefill" if decodes == 0 else "mixed"


@dataclass
class StepRecord:
    kind: str
    num_tokens: int
    num_reqs: int
    # loop: scheduler.schedule() (none for a step scheduled ahead) + scheduling the next
    # step ahead (async scheduling, while this one runs)
    schedule: float = 0.0
    prepare: float = 0.0  # worker: input tensors and attention metadata
    forward: float = 0.0  # worker: the model
    sample: float = 0.0  # worker: logits of the sampling rows, sampler, logprobs
    propose: float = 0.0  # worker: drafts for the next step (speculative decoding)
    process: float = 0.0  # loop, during the step: grammar bitmask + outputs of step N-1
    wait: float = 0.0  # loop: waiting for the worker after its own work
    update: float = 0.0  # loop: scheduler.update_from_output()
    idle: float = 0.0  # loop: nothing to run before this step
    executor: str = ""  # worker: who ran the layers (ModelRunnerOutput.executor)
    start: float = 0.0  # time.monotonic() as the loop began the step (requests' clock)
    decode_rows: int = 0  # requests computing one token, or one and its drafts
    draft_tokens: int = 0  # drafts verified (num_tokens - decode_rows - drafts: prefill)


@dataclass
class StepTimeline:
    enabled: bool = False
    records: list[StepRecord] = field(default_factory=list)
    _idle_since: float | None = None

    def mark_idle(self) -> None:
        if self.enabled and self._idle_since is None:
            self._idle_since = time.perf_counter()

    def take_idle(self) -> float:
        if self._idle_since is None:
            return 0.0
        idle, self._idle_since = time.perf_counter() - self._idle_since, None
        return idle

    def add(self, record: StepRecord) -> None:
        if self.enabled:
            self.records.append(record)

    def summary(self) -> dict[str, dict[str, float]]:
        """Per step kind: steps, tokens per step, mean ms of each phase, and `overlap`, the
        share of the loop's in-step work (process) done while the worker was busy."""
        out: dict[str, dict[str, float]] = {}
        for kind in ("prefill", "mixed", "decode", "all"):
            recs = [r for r in self.records if kind in ("all", r.kind)]
            if not recs:
                continue
            row = {"steps": float(len(recs)),
                   "tokens_per_step": sum(r.num_tokens for r in recs) / len(recs)}
            for phase in PHASES:
                row[f"{phase}_ms"] = 1e3 * sum(getattr(r, phase) for r in recs) / len(recs)
            # The loop's in-step work starts as the worker starts: it is hidden up to the
            # worker's own duration.
            process = sum(r.process for r in recs)
            hidden = sum(min(r.process, r.prepare + r.forward + r.sample + r.propose)
                         for r in recs)
            row["overlap"] = hidden / process if process else 1.0
            row["fused_share"] = sum(r.executor == "fused_cpu_decode" for r in recs) / len(recs)
            out[kind] = row
        return out

    def to_json(self) -> list[dict]:
        return [asdict(r) for r in self.records]


assert tuple(f.name for f in fields(StepRecord))[3:3 + len(PHASES)] == PHASES
