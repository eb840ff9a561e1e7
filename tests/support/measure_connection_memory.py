"""Measures the agent's memory per traced connection (the figure in docs/how-it-works.md's "Limits
under hostile input"): the real agent attached to a Gym-shaped uvicorn server, its RSS
before and after N connections, idle and holding a partial head. Run as root:

    GYM_TRACER_BIN=target/release/gym-tracer target/venv/bin/python tests/support/measure_connection_memory.py [N]
"""

import resource
import socket
import sys
import time

from harness import Agent, UvicornServer, rss_kib, wait_accepted


def measure(connections, partial_head):
    server = UvicornServer(extra_args=["--log-level", "critical", "--backlog", "4096"]).start()
    agent = None
    sockets = []
    try:
        agent = Agent([server.pid], extra_args=["--no-route-harvest"]).start()
        time.sleep(1)
        before = rss_kib(agent.process.pid)
        for i in range(connections):
            sock = socket.create_connection(("127.0.0.1", server.port))
            if partial_head:
                sock.send(b"GET /health HTTP/1.1\r\nHost: a\r\nUser-Agent: " + b"x" * 900)
            sockets.append(sock)
            if i % 500 == 499:
                wait_accepted(server.port)
        wait_accepted(server.port)
        time.sleep(2)  # the agent drains the ring every few ms
        after = rss_kib(agent.process.pid)
    finally:
        for sock in sockets:
            sock.close()
        if agent is not None:
            agent.stop()
        server.stop()
    return before, after


def main():
    connections = int(sys.argv[1]) if len(sys.argv) > 1 else 8000
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    for label, partial_head in [("idle", False), ("~1 KB partial head", True)]:
        before, after = measure(connections, partial_head)
        print(f"{label}: {connections} connections, agent RSS {before} KiB -> {after} KiB, "
              f"{(after - before) * 1024 // connections} bytes per connection")


if __name__ == "__main__":
    main()
