"""The HTTP idempotency gateway: a Starlette app in front of upstream APIs.

For a deduplicated method under a route (draft-ietf-httpapi-idempotency-key-header):

* the first request with a key claims it in the store, is forwarded, and the upstream's
  response (status, headers, body) is stored under the key with the request's fingerprint;
* a repeat with the same key and fingerprint gets the stored response (header
  ``Idempotent-Replayed: true``) and never reaches the upstream;
* a repeat while the first is in flight gets 409 (``concurrent = "reject"``) or waits for
  the answer (``"wait"``, at most ``wait_s``, then 409);
* the same key with another fingerprint gets 422, in flight or settled;
* no key: forwarded as it is (``missing_key = "pass"``) or 400 (``"refuse"``); a malformed
  or oversized key: 400. Errors are ``application/problem+json`` (RFC 9457).

Crashes. The claim is written before the request is forwarded, so a gateway that dies
mid-request leaves a running claim, which outlives its lease (longer than the upstream
timeout). A retry inside the lease gets 409; after it the request is *in doubt* (the upstream
may have acted): ``in_doubt = "refuse"`` records and answers 502 without forwarding, so the
upstream never acts twice; ``"forward"`` sends it again (for upstreams that deduplicate on the
forwarded header). A connection that never reached the upstream releases the claim. A store
that does not answer is 503 and nothing is forwarded.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Final
from urllib.parse import quote

import httpx
import msgspec
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route as StarletteRoute

from wal_engine.effects.gateway import Acquired, Claim, GatewayStore, GatewayStoreUnavailable
from wal_engine.errors import DatabaseUnavailable
from wal_engine.gateway.config import RESERVED_PREFIX, GatewayConfig, Route
from wal_engine.gateway.keys import HEADER, MalformedKey, fingerprint, parse_key, scope_digest
from wal_engine.gateway.metrics import GatewayMetrics
from wal_engine.observability.logs import get_logger

HOP_HEADERS: Final = frozenset({
    "connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
    "trailer", "trailers", "transfer-encoding", "upgrade", "host", "content-length",
})
"""Headers not forwarded in either direction (hop-by-hop, or set again by the sender)."""
RESPONSE_DROPPED: Final = HOP_HEADERS | {"content-encoding", "date", "server"}
"""httpx decodes the upstream's body, so its Content-Encoding no longer applies (a request's
body is forwarded as it came, so its Content-Encoding is kept). Date and Server are the
gateway's own (uvicorn adds them; the upstream's would be a second, stale line)."""
REPLAYED_HEADER: Final = "idempotent-replayed"
KEY_PREFIX: Final = "http:"
"""The gateway's keys in the store, apart from the engine's ``idem:`` keys of the tenant."""
wait_poll_s: Final = 0.02
UPSTREAM_KEEPALIVE_S: Final = 2.0
CLIENT_KEEPALIVE_S: Final = 75
"""How long the gateway keeps an idle client connection (longer than clients keep theirs,
for the same reason as ``UPSTREAM_KEEPALIVE_S``)."""
settle_attempts_max: Final = 50
STORE_ERRORS: Final = (GatewayStoreUnavailable, DatabaseUnavailable)

log = get_logger(__name__)


class StoredResponse(msgspec.Struct, frozen=True, kw_only=True):
    """An upstream response as the store keeps it."""

    fingerprint: str
    status: int
    headers: list[tuple[str, str]]
    body: bytes


class StoredFailure(msgspec.Struct, frozen=True, kw_only=True):
    """A key's answer when no response can be replayed (in doubt, too large)."""

    fingerprint: str
    status: int
    title: str
    detail: str


_encode = msgspec.msgpack.Encoder().encode
_decode_response = msgspec.msgpack.Decoder(StoredResponse).decode
_decode_failure = msgspec.json.Decoder(StoredFailure).decode


PATH_SAFE: Final = "/:@!$&'()*+,;="
"""Characters of a decoded path sent as they are (RFC 3986 pchar and "/")."""


def has_dot_segment(path: str) -> bool:
    """Whether the decoded ``path`` has a ``.`` or ``..`` segment: the upstream (or httpx)
    would resolve it, so ``/pay/../admin`` (or ``/pay%2F..%2Fadmin``), matched by the
    ``/pay`` route, would reach ``/admin`` under that route's policy."""
    return any(segment in (".", "..") for segment in path.split("/"))


class Problem(Exception):
    """An answer of the gateway itself (RFC 9457 problem details)."""

    def __init__(self, status: int, title: str, detail: str, outcome: str,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.title = title
        self.detail = detail
        self.outcome = outcome
        self.headers = headers or {}

    def response(self) -> Response:
        """The problem as an HTTP response."""
        body = {"type": "about:blank", "title": self.title, "status": self.status,
                "detail": self.detail}
        return JSONResponse(body, status_code=self.status, headers=self.headers,
                            media_type="application/problem+json")


class Incoming(msgspec.Struct, frozen=True, kw_only=True):
    """A request to forward, read whole."""

    route: Route
    method: str
    target: str
    headers: list[tuple[bytes, bytes]]
    """As the client sent them (bytes: a value need not be ASCII)."""
    body: bytes


class Gateway:
    """The request logic, independent of the server that runs it."""

    def __init__(self, config: GatewayConfig, store: GatewayStore, client: httpx.AsyncClient,
                 metrics: GatewayMetrics) -> None:
        self.config = config
        self.store = store
        self.client = client
        self.metrics = metrics
        self.gateway_id = uuid.uuid4().hex[:12]
        self._routes = sorted(config.routes, key=lambda route: len(route.prefix), reverse=True)
        self._tasks: set[asyncio.Task[Response]] = set()

    def match(self, path: str) -> Route | None:
        """The route with the longest prefix of ``path``."""
        for route in self._routes:
            if path == route.prefix or path.startswith(route.prefix.rstrip("/") + "/"):
                return route
        return None

    async def handle(self, request: Request) -> Response:
        """Answer one request (the catch-all endpoint)."""
        if has_dot_segment(request.url.path):
            return Problem(400, "Bad Request", "the path must not contain '.' or '..' "
                           "segments, encoded or not", "bad_path").response()
        route = self.match(request.url.path)
        if route is None:
            return Problem(404, "Not Found", "no route for this path", "no_route").response()
        try:
            response, outcome = await self._dispatch(route, request)
        except Problem as problem:
            response, outcome = problem.response(), problem.outcome
        except STORE_ERRORS as error:
            response = Problem(503, "Service Unavailable", f"idempotency store: {error}",
                               "store_unavailable", {"retry-after": "1"}).response()
            outcome = "store_unavailable"
        self.metrics.request(route.name, outcome)
        return response

    async def _dispatch(self, route: Route, request: Request) -> tuple[Response, str]:
        incoming = await self._read(route, request)
        if request.method not in route.methods:
            return await self._pass(incoming), "passed"
        key = parse_key_or_problem(request, self.config.gateway.key_chars_max)
        if key is None:
            if route.missing_key == "refuse":
                raise Problem(400, "Bad Request", "this route requires an Idempotency-Key "
                              "header", "missing_key")
            return await self._pass(incoming), "passed"
        return await self._keyed(incoming, key, request)

    async def _read(self, route: Route, request: Request) -> Incoming:
        limit = self.config.gateway.request_bytes_max
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise Problem(413, "Content Too Large", f"request bodies over {limit} bytes are "
                          "refused", "too_large")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > limit:
                raise Problem(413, "Content Too Large", f"request bodies over {limit} bytes "
                              "are refused", "too_large")
        # The path as matched (decoded), encoded again: a decoded "%3F" or "%23" must not
        # become the upstream's query or fragment.
        target = (quote(request.url.path, safe=PATH_SAFE)
                  + (f"?{request.url.query}" if request.url.query else ""))
        headers = [(name, value) for name, value in request.headers.raw
                   if name.decode("latin-1") not in HOP_HEADERS]
        return Incoming(route=route, method=request.method, target=target, headers=headers,
                        body=bytes(body))

    async def _keyed(self, incoming: Incoming, key: str, request: Request) -> tuple[Response, str]:
        route = incoming.route
        scope = route.scope_header and request.headers.get(route.scope_header)
        store_key = key_in_store(route.name, scope or None, key)
        print_ = fingerprint(incoming.method, incoming.target,
                             request.headers.get("content-type", ""), incoming.body)
        claim = Claim(key=store_key, owner=f"{self.gateway_id}:{uuid.uuid4().hex}:{print_}",
                      epoch=0)
        waits_s = route.wait_s if route.concurrent == "wait" else 0.0
        deadline = time.monotonic() + waits_s
        # Bounded: one pass per poll while waiting, plus a few for released claims.
        # Read before claiming: a repeat (the hit path) is then one read, and PostgreSQL's
        # claim, which locks the row and so commits with a flush even when it loses, is
        # left to keys that are free or in flight.
        for _ in range(int(waits_s / wait_poll_s) + settle_attempts_max):
            answer = await self._settled(store_key, print_, deadline)
            if answer is not None:
                return answer
            acquired = await self.store.claim_key(claim, route.lease_ms)
            if acquired is Acquired.NEW:
                return await self._forward_once(incoming, claim, print_), "forwarded"
            if acquired is Acquired.TAKEN_OVER:
                return await self._in_doubt(incoming, claim, print_)
            await asyncio.sleep(wait_poll_s)
        raise Problem(409, "Conflict", "the request with this key is still in flight",
                      "conflict", {"retry-after": "1"})

    async def _settled(self, store_key: str, print_: str, deadline: float
                       ) -> tuple[Response, str] | None:
        """The answer stored or pending under the key, or None to try a claim (the key is
        free, its holder died, or this request waits)."""
        record = await self.store.read_key(store_key)
        if record is None:
            return None
        if record.state == "completed" and record.result is not None:
            stored = _decode_response(record.result)
            _same_request(stored.fingerprint, print_)
            return replay(stored), "replayed"
        if record.state == "failed":
            failure = _decode_failure(record.error or "")
            _same_request(failure.fingerprint, print_)
            raise Problem(failure.status, failure.title, failure.detail, "failed")
        _same_request(str(record.owner).rpartition(":")[2], print_)
        if record.expired or time.monotonic() < deadline:
            # Expired: its holder died; the next claim takes it over and says so.
            return None
        raise Problem(409, "Conflict", "a request with this Idempotency-Key is still in "
                      "flight; retry later", "conflict", {"retry-after": "1"})

    async def _in_doubt(self, incoming: Incoming, claim: Claim, print_: str
                        ) -> tuple[Response, str]:
        if incoming.route.in_doubt == "forward":
            return await self._forward_once(incoming, claim, print_), "forwarded_again"
        failure = StoredFailure(
            fingerprint=print_, status=502, title="Bad Gateway",
            detail="the first request with this Idempotency-Key may have reached the upstream "
                   "but its response was lost; it is not sent again")
        await self.store.complete_key(claim, "failed", None, msgspec.json.encode(
            failure).decode())
        raise Problem(502, failure.title, failure.detail, "in_doubt")

    async def _forward_once(self, incoming: Incoming, claim: Claim, print_: str) -> Response:
        # Shielded and owned: a client that hangs up must not cancel the recording of a
        # response the upstream already acted on.
        task = asyncio.create_task(self._forward_and_record(incoming, claim, print_))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return await asyncio.shield(task)

    async def _forward_and_record(self, incoming: Incoming, claim: Claim, print_: str
                                  ) -> Response:
        try:
            upstream = await self._send(incoming)
        except httpx.ConnectError as error:
            await self.store.release_key(claim)  # Never reached the upstream: may retry.
            raise Problem(502, "Bad Gateway", f"upstream unreachable: {error}",
                          "upstream_unreachable") from error
        except (httpx.HTTPError, TimeoutError) as error:
            failure = StoredFailure(fingerprint=print_, status=504, title="Gateway Timeout",
                                    detail=f"upstream did not answer: {type(error).__name__}; "
                                           "it may have acted, so this key is not resent")
            await self.store.complete_key(claim, "failed", None,
                                          msgspec.json.encode(failure).decode())
            raise Problem(504, failure.title, failure.detail, "upstream_in_doubt") from error
        stored = StoredResponse(fingerprint=print_, status=upstream.status_code,
                                headers=_response_headers(upstream), body=upstream.content)
        if stored.status in incoming.route.release_statuses:
            # The upstream says it did not act (rate limited, unavailable): pass the answer
            # on, keep nothing, and let a retry under the same key be forwarded.
            await self._release(claim)
        else:
            await self._record(claim, stored)
        return _response(stored)

    async def _record(self, claim: Claim, stored: StoredResponse) -> None:
        """Store the response. The upstream has acted, so this caller gets its answer even
        when the store fails now; the key then stays claimed and is in doubt after its
        lease, never resent."""
        try:
            if len(stored.body) > self.config.gateway.response_bytes_max:
                failure = StoredFailure(
                    fingerprint=stored.fingerprint, status=502, title="Bad Gateway",
                    detail="the response to the first request with this key was too large "
                           "to store; it is not sent again")
                await self.store.complete_key(claim, "failed", None,
                                              msgspec.json.encode(failure).decode())
                return
            await self.store.complete_key(claim, "completed", _encode(stored), None)
        except STORE_ERRORS as error:
            log.warning("gateway_record_failed", key=claim.key, error=str(error))
            self.metrics.request(claim.key.split(":")[1], "record_failed")

    async def _release(self, claim: Claim) -> None:
        """Free the key after an answer that says the upstream did not act. The answer
        still reaches the caller when the store fails now; the key then stays claimed and
        is in doubt after its lease, never resent."""
        try:
            await self.store.release_key(claim)
        except STORE_ERRORS as error:
            log.warning("gateway_release_failed", key=claim.key, error=str(error))
            self.metrics.request(claim.key.split(":")[1], "release_failed")

    async def _send(self, incoming: Incoming) -> httpx.Response:
        route = incoming.route
        target = incoming.target
        if route.strip_prefix:
            target = target[len(route.prefix.rstrip("/")):] or "/"
        started = time.perf_counter()
        try:
            # httpx's timeout bounds each read and write, not the exchange: an upstream that
            # trickles its answer would outlast the claim's lease, and a retry would then take
            # a live claim over. The whole exchange gets timeout_s.
            async with asyncio.timeout(route.timeout_s):
                return await self.client.request(
                    incoming.method, route.upstream.rstrip("/") + target,
                    headers=incoming.headers, content=incoming.body, timeout=route.timeout_s)
        finally:
            self.metrics.upstream(route.name, time.perf_counter() - started)

    async def _pass(self, incoming: Incoming) -> Response:
        try:
            upstream = await self._send(incoming)
        except (httpx.HTTPError, TimeoutError) as error:
            raise Problem(502, "Bad Gateway", f"upstream failed: {type(error).__name__}",
                          "upstream_error") from error
        return _response(StoredResponse(fingerprint="", status=upstream.status_code,
                                        headers=_response_headers(upstream),
                                        body=upstream.content))

    async def drain(self) -> None:
        """Wait for forwarded requests still being recorded (at shutdown)."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=30.0)


def key_in_store(route_name: str, scope: str | None, key: str) -> str:
    """The store key of ``key`` on route ``route_name`` for the scope header's value."""
    return f"{KEY_PREFIX}{route_name}:{scope_digest(scope)}:{key}"


def parse_key_or_problem(request: Request, chars_max: int) -> str | None:
    """The request's key; a 400 problem when the header is malformed or oversized."""
    try:
        return parse_key(request.headers.getlist(HEADER), chars_max)
    except MalformedKey as error:
        raise Problem(400, "Bad Request", str(error), "bad_key") from error


def _same_request(stored: str, current: str) -> None:
    if stored != current:
        raise Problem(422, "Unprocessable Content", "this Idempotency-Key was used for a "
                      "different request (method, path, content type or body)", "mismatch")


def replay(stored: StoredResponse) -> Response:
    """The stored response, marked as a replay."""
    return _response(stored, [(REPLAYED_HEADER, "true")])


def _response(stored: StoredResponse, extra: list[tuple[str, str]] | None = None) -> Response:
    """``stored`` as a response, every header line as the upstream sent it: a header sent
    twice (Set-Cookie) stays two lines, never one joined with commas."""
    response = Response(stored.body, status_code=stored.status)
    response.raw_headers.extend(
        (name.lower().encode("latin-1"), value.encode("latin-1"))
        for name, value in [*stored.headers, *(extra or [])])
    return response


def _response_headers(response: httpx.Response) -> list[tuple[str, str]]:
    """The upstream's header lines, byte for byte (latin-1 maps every byte to one
    character), repeated ones kept apart, hop-by-hop ones left out."""
    return [(name.decode("latin-1"), value.decode("latin-1"))
            for name, value in response.headers.raw
            if name.decode("latin-1").lower() not in RESPONSE_DROPPED]


def create_app(config: GatewayConfig,
               open_store: Callable[[], Any]) -> Starlette:
    """The ASGI app; ``open_store()`` (awaitable) opens the store at startup."""
    state: dict[str, Gateway] = {}
    metrics = GatewayMetrics()

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        store: GatewayStore = await open_store()
        # Idle upstream connections are dropped well before the 5 s after which common
        # servers (uvicorn, many proxies) close them: a request sent on a connection the
        # upstream is closing fails after it was written, which makes it in doubt.
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=100,
                              keepalive_expiry=UPSTREAM_KEEPALIVE_S)
        async with httpx.AsyncClient(limits=limits, follow_redirects=False) as client:
            gateway = Gateway(config, store, client, metrics)
            state["gateway"] = gateway
            expiring = asyncio.create_task(expire_forever(gateway))
            try:
                yield
            finally:
                expiring.cancel()
                await gateway.drain()
                await store.close()

    async def health(_: Request) -> Response:
        try:
            await state["gateway"].store.ping()
        except STORE_ERRORS as error:
            return JSONResponse({"status": "unavailable", "store": str(error)}, 503)
        return JSONResponse({"status": "ok", "store": config.store.kind})

    async def metrics_endpoint(_: Request) -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    async def catch_all(request: Request) -> Response:
        return await state["gateway"].handle(request)

    methods = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]
    return Starlette(routes=[
        StarletteRoute(f"{RESERVED_PREFIX}/health", health, methods=["GET"]),
        StarletteRoute(f"{RESERVED_PREFIX}/metrics", metrics_endpoint, methods=["GET"]),
        StarletteRoute("/{path:path}", catch_all, methods=methods),
    ], lifespan=lifespan)


async def expire_forever(gateway: Gateway) -> None:
    """Delete settled keys past retention every ``expire_every_s`` (owned by the app)."""
    settings = gateway.config.gateway
    while True:
        await asyncio.sleep(settings.expire_every_s)
        try:
            await gateway.store.expire_keys(int(settings.retention_s * 1000),
                                            prefix=KEY_PREFIX)
        except STORE_ERRORS:
            gateway.metrics.request("-", "expire_failed")
