"""Budget arithmetic (pure): which limit, if any, a task's usage has reached."""

from __future__ import annotations

import math

import msgspec

from wal_engine.errors import InvalidInput
from wal_engine.events import Budget


def validate_budget(budget: Budget) -> Budget:
    """Return ``budget`` if every limit it sets is a positive finite number, else raise
    InvalidInput (the database's insert trigger refuses the same)."""
    for name in budget.__struct_fields__:
        value = getattr(budget, name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not math.isfinite(value) or value <= 0:
            raise InvalidInput(f"budget {name} must be a positive number, not {value!r}")
    return budget


class Usage(msgspec.Struct, frozen=True, kw_only=True):
    """What a task has used so far, as recorded in its log (and the database clock)."""

    steps: int = 0
    tokens: int = 0
    runtime_s: float = 0.0
    cost_usd: float = 0.0
    tool_calls: int = 0
    attempts: int = 0


class BudgetTrip(msgspec.Struct, frozen=True, kw_only=True):
    """A budget that is used up: its name, limit and the amount used."""

    budget: str
    limit: float
    used: float


def first_trip(
    budget: Budget,
    usage: Usage,
    *,
    planned_tool_calls: int = 0,
    check_steps: bool = True,
    check_attempts: bool = True,
    attempts_default: int | None = None,
) -> BudgetTrip | None:
    """The first budget that ``usage`` has reached, or None.

    ``planned_tool_calls`` counts a call about to be made, so that a tool-call budget of N
    allows exactly N calls. Steps, tokens, runtime and cost trip when used >= limit after the
    fact; attempts trip when more claims than allowed were made. Steps are checked only
    when a new step would start, attempts only at a claim (``check_steps``,
    ``check_attempts``); ``attempts_default`` applies when the budget sets no max_attempts.
    """
    checks: tuple[tuple[str, float | None, float], ...] = (
        ("max_steps", budget.max_steps if check_steps else None, usage.steps),
        ("max_tokens", budget.max_tokens, usage.tokens),
        ("max_runtime_s", budget.max_runtime_s, usage.runtime_s),
        ("max_cost_usd", budget.max_cost_usd, usage.cost_usd),
    )
    for name, limit, used in checks:
        if limit is not None and used >= limit:
            return BudgetTrip(budget=name, limit=float(limit), used=float(used))
    calls = usage.tool_calls + planned_tool_calls
    if budget.max_tool_calls is not None and calls > budget.max_tool_calls:
        return BudgetTrip(budget="max_tool_calls", limit=float(budget.max_tool_calls),
                          used=float(calls))
    attempts_max = budget.max_attempts if budget.max_attempts is not None else attempts_default
    if check_attempts and attempts_max is not None and usage.attempts > attempts_max:
        return BudgetTrip(budget="max_attempts", limit=float(attempts_max),
                          used=float(usage.attempts))
    return None
