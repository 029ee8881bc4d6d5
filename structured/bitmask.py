"""The token bitmask of one step, filled on the event loop while the forward runs.

    loop:    schedule N -> submit forward N -> fill bitmask N -> stream N-1 -> await N
    worker:                forward N ........................ wait(ready) -> mask -> sample

The runner needs the mask only at sampling time, after the whole forward, so the CPU
cost of `fill_next_token_bitmask` hides behind it. Matchers only change in the
scheduler's update (on the loop, after the step's forward finished), so filling reads a
stable state. Row i of the bitmask belongs to row i of the logits the runner samples.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import xgrammar as xgr

from aioengine.structured.request_state import StructuredRequestState

# The forward waits at most this long for its mask; an unfilled mask fails the step
# (its requests error out) rather than hanging the engine.
_FILL_TIMEOUT_S = 120.0


@dataclass(eq=False)
class GrammarBitmask:
    """Invariant: `states[i]` is the grammar state of sampled row i (None = unconstrained);
    `drafts[i]`, when given, the draft tokens before row i's position (speculative
    decoding: the row is filled as if they had been accepted, then they are rolled back)."""

    states: list[StructuredRequestState | None]
    vocab_size: int
    drafts: list[list[int]] | None = None
    bitmask: torch.Tensor = field(init=False)  # [rows, ceil(vocab / 32)] int32, CPU
    ready: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.bitmask = xgr.allocate_token_bitmask(len(self.states), self.vocab_size)

    @property
    def constrained_rows(self) -> list[int]:
        return [i for i, s in enumerate(self.states) if s is not None]

    def fill(self) -> None:
        """Fills every constrained row (event loop). Idempotent; always sets `ready`.
        Never raises: an error is handed to the worker, which fails the step's requests
        (not the engine loop)."""
        if self.ready.is_set():
            return
        try:
            for i, state in enumerate(self.states):
                if state is not None:
                    state.fill_bitmask(self.bitmask, i, self.drafts[i] if self.drafts else ())
        except Exception as e:  # noqa: BLE001 - handed to the worker
            self.error = e
        finally:
            self.ready.set()

    def apply(self, logits: torch.Tensor) -> None:
        """Masks disallowed tokens of `logits` [rows, V] to -inf in place (worker thread),
        before any sampling parameter sees them."""
        if not self.ready.wait(_FILL_TIMEOUT_S):
            raise RuntimeError("the grammar bitmask for this step was never filled")
        if self.error is not None:
            raise RuntimeError(f"filling the grammar bitmask failed: {self.error!r}")
        bitmask = self.bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size,
                                        indices=self.constrained_rows)
