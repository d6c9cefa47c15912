"""A real upstream API for gateway tests and benchmarks:
``python -m wal_engine.testing.upstream PORT``.

Every POST, PUT, PATCH or DELETE is a mutation, counted per ``Idempotency-Key`` header value
(``-`` without one). It does not deduplicate: that is what the gateway in front of it is for.
``X-Delay-Ms`` holds the answer back (a slow API); ``received`` counts requests that arrived,
``counts`` mutations that finished. ``GET /_counts`` returns both.
"""

from __future__ import annotations

import asyncio
import sys
from collections import Counter

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
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
    return JSONResponse({"mutation": counts[key], "key": key, "path": request.url.path,
                         "body": body.decode(errors="replace")}, status_code=status,
                        headers={"x-upstream": "yes"})


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
