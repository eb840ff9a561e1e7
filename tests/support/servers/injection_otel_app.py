"""An OpenTelemetry-instrumented FastAPI server (the gym-tracer does NOT trace it), for
tests/test_injection.py: the callee that should join the caller's trace through the
`traceparent` gym-tracer injects.

`POST /call/{n}/{i}` answers `{"ok": true}`. OpenTelemetry's FastAPI instrumentation makes a
SERVER span of it (W3C trace context: a `traceparent` header makes it a child of that span);
the handler adds `test.path` (its path) and `test.traceparent` (every traceparent header
it received, joined by ", ") to that span. Spans go over OTLP/HTTP, one export per span
(SimpleSpanProcessor), to `INJECTION_OTLP_TRACES` (a full /v1/traces URL)."""

import os

from fastapi import FastAPI, Request
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

SERVICE_NAME = "injection-otel-callee"

provider = TracerProvider(resource=Resource.create({"service.name": SERVICE_NAME, "process.pid": os.getpid()}))
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=os.environ["INJECTION_OTLP_TRACES"])))
trace.set_tracer_provider(provider)

app = FastAPI()


@app.post("/call/{n}/{i}")
async def call(n: int, i: int, request: Request):
    span = trace.get_current_span()
    span.set_attribute("test.path", f"/call/{n}/{i}")
    span.set_attribute("test.traceparent", ", ".join(request.headers.getlist("traceparent")))
    await request.body()
    return {"ok": True}


FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, exclude_spans=["receive", "send"])
