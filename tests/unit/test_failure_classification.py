"""The table of what follows a failed attempt (docs/architecture.md, "What happens to a
failed call"), row by row, for calls that are safe to repeat and for those that are not."""

from __future__ import annotations

import pytest

from wal_engine.retries import (
    DidNotAct,
    Disposition,
    LeaseExpired,
    PermanentError,
    RetryPolicy,
    TransientError,
    classify_failure,
)
from wal_engine.runtime.context import CallTimedOut

POLICY = RetryPolicy(max_attempts=3, did_not_act_on=("RefusedByGateway",))


class RefusedByGateway(Exception):
    """A client library's 'never sent' error, named in the policy."""


@pytest.mark.parametrize(("error", "safe", "unsafe"), [
    (DidNotAct("refused"), Disposition.RETRY, Disposition.RETRY),
    (RefusedByGateway("not sent"), Disposition.RETRY, Disposition.RETRY),
    (PermanentError("declined"), Disposition.FAIL, Disposition.FAIL),
    (TransientError("flaky"), Disposition.RETRY, Disposition.IN_DOUBT),
    (TimeoutError(), Disposition.RETRY, Disposition.IN_DOUBT),
    (CallTimedOut(0.1, None), Disposition.RETRY, Disposition.IN_DOUBT),
    (ConnectionResetError(), Disposition.RETRY, Disposition.IN_DOUBT),
    (ValueError("bad"), Disposition.FAIL, Disposition.IN_DOUBT),
])
def test_each_failure_of_a_first_attempt(error: Exception, safe: Disposition,
                                         unsafe: Disposition) -> None:
    """A call safe to repeat retries transient errors; one that is not is in doubt unless
    the error says it did not act (or is a declared permanent failure)."""
    assert classify_failure(error, POLICY, 1, repeat_safe=True) is safe
    assert classify_failure(error, POLICY, 1, repeat_safe=False) is unsafe


def test_the_last_attempt_fails_instead_of_retrying() -> None:
    """Past max_attempts a retryable failure is the call's failure; doubt stays doubt."""
    assert classify_failure(TimeoutError(), POLICY, 3, repeat_safe=True) is Disposition.FAIL
    assert classify_failure(DidNotAct(), POLICY, 3, repeat_safe=False) is Disposition.FAIL
    assert classify_failure(TimeoutError(), POLICY, 3,
                            repeat_safe=False) is Disposition.IN_DOUBT


def test_a_lease_lost_before_the_effect_never_uses_up_the_policy() -> None:
    """LeaseExpired is this worker's failure, not the call's: the next owner makes the
    attempt, however many the policy allowed."""
    for attempt in (1, 3, 99):
        assert classify_failure(LeaseExpired("gone"), POLICY, attempt,
                                repeat_safe=False) is Disposition.RETRY
