"""An HTTPS client's CPU per call, on a CPython process alone (the `tls` section of the bench).

One keep-alive TLS connection to the untraced sink (tls_sink.py), N sequential
`POST /v1/responses` with a small JSON body, each response read whole: per call one
SSL_write(_ex) of the request and one or two SSL_read(_ex) of the response. With aiohttp when
this Python has it (what a model server's client library runs on), else asyncio streams with
ssl. The connection is opened and WARMUP calls are made before the clock starts. Prints one
JSON line: the client's CPU (user + sys, all threads) per measured call in µs, the calls made
in all (warm-up included) and which client ran.

Usage: python tls_client.py PORT CAFILE N [--client auto|aiohttp|streams]
(prints "ready" once its modules are loaded, then waits for a line on stdin before
connecting, so that an agent attached meanwhile sees the connection open)
"""

import argparse
import asyncio
import json
import socket
import ssl
import sys
import time

try:
    import aiohttp
except ImportError:  # the streams client below needs the stdlib only
    aiohttp = None

WARMUP = 20
BODY = b'{"model":"bench","input":"What is 6 x 7?","max_output_tokens":16}'
PATH = "/v1/responses"


async def with_aiohttp(port, context, n):
    url = f"https://127.0.0.1:{port}{PATH}"
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(ssl=context, limit=1)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def call():
            async with session.post(url, data=BODY, headers=headers) as response:
                if response.status != 200:
                    raise RuntimeError(f"the sink answered {response.status}")
                await response.read()

        return await timed(call, n)


async def timed(call, n):
    """CPU seconds of `n` calls, after WARMUP untimed ones."""
    for _ in range(WARMUP):
        await call()
    start = time.process_time()
    for _ in range(n):
        await call()
    return time.process_time() - start


async def with_streams(port, context, n):
    reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    request = (f"POST {PATH} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(BODY)}\r\n\r\n").encode() + BODY

    async def call():
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200 "):
            status_line = head.split(b"\r\n", 1)[0]
            raise RuntimeError(f"the sink answered {status_line!r}")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        await reader.readexactly(length)

    try:
        return await timed(call, n)
    finally:
        writer.close()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("cafile")
    parser.add_argument("n", type=int)
    parser.add_argument("--client", choices=("auto", "aiohttp", "streams"), default="auto")
    args = parser.parse_args()
    use_aiohttp = args.client == "aiohttp" or (args.client == "auto" and aiohttp is not None)
    if use_aiohttp and aiohttp is None:
        sys.exit("tls_client.py: --client aiohttp, but this Python has no aiohttp")
    context = ssl.create_default_context(cafile=args.cafile)
    print("ready", flush=True)  # imports done (libssl mapped): the bench may attach the agent
    sys.stdin.readline()
    drive = with_aiohttp if use_aiohttp else with_streams
    cpu = asyncio.run(drive(args.port, context, args.n))
    print(json.dumps({"us_per_req": 1e6 * cpu / args.n, "calls": WARMUP + args.n,
                      "client": f"aiohttp {aiohttp.__version__}" if use_aiohttp else "asyncio streams"}), flush=True)


if __name__ == "__main__":
    main()
