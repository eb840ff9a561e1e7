"""A plain socket HTTP/1.1 server that records the exact bytes of every request it receives,
for tests that need the callee on another "host" (a network namespace: tests/support/netns.py)
where the test's own in-process capture server cannot listen.

    python capture_server.py --host ADDRESS --port PORT --out FILE --ready FILE

Each request (head, then Content-Length bytes of body; keep-alive) is appended to --out as
one JSON line {"path": <request-line path>, "request": <the bytes, base64>} and answered
`200 ok`; a request it cannot frame is recorded as {"error": ...}. --ready is written once it
listens (the filesystem is shared across network namespaces). Standard library only."""

import argparse
import base64
import json
import socket
import threading


def next_request(connection, buffered):
    """The next whole HTTP/1.1 request on `connection` (head, then Content-Length bytes of
    body) after the bytes already `buffered`: (request, the bytes after it), or (None, b"")
    when the peer closed between requests. A request it cannot frame raises ValueError."""
    while b"\r\n\r\n" not in buffered:
        chunk = connection.recv(65536)
        if not chunk:
            if buffered:
                raise ValueError(f"connection closed inside a request head: {buffered[:200]!r}")
            return None, b""
        buffered += chunk
    head_end = buffered.index(b"\r\n\r\n") + 4
    lengths = [int(line.split(b":", 1)[1]) for line in buffered[:head_end].split(b"\r\n")[1:]
               if line.lower().startswith(b"content-length:")]
    if len(lengths) > 1:
        raise ValueError(f"several Content-Length headers: {buffered[:head_end]!r}")
    end = head_end + (lengths[0] if lengths else 0)
    while len(buffered) < end:
        chunk = connection.recv(65536)
        if not chunk:
            raise ValueError(f"connection closed inside a request body: {buffered[:200]!r}")
        buffered += chunk
    return buffered[:end], buffered[end:]


def serve(connection, out, lock):
    buffered = b""
    with connection:
        while True:
            try:
                request, buffered = next_request(connection, buffered)
            except ValueError as error:
                record(out, lock, {"error": str(error)})
                return
            if request is None:
                return
            path = request.split(b"\r\n", 1)[0].split(b" ")[1].decode()
            record(out, lock, {"path": path, "request": base64.b64encode(request).decode()})
            connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")


def record(out, lock, entry):
    with lock, open(out, "a") as sink:
        sink.write(json.dumps(entry) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--ready", required=True)
    args = parser.parse_args()
    listener = socket.create_server((args.host, args.port), backlog=256)
    lock = threading.Lock()
    with open(args.ready, "w") as ready:
        ready.write("listening\n")
    while True:
        connection, _ = listener.accept()
        threading.Thread(target=serve, args=(connection, args.out, lock), daemon=True).start()


if __name__ == "__main__":
    main()
