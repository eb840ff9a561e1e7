"""`gym-tracer run --inject-traceparent`: the kernel inserts `traceparent: 00-<trace>-<span>-01`
right after the request line of a traced process's outbound plaintext HTTP/1.x request: the
trace of the inbound request the writing handler was born for (here: the one its inbound
`traceparent` names), known to the kernel from the handler's first call on (task lineage,
which `--task-lineage auto` turns on for every traced process when injecting).

The caller is a plain FastAPI app (support/servers/injection_app.py), traced by `--pid`:
`POST /go/{n}` makes two aiohttp POSTs, 0.3 s apart, `/call/{n}/0` and `/call/{n}/1`, over a
ClientSession of its own (so over a socket connected while the tracer runs). Each inbound
request carries a traceparent with a trace id of its own (`inbound_trace_id(n)`).

- test 1: the callee is a raw TCP capture server on loopback (the exact bytes of every
  request). The same requests untraced, traced without the flag (byte for byte the same),
  traced with `all` (every call: the one added line, the right trace and span ids, nothing
  else changed; the counter agrees with what the server saw), and traced with `remote` (a
  call on this host: byte for byte as untraced, its trace handed over instead);
- test 2: the callee is an OpenTelemetry-instrumented FastAPI server the tracer does not
  trace (support/servers/injection_otel_app.py), exporting to the test's OTLP receiver: with
  `all`, every SERVER span joins the caller's trace under gym-tracer's exact CLIENT span;
  without the flag none does;
- test 3: a caller that sends a traceparent of its own (in three spellings of the name):
  never a second one;
- test 4, `remote` across two hosts: the callee is a capture server on host B (a network
  namespace, support/netns.py), the caller on host A: every call, the very first request's
  included, carries the inbound request's trace under gym-tracer's exact CLIENT span, nothing
  else changed."""

import base64
import collections
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

from harness import SUPPORT_DIR, free_port, wait_until
from netns import TwoHosts
from servers.capture_server import next_request
from span_ids import parent_key, span_key

TOTAL = 8  # inbound requests per traced run, two calls each
CALLS = 2
INJECT = ["--inject-traceparent"]  # the bare flag: `all`
REMOTE = ["--inject-traceparent", "remote"]
COUNTERS = ["traceparents_injected", "traceparents_handed_over", "traceparents_not_known", "traceparents_carried", "traceparents_head_unscanned",
            "traceparents_owner_answered", "traceparents_not_delivered", "traceparents_failed", "traces_published",
            "traces_unsettled"]
# The line the tracer inserts, exactly (a lowercase name, one space, sampled flag).
INJECTED_LINE = re.compile(rb"traceparent: 00-([0-9a-f]{32})-([0-9a-f]{16})-01\r\n")
CALL_PATH = re.compile(r"^/call/(\d+)/(\d+)$")
CALLER_APP = "servers.injection_app:app"
OTEL_APP = "servers.injection_otel_app:app"


def inbound_trace_id(n):
    return f"4bf92f3577b34da6a3ce929d0e0e{n:04x}"


def inbound_traceparent(n):
    return f"00-{inbound_trace_id(n)}-00f067aa0ba9{n:04x}-01"


class CaptureServer:
    """A plain socket server on 127.0.0.1 (threads, keep-alive): reads each HTTP/1.1 request in
    full (head, then Content-Length bytes of body), records its exact bytes under the path of
    its request line, and answers `200 ok`."""

    def __init__(self):
        self.listener = socket.create_server(("127.0.0.1", 0), backlog=64)
        self.port = self.listener.getsockname()[1]
        self.lock = threading.Lock()
        self.requests = collections.defaultdict(list)  # path -> [bytes, ...]
        self.errors = []
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}"

    def take(self):
        """What was captured since the last take: {path: [request bytes, ...]}."""
        with self.lock:
            taken, self.requests = dict(self.requests), collections.defaultdict(list)
            assert not self.errors, self.errors
        return taken

    def _accept(self):
        while not self.closed:
            try:
                connection, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection):
        buffered = b""
        try:
            with connection:
                while True:
                    request, buffered = next_request(connection, buffered)
                    if request is None:
                        return
                    path = request.split(b"\r\n", 1)[0].split(b" ")[1].decode()
                    with self.lock:
                        self.requests[path].append(request)
                    connection.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        except Exception as error:  # noqa: BLE001 - the test fails on it (take())
            with self.lock:
                self.errors.append(repr(error))

    def close(self):
        self.closed = True
        self.listener.close()


def drive(port, route, numbers):
    """POST /<route>/<n> for each n, one after the other, each with its inbound traceparent."""
    for n in numbers:
        request = urllib.request.Request(f"http://127.0.0.1:{port}/{route}/{n}", data=b"", method="POST",
                                         headers={"traceparent": inbound_traceparent(n)})
        with urllib.request.urlopen(request, timeout=30) as response:
            assert response.status == 200
            response.read()


def call_key(path):
    match = CALL_PATH.match(path)
    assert match, path
    return int(match.group(1)), int(match.group(2))


def client_spans(agent, pid):
    """gym-tracer's CLIENT spans of `pid`, by (n, i) from their url.full."""
    spans = {}
    for span in agent.spans():
        if span["kind"] == "CLIENT" and span["resource"].get("process.pid") == pid:
            path = "/" + span["attributes"]["url.full"].split("://", 1)[1].split("/", 1)[1]
            key = call_key(path)
            assert key not in spans, f"two CLIENT spans for {path}"
            spans[key] = span
    return spans


def traced_run(server_factory, agents, downstream, extra_args, route="go", numbers=range(TOTAL)):
    """A fresh caller (calling `downstream`), traced by a fresh agent with `extra_args`, or
    untraced if `extra_args` is None; drives `numbers` and stops the agent once every span is
    out. Returns (agent or None, the caller's pid, gym-tracer's CLIENT spans by (n, i))."""
    caller = server_factory(app=CALLER_APP, env={"INJECTION_DOWNSTREAM": downstream})
    agent = None
    if extra_args is not None:
        agent = agents([caller.pid], extra_args=extra_args)
        agent.wait_for_routes(caller.pid)
    drive(caller.port, route, numbers)
    clients = {}
    if agent is not None:
        wanted = len(numbers) * CALLS
        wait_until(lambda: len(client_spans(agent, caller.pid)) >= wanted, 15,
                   lambda: f"{wanted} CLIENT spans (have {len(client_spans(agent, caller.pid))})")
        agent.stop()
        assert agent.returncode == 0, agent.stderr()
        clients = client_spans(agent, caller.pid)
        assert sorted(clients) == [(n, i) for n in numbers for i in range(CALLS)]
    caller.stop()
    return agent, caller.pid, clients


def one_each(captured, numbers):
    """{(n, i): bytes}: exactly one captured request per call."""
    assert sorted(captured) == sorted(f"/call/{n}/{i}" for n in numbers for i in range(CALLS)), sorted(captured)
    for path, requests in captured.items():
        assert len(requests) == 1, f"{path} arrived {len(requests)} times"
    return {call_key(path): requests[0] for path, requests in captured.items()}


def counters(agent):
    summary = agent.summary()
    return {name: summary[name] for name in COUNTERS}


def remove_injected_line(request):
    """(the request without a traceparent line right after its request line, the match), or
    (None, None) if there is no such line there."""
    line_end = request.index(b"\r\n") + 2
    match = INJECTED_LINE.match(request, line_end)
    if not match:
        return None, None
    return request[:line_end] + request[match.end():], match


def test_injection_off_leaves_requests_byte_for_byte_unchanged(server_factory, agents):
    capture = CaptureServer()
    try:
        # (a) untraced: the reference bytes. aiohttp sends Host (the capture server's fixed
        # port), Accept, Accept-Encoding, User-Agent, Content-Length, Content-Type and the
        # JSON body: nothing that varies from run to run, so the comparisons are exact.
        traced_run(server_factory, agents, capture.base_url, None)
        reference = one_each(capture.take(), range(TOTAL))
        for request in reference.values():
            assert b"traceparent" not in request.lower(), request

        # (b) traced without the flag: byte for byte the same.
        plain_agent, _, _ = traced_run(server_factory, agents, capture.base_url, [])
        plain = one_each(capture.take(), range(TOTAL))
        differ = [key for key in reference if plain[key] != reference[key]]
        assert not differ, "traced without --inject-traceparent, requests changed:\n" + "\n".join(
            f"{key}:\n  untraced {reference[key]!r}\n  traced   {plain[key]!r}" for key in differ)
        plain_counters = counters(plain_agent)
        assert plain_counters["traceparents_injected"] == 0, plain_counters

        # (c) traced with `remote`: a call to loopback goes out byte for byte.
        local_agent, _, _ = traced_run(server_factory, agents, capture.base_url, REMOTE)
        local = one_each(capture.take(), range(TOTAL))
        differ = [key for key in reference if local[key] != reference[key]]
        assert not differ, "traced with --inject-traceparent remote, loopback requests changed:\n" + "\n".join(
            f"{key}:\n  untraced {reference[key]!r}\n  traced   {local[key]!r}" for key in differ)
        local_counters = counters(local_agent)
        assert (local_counters["traceparents_injected"], local_counters["traceparents_handed_over"]) == \
            (0, TOTAL * CALLS), local_counters

        # (d) traced with `all`.
        agent, _, clients = traced_run(server_factory, agents, capture.base_url, INJECT)
        injected = one_each(capture.take(), range(TOTAL))
    finally:
        capture.close()

    changed, problems = [], []
    for key, request in sorted(injected.items()):
        if request == reference[key]:
            continue
        stripped, match = remove_injected_line(request)
        if stripped is None or stripped != reference[key]:
            problems.append(f"{key} changed other than by one traceparent line after the request line:\n"
                            f"  untraced {reference[key]!r}\n  injected {request!r}")
            continue
        n, i = key
        trace_id, span_id = match.group(1).decode(), match.group(2).decode()
        client = clients[key]
        if trace_id != inbound_trace_id(n):
            problems.append(f"{key}: injected trace id {trace_id}, the inbound request's is {inbound_trace_id(n)}")
        if span_id != client["span_id"] or trace_id != client["trace_id"]:
            problems.append(f"{key}: injected {trace_id}-{span_id}, gym-tracer's CLIENT span is "
                            f"{client['trace_id']}-{client['span_id']}")
        if request.lower().count(b"\r\ntraceparent:") != 1:
            problems.append(f"{key}: not exactly one traceparent header: {request!r}")
        changed.append(key)

    figures = counters(agent)
    print(f"\n[injection bytes] {len(reference)} requests untraced = traced without the flag = traced with "
          f"`remote` (loopback), byte for byte; with `all` {len(changed)} changed, {len(problems)} problems; "
          f"counters {figures}")
    assert not problems, "\n".join(problems)
    # Every call, a handler's first and the very first request's included.
    assert changed == sorted(injected), f"calls injected: {changed}; counters {figures}"
    assert figures["traceparents_injected"] == len(changed), \
        f"the agent counted {figures['traceparents_injected']} injections, the server saw {len(changed)}: {changed}"
    assert figures["traceparents_failed"] == 0, figures


def otel_server_spans(receiver, numbers):
    """The OpenTelemetry server's SERVER spans, by (n, i), of requests numbered in `numbers`."""
    spans = {}
    with receiver.received.lock:
        received = list(receiver.received.spans)
    for span in received:
        if span["resource"].get("service.name") != "injection-otel-callee" or span["kind"] != "SERVER":
            continue
        key = call_key(span["attributes"]["test.path"])
        if key[0] in numbers:
            assert key not in spans, f"two OpenTelemetry SERVER spans for {key}"
            spans[key] = span
    return spans


def test_an_untraced_opentelemetry_server_joins_the_trace(server_factory, agents, receiver):
    otel = server_factory(app=OTEL_APP, env={"INJECTION_OTLP_TRACES": f"{receiver.http_endpoint}/v1/traces"})

    def otel_spans(numbers):
        wanted = len(numbers) * CALLS
        return wait_until(lambda: (lambda s: s if len(s) >= wanted else None)(otel_server_spans(receiver, numbers)),
                          15, lambda: f"{wanted} OpenTelemetry SERVER spans "
                                      f"(have {len(otel_server_spans(receiver, numbers))})")

    # With the flag.
    numbers = range(TOTAL)
    agent, _, clients = traced_run(server_factory, agents, otel.base_url, INJECT, numbers=numbers)
    servers = otel_spans(numbers)
    assert sorted(servers) == sorted(clients)
    gym_keys = {span_key(span) for span in agent.spans()}
    joined, problems = [], []
    for key, server in sorted(servers.items()):
        n, i = key
        client = clients[key]
        header = server["attributes"]["test.traceparent"]
        if not header:
            if server["parent_span_id"]:
                problems.append(f"{key}: no traceparent arrived, yet a parent {server['parent_span_id']}")
            continue
        expected = f"00-{client['trace_id']}-{client['span_id']}-01"
        if header != expected:
            problems.append(f"{key}: the server received traceparent {header!r}, gym-tracer's CLIENT span is "
                            f"{expected!r}")
        if parent_key(server) != span_key(client):
            problems.append(f"{key}: OpenTelemetry SERVER span in {server['trace_id']} under "
                            f"{server['parent_span_id']}, gym-tracer's CLIENT span is {client['trace_id']} "
                            f"{client['span_id']}")
        if client["trace_id"] != inbound_trace_id(n):
            problems.append(f"{key}: CLIENT span in trace {client['trace_id']}, the inbound request's is "
                            f"{inbound_trace_id(n)}")
        joined.append(key)
    figures = counters(agent)
    print(f"\n[injection otel] {len(servers)} OpenTelemetry SERVER spans, {len(joined)} joined under gym-tracer's "
          f"CLIENT span, {len(problems)} problems; counters {figures}")
    assert not problems, "\n".join(problems)
    assert joined == sorted(servers), f"joined: {joined}; counters {figures}"
    assert figures["traceparents_injected"] == len(joined), (figures, joined)
    assert figures["traceparents_failed"] == 0, figures
    assert all(parent_key(servers[key]) in gym_keys for key in joined)

    # Without the flag: no OpenTelemetry span hangs under a gym-tracer span.
    numbers = range(100, 105)
    plain_agent, _, plain_clients = traced_run(server_factory, agents, otel.base_url, [], numbers=numbers)
    plain_servers = otel_spans(numbers)
    # By span id alone, whatever the trace: under no gym-tracer span at all (stricter than within a trace).
    plain_gym_ids = {span["span_id"] for span in plain_agent.spans()}
    adopted = [key for key, span in plain_servers.items()
               if span["parent_span_id"] or span["attributes"]["test.traceparent"]
               or span["trace_id"] in {client["trace_id"] for client in plain_clients.values()}]
    print(f"[injection otel] without the flag: {len(plain_servers)} OpenTelemetry SERVER spans, "
          f"{len(adopted)} with a parent or a caller's trace id")
    assert not adopted, {key: plain_servers[key] for key in adopted}
    assert not {span["parent_span_id"] for span in plain_servers.values()} & plain_gym_ids
    assert counters(plain_agent)["traceparents_injected"] == 0


def test_a_request_never_carries_two_traceparents(server_factory, agents):
    from servers.injection_app import OWN_HEADER_NAMES, OWN_TRACEPARENT

    capture = CaptureServer()
    try:
        agent, _, clients = traced_run(server_factory, agents, capture.base_url, INJECT, route="own")
        captured = one_each(capture.take(), range(TOTAL))
    finally:
        capture.close()
    problems = []
    for (n, i), request in sorted(captured.items()):
        lines = [line for line in request.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]
                 if line.lower().startswith(b"traceparent:")]
        name = OWN_HEADER_NAMES[n % len(OWN_HEADER_NAMES)].encode()
        if lines != [name + b": " + OWN_TRACEPARENT.encode()]:
            problems.append(f"({n}, {i}) [{name.decode()}]: traceparent lines {lines}")
    figures = counters(agent)
    print(f"\n[injection own header] {len(captured)} requests each with the caller's own traceparent "
          f"(names {OWN_HEADER_NAMES}), {len(problems)} with another count; counters {figures}")
    assert not problems, "\n".join(problems)
    assert figures["traceparents_carried"] >= 1, figures
    assert figures["traceparents_injected"] == 0, figures
    assert figures["traceparents_failed"] == 0, figures


def test_every_call_to_another_host_carries_its_handlers_header(server_factory, agents):
    numbers = range(TOTAL)
    with TwoHosts() as hosts, tempfile.TemporaryDirectory(prefix="capture-b-") as workdir:
        port = free_port()
        out, ready = os.path.join(workdir, "requests.jsonl"), os.path.join(workdir, "ready")
        callee = subprocess.Popen([*hosts.b_exec, sys.executable, str(SUPPORT_DIR / "servers" / "capture_server.py"),
                                   "--host", hosts.b_address, "--port", str(port), "--out", out, "--ready", ready])
        try:
            wait_until(lambda: os.path.exists(ready), 20, "the capture server on host B listening")
            agent, _, clients = traced_run(server_factory, agents, f"http://{hosts.b_address}:{port}",
                                           REMOTE, numbers=numbers)
        finally:
            callee.terminate()
            callee.wait(10)
        with open(out) as sink:
            entries = [json.loads(line) for line in sink]
    errors = [entry["error"] for entry in entries if "error" in entry]
    assert not errors, errors
    captured = collections.defaultdict(list)
    for entry in entries:
        captured[entry["path"]].append(base64.b64decode(entry["request"]))
    requests = one_each(captured, numbers)

    problems = []
    for key, request in sorted(requests.items()):
        n, _ = key
        client = clients[key]
        stripped, match = remove_injected_line(request)
        if match is None:
            problems.append(f"{key}: no traceparent line after the request line: {request[:300]!r}")
            continue
        if b"traceparent" in stripped.lower():
            problems.append(f"{key}: another traceparent besides the injected one: {request[:300]!r}")
        trace_id, span_id = match.group(1).decode(), match.group(2).decode()
        if trace_id != inbound_trace_id(n):
            problems.append(f"{key}: injected trace {trace_id}, the inbound request's is {inbound_trace_id(n)}")
        if (trace_id, span_id) != (client["trace_id"], client["span_id"]):
            problems.append(f"{key}: injected {trace_id}-{span_id}, gym-tracer's CLIENT span is "
                            f"{client['trace_id']}-{client['span_id']}")
        if client["trace_id"] != inbound_trace_id(n):
            problems.append(f"{key}: CLIENT span in trace {client['trace_id']}, the inbound request's is "
                            f"{inbound_trace_id(n)}")
    figures = counters(agent)
    summary = agent.summary()
    print(f"\n[injection across hosts, remote] {len(requests)} requests to host B, {len(problems)} problems; "
          f"counters {figures}; parents_by_lineage={summary['parents_by_lineage']}")
    assert not problems, "\n".join(problems)
    assert figures["traceparents_injected"] == len(requests), figures
    assert figures["traceparents_not_known"] == 0 and figures["traceparents_failed"] == 0, figures
    assert summary["parents_by_lineage"] == len(requests), summary["parents_by_lineage"]
