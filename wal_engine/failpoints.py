"""Named crash points for fault tests: kill or abandon a worker at an exact place.

A failpoint is armed with ``ENGINE_FAILPOINT=<name>:<nth>:<action>`` in a worker's
environment (out-of-process tests), or with :func:`arm` (in-process tests). When the
running code passes the point the ``nth`` time, the action happens:

* ``sigkill``: the process kills itself with SIGKILL, as a crash would (no cleanup);
* ``raise``: :class:`SimulatedCrash` unwinds the task run without any cleanup write, as if
  the worker had vanished (the lease then expires and another worker resumes the task).

Unarmed, a failpoint costs one dict lookup.
"""

from __future__ import annotations

import os
import signal
from typing import Final

ENV: Final = "ENGINE_FAILPOINT"

POINTS: Final = (
    "after_claim",
    "before_intent_append",
    "after_intent_commit",
    "during_effect",
    "after_effect_before_result",
    "after_result_commit",
    "at_checkpoint",
    "during_heartbeat",
)
"""The points of a task run (the crash tests arm each of them in turn)."""

OUTSIDE_RUNS: Final = (
    "schedule_tick_before_commit",
    "retention_after_archive",
)
"""Points outside any task run: a schedule's tick written, not yet committed; a retention
batch's archive written, fsynced and verified, its tasks not yet removed."""

CHILD_POINTS: Final = (
    "after_child_submit",
    "after_child_outcome",
)
"""Points of child tasks: the child created, its spawn not yet recorded in the parent
(``ctx.spawn``); a child's outcome (and charge) recorded in the parent, its budget not yet
checked (``handle.result()``)."""
LIMITER_POINTS: Final = (
    "after_limiter_grant",
)
"""A call's limiter grant committed, its intent not yet written (calls with ``limiter=``
only, so not among :data:`POINTS`, which every crash test arms in turn)."""


class SimulatedCrash(BaseException):
    """The worker 'died' here: nothing after this point runs for the task.

    A BaseException so that no ``except Exception`` in agent or engine code records it.
    """


_armed: dict[str, tuple[int, str]] = {}
_hits: dict[str, int] = {}
fired: list[str] = []
"""Points that fired in this process (for tests)."""


def arm(name: str, nth: int = 1, action: str = "raise") -> None:
    """Arm ``name`` to fire on its ``nth`` pass with ``action`` (``raise`` or ``sigkill``)."""
    if name not in POINTS + OUTSIDE_RUNS + CHILD_POINTS + LIMITER_POINTS:
        raise ValueError(f"unknown failpoint {name!r}; known: "
                         f"{', '.join(POINTS + OUTSIDE_RUNS + CHILD_POINTS + LIMITER_POINTS)}")
    if action not in ("raise", "sigkill"):
        raise ValueError(f"unknown failpoint action {action!r}")
    _armed[name] = (nth, action)
    _hits[name] = 0


def disarm() -> None:
    """Disarm every failpoint and forget the hits."""
    _armed.clear()
    _hits.clear()
    fired.clear()


def arm_from_environment() -> None:
    """Arm what ``ENGINE_FAILPOINT`` names (``name:nth:action``, comma-separated)."""
    spec = os.environ.get(ENV, "")
    for item in filter(None, spec.split(",")):
        name, nth, action = [*item.split(":"), "1", "sigkill"][:3]
        arm(name, int(nth), action)


def hit(name: str) -> None:
    """Pass the failpoint ``name``."""
    if not _armed:
        return
    armed = _armed.get(name)
    if armed is None:
        return
    _hits[name] += 1
    nth, action = armed
    if _hits[name] != nth:
        return
    fired.append(name)
    if action == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    raise SimulatedCrash(name)


arm_from_environment()
