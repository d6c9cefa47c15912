"""A Flask app on the sync client, served by waitress in ``test_sync_client.py``: every
view calls :mod:`wal_engine.sync` from a request thread, as a sync web app would."""

from __future__ import annotations

import os
from typing import Any

import msgspec
from flask import Flask, jsonify, request

from wal_engine.sync import connect_sync

engine = connect_sync(os.environ["WEB_APP_DSN"], migrate=False, pool_size_max=4)
app = Flask(__name__)


def _state_view(task_id: str) -> dict[str, Any]:
    state = engine.state(task_id)
    pending = sorted(call_id for call_id, approval in state.approvals.items()
                     if approval.approved is None)
    waiting = state.waiting_on.signal if state.waiting_on is not None else None
    return {"task_id": task_id, "status": str(state.status), "output": state.output,
            "waiting_signal": waiting, "pending_approvals": pending}


@app.get("/health")
def health() -> Any:
    """The server answers (the test waits for this before its first request)."""
    return jsonify(ok=True)


@app.post("/tasks")
def submit() -> Any:
    """Queue a task: {"agent": ..., "input": ...}."""
    body = request.get_json()
    return jsonify(task_id=engine.submit(body["agent"], body.get("input")))


@app.get("/tasks/<task_id>")
def state(task_id: str) -> Any:
    """The task's folded state, reduced to what the test reads."""
    return jsonify(_state_view(task_id))


@app.post("/tasks/<task_id>/signals/<name>")
def signal(task_id: str, name: str) -> Any:
    """Send a signal with the request body as its payload."""
    return jsonify(signal_id=engine.signal(task_id, name, request.get_json()))


@app.post("/tasks/<task_id>/approvals/<call_id>")
def approve(task_id: str, call_id: str) -> Any:
    """Approve a pending call as the approver named in the body."""
    body = request.get_json()
    return jsonify(signal_id=engine.approve(task_id, call_id, approver=body["approver"]))


@app.post("/tasks/<task_id>/cancel")
def cancel(task_id: str) -> Any:
    """Cancel the task."""
    return jsonify(cancelled=engine.cancel(task_id, reason="web", requested_by="web-app"))


@app.get("/tasks/<task_id>/history")
def history(task_id: str) -> Any:
    """The event types of the task's log, in order."""
    return jsonify(types=[str(record.type) for record in engine.history(task_id)])


@app.get("/tasks/<task_id>/wait")
def wait(task_id: str) -> Any:
    """Block this request thread until the task ends (at most 30 s)."""
    final = engine.wait(task_id, timeout_s=30)
    return jsonify(status=str(final.status), output=msgspec.to_builtins(final.output))
