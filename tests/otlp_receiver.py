"""A real OTLP receiver for the tests: gRPC (TraceService, MetricsService) and HTTP/protobuf
(/v1/traces, /v1/metrics) on loopback. Received data is flattened into plain dicts."""

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

KINDS = {1: "INTERNAL", 2: "SERVER", 3: "CLIENT", 4: "PRODUCER", 5: "CONSUMER"}
STATUS = {0: "UNSET", 1: "OK", 2: "ERROR"}


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


def _attributes(key_values):
    return {kv.key: _value(kv.value) for kv in key_values}


class Received:
    def __init__(self):
        self.lock = threading.Lock()
        self.spans = []
        self.histogram_points = []
        self.requests = 0

    def add_traces(self, request):
        with self.lock:
            self.requests += 1
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
            for resource_metrics in request.resource_metrics:
                resource = _attributes(resource_metrics.resource.attributes)
                for scope_metrics in resource_metrics.scope_metrics:
                    for metric in scope_metrics.metrics:
                        if metric.WhichOneof("data") != "histogram":
                            continue
                        for point in metric.histogram.data_points:
                            self.histogram_points.append(
                                {
                                    "metric": metric.name,
                                    "unit": metric.unit,
                                    "attributes": _attributes(point.attributes),
                                    "resource": resource,
                                    "count": point.count,
                                    "time_unix_nano": point.time_unix_nano,
                                }
                            )

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


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, received):
        self.received = received

    def Export(self, request, context):
        self.received.add_traces(request)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, received):
        self.received = received

    def Export(self, request, context):
        self.received.add_metrics(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class OtlpReceiver:
    """Listens on 127.0.0.1 for gRPC (`grpc_endpoint`) and HTTP (`http_endpoint`)."""

    def __init__(self):
        self.received = Received()
        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self.received), self.grpc_server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(_MetricsService(self.received), self.grpc_server)
        grpc_port = self.grpc_server.add_insecure_port("127.0.0.1:0")
        self.grpc_endpoint = f"http://127.0.0.1:{grpc_port}"

        received = self.received

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                if self.path == "/v1/traces":
                    request = trace_service_pb2.ExportTraceServiceRequest()
                    request.ParseFromString(body)
                    received.add_traces(request)
                    reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
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

        self.http_server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.http_endpoint = f"http://127.0.0.1:{self.http_server.server_port}"
        self._http_thread = threading.Thread(target=self.http_server.serve_forever, daemon=True)

    def start(self):
        self.grpc_server.start()
        self._http_thread.start()
        return self

    def stop(self):
        self.grpc_server.stop(grace=None)
        self.http_server.shutdown()
