"""A counting OTLP/HTTP receiver for the benchmark: it decodes each trace export and counts
spans per (process.pid, span kind), and answers everything else (metrics) with 200.

Unlike tests/support/otlp_receiver.py it keeps no span, so its memory stays flat and its CPU (it runs
on the load generator's core) stays small at thousands of spans per second.

    python otlp_counter.py PORT_FILE     # writes its port to PORT_FILE once listening
    GET /counts                          # {"<pid>": {"SERVER": n, "INTERNAL": n, "CLIENT": n}}
"""

import json
import sys
import threading
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}

lock = threading.Lock()
counts = defaultdict(lambda: defaultdict(int))


def resource_pid(resource):
    for attribute in resource.attributes:
        if attribute.key == "process.pid":
            value = attribute.value
            return str(value.int_value if value.HasField("int_value") else value.string_value)
    return "unknown"


def count(body):
    request = trace_service_pb2.ExportTraceServiceRequest()
    request.ParseFromString(body)
    batch = defaultdict(int)
    for resource_spans in request.resource_spans:
        pid = resource_pid(resource_spans.resource)
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                batch[(pid, KINDS.get(span.kind, "UNSPECIFIED"))] += 1
    with lock:
        for (pid, kind), n in batch.items():
            counts[pid][kind] += n


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: exporters reuse their connection

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length", "0")))
        if self.path == "/v1/traces":
            count(body)
        self.reply(200, b"", "application/x-protobuf")

    def do_GET(self):
        if self.path != "/counts":
            return self.reply(404, b"", "text/plain")
        with lock:
            snapshot = {pid: dict(kinds) for pid, kinds in counts.items()}
        self.reply(200, json.dumps(snapshot).encode(), "application/json")

    def reply(self, status, body, content_type):
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        # An exporter that gave up (an agent stopping within its shutdown timeout) closed
        # the connection before the 200: its body was read and counted; nothing to report.
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            return
        super().handle_error(request, client_address)


def main():
    server = Server(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    with open(sys.argv[1], "w") as f:
        f.write(str(server.server_port))
    server.serve_forever()


if __name__ == "__main__":
    main()
