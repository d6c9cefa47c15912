"""The public API is pinned: removing or renaming an export is a visible, deliberate change."""

from __future__ import annotations

import wal_engine

EXPECTED = {
    "AgentContext", "Budget", "Database", "Engine", "EventRecord", "LlmResponse",
    "PermanentError", "PlanNode", "RetryPolicy", "SignalTimeout", "Store", "TaskHead",
    "ToolError", "TransientError", "WalError", "__version__", "connect", "secret_ref",
    "DidNotAct", "LeaseExpired", "current_call", "ensure_lease", "lease_valid",
}


def test_exports_are_pinned() -> None:
    """wal_engine.__all__ is exactly the documented surface, and every name resolves."""
    assert set(wal_engine.__all__) == EXPECTED
    for name in wal_engine.__all__:
        assert getattr(wal_engine, name) is not None


def test_engine_methods_are_pinned() -> None:
    """The Engine keeps the methods the design names."""
    for method in ("agent", "submit", "signal", "cancel", "approve", "reconcile", "fork",
                   "state", "history", "wait", "worker", "close"):
        assert callable(getattr(wal_engine.Engine, method))
