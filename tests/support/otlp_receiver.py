"""A real OTLP receiver for the tests: gRPC (TraceService, MetricsService) and HTTP/protobuf
(/v1/traces, /v1/metrics) on loopback. Received data is flattened into plain dicts.

Optionally over TLS (`Tls`), with client certificates required (mutual TLS); the headers (gRPC
metadata) of every export request are recorded, and gzip-compressed requests are accepted.

For the collector-fault tests it can misbehave like a real collector: start late, stop and
restart on the same ports (`stop()` then `start()`), answer slowly (`delay_s`), or refuse every
export (`mode`: "refuse" is gRPC UNAVAILABLE / HTTP 503, "reject" is gRPC INVALID_ARGUMENT /
HTTP 400)."""

import collections
import gzip
import ssl
import sys
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

from harness import free_port
from span_ids import shared_span_ids, span_key

KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(key_values):
    return {kv.key: _value(kv.value) for kv in key_values}


@dataclass
class Tls:
    """PEM files: the receiver's certificate and key, and the CA that client certificates must
    chain to (set: mutual TLS, a client without a valid certificate is refused)."""

    cert: str
    key: str
    client_ca: str = None


class Received:
    def __init__(self):
        self.lock = threading.Lock()
        self.spans = []
        self.histogram_points = []
        # Sum and gauge data points, as dicts like the histogram ones with a "value".
        self.metric_points = []
        self.requests = 0
        # One entry per export request: {"transport", "path", "headers"} (header names lower-case).
        self.request_headers = []
        # Every export request as it was encoded (protobuf), for checks of anything in it, also
        # fields the dicts above leave out (span events, links, scopes, status messages).
        self.payloads = []

    def add_headers(self, transport, path, headers):
        with self.lock:
            self.request_headers.append(
                {"transport": transport, "path": path, "headers": {k.lower(): v for k, v in headers}}
            )

    def header_values(self, name):
        """The values of header `name` over every export request."""
        with self.lock:
            return [r["headers"][name] for r in self.request_headers if name in r["headers"]]

    def add_traces(self, request):
        with self.lock:
            self.requests += 1
            self.payloads.append(request.SerializeToString())
            for resource_spans in request.resource_spans:
                resource = _attributes(resource_spans.resource.attributes)
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        self.spans.append(
                            {
                                "name": span.name,
                                "kind": KINDS.get(span.kind, str(span.kind)),
                                "trace_id": span.trace_id.hex(),
                                "span_id": span.span_id.hex(),
                                "parent_span_id": span.parent_span_id.hex(),
                                "start_time_unix_nano": span.start_time_unix_nano,
                                "end_time_unix_nano": span.end_time_unix_nano,
                                "attributes": _attributes(span.attributes),
                                "resource": resource,
                                "status": STATUS.get(span.status.code, str(span.status.code)),
                            }
                        )

    def add_metrics(self, request):
        with self.lock:
            self.requests += 1
            self.payloads.append(request.SerializeToString())
            for resource_metrics in request.resource_metrics:
                resource = _attributes(resource_metrics.resource.attributes)
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        data = metric.WhichOneof("data")
                        if data in ("sum", "gauge"):
                            for point in getattr(metric, data).data_points:
                                self.metric_points.append(
                                    {
                                        "metric": metric.name,
                                        "unit": metric.unit,
                                        "type": data,
                                        "attributes": _attributes(point.attributes),
                                        "resource": resource,
                                        "value": getattr(point, point.WhichOneof("value")),
                                        "time_unix_nano": point.time_unix_nano,
                                    }
                                )
                        if data != "histogram":
                            continue
                        for point in metric.histogram.data_points:
                            self.histogram_points.append(
                                {
                                    "metric": metric.name,
                                    "unit": metric.unit,
                                    "attributes": _attributes(point.attributes),
                                    "resource": resource,
                                    "count": point.count,
                                    "sum": point.sum,
                                    "time_unix_nano": point.time_unix_nano,
                                }
                            )

    def latest_points(self, name):
        """Sum and gauge points of metric `name`: the newest per (resource instance, attributes)."""
        newest = {}
        with self.lock:
            for point in self.metric_points:
                if point["metric"] != name:
                    continue
                resource = point["resource"]
                instance = resource.get("service.instance.id", resource.get("process.pid"))
                key = (instance, tuple(sorted(point["attributes"].items())))
                if key not in newest or newest[key]["time_unix_nano"] <= point["time_unix_nano"]:
                    newest[key] = point
        return list(newest.values())

    def span_ids(self):
        """The distinct spans received, by span_key (trace id, span id)."""
        with self.lock:
            return {span_key(span) for span in self.spans}

    def span_deliveries(self):
        """How many times each span (by span_key) arrived (a retried batch the collector had
        taken arrives twice)."""
        with self.lock:
            return collections.Counter(span_key(span) for span in self.spans)

    def shared_span_ids(self):
        """span_ids.shared_span_ids over every span received (one delivered twice is one)."""
        with self.lock:
            return shared_span_ids(self.spans)

    def latest_histograms(self, name):
        """Cumulative points: keep the newest per (resource pid, attributes)."""
        newest = {}
        with self.lock:
            for point in self.histogram_points:
                if point["metric"] != name:
                    continue
                key = (point["resource"].get("process.pid"), tuple(sorted(point["attributes"].items())))
                if key not in newest or newest[key]["time_unix_nano"] <= point["time_unix_nano"]:
                    newest[key] = point
        return list(newest.values())


_GRPC_REFUSALS = {"refuse": grpc.StatusCode.UNAVAILABLE, "reject": grpc.StatusCode.INVALID_ARGUMENT}
_HTTP_REFUSALS = {"refuse": 503, "reject": 400}


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver):
        self.receiver = receiver

    def Export(self, request, context):
        mode = self.receiver.misbehave()
        if mode in _GRPC_REFUSALS:
            context.abort(_GRPC_REFUSALS[mode], f"test receiver: {mode}")
        self.receiver.received.add_headers("grpc", "TraceService/Export", context.invocation_metadata())
        self.receiver.received.add_traces(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver):
        self.receiver = receiver

    def Export(self, request, context):
        mode = self.receiver.misbehave()
        if mode in _GRPC_REFUSALS:
            context.abort(_GRPC_REFUSALS[mode], f"test receiver: {mode}")
        self.receiver.received.add_headers("grpc", "MetricsService/Export", context.invocation_metadata())
        self.receiver.received.add_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


def _read(path):
    with open(path, "rb") as f:
        return f.read()


class _HttpServer(ThreadingHTTPServer):
    """With `ssl_context`, TLS is negotiated in each connection's thread, so a client that fails
    the handshake does not hold up the others; failed handshakes are counted."""

    ssl_context = None

    def get_request(self):
        sock, address = super().get_request()
        if self.ssl_context is not None:
            sock = self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
        return sock, address

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # not a refused handshake or a hang-up
            super().handle_error(request, client_address)


class OtlpReceiver:
    """Listens on 127.0.0.1 for gRPC (`grpc_endpoint`) and HTTP (`http_endpoint`); with `tls`,
    over TLS (the endpoints are then https://). The ports are fixed when it is made, so it can
    start after the agent, and stop and start again on the same ports (what it received is kept).

    gRPC hides `grpc-encoding` from the handler, so a test sees that a client compresses by
    `grpc_gzip=False`: the gRPC server then refuses gzip-compressed requests (UNIMPLEMENTED)."""

    def __init__(self, tls=None, grpc_gzip=True):
        self.received = Received()
        self.tls, self.grpc_gzip = tls, grpc_gzip
        # "accept", "refuse" (retryable), "reject" (permanent) or "partial" (traces over HTTP:
        # taken, with a partial success rejecting one span of each request); read by every
        # export request.
        self.mode = "accept"
        # Seconds every export request waits before it is answered.
        self.delay_s = 0.0
        # Export requests refused or rejected, by mode.
        self.refusals = {"refuse": 0, "reject": 0}
        # Trace exports answered with a partial success.
        self.partial_answers = 0
        self.grpc_port, self.http_port = free_port(), free_port()
        scheme = "https" if tls else "http"
        self.grpc_endpoint = f"{scheme}://127.0.0.1:{self.grpc_port}"
        self.http_endpoint = f"{scheme}://127.0.0.1:{self.http_port}"
        self.tls_handshakes_failed = 0
        self.grpc_server = self.http_server = None

    def misbehave(self):
        """Applies the delay; returns the mode this request gets (refusals are counted)."""
        if self.delay_s:
            time.sleep(self.delay_s)
        mode = self.mode
        if mode in self.refusals:
            with self.received.lock:
                self.refusals[mode] += 1
        return mode

    def _grpc_server(self):
        tls = self.tls
        # Bits: identity 1, deflate 2, gzip 4.
        algorithms = 7 if self.grpc_gzip else 3
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=8),
            options=[("grpc.compression_enabled_algorithms_bitset", algorithms)],
        )
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(self), server)
        address = f"127.0.0.1:{self.grpc_port}"
        if tls:
            credentials = grpc.ssl_server_credentials(
                [(_read(tls.key), _read(tls.cert))],
                root_certificates=_read(tls.client_ca) if tls.client_ca else None,
                require_client_auth=tls.client_ca is not None,
            )
            server.add_secure_port(address, credentials)
        else:
            server.add_insecure_port(address)
        return server

    def _http_server(self):
        tls = self.tls
        received = self.received
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def setup(self):
                if isinstance(self.request, ssl.SSLSocket):
                    try:
                        self.request.do_handshake()
                    except (ssl.SSLError, OSError):
                        with received.lock:
                            receiver.tls_handshakes_failed += 1
                        raise
                super().setup()

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                mode = receiver.misbehave()
                if mode in _HTTP_REFUSALS:
                    self.send_response(_HTTP_REFUSALS[mode])
                    self.send_header("content-length", "0")
                    self.end_headers()
                    return
                if self.headers.get("content-encoding", "").lower() == "gzip":
                    body = gzip.decompress(body)
                received.add_headers("http", self.path, self.headers.items())
                if self.path == "/v1/traces":
                    request = trace_service_pb2.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    received.add_traces(request)
                    reply = trace_service_pb2.ExportTraceServiceResponse()
                    if mode == "partial":
                        with received.lock:
                            receiver.partial_answers += 1
                        reply.partial_success.rejected_spans = 1
                        reply.partial_success.error_message = "test receiver: one span too old"
                    reply = reply.SerializeToString()
                elif self.path == "/v1/metrics":
                    request = metrics_service_pb2.ExportMetricsServiceRequest()
                    request.ParseFromString(body)
                    received.add_metrics(request)
                    reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                else:
                    self.send_response(404)
                    self.end_headers()
                    return
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        server = _HttpServer(("127.0.0.1", self.http_port), Handler)
        server.daemon_threads = True
        if tls:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(tls.cert, tls.key)
            if tls.client_ca:
                context.verify_mode = ssl.CERT_REQUIRED
                context.load_verify_locations(tls.client_ca)
            server.ssl_context = context
        return server

    def start(self):
        self.grpc_server = self._grpc_server()
        self.grpc_server.start()
        self.http_server = self._http_server()
        threading.Thread(target=self.http_server.serve_forever, daemon=True).start()
        return self

    def assert_span_ids_unique(self):
        """The run-wide check on what it received, for a test's teardown: no two spans share a
        span id (the checkers key spans by id, and would merge them)."""
        shared = self.received.shared_span_ids()
        if shared:
            raise AssertionError(f"the OTLP receiver got {len(shared)} span ids on more than one span:\n"
                                 + "\n".join(shared[:20]))

    def stop(self):
        """Closes both listeners (clients see connection refused); `start()` opens them again."""
        if self.grpc_server is not None:
            self.grpc_server.stop(grace=None).wait()
            self.grpc_server = None
        if self.http_server is not None:
            self.http_server.shutdown()
            self.http_server.server_close()
            self.http_server = None
