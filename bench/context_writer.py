"""The per-request cost of the kernel's task-context reads, on a CPython process alone.

An asyncio task (so that its writes run under a task context over the loop's, as a
handler's do) sends N requests over one keep-alive TCP connection to an untraced sink
process (context_sink.py): each request is one `send` of a request line and headers (a
message-start write, where the kernel reads the context) and one `recv` of the sink's
response. Prints the writer's CPU microseconds per request.

Usage: python context_writer.py SINK_PORT N   (waits for a line on stdin before connecting,
so that an agent attached meanwhile sees the connection open)
"""

import asyncio
import socket
import sys
import time

REQUEST = b"POST /v1/responses HTTP/1.1\r\nHost: sink\r\nContent-Length: 0\r\n\r\n"


async def drive(port, n):
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    start = time.process_time()
    for _ in range(n):
        sock.sendall(REQUEST)
        if not sock.recv(4096):
            raise RuntimeError("the sink closed the connection")
    cpu = time.process_time() - start
    sock.close()
    return cpu


def main():
    port, n = int(sys.argv[1]), int(sys.argv[2])
    sys.stdin.readline()
    cpu = asyncio.run(drive(port, n))
    print(f"{1e6 * cpu / n:.3f}", flush=True)


if __name__ == "__main__":
    main()
