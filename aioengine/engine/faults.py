"""In-process fault injection: the engine's real failure paths, triggered on purpose.

`AsyncEngine.faults` is always there and costs one attribute read per step. Tests arm it
directly; `aioengine serve` with AIOENGINE_FAULT_INJECTION=1 also exposes
`POST /debug/faults {"kind": "forward" | "loop", "count": N}` for tests and soak runs
against a real server process.

    forward   the next `count` forwards raise (on the worker thread, where a real kernel
              failure would): that step's requests end with finish_reason "error"
    loop      the engine loop itself raises at its next turn: the engine is dead, every
              request in flight ends with "error", new ones are refused
"""
from __future__ import annotations

from dataclasses import dataclass

FAULT_KINDS = ("forward", "loop")


class InjectedFault(RuntimeError):
    """A failure raised on purpose by the FaultInjector."""


@dataclass
class FaultInjector:
    forward: int = 0  # forwards still to fail
    loop: bool = False

    def arm(self, kind: str, count: int = 1) -> None:
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {', '.join(FAULT_KINDS)}, got {kind!r}")
        if kind == "forward":
            self.forward += count
        else:
            self.loop = True

    def check_forward(self) -> None:
        """On the worker thread, before a forward (the loop thread only arms: a lost
        decrement under a race would fail one forward more, never crash)."""
        if self.forward > 0:
            self.forward -= 1
            raise InjectedFault("injected forward failure")

    def check_loop(self) -> None:
        if self.loop:
            self.loop = False
            raise InjectedFault("injected engine loop failure")
