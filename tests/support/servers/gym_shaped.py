"""A FastAPI app shaped like a Gym resources server, for the integration tests and the demo.

Routes: POST /verify (JSON body), GET /health, POST /fail (500), GET /slow (sleeps
SLOW_SECONDS), GET /stream (a chunked streaming response).
"""

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

SLOW_SECONDS = 0.3
STREAM_CHUNKS = 4
STREAM_CHUNK_BYTES = 3000
STREAM_DELAY_SECONDS = 0.05

app = FastAPI()


@app.get("/health")
async def health():
    return {"ok": True}


@app.post("/verify")
async def verify(request: Request):
    body = await request.json()
    answer = str(body.get("answer", ""))
    return {"reward": 1.0 if answer == "42" else 0.0, "body_bytes": len(str(body))}


@app.post("/fail")
async def fail():
    return JSONResponse({"error": "verifier crashed"}, status_code=500)


@app.get("/slow")
async def slow():
    await asyncio.sleep(SLOW_SECONDS)
    return {"slow": True}


@app.get("/stream")
async def stream():
    async def chunks():
        for i in range(STREAM_CHUNKS):
            await asyncio.sleep(STREAM_DELAY_SECONDS)
            yield (str(i) * STREAM_CHUNK_BYTES).encode()

    return StreamingResponse(chunks(), media_type="text/plain")
