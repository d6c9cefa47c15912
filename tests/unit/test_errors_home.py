"""Every exception of the public API is defined in wal_engine.errors and is the same class
under its old import path, with its message, fields and pickling unchanged."""

from __future__ import annotations

import importlib
import inspect
import pickle

import pytest

from wal_engine import errors

OLD_HOMES = {
    "wal_engine.retries": ["TransientError", "PermanentError", "DidNotAct", "LeaseExpired"],
    "wal_engine.effects.gateway": ["StaleEpoch", "EffectFailed", "InvalidKey",
                                   "GatewayStoreUnavailable"],
    "wal_engine.gateway.client": ["HttpToolError", "HttpToolRetry"],
    "wal_engine.security.encryption": ["KeyShredded", "EnvelopeInvalid"],
    "wal_engine.security.roles": ["InsecureSetup"],
    "wal_engine.security.redaction": ["SecretUnavailable"],
    "wal_engine.security.tenants": ["TenantExists", "UnknownTenant"],
    "wal_engine.audit.anchor": ["AnchorInvalid"],
    "wal_engine.runtime.context": ["CallTimedOut", "ToolError", "SignalTimeout"],
    "wal_engine.gateway.keys": ["MalformedKey"],
    "replay.divergence": ["NonDeterminismError", "CallSignature"],
}


@pytest.mark.parametrize(("module", "name"), [
    (module, name) for module, names in OLD_HOMES.items() for name in names])
def test_old_import_path_is_the_same_class(module: str, name: str) -> None:
    """`from <old module> import X` still works and gives the class defined in errors."""
    cls = getattr(importlib.import_module(module), name)
    assert cls is getattr(errors, name)
    assert cls.__module__ == "wal_engine.errors"


def test_no_wal_error_defined_elsewhere() -> None:
    """No module of the package defines a WalError subclass of its own."""
    import pkgutil

    import replay
    import wal_engine

    elsewhere = []
    for package in (wal_engine, replay):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if ".testing" in info.name or info.name.endswith("__main__"):
                continue
            try:
                module = importlib.import_module(info.name)
            except ImportError:
                continue  # An optional extra that is not installed.
            for _, cls in inspect.getmembers(module, inspect.isclass):
                if (issubclass(cls, errors.WalError) and cls.__module__ == info.name
                        and info.name != "wal_engine.errors"):
                    elsewhere.append(f"{info.name}.{cls.__name__}")
    assert elsewhere == []


def test_fields_and_messages_are_kept() -> None:
    """The moved classes carry the same fields and messages as before the move."""
    stale = errors.StaleEpoch("k", 1, 2)
    assert (stale.key, stale.epoch, stale.recorded_epoch) == ("k", 1, 2)
    assert str(stale) == "key 'k': epoch 1 is older than recorded epoch 2"
    tool = errors.ToolError("c1", "ValueError", "boom")
    assert str(tool) == "call c1 failed: ValueError: boom"
    assert isinstance(errors.CallTimedOut(1.0, None), TimeoutError)
    assert issubclass(errors.HttpToolRetry, errors.TransientError)
    assert issubclass(errors.LeaseExpired, errors.DidNotAct)
    assert "WAL_ENGINE_DEVELOPMENT=1" in str(errors.InsecureSetup("r", ["superuser"]))
    divergence = errors.NonDeterminismError(
        seq=3, recorded=errors.CallSignature(kind="tool", name="a"), requested=None,
        fork_point=2, call_index=0)
    assert "fork at seq 2" in str(divergence)


@pytest.mark.parametrize("error", [
    errors.TransientError("again"), errors.EnvelopeInvalid("bad"),
    errors.AnchorInvalid("bad"), errors.SignalTimeout("late"), errors.PermanentError("no"),
])
def test_single_message_errors_pickle(error: Exception) -> None:
    """Errors built from one message survive pickling (as they did before the move)."""
    again = pickle.loads(pickle.dumps(error))
    assert type(again) is type(error) and str(again) == str(error)
