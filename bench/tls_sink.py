"""The untraced HTTPS peer of tls_client.py: answers every `POST /v1/responses` on each
keep-alive connection with a fixed small JSON body (with Content-Length). CPython stdlib
only (asyncio streams + ssl).

Usage: python tls_sink.py CERT KEY   (listens on 127.0.0.1, an ephemeral port; prints
"ready PORT" once listening)
"""

import asyncio
import socket
import ssl
import sys

BODY = b'{"id":"resp_bench","object":"response","status":"completed","output_text":"ok"}'
RESPONSE = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
            + str(len(BODY)).encode() + b"\r\n\r\n" + BODY)
NOT_FOUND = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"


def content_length(head):
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


async def serve(reader, writer):
    sock = writer.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = content_length(head)
            if length:
                await reader.readexactly(length)
            writer.write(RESPONSE if head.startswith(b"POST /v1/responses ") else NOT_FOUND)
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
        pass  # the client closed its connection
    finally:
        writer.close()


async def main():
    cert, key = sys.argv[1], sys.argv[2]
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=context)
    print(f"ready {server.sockets[0].getsockname()[1]}", flush=True)
    async with server:
        await server.serve_forever()


if __name__ == "__main__":
    asyncio.run(main())
