"""A real upstream API for gateway tests and benchmarks:
``python -m wal_engine.testing.upstream PORT``.

Every POST, PUT, PATCH or DELETE is a mutation, counted per ``Idempotency-Key`` header value
(``-`` without one). It does not deduplicate: that is what the gateway in front of it is for.
``X-Delay-Ms`` holds the answer back (a slow API); ``X-Drip-Ms`` sends the body one byte per
that many milliseconds (an API that trickles); ``X-Status`` is the answer's status;
``X-Cookies: N`` adds N ``Set-Cookie`` lines. The answer echoes the path, the body and the
request's ``Content-Encoding``. ``received`` counts requests that arrived, ``counts`` mutations
that finished. ``GET /_counts`` returns both.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter
from collections.abc import AsyncIterator

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

received: Counter[str] = Counter()
counts: Counter[str] = Counter()


async def mutate(request: Request) -> Response:
    """Count a mutation and answer with its number."""
    key = request.headers.get("idempotency-key", "-")
    received[key] += 1
    body = await request.body()
    delay_ms = int(request.headers.get("x-delay-ms", "0"))
    if delay_ms:
        await asyncio.sleep(delay_ms / 1000)  # The API's own latency, part of the scenario.
    counts[key] += 1
    status = int(request.headers.get("x-status", "201"))
    answer = JSONResponse({"mutation": counts[key], "key": key, "path": request.url.path,
                           "body": body.decode(errors="replace"),
                           "content_encoding": request.headers.get("content-encoding")},
                          status_code=status, headers={"x-upstream": "yes"})
    for index in range(int(request.headers.get("x-cookies", "0"))):
        answer.raw_headers.append((b"set-cookie",
                                   f"c{index}={index}; Expires=Wed, 21 Oct 2026 07:28:00 GMT"
                                   .encode()))
    drip_ms = int(request.headers.get("x-drip-ms", "0"))
    if drip_ms:
        return StreamingResponse(_drip(bytes(answer.body), drip_ms / 1000), status_code=status,
                                 headers={"content-length": str(len(answer.body))})
    return answer


async def _drip(body: bytes, pause_s: float) -> AsyncIterator[bytes]:
    for index in range(len(body)):
        await asyncio.sleep(pause_s)  # The trickling API's pace, part of the scenario.
        yield body[index:index + 1]


async def read(request: Request) -> Response:
    """Answer reads; ``/_counts`` reports the counters."""
    if request.url.path == "/_counts":
        return JSONResponse({"counts": dict(counts), "received": dict(received)})
    return JSONResponse({"read": request.url.path})


app = Starlette(routes=[
    Route("/{path:path}", mutate, methods=["POST", "PUT", "PATCH", "DELETE"]),
    Route("/{path:path}", read, methods=["GET"]),
])


def main() -> None:
    """Serve on 127.0.0.1:PORT until killed."""
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning",
                access_log=False)


if __name__ == "__main__":
    main()
