"""The untraced peer of context_writer.py: answers every request on each connection with an
empty 200. Usage: python context_sink.py PORT"""

import socket
import sys
import threading

RESPONSE = b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"


def serve(conn):
    with conn:
        while conn.recv(4096):
            conn.sendall(RESPONSE)


def main():
    listener = socket.create_server(("127.0.0.1", int(sys.argv[1])))
    print("ready", flush=True)
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


if __name__ == "__main__":
    main()
