"""Hostile input: malformed HTTP, binary garbage, oversized heads, half requests, floods of
abandoned connections, exec and PID reuse. In every case the real agent stays up, a healthy
client's requests interleaved with the hostile traffic all get correct spans, and the
counters say what was refused, cut or evicted."""

import http.client
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request

from harness import TESTS_DIR, Agent, free_port, http_get, wait_for_health

SECRET = "hostile-secret-7f3a9c"


class HealthyClient:
    """One keep-alive connection whose every request names itself in its User-Agent, so its
    spans can be checked one by one among the hostile traffic."""

    def __init__(self, port):
        self.connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        self.sent = 0

    def request(self):
        self.connection.request("GET", "/health", headers={"User-Agent": f"healthy-{self.sent}"})
        response = self.connection.getresponse()
        response.read()
        assert response.status == 200
        self.sent += 1

    def assert_all_traced(self, agent, server):
        spans = [s for s in agent.spans() if s["attributes"].get("user_agent.original", "").startswith("healthy-")]
        agents = sorted(s["attributes"]["user_agent.original"] for s in spans)
        assert agents == sorted(f"healthy-{i}" for i in range(self.sent)), agents
        for span in spans:
            assert span["name"] == "GET /health"
            assert span["kind"] == "SERVER"
            assert span["attributes"]["http.response.status_code"] == 200
            assert span["resource"]["process.pid"] == server.pid


def send_raw(port, payload, read=True, close=True):
    """Sends `payload` on a new connection; returns the socket if not closed."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    sock.sendall(payload)
    if read:
        try:
            sock.recv(65536)
        except OSError:
            pass
    if close:
        sock.close()
        return None
    return sock


def start_server(env=None):
    """A Gym-shaped uvicorn server with a backlog for a flood of connections; returns
    (process, port)."""
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "servers.gym_shaped:app", "--host", "127.0.0.1", "--port", str(port),
         "--no-access-log", "--log-level", "critical", "--backlog", "4096"],
        env=dict(os.environ, PYTHONPATH=str(TESTS_DIR), **(env or {})), cwd=TESTS_DIR,
    )
    wait_for_health(port)
    return process, port



class Server:
    def __init__(self, process, port):
        self.process, self.port = process, port

    @property
    def pid(self):
        return self.process.pid

    def stop(self):
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def wait_accepted(port, timeout=20):
    """Waits until the server has accepted every connection queued on its listening socket
    (a listener's rx_queue in /proc/net/tcp is its accept queue)."""
    local = f":{port:04X}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with open("/proc/net/tcp") as table:
            queued = [int(fields[4].split(":")[1], 16) for fields in (line.split() for line in table)
                      if fields[1].endswith(local) and fields[3] == "0A"]
        if queued and queued[0] == 0:
            return
        time.sleep(0.02)
    raise AssertionError(f"the server on port {port} did not accept its queue within {timeout} s")


def rss_kib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def metrics(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            values[name] = int(float(value))
    return values


def test_malformed_garbage_oversized_and_half_requests_leave_healthy_traffic_traced():
    server = Server(*start_server())
    agent = Agent([server.pid], extra_args=["--server-name", "victim", "--server-type", "resources"]).start()
    silent = []
    try:
        healthy = HealthyClient(server.port)
        healthy.request()
        hostile = [
            b"GET\x01/ HTTP/1.1\r\n\r\n",                                          # bad request line
            b"GET /health HTTP/1.1\r\nHost: a\r\nBad Header Line\r\n\r\n",         # bad header syntax
            (b"POST /verify HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
             b"zz-not-hex\r\n{}\r\n0\r\n\r\n"),                                     # invalid chunked body
            bytes(range(256)) * 16,                                                # binary garbage
            b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + os.urandom(500),     # a TLS hello
            (f"GET /health?token={SECRET} HTTP/1.1\r\nHost: a\r\n"
             f"Cookie: session={SECRET}{'s' * 20 * 1024}\r\n\r\n").encode(),       # head > capture
        ]
        for payload in hostile:
            send_raw(server.port, payload)
            healthy.request()
        # Half a request, then the peer goes away; and one that stays silent.
        send_raw(server.port, b"POST /verify HTTP/1.1\r\nHost: a\r\nContent-Len", read=False)
        healthy.request()
        send_raw(server.port, b"POST /verify HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"answ", read=False)
        healthy.request()
        silent.append(send_raw(server.port, b"GET /health HTTP/1.1\r\nHo", read=False, close=False))
        silent.append(send_raw(server.port, b"", read=False, close=False))
        for _ in range(5):
            healthy.request()
        time.sleep(1.0)
        assert agent.process.poll() is None, "the agent stays up"
    finally:
        agent.stop()
        for sock in silent:
            sock.close()
        server.stop()

    assert agent.returncode == 0, agent.stderr()
    healthy.assert_all_traced(agent, server)
    # The head larger than the capture is traced by its captured lines.
    cut = [s for s in agent.spans() if s["name"] == "GET /health" and "user_agent.original" not in s["attributes"]]
    assert len(cut) == 1, cut
    summary = agent.summary()
    assert summary["parse_not_http"] >= 3, summary
    assert summary["parse_head_too_large"] >= 1, summary
    output = agent.stdout_text() + agent.stderr()
    assert SECRET not in output, "a header or query value past the capture must never be exported"
    assert "panicked" not in output


def test_ten_thousand_abandoned_connections_are_evicted_within_the_bound():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # inherited by the server
    assert hard >= 10_000 + 2_000, f"RLIMIT_NOFILE hard limit {hard} is too low for this test"
    server = Server(*start_server())
    health_port = free_port()
    max_connections = 1000
    agent = Agent([server.pid], extra_args=["--max-connections", str(max_connections),
                                            "--health-listen", str(health_port)]).start()
    abandoned = []
    try:
        healthy = HealthyClient(server.port)
        healthy.request()
        rss_before = rss_kib(agent.process.pid)
        tracked_peak = 0
        # LRU keeps a connection while fewer than --max-connections others have been opened or
        # active since it was: the healthy client is active every 250 accepted connections.
        for batch in range(40):
            for i in range(250):
                sock = socket.socket()
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                sock.connect(("127.0.0.1", server.port))
                if i % 5 == 0:  # some leave half a head behind
                    sock.send(b"GET /health HTTP/1.1\r\nX-Abandoned: ")
                abandoned.append(sock)
            wait_accepted(server.port)
            healthy.request()
            if batch % 10 == 9:
                time.sleep(1.2)  # a /metrics refresh
                tracked_peak = max(tracked_peak, metrics(health_port)["gym_tracer_connections_tracked"])
        time.sleep(1.0)
        values = metrics(health_port)
        tracked_peak = max(tracked_peak, values["gym_tracer_connections_tracked"])
        rss_after = rss_kib(agent.process.pid)
        assert agent.process.poll() is None, "the agent stays up"
    finally:
        for sock in abandoned:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        agent.stop()
        server.stop()

    assert agent.returncode == 0, agent.stderr()
    healthy.assert_all_traced(agent, server)
    assert tracked_peak <= max_connections
    summary = agent.summary()
    # Every connection past the bound evicted another, never the healthy one.
    assert summary["connections_evicted"] >= 10_000 - max_connections, summary
    assert summary["connections_dropped"] == 0, summary
    # A thousand connections, half heads included, cost the agent a few MiB at most.
    assert rss_after - rss_before < 64 * 1024, (rss_before, rss_after)


EXEC_INTO_SLEEP = """
import os, socket, sys, time
listener = socket.socket()
listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(("127.0.0.1", int(sys.argv[1])))
listener.listen()
# Accept in short calls: a call already blocked when the agent attaches is not seen.
listener.settimeout(0.05)
while True:
    try:
        connection, _ = listener.accept()
        break
    except TimeoutError:
        pass
connection.settimeout(None)
while True:
    request = connection.recv(65536)
    if not request:
        break
    if b"/exec" in request:
        # A request in flight on a connection the exec closes without a close() call.
        os.execv("/bin/sleep", ["sleep", "3"])
    connection.sendall(b"HTTP/1.1 200 OK\\r\\ncontent-length: 2\\r\\n\\r\\nok")
"""


def test_a_traced_process_that_execs_into_something_else():
    healthy_server = Server(*start_server())
    port = free_port()
    execer = subprocess.Popen([sys.executable, "-c", EXEC_INTO_SLEEP, str(port)])
    agent = None
    try:
        agent = Agent([execer.pid, healthy_server.pid], extra_args=["--no-route-harvest"]).start()
        deadline = time.monotonic() + 10
        while True:
            try:
                client = socket.create_connection(("127.0.0.1", port), timeout=5)
                break
            except OSError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        client.sendall(b"GET /before HTTP/1.1\r\nHost: a\r\n\r\n")
        assert client.recv(100).startswith(b"HTTP/1.1 200")
        client.sendall(b"GET /exec HTTP/1.1\r\nHost: a\r\n\r\n")
        healthy = HealthyClient(healthy_server.port)
        for _ in range(3):
            healthy.request()
        execer.wait(15)  # `sleep 3` exits
        client.close()
        agent.wait_for_stderr(f"pid {execer.pid} exited")
        for _ in range(3):
            healthy.request()
        time.sleep(1.0)
        assert agent.process.poll() is None, "the agent keeps tracing the other server"
    finally:
        if agent is not None:
            agent.stop()
        execer.kill()
        healthy_server.stop()

    assert agent.returncode == 0, agent.stderr()
    healthy.assert_all_traced(agent, healthy_server)
    mine = [s for s in agent.spans() if s["resource"]["process.pid"] == execer.pid]
    by_path = {s["attributes"]["url.path"]: s for s in mine}
    assert by_path["/before"]["attributes"]["http.response.status_code"] == 200
    # The request the exec cut off ends at the exec: the old program's state is not kept.
    assert by_path["/exec"]["attributes"]["error.type"] == "process_exec", by_path["/exec"]
    # Attached by --pid, the pid is traced across the exec, under the identity it had.
    assert len({s["resource"]["service.name"] for s in mine}) == 1, mine
    summary = agent.summary()
    assert summary["processes_execd"] == 1, summary
    assert summary["processes_exited"] == 1, summary
    assert summary["data_without_connection"] == 0, summary


def spawn_with_pid(pid, command, **kwargs):
    """Starts `command` as process `pid` (free again) through /proc/sys/kernel/ns_last_pid;
    retries while other processes on the host take the pid first. Restores the counter."""
    path = "/proc/sys/kernel/ns_last_pid"
    original = int(open(path).read())
    try:
        for _ in range(50):
            with open(path, "w") as f:
                f.write(str(pid - 1))
            process = subprocess.Popen(command, **kwargs)
            if process.pid == pid:
                return process
            process.kill()
            process.wait()
        raise AssertionError(f"could not get pid {pid}")
    finally:
        with open(path, "w") as f:
            f.write(str(max(original, int(open(path).read()))))


def test_a_reused_pid_is_not_traced_under_the_old_identity():
    healthy_server = Server(*start_server())
    victim = Server(*start_server())
    agent = Agent([victim.pid, healthy_server.pid]).start()
    reused = None
    try:
        victim_pid = victim.pid
        http_get(f"http://127.0.0.1:{victim.port}/health")
        victim.stop()
        agent.wait_for_stderr(f"pid {victim_pid} exited")
        port = free_port()
        reused = Server(spawn_with_pid(
            victim_pid,
            [sys.executable, "-m", "uvicorn", "servers.gym_shaped:app", "--host", "127.0.0.1", "--port", str(port),
             "--no-access-log", "--log-level", "warning"],
            env=dict(os.environ, PYTHONPATH=str(TESTS_DIR)), cwd=TESTS_DIR,
        ), port)
        wait_for_health(port)
        assert reused.pid == victim_pid
        for _ in range(5):
            http_get(f"http://127.0.0.1:{port}/health")
        healthy = HealthyClient(healthy_server.port)
        for _ in range(3):
            healthy.request()
        time.sleep(1.0)
        assert agent.process.poll() is None
    finally:
        agent.stop()
        if reused is not None:
            reused.stop()
        healthy_server.stop()

    assert agent.returncode == 0, agent.stderr()
    healthy.assert_all_traced(agent, healthy_server)
    # Attached by --pid, a process is traced until it exits: the pid's next owner is not.
    victim_spans = [s for s in agent.spans() if s["resource"]["process.pid"] == victim_pid]
    assert len(victim_spans) == 1, victim_spans
    assert agent.summary()["processes_exited"] == 1
