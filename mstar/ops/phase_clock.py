"""Host time spent in attention plans, for the runtime's phase timing (MSTAR_PHASE_TIMING).

Backends that split a call into plan + run (FlashInfer) add the host time of their plan()
calls to `plan_ns` while `enabled` is set; the runtime's phase timer turns it on, reads
and zeroes the total once per step. Off (the default), a backend pays one attribute
check per plan and calls no clock.
"""

from __future__ import annotations

enabled: bool = False
plan_ns: int = 0


def take_plan_ns() -> int:
    """The plan time accumulated since the last call, in nanoseconds; resets it."""
    global plan_ns
    n, plan_ns = plan_ns, 0
    return n
