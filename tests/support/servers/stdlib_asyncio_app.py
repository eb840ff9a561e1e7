"""An HTTP/1.1 server on the standard library alone (asyncio streams), so that any CPython a
machine has can run it: tests/test_interpreters.py traces it under several minors.

`GET /front/{n}` opens a connection to `/leaf/{n}/0` on the same server, then to
`/leaf/{n}/1`, and answers once both answered; `GET /leaf/{n}/{i}` answers after a short
sleep. One connection per request (`Connection: close`), each served by the task asyncio
starts for it, which makes the calls and writes the response itself.

Usage: python stdlib_asyncio_app.py PORT
"""

import asyncio
import sys

LEAF_SECONDS = 0.02


async def read_head(reader):
    head = await reader.readuntil(b"\r\n\r\n")
    return head.split(b" ", 2)[1].decode()


async def call(port, path):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode())
    await writer.drain()
    response = await reader.read()
    writer.close()
    await writer.wait_closed()
    if not response.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"{path}: {response[:40]!r}")


async def serve(reader, writer, port):
    try:
        path = await read_head(reader)
    except asyncio.IncompleteReadError:  # a readiness probe that connects and closes
        writer.close()
        return
    parts = path.strip("/").split("/")
    if parts[0] == "front":
        await call(port, f"/leaf/{parts[1]}/0")
        await call(port, f"/leaf/{parts[1]}/1")
    else:
        await asyncio.sleep(LEAF_SECONDS)
    body = b'{"ok": true}'
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    await writer.drain()
    writer.close()


async def main(port):
    server = await asyncio.start_server(lambda r, w: serve(r, w, port), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
