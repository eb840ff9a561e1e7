"""A plain FastAPI caller app, no Gym, for tests/test_injection.py (`--inject-traceparent`).

`POST /go/{n}` makes two outbound aiohttp POSTs, one after the other with a pause between,
to `INJECTION_DOWNSTREAM` (e.g. http://127.0.0.1:PORT): `/call/{n}/0` and `/call/{n}/1`, each
with a fixed JSON body. Every handler call opens a ClientSession (a connection pool) of its
own, so its calls go over a socket connected while the tracer runs (only those are injected);
the two calls of one handler share that connection (keep-alive).

`POST /own/{n}` does the same, but the caller sets a `traceparent` header of its own on both
calls (OWN_TRACEPARENT), under the name OWN_HEADER_NAMES[n % 3]: HTTP header names are
case-insensitive, so a tracer must not add a second one whatever the case.

The request number `n` is a path segment all the way down, so the test can tell the requests
(and the tracer's CLIENT spans, by url.full) apart."""

import asyncio
import os

import aiohttp
from fastapi import FastAPI

DOWNSTREAM = os.environ.get("INJECTION_DOWNSTREAM", "")
PAUSE_S = 0.3
OWN_TRACEPARENT = "00-11111111111111111111111111111111-2222222222222222-01"
OWN_HEADER_NAMES = ["traceparent", "Traceparent", "TRACEPARENT"]

app = FastAPI()


def body(n, i):
    return {"question": "what is 6 * 7?", "n": n, "call": i}


async def two_calls(n, headers=None):
    async with aiohttp.ClientSession() as session:
        for i in range(2):
            if i:
                await asyncio.sleep(PAUSE_S)
            async with session.post(f"{DOWNSTREAM}/call/{n}/{i}", json=body(n, i), headers=headers) as response:
                response.raise_for_status()
                await response.read()
    return {"n": n}


@app.post("/go/{n}")
async def go(n: int):
    return await two_calls(n)


@app.post("/own/{n}")
async def own(n: int):
    return await two_calls(n, headers={OWN_HEADER_NAMES[n % len(OWN_HEADER_NAMES)]: OWN_TRACEPARENT})
