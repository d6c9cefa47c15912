"""Named crash points: arming, counting passes, the two actions, the environment spec."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import pytest

from wal_engine import failpoints
from wal_engine.failpoints import SimulatedCrash


@pytest.fixture(autouse=True)
def disarmed() -> Iterator[None]:
    failpoints.disarm()
    yield
    failpoints.disarm()


def test_unarmed_points_do_nothing() -> None:
    """With nothing armed, passing every point has no effect."""
    for point in failpoints.POINTS:
        failpoints.hit(point)
    assert failpoints.fired == []


def test_raise_fires_on_the_nth_pass_only() -> None:
    """``raise`` unwinds exactly on the nth pass, and the point is recorded as fired."""
    failpoints.arm("after_intent_commit", 3, "raise")
    failpoints.hit("after_intent_commit")
    failpoints.hit("after_intent_commit")
    failpoints.hit("during_effect")  # Another point does not count.
    with pytest.raises(SimulatedCrash, match="after_intent_commit"):
        failpoints.hit("after_intent_commit")
    failpoints.hit("after_intent_commit")  # Passes after the nth do nothing.
    assert failpoints.fired == ["after_intent_commit"]


def test_simulated_crash_escapes_except_exception() -> None:
    """A simulated crash is a BaseException: agent code's ``except Exception`` cannot eat it."""
    failpoints.arm("during_effect", 1, "raise")
    with pytest.raises(SimulatedCrash):
        try:
            failpoints.hit("during_effect")
        except Exception:
            pytest.fail("caught by except Exception")


def test_disarm_forgets_counts_and_fired_points() -> None:
    """Disarming clears armed points, pass counts and the fired list."""
    failpoints.arm("at_checkpoint", 1)
    with pytest.raises(SimulatedCrash):
        failpoints.hit("at_checkpoint")
    failpoints.disarm()
    failpoints.hit("at_checkpoint")
    assert failpoints.fired == []


@pytest.mark.parametrize(("name", "action"), [("no_such_point", "raise"),
                                              ("after_claim", "explode")])
def test_unknown_points_and_actions_are_refused(name: str, action: str) -> None:
    """A typo in a point or an action fails loudly instead of never firing."""
    with pytest.raises(ValueError):
        failpoints.arm(name, 1, action)


def test_every_documented_point_is_armable() -> None:
    """The runtime's points (RELIABILITY.md / the issue) are all known."""
    expected = {"after_claim", "before_intent_append", "after_intent_commit", "during_effect",
                "after_effect_before_result", "after_result_commit", "at_checkpoint",
                "during_heartbeat"}
    assert expected <= set(failpoints.POINTS)
    for point in failpoints.POINTS:
        failpoints.arm(point, 1)


def test_environment_spec_arms_several_points(monkeypatch: pytest.MonkeyPatch) -> None:
    """``ENGINE_FAILPOINT=a:2:raise,b`` arms both; missing parts default to 1 and sigkill."""
    monkeypatch.setenv(failpoints.ENV, "during_effect:2:raise,after_claim")
    failpoints.arm_from_environment()
    failpoints.hit("during_effect")
    with pytest.raises(SimulatedCrash):
        failpoints.hit("during_effect")
    assert failpoints._armed["after_claim"] == (1, "sigkill")


def test_sigkill_kills_the_process_at_the_point() -> None:
    """``sigkill`` ends the process with SIGKILL at the point: no cleanup, exit status -9."""
    code = ("from wal_engine import failpoints\n"
            "failpoints.hit('after_result_commit')\n"
            "print('before', flush=True)\n"
            "failpoints.hit('after_result_commit')\n"
            "print('after', flush=True)\n")
    env = {"ENGINE_FAILPOINT": "after_result_commit:2:sigkill", "PATH": "/usr/bin:/bin"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=60)
    assert result.returncode == -9
    assert result.stdout == "before\n"
