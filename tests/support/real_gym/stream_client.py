"""A client of the canned upstream that streams, as a program using the OpenAI API with
`"stream": true` does: aiohttp (as Gym's model servers use) over HTTPS, one keep-alive session,
K streamed `POST /v1/responses` then K streamed `POST /v1/chat/completions`, one at a time.

Everything is imported (and libssl loaded) before it prints `ready`; it then waits for its
orders on stdin, so a tracer can attach to it in between: one JSON line {"api_key", "prompt"}
(secrets, so not on the command line, which is anyone's to read in /proc). It prints one JSON
line per call, {"path", "status", "content_type", "events", "usage": {"input", "output"} as
the stream said, "model" as the stream said, "first_event_s" and "elapsed_s": seconds from
just before the call to its first event and to its end, by the client's clock}, then `done`,
and exits when stdin closes (so it is still there while a tracer finishes with its calls). Trust in the upstream's certificate
comes from SSL_CERT_FILE (aiohttp's default context is `ssl.create_default_context()`).

    SSL_CERT_FILE=cert.pem python stream_client.py --base-url https://127.0.0.1:PORT/v1 \\
        --model NAME --calls K
"""

import argparse
import asyncio
import json
import sys
import time

import aiohttp


def request_body(path, model, prompt):
    """The body of a streamed call: `model` first, as OpenAI's SDKs send it."""
    if path == "/responses":
        return {"model": model, "input": [{"role": "user", "content": prompt}], "stream": True}
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "stream": True,
            "stream_options": {"include_usage": True}}


async def stream_one(session, base_url, path, body, api_key):
    """One streamed call, read event by event as it arrives."""
    headers = {"Authorization": f"Bearer {api_key}", "Accept": "text/event-stream"}
    result = {"path": "/v1" + path, "events": 0, "usage": None, "model": None}
    started = time.monotonic()
    async with session.post(base_url + path, json=body, headers=headers) as response:
        result["status"] = response.status
        result["content_type"] = response.headers.get("Content-Type", "")
        async for line in response.content:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if not result["events"]:
                result["first_event_s"] = time.monotonic() - started
            result["events"] += 1
            data = json.loads(line[len("data: "):])
            if data.get("type") == "response.completed":
                usage = data["response"]["usage"]
                result["usage"] = {"input": usage["input_tokens"], "output": usage["output_tokens"]}
                result["model"] = data["response"]["model"]
            elif data.get("object") == "chat.completion.chunk":
                result["model"] = data["model"]
                if data.get("usage"):
                    usage = data["usage"]
                    result["usage"] = {"input": usage["prompt_tokens"], "output": usage["completion_tokens"]}
        result["elapsed_s"] = time.monotonic() - started
    return result


async def main_async(args, api_key, prompt):
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        for path in ["/responses"] * args.calls + ["/chat/completions"] * args.calls:
            body = request_body(path, args.model, prompt)
            print(json.dumps(await stream_one(session, args.base_url, path, body, api_key)), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--calls", type=int, default=3)
    args = parser.parse_args()
    print("ready", flush=True)
    line = sys.stdin.readline()
    if not line:
        return  # no orders: the test gave up
    orders = json.loads(line)
    asyncio.run(main_async(args, orders["api_key"], orders.get("prompt", "What is the weather in San Francisco?")))
    print("done", flush=True)
    sys.stdin.read()  # until stdin closes


if __name__ == "__main__":
    main()
