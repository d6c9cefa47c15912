"""HTTP tools for agents: every mutating request carries the call's idempotency key.

Inside ``ctx.tool``, :func:`wal_engine.runtime.context.current_call` is the call in flight, and its
key is the same for every attempt, retry, replay and new owner of the task. Sent as the
``Idempotency-Key`` header (draft-ietf-httpapi-idempotency-key-header) to an API that honours
it, or to ``wal-engine gateway`` in front of one that does not, the key makes a retried call
act once, so such a tool may be declared ``idempotent=True`` (``ctx.tool``'s default) even
when the API itself is not::

    async def charge(args):
        return await http_tool("POST", "http://gateway:8080/payments/charges", json=args)

    await ctx.tool("charge", charge, {"amount": 100})

Two ways to use it: :class:`IdempotencyKeyTransport` wraps any httpx transport (so an
existing ``httpx.AsyncClient`` gains the header), and :func:`http_tool` makes one request and
returns a plain JSON result for the log. Needs ``httpx`` (the ``gateway`` extra).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import httpx
import orjson

from wal_engine.errors import HttpToolError as HttpToolError
from wal_engine.errors import HttpToolRetry as HttpToolRetry
from wal_engine.gateway.keys import HEADER, format_key
from wal_engine.runtime.context import current_call

KEYED_METHODS: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})
timeout_s_default: Final = 30.0
RETRYABLE_STATUSES: Final = frozenset({429, 503})
"""Answers that say the request was not acted on, so a retry under the same key is safe
and useful. A 409 from the gateway (the first attempt still in flight) is one too."""


class IdempotencyKeyTransport(httpx.AsyncBaseTransport):
    """Adds ``Idempotency-Key: "<ctx.idempotency_key>"`` to mutating requests made inside a
    tool call (a header the caller set is left alone)."""

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None, *,
                 methods: frozenset[str] = KEYED_METHODS) -> None:
        self._transport = transport or httpx.AsyncHTTPTransport()
        self.methods = methods

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        """Add the header, then send through the wrapped transport."""
        claim = current_call()
        if claim is not None and request.method in self.methods and HEADER not in request.headers:
            request.headers[HEADER] = format_key(claim.key)
        return await self._transport.handle_async_request(request)

    async def aclose(self) -> None:
        """Close the wrapped transport."""
        await self._transport.aclose()


def idempotent_client(**options: Any) -> httpx.AsyncClient:
    """An ``httpx.AsyncClient`` whose mutating requests carry the call's key."""
    transport = options.pop("transport", None)
    return httpx.AsyncClient(transport=IdempotencyKeyTransport(transport), **options)


async def http_tool(method: str, url: str, *, json: Any = None, content: bytes | None = None,
                    headers: Mapping[str, str] | None = None,
                    timeout_s: float = timeout_s_default,
                    client: httpx.AsyncClient | None = None) -> dict[str, Any]:
    """Make one request with the call's key; return ``{"status", "headers", "body"}``.

    ``body`` is the decoded JSON when the response is JSON, else its text. 409, 429 and 503
    raise :class:`HttpToolRetry` (transient: ``ctx.tool`` retries under the same key); other
    4xx and 5xx raise :class:`HttpToolError`; a lost connection or timeout raises httpx's
    error, which the retry policy treats per its ``retry_on``.
    """
    if client is None:
        async with idempotent_client(timeout=timeout_s) as own:
            return await http_tool(method, url, json=json, content=content, headers=headers,
                                   timeout_s=timeout_s, client=own)
    request = client.build_request(method, url, json=json, content=content,
                                   headers=dict(headers or {}), timeout=timeout_s)
    claim = current_call()
    if claim is not None and method.upper() in KEYED_METHODS and HEADER not in request.headers:
        request.headers[HEADER] = format_key(claim.key)  # A client without our transport.
    response = await client.send(request)
    text = response.text
    if response.status_code in RETRYABLE_STATUSES or response.status_code == 409:
        raise HttpToolRetry(f"{method} {url} answered {response.status_code}: {text[:200]}")
    if response.status_code >= 400:
        raise HttpToolError(method, url, response.status_code, text)
    return {"status": response.status_code, "headers": dict(response.headers),
            "body": _body(response, text)}


def _body(response: httpx.Response, text: str) -> Any:
    if response.headers.get("content-type", "").split(";")[0].strip().endswith("json"):
        try:
            return orjson.loads(response.content)
        except orjson.JSONDecodeError:
            return text
    return text
