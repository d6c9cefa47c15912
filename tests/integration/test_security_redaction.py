"""Secrets never reach the log (RELIABILITY.md S6): redaction before append, secret
references resolved at call time, and a canary scan of a pg_dump and of the logs."""

from __future__ import annotations

import asyncio
import os
import subprocess
from typing import Any

import pytest
import structlog

from wal_engine import events as ev
from wal_engine.engine import Engine, connect
from wal_engine.retries import TransientError
from wal_engine.runtime.context import AgentContext, LlmResponse
from wal_engine.security.redaction import (
    REDACTED,
    DefaultRedactor,
    SecretUnavailable,
    default_redactor,
    environment_secrets,
    mapping_secrets,
    redact_event,
    secret_ref,
    structlog_processor,
)
from wal_engine.state_machine import Status

FAST: dict[str, Any] = {"lease_ttl_ms": 2000, "heartbeat_ms": 300, "poll_ms": 50,
                        "sweep_ms": 200}

# Fake credentials, each in a format (or under a key) the default redactor knows.
PASSWORD = "canary-pw-7f3a9b21"
INPUT_KEY = "canary-input-apikey-7d1e"
REF_VALUE = "canary-ref-secret-value-91c2"
COOKIE = "canary-cookie-4242-aa"
ENV_TOKEN = "canary-env-token-31bb"
OUTPUT_SECRET = "canary-output-secret-0c9e"
GITHUB = "ghp_CanaryGithubToken" + "0" * 18 + "1"  # 36 characters after the prefix
AWS = "AKIACANARY0000000001"
OPENAI = "sk-proj-CanaryOpenAiKey1234567890abcdef"
JWT = "eyJhbGciOiJIUzI1NiJ9.eyJjYW5hcnkiOiJqd3QifQ.c2lnbmF0dXJlLWNhbmFyeQ"
BEARER = "canaryBearer0123456789xyz"
URL_PASSWORD = "canary-url-pass-5512"
PRIVATE_KEY_BODY = "MIIEcanaryPrivateKeyBody0123456789"
PRIVATE_KEY = (f"-----BEGIN RSA PRIVATE KEY-----\n{PRIVATE_KEY_BODY}\n"
               f"-----END RSA PRIVATE KEY-----")
STRIPE = "sk_live_CanaryStripe0123456789"
TX_TOKEN = "canary-transaction-session-77e"

CANARIES = [PASSWORD, INPUT_KEY, REF_VALUE, COOKIE, ENV_TOKEN, OUTPUT_SECRET, GITHUB, AWS,
            OPENAI, JWT, BEARER, URL_PASSWORD, PRIVATE_KEY_BODY, STRIPE, TX_TOKEN]


# ------------------------------------------------------------------------- the redactor


def test_default_redactor_redacts_secret_keys_and_credential_formats() -> None:
    """Values under secret-looking keys and credential-shaped substrings are replaced;
    look-alike keys (max_tokens, next_page_token, idempotency_key) are kept."""
    value = {
        "Authorization": "Bearer x", "headers": {"X-Api-Key": "k", "Content-Type": "json"},
        "dbPassword": "p", "client_secret": {"nested": "s"}, "API_TOKEN": "t",
        "max_tokens": 100, "next_page_token": "np", "idempotency_key": "idem:t:3",
        "text": f"use {GITHUB} with {AWS}, Authorization: Bearer {BEARER}",
        "url": f"postgres://admin:{URL_PASSWORD}@db/x", "free": "password=hunter22; ok",
        "jwt_text": f"token is {JWT}", "key": OPENAI, "pem": PRIVATE_KEY,
        "prose": "the bearer of bad news has a basic understanding",
    }
    redacted = default_redactor(value)
    assert redacted["Authorization"] == redacted["dbPassword"] == REDACTED
    assert redacted["client_secret"] == redacted["API_TOKEN"] == REDACTED
    assert redacted["headers"] == {"X-Api-Key": REDACTED, "Content-Type": "json"}
    assert (redacted["max_tokens"], redacted["next_page_token"],
            redacted["idempotency_key"]) == (100, "np", "idem:t:3")
    assert redacted["prose"] == value["prose"]
    assert redacted["free"] == "password=[REDACTED]; ok"
    text = str(redacted)
    for secret in (GITHUB, AWS, BEARER, URL_PASSWORD, JWT, OPENAI, PRIVATE_KEY_BODY):
        assert secret not in text
    assert default_redactor(redacted) == redacted, "redaction must be idempotent"
    assert default_redactor(value) == redacted, "redaction must be deterministic"


def test_redactor_is_configurable_and_keeps_secret_references() -> None:
    """extra_keys/keep_keys change the key rules; a secret reference is never redacted."""
    redactor = DefaultRedactor(extra_keys=["ssn"], keep_keys=["token"])
    assert redactor({"ssn": "123", "token": "t", "ref": secret_ref("stripe")}) == {
        "ssn": REDACTED, "token": "t", "ref": {"$secret": "stripe"}}


def test_redact_event_covers_user_fields_only() -> None:
    """Engine fields (ids, names, hashes, keys) are never touched; user fields are."""
    intent = ev.ToolCallIntended(call_id="c1", tool="login", args={"password": "p"},
                                 args_hash="h", idempotency_key="idem:t:2")
    redacted = redact_event(intent, default_redactor)
    assert isinstance(redacted, ev.ToolCallIntended)
    assert redacted.args == {"password": REDACTED}
    assert (redacted.call_id, redacted.tool, redacted.idempotency_key) == ("c1", "login",
                                                                          "idem:t:2")
    plain = ev.TaskClaimed(worker_id="w")
    assert redact_event(plain, default_redactor) is plain


def test_structlog_processor_redacts_log_fields() -> None:
    """The processor an application may add keeps credentials out of its own logs."""
    process = structlog_processor()
    out = process(None, "info", {"event": "call", "error": f"denied {OPENAI}",
                                 "password": "p", "n": 3})
    assert out == {"event": "call", "error": "denied [REDACTED:api_key]",
                   "password": REDACTED, "n": 3}


async def test_secret_resolvers() -> None:
    """Resolvers read a mapping or the environment and name what is missing."""
    from wal_engine.security.redaction import resolve_secret_refs

    value, used = await resolve_secret_refs({"k": secret_ref("a"), "n": 1},
                                            mapping_secrets({"a": "sa"}))
    assert (value, used) == ({"k": "sa", "n": 1}, ("sa",))
    with pytest.raises(SecretUnavailable):
        await resolve_secret_refs([secret_ref("missing")], mapping_secrets({}))
    with pytest.raises(SecretUnavailable):
        await resolve_secret_refs(secret_ref("x"), None)
    os.environ["WALTEST_SECRET_Y"] = "from-env"
    try:
        assert (await resolve_secret_refs(secret_ref("Y"), environment_secrets(
            "WALTEST_SECRET_")))[0] == "from-env"
    finally:
        del os.environ["WALTEST_SECRET_Y"]


# ------------------------------------------------------------------------- the canary run


def _pg_dump(dsn: str) -> bytes:
    from wal_engine.embedded import find_pg_bin

    try:
        binary = find_pg_bin() / "pg_dump"
    except Exception as error:  # The server is borrowed and has no local binaries.
        pytest.skip(f"no pg_dump available: {error}")
    if not binary.exists():
        pytest.skip(f"no pg_dump next to the server binaries in {binary.parent}")
    done = subprocess.run([str(binary), "--no-owner", f"--dbname={dsn}"], check=False,
                          capture_output=True, timeout=120)
    if done.returncode != 0:
        pytest.skip(f"pg_dump failed: {done.stderr.decode(errors='replace')[:300]}")
    return done.stdout


def _hits(blob: bytes, canaries: list[str]) -> dict[str, int]:
    """Occurrences of each canary as text and as the hex of a bytea column."""
    text = blob.decode("utf-8", errors="replace")
    lowered = text.lower()
    hits = {}
    for canary in canaries:
        count = text.count(canary) + lowered.count(canary.encode().hex())
        if count:
            hits[canary] = count
    return hits


async def _run_canary_agent(engine: Engine) -> str:
    calls = {"login": 0}

    async def login(args: Any) -> Any:
        calls["login"] += 1
        if calls["login"] == 1:  # The first attempt fails with the credentials in its text.
            raise TransientError(f"401 for {args['password']} / {args['api_key']} ({AWS})")
        return {"session": {"id": f"tok-{GITHUB}"}, "echo": args["api_key"],
                "note": f"signed in as admin:{args['password']}"}

    def llm(request: Any) -> LlmResponse:
        return LlmResponse(content=f"Here is a token: {JWT} and key {OPENAI}",
                           input_tokens=5, output_tokens=7)

    async def write(connection: Any, args: Any) -> Any:
        await connection.fetchval("SELECT 1")
        return {"session_token": TX_TOKEN, "rows": 1}

    @engine.agent("canary")
    async def canary(ctx: AgentContext, task_input: Any) -> Any:
        await ctx.message("user", f"my key is {STRIPE}\n{PRIVATE_KEY}")
        await ctx.set_env(API_TOKEN=ENV_TOKEN, REGION="eu")
        reply = await ctx.llm("model", llm, {"messages": [
            {"role": "user", "content": f"call with Authorization: Bearer {BEARER}"}]})
        result = await ctx.tool("login", login, {
            "user": "admin", "password": PASSWORD, "api_key": secret_ref("service"),
            "dsn": f"postgres://admin:{URL_PASSWORD}@db/x"})
        await ctx.checkpoint(next_action={"cookie": COOKIE})
        await ctx.transaction("record", write, {"n": 1})
        signal = await ctx.wait_for_signal("webhook", timeout_s=30)
        await ctx.message("assistant", f"{reply} {result} {signal}")
        return {"secret": OUTPUT_SECRET, "result": result, "signal": signal}

    task_id = await engine.submit("canary", {"api_key": INPUT_KEY, "q": "hello"})
    worker = engine.worker(concurrency=2, **FAST)
    running = asyncio.create_task(worker.run())
    try:
        for _ in range(400):
            if (await engine.head(task_id)).status is Status.WAITING:
                break
            await asyncio.sleep(0.05)
        await engine.signal(task_id, "webhook", {"cookie": COOKIE, "body": f"from {AWS}"})
        state = await engine.wait(task_id, timeout_s=30)
    finally:
        worker.stop()
        await running
    assert state.status is Status.COMPLETED, state
    assert calls["login"] == 2
    return task_id


async def test_s6_canary_secrets_never_reach_the_database_or_logs(
        database_dsn: str, capsys: pytest.CaptureFixture[str]) -> None:
    """S6: canaries seeded in the input, tool args (a reference and raw values), tool
    results and errors, LLM requests and responses, messages, env, checkpoints, a
    transaction's result and a signal: zero hits in a pg_dump and in the logs."""
    engine = await connect(database_dsn, migrate=False, pool_size_max=5,
                           secrets=mapping_secrets({"service": REF_VALUE}))
    try:
        with structlog.testing.capture_logs() as logs:
            task_id = await _run_canary_agent(engine)
        state = await engine.state(task_id)
        assert (await engine.store.verify_task(task_id)).ok
    finally:
        await engine.close()
    # What the agent saw is what was recorded: the redacted values.
    assert state.output["secret"] == REDACTED
    assert state.output["result"]["session"]["id"] == "tok-[REDACTED:github_token]"
    assert state.output["result"]["echo"] == "[REDACTED:secret_ref]"
    assert state.env == {"API_TOKEN": REDACTED, "REGION": "eu"}
    dump = _pg_dump(database_dsn)
    # Controls: the dump holds the log, and its bytea payloads are scanned as hex.
    assert b"tool_call_intended" in dump
    assert _hits(dump, ['"q":"hello"']) != {}
    assert _hits(dump, CANARIES) == {}
    captured = capsys.readouterr()
    assert _hits(f"{logs!r}{captured.out}{captured.err}".encode(), CANARIES) == {}


async def test_redaction_can_be_turned_off(database_dsn: str) -> None:
    """connect(redactor=None) stores values as given (the canary test's control)."""
    engine = await connect(database_dsn, migrate=False, pool_size_max=2, redactor=None)
    try:
        task_id = await engine.submit("agent", {"password": PASSWORD})
        first = (await engine.history(task_id))[0]
    finally:
        await engine.close()
    assert PASSWORD.encode() in first.payload
    assert _hits(_pg_dump(database_dsn), [PASSWORD]) == {PASSWORD: 1}


async def test_code_gets_the_placeholder_live_as_on_replay(engine: Engine) -> None:
    """What the README says where signals and tools are introduced: a `token` field of a
    signal payload or of a tool's result reaches the agent as the placeholder on the first
    run (not only after a resume), while the tool itself gets the arguments it was called
    with (the intent records the placeholder)."""
    seen: dict[str, Any] = {}

    async def charge(args: dict[str, Any]) -> dict[str, Any]:
        seen["tool"] = dict(args)
        return {"charged": args["cents"], "token": "receipt-token"}

    @engine.agent("pays")
    async def pays(ctx: AgentContext, task_input: Any) -> Any:
        seen["signal"] = await ctx.wait_for_signal("manager_ok", timeout_s=60)
        seen["result"] = await ctx.tool("charge", charge, {"cents": 5, "api_key": "k-123"})
        return None

    task_id = await engine.submit("pays", None)
    await engine.worker(poll_ms=20).run(until_idle=True)
    await engine.signal(task_id, "manager_ok", {"ok": True, "token": "abc"})
    await engine.worker(poll_ms=20).run(until_idle=True)
    assert (await engine.state(task_id)).status == Status.COMPLETED
    assert seen == {"signal": {"ok": True, "token": REDACTED},
                    "tool": {"cents": 5, "api_key": "k-123"},
                    "result": {"charged": 5, "token": REDACTED}}
    (intent,) = [e for e in await engine.history(task_id) if e.type == "tool_call_intended"]
    assert b"k-123" not in intent.payload
