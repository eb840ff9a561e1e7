"""Plain FastAPI apps, no Gym, for tests/test_causality.py: handlers that each make two
outbound aiohttp calls (through one shared ClientSession, one connection pool, as Gym's
global client) to a leaf server, so that a test can check which inbound request the tracer
makes the parent of each call. The request number `n` is a path segment all the way down
(`/plain/7` calls `/leaf/7/0` and `/leaf/7/1`), since the tracer drops query strings.

- `app`: `GET /plain/{n}` (the two calls one after the other), `GET /gather/{n}` (the two
  calls at once, `asyncio.gather`: each in a task of its own) and `GET /leaf/{n}/{i}` (the
  leaf: answers after LEAF_SECONDS);
- `app`: `GET /spawn/{n}`: the two calls made by two `curl` processes the handler runs one
  after the other (`asyncio.create_subprocess_exec`, as Gym's codex_agent runs its CLI);
- `middleware_app`: `GET /middleware/{n}` (the two calls one after the other) behind an
  `@app.middleware("http")` pass-through (Starlette's BaseHTTPMiddleware: the handler runs
  in a task of its own, the response is written by the middleware's).

The leaf's base URL comes from `CAUSALITY_DOWNSTREAM` (e.g. http://127.0.0.1:PORT).
"""

import asyncio
import os

import aiohttp
from fastapi import FastAPI

LEAF_SECONDS = 0.02
DOWNSTREAM = os.environ.get("CAUSALITY_DOWNSTREAM", "")
_session = None


def client():
    global _session
    if _session is None:
        _session = aiohttp.ClientSession()
    return _session


async def call(n, i):
    async with client().get(f"{DOWNSTREAM}/leaf/{n}/{i}") as response:
        response.raise_for_status()
        return await response.json()


async def two_in_a_row(n):
    return [await call(n, 0), await call(n, 1)]


app = FastAPI()


@app.get("/plain/{n}")
async def plain(n: int):
    return {"n": n, "leaves": await two_in_a_row(n)}


@app.get("/gather/{n}")
async def gather(n: int):
    return {"n": n, "leaves": list(await asyncio.gather(call(n, 0), call(n, 1)))}


async def curl(n, i):
    process = await asyncio.create_subprocess_exec(
        "curl", "--silent", "--fail", "--max-time", "30", f"{DOWNSTREAM}/leaf/{n}/{i}",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE)
    out, _ = await process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"curl /leaf/{n}/{i} exited {process.returncode}")
    return out.decode()


@app.get("/spawn/{n}")
async def spawn(n: int):
    return {"n": n, "leaves": [await curl(n, 0), await curl(n, 1)]}


@app.get("/leaf/{n}/{i}")
async def leaf(n: int, i: int):
    await asyncio.sleep(LEAF_SECONDS)
    return {"n": n, "i": i}


middleware_app = FastAPI()


@middleware_app.middleware("http")
async def pass_through(request, call_next):
    return await call_next(request)


@middleware_app.get("/middleware/{n}")
async def behind_middleware(n: int):
    return {"n": n, "leaves": await two_in_a_row(n)}
