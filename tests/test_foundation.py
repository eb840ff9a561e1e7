"""End-to-end tests of [foundation]: the real agent, loaded into the real kernel, attached by
PID to real uvicorn servers; spans and metrics read from its JSON lines or received over
real OTLP."""

import collections
import http.client
import json
import socket
import subprocess
import threading
import time

import pytest

from harness import agent_binary
from servers import gym_shaped

SERVER_FLAVOURS = [
    pytest.param({"loop": "uvloop", "http": "httptools"}, id="uvloop-httptools"),
    pytest.param({"loop": "asyncio", "http": "h11"}, id="asyncio-h11"),
]

SECRET_QUERY = "token=do-not-export-me"


def post_json(connection, path, payload, headers=None):
    body = json.dumps(payload)
    connection.request("POST", path, body=body, headers={"content-type": "application/json", **(headers or {})})
    response = connection.getresponse()
    response.read()
    return response.status


def drive_known_mix(server):
    """Sends a fixed mix of requests and returns how many of each span to expect."""
    expected = collections.Counter()
    keep_alive = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    for _ in range(5):
        keep_alive.request("GET", "/health")
        response = keep_alive.getresponse()
        response.read()
        assert response.status == 200
    expected["GET /health"] += 5
    for i in range(3):
        assert post_json(keep_alive, f"/verify?{SECRET_QUERY}", {"answer": "42", "i": i}) == 200
    expected["POST /verify"] += 3
    for _ in range(2):
        assert post_json(keep_alive, "/fail", {}) == 500
    expected["POST /fail"] += 2
    keep_alive.close()

    # Bodies larger than the capture, on fresh connections.
    for _ in range(2):
        big = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        assert post_json(big, "/verify", {"answer": "42", "padding": "x" * 20_000}) == 200
        big.close()
    expected["POST /verify"] += 2

    # Concurrent requests, each on its own connection.
    statuses = []

    def one(i):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        statuses.append(post_json(connection, "/verify", {"answer": str(i)}))
        connection.close()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [200] * 20
    expected["POST /verify"] += 20

    slow = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    slow.request("GET", "/slow")
    assert slow.getresponse().read()
    slow.close()
    expected["GET /slow"] += 1
    return expected


@pytest.mark.parametrize("flavour", SERVER_FLAVOURS)
def test_json_lines_spans_for_a_known_mix_of_requests(server_factory, flavour, agents):
    server = server_factory(**flavour)
    agent = agents([server.pid])
    agent.wait_for_routes(server.pid)
    expected = drive_known_mix(server)
    agent.wait_for_spans(sum(expected.values()))
    agent.stop()
    assert agent.returncode == 0, agent.stderr()

    spans = agent.spans()
    assert collections.Counter(span["name"] for span in spans) == expected
    assert SECRET_QUERY not in agent.stdout_text(), "query strings must never be exported"

    for span in spans:
        assert span["kind"] == "SERVER"
        assert len(span["trace_id"]) == 32 and len(span["span_id"]) == 16
        assert span["parent_span_id"] == ""
        assert span["end_time_unix_nano"] > span["start_time_unix_nano"]
        # Wall clock, not boot time: within the last ten minutes.
        assert abs(span["start_time_unix_nano"] / 1e9 - time.time()) < 600
        attributes = span["attributes"]
        method, path = span["name"].split(" ", 1)
        assert attributes["http.request.method"] == method
        assert attributes["url.path"] == path
        assert attributes["url.scheme"] == "http"
        assert attributes["server.port"] == server.port
        assert attributes["client.address"] == "127.0.0.1"
        assert attributes["network.protocol.version"] == "1.1"
        # The server's own route table (its /openapi.json, harvested once) names every route.
        assert attributes["http.route"] == path
        status = attributes["http.response.status_code"]
        if span["name"] == "POST /fail":
            assert status == 500 and span["status"] == "ERROR"
        else:
            assert status == 200 and span["status"] == "UNSET"
        assert span["resource"]["process.pid"] == server.pid

    slow = next(span for span in spans if span["name"] == "GET /slow")
    # libuv's timers count whole milliseconds from a cached loop time, so a 0.3 s sleep can
    # end up to 1 ms early by the kernel's clock (seen: 0.29999991 s).
    assert (slow["end_time_unix_nano"] - slow["start_time_unix_nano"]) / 1e9 >= gym_shaped.SLOW_SECONDS - 0.002

    points = agent.metric_points("http.server.request.duration")
    counts = collections.Counter()
    for point in points:
        assert point["unit"] == "s"
        key = (point["attributes"]["http.request.method"], point["attributes"]["http.response.status_code"])
        counts[key] += point["count"]
    assert counts == {
        ("GET", 200): expected["GET /health"] + expected["GET /slow"],
        ("POST", 200): expected["POST /verify"],
        ("POST", 500): expected["POST /fail"],
    }
    summary = agent.summary()
    assert summary["events_lost_in_kernel"] == 0
    assert summary["spans_exported"] == sum(expected.values())


def test_traceparent_is_adopted_as_parent(server_factory, agents):
    server = server_factory()
    agent = agents([server.pid])
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    post_json(connection, "/verify", {"answer": "1"}, headers={"traceparent": f"00-{trace_id}-{parent_id}-01"})
    agent.wait_for_spans(1)
    agent.stop()
    [span] = agent.spans()
    assert span["trace_id"] == trace_id
    assert span["parent_span_id"] == parent_id


def raw_exchange(port, payload, read_until_count=1, delay_between=None):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        if isinstance(payload, list):
            for part in payload:
                s.sendall(part)
                if delay_between:
                    time.sleep(delay_between)
        else:
            s.sendall(payload)
        data = b""
        while data.count(b"HTTP/1.1 ") < read_until_count:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        time.sleep(0.1)
        return data


def test_pipelined_requests_and_split_headers(server_factory, agents):
    server = server_factory()
    agent = agents([server.pid])
    two = b"GET /health HTTP/1.1\r\nHost: a\r\n\r\nGET /slow HTTP/1.1\r\nHost: a\r\n\r\n"
    raw_exchange(server.port, two, read_until_count=2)
    request = b"GET /health HTTP/1.1\r\nHost: a\r\nUser-Agent: split\r\n\r\n"
    raw_exchange(server.port, [request[:7], request[7:30], request[30:]], delay_between=0.05)
    agent.wait_for_spans(3)
    agent.stop()
    names = [span["name"] for span in agent.spans()]
    assert sorted(names) == ["GET /health", "GET /health", "GET /slow"]
    split = [span for span in agent.spans() if span["attributes"].get("user_agent.original") == "split"]
    assert len(split) == 1


def test_expect_100_continue(server_factory, agents):
    server = server_factory()
    agent = agents([server.pid])
    body = b'{"answer": "42"}'
    head = (
        b"POST /verify HTTP/1.1\r\nHost: a\r\nContent-Type: application/json\r\n"
        b"Expect: 100-continue\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(head)
        interim = s.recv(1024)
        assert interim.startswith(b"HTTP/1.1 100")
        s.sendall(body)
        final = s.recv(65536)
        assert b" 200 " in final.split(b"\r\n", 1)[0]
    agent.wait_for_spans(1)
    agent.stop()
    [span] = agent.spans()
    assert span["name"] == "POST /verify"
    assert span["attributes"]["http.response.status_code"] == 200


def test_chunked_streaming_response_ends_at_its_last_chunk(server_factory, agents):
    server = server_factory()
    agent = agents([server.pid])
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    for _ in range(2):  # twice on one connection: the first must end for the second to start
        connection.request("GET", "/stream")
        response = connection.getresponse()
        assert response.getheader("transfer-encoding") == "chunked"
        assert len(response.read()) == gym_shaped.STREAM_CHUNKS * gym_shaped.STREAM_CHUNK_BYTES
    connection.close()
    agent.wait_for_spans(2)
    agent.stop()
    spans = agent.spans()
    assert [span["name"] for span in spans] == ["GET /stream", "GET /stream"]
    minimum = gym_shaped.STREAM_CHUNKS * gym_shaped.STREAM_DELAY_SECONDS
    for span in spans:
        assert span["status"] == "UNSET"
        assert (span["end_time_unix_nano"] - span["start_time_unix_nano"]) / 1e9 >= minimum


def test_client_that_disconnects_mid_request_gives_an_error_span(server_factory, agents):
    server = server_factory()
    agent = agents([server.pid])
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: a\r\n\r\n")
        time.sleep(0.05)
    time.sleep(gym_shaped.SLOW_SECONDS + 0.3)
    # The server keeps serving others.
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200
    agent.wait_for_spans(2)
    agent.stop()
    spans = {span["name"]: span for span in agent.spans()}
    assert set(spans) == {"GET /slow", "GET /health"}
    aborted = spans["GET /slow"]
    assert aborted["status"] == "ERROR"
    assert aborted["attributes"]["error.type"] == "connection_closed"
    assert "http.response.status_code" not in aborted["attributes"]


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_otlp_export(server_factory, receiver, protocol, agents):
    server = server_factory()
    endpoint = receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint
    agent = agents(
        [server.pid],
        env={"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": protocol},
    )
    # Requests before the route table arrives have no http.route: a separate histogram point.
    agent.wait_for_routes(server.pid)
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    for i in range(7):
        assert post_json(connection, "/verify", {"answer": str(i)}) == 200
    assert post_json(connection, "/fail", {}) == 500
    connection.close()
    time.sleep(1.0)
    agent.stop()
    assert agent.returncode == 0, agent.stderr()
    assert agent.stdout_text() == "", "with an OTLP endpoint nothing goes to stdout"

    spans = receiver.received.spans
    assert collections.Counter(span["name"] for span in spans) == {"POST /verify": 7, "POST /fail": 1}
    for span in spans:
        assert span["kind"] == "SERVER"
        assert span["resource"]["process.pid"] == server.pid
        assert span["resource"]["service.name"]
        assert span["attributes"]["server.port"] == server.port
    assert [span["status"] for span in spans if span["name"] == "POST /fail"] == ["ERROR"]

    points = receiver.received.latest_histograms("http.server.request.duration")
    counts = {point["attributes"]["http.response.status_code"]: point["count"] for point in points}
    assert counts == {200: 7, 500: 1}
    assert all(point["unit"] == "s" for point in points)


def test_service_name_override(server_factory, agents):
    server = server_factory()
    agent = agents([server.pid], env={"OTEL_SERVICE_NAME": "my-verifier"})
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request("GET", "/health")
    connection.getresponse().read()
    agent.wait_for_spans(1)
    agent.stop()
    [span] = agent.spans()
    assert span["resource"]["service.name"] == "my-verifier"


def test_no_loss_at_a_few_thousand_requests(server_factory, agents):
    """Thousands of requests over keep-alive connections: every one becomes a span."""
    server = server_factory()
    agent = agents([server.pid])
    per_connection, connections = 250, 8
    errors = []

    def worker():
        try:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
            for _ in range(per_connection):
                connection.request("GET", "/health")
                connection.getresponse().read()
            connection.close()
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(connections)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    total = per_connection * connections
    agent.wait_for_spans(total, timeout=10)
    agent.stop()
    assert len(agent.spans()) == total
    summary = agent.summary()
    assert summary["events_lost_in_kernel"] == 0
    assert summary["spans_dropped_queue_full"] == 0


def test_clear_errors(server_factory):
    binary = str(agent_binary())
    missing = subprocess.run([binary, "run", "--pid", "999999999"], capture_output=True, text=True, timeout=30)
    assert missing.returncode != 0
    assert "no process with pid 999999999" in missing.stderr

    server = server_factory()
    unprivileged = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", binary, "run", "--pid", str(server.pid)],
        capture_output=True, text=True, timeout=30,
    )
    assert unprivileged.returncode != 0
    assert "CAP_BPF" in unprivileged.stderr and "root" in unprivileged.stderr
    assert "lacks CAP_BPF, CAP_PERFMON, CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE" in unprivileged.stderr

    bad_flag = subprocess.run([binary, "run", "--pid", str(server.pid), "--capture-bytes", "999999"],
                              capture_output=True, text=True, timeout=30)
    assert bad_flag.returncode != 0 and "capture-bytes" in bad_flag.stderr


def test_untraced_process_is_not_reported(server_factory, agents):
    traced = server_factory()
    untraced = server_factory()
    agent = agents([traced.pid])
    for server in (traced, untraced, untraced):
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        connection.request("GET", "/health")
        connection.getresponse().read()
        connection.close()
    agent.wait_for_spans(1)
    time.sleep(0.6)
    agent.stop()
    spans = agent.spans()
    assert len(spans) == 1
    assert spans[0]["resource"]["process.pid"] == traced.pid


def test_agent_exits_when_the_traced_process_exits(server_factory, agents):
    server = server_factory()
    agent = agents([server.pid])
    server.stop()
    agent.process.wait(timeout=20)
    assert agent.process.returncode == 0
    assert "every traced process has exited" in agent.stderr()

