"""What every Gym-shaped test server shares: reading its own entry from the run config the
launcher puts in the environment (as `ng_run` does), and serving under uvicorn (uvloop +
httptools) from `python <server>.py`.

Opt-in in-process OpenTelemetry mode (the REFERENCE the tracer is compared with): with
`GYM_TEST_INPROCESS_OTEL=<OTLP/HTTP endpoint>` in its environment a server traces itself the
way NeMo Gym 0.7.0 does with its telemetry on (nemo_gym/telemetry/*, server_utils.py), and
exports the spans over OTLP/HTTP to `<endpoint>/v1/traces`:
- OpenTelemetry's FastAPI instrumentation (ASGI `receive`/`send` spans excluded), applied as
  Gym applies it: after the rollout-prefix middleware was added with `add_middleware`, so the
  instrumentor sits OUTSIDE it and sees the prefixed path (a prefixed call's SERVER span is
  named just `POST`, without `http.route`: Gym's observed quirk, kept on purpose);
- the gym.* INTERNAL spans of Gym's `traced_endpoint` (`traced` below), with
  `nemo.gym.server.name` and `nemo.gym.rollout.id` read from Gym's rollout ContextVar at span
  start (`ROLLOUT_ID`: set by the prefix middlewares and, on the agent's /run, from the body);
- CLIENT spans per `GYM_TEST_INPROCESS_OTEL_CLIENT`: `gym` (default) = Gym's own
  `_traced_request` (span `HTTP POST`, `url.full` without query, `nemo.gym.rollout.id`,
  `http.response.status_code`, `traceparent` injected by hand; the span ends before the caller's
  raise_for_status); `aiohttp` = OpenTelemetry's aiohttp-client instrumentation instead
  (nemo-lens's `instrument_aiohttp_client`: span named `POST`, its own attributes);
- W3C trace context; `service.name` = `<OTEL_SERVICE_NAME or nemo>/<server name>`, resource
  `nemo.gym.server.name`, `nemo.gym.server.type`, `nemo.gym.service_group`.
Without the variable nothing here changes a server's behaviour: `traced` returns the handler
itself and `client_span` does nothing."""

import os
import re
from contextlib import contextmanager
from contextvars import ContextVar
from functools import wraps

import uvicorn
import yaml
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

# Credentials a real Gym server sends and receives (an API key, a bearer token, a session
# cookie), as a canary the tracer must never export: every server sends them on its outbound
# calls and sets the cookie on every response; the tests send them inbound.
CANARY = "canary-5f1d7c-secret-never-export"
SECRET_HEADERS = {"Authorization": f"Bearer {CANARY}", "x-api-key": CANARY, "Cookie": f"session={CANARY}"}
SET_COOKIE = f"session={CANARY}; Path=/; HttpOnly"

# Gym's rollout id (nemo_gym/rollout_correlation.py).
ROLLOUT_ID_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
# Gym's current_rollout_id() (nemo_gym/rollout_correlation.py `_ROLLOUT_ID`).
ROLLOUT_ID = ContextVar("nemo_gym_rollout_id", default=None)


class RolloutPrefixMiddleware:
    """Pure ASGI, as Gym's: strips the `/ng-rollout/<id>` prefix that `PREFIX` matches and
    publishes the id to the handler through `ROLLOUT_ID`. Subclasses set `PREFIX` (Gym's
    resources and model servers match the id differently)."""

    PREFIX: re.Pattern

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        match = self.PREFIX.match(scope.get("path", "")) if scope["type"] == "http" else None
        if match is None:
            return await self.app(scope, receive, send)
        path = match.group("rest")
        token = ROLLOUT_ID.set(match.group("rollout_id"))
        try:
            await self.app({**scope, "path": path, "raw_path": path.encode()}, receive, send)
        finally:
            ROLLOUT_ID.reset(token)

INPROCESS_OTEL_ENV = "GYM_TEST_INPROCESS_OTEL"
INPROCESS_OTEL_CLIENT_ENV = "GYM_TEST_INPROCESS_OTEL_CLIENT"
CLIENT_MODES = ("gym", "aiohttp")


def inprocess_otel_endpoint():
    """The OTLP/HTTP endpoint of the in-process OpenTelemetry mode, or None (the default: off)."""
    return os.environ.get(INPROCESS_OTEL_ENV) or None


def inprocess_otel_client_mode():
    mode = os.environ.get(INPROCESS_OTEL_CLIENT_ENV) or "gym"
    if mode not in CLIENT_MODES:
        raise ValueError(f"{INPROCESS_OTEL_CLIENT_ENV} must be one of {CLIENT_MODES}, not {mode!r}")
    return mode


def run_config():
    return yaml.safe_load(os.environ["NEMO_GYM_CONFIG_DICT"])


def server_entry(config, name):
    """`name: {<server type>: {<impl name>: {...}}}` -> (server type, that innermost dict)."""
    [(server_type, impls)] = config[name].items()
    [(_, entry)] = impls.items()
    return server_type, entry


def own_entry():
    return server_entry(run_config(), os.environ["NEMO_GYM_CONFIG_PATH"])[1]


def base_url(name):
    entry = server_entry(run_config(), name)[1]
    return f"http://{entry['host']}:{entry['port']}"


def new_app():
    app = FastAPI()  # keeps FastAPI's /openapi.json: the tracer harvests routes from it

    @app.middleware("http")
    async def exception_handling_middleware(request: Request, call_next):
        """Gym's: an exception becomes a JSON 500 and the connection stays open. Every
        response sets the canary session cookie."""
        try:
            response = await call_next(request)
        except Exception as error:  # noqa: BLE001
            response = JSONResponse(content=repr(error), status_code=500)
        response.headers["set-cookie"] = SET_COOKIE
        return response

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    return app


def serve(app):
    entry = own_entry()
    if inprocess_otel_endpoint():
        app = _instrument(app)
    uvicorn.run(app, host=entry["host"], port=entry["port"], loop="uvloop", http="httptools",
                access_log=False, log_level="warning")


# ---- the in-process OpenTelemetry mode (only with GYM_TEST_INPROCESS_OTEL) ----

def _tracer():
    from opentelemetry import trace
    return trace.get_tracer("nemo.gym")


def traced(group, span_name, rollout_id_from_body=None):
    """Gym's `traced_endpoint(group, span_name, handler, {"nemo.gym.server.name": ...})` as a
    decorator (put it under `@app.post`). Off: the handler itself. `rollout_id_from_body`: the
    agent's /run, where Gym sets the rollout ContextVar from the parsed body OUTSIDE the span
    (`run_with_rollout_context`), so a malformed id fails before any gym.rollout span."""
    def decorate(handler):
        if not inprocess_otel_endpoint():
            return handler

        @wraps(handler)
        async def in_span(*args, **kwargs):
            from opentelemetry import context
            from opentelemetry.trace import StatusCode, set_span_in_context
            # nemo.lens.helpers.managed_span: start_span (INTERNAL), attach, record, end.
            span = _tracer().start_span(span_name)
            attributes = {"nemo.gym.server.name": os.environ["NEMO_GYM_CONFIG_PATH"]}
            if ROLLOUT_ID.get():
                attributes["nemo.gym.rollout.id"] = ROLLOUT_ID.get()
            span.set_attributes(attributes)
            token = context.attach(set_span_in_context(span))
            try:
                return await handler(*args, **kwargs)
            except Exception as error:
                span.record_exception(error)
                span.set_status(StatusCode.ERROR, str(error))
                raise
            finally:
                context.detach(token)
                span.end()

        if rollout_id_from_body is None:
            return in_span

        @wraps(handler)
        async def with_rollout_context(*args, **kwargs):
            request = kwargs.get("request") or next(a for a in args if isinstance(a, Request))
            token = ROLLOUT_ID.set(rollout_id_from_body(await request.json()))  # cached for the handler
            try:
                return await in_span(*args, **kwargs)
            finally:
                ROLLOUT_ID.reset(token)

        return with_rollout_context

    return decorate


class _NoCall:
    headers = None

    def status(self, code):
        pass


class _GymCall:
    def __init__(self, span, headers):
        self.span, self.headers = span, headers

    def status(self, code):
        self.span.set_attribute("http.response.status_code", code)


@contextmanager
def client_span(method, url):
    """Gym's `_traced_request` around one outbound call: yields `.headers` to send (None when
    off) and `.status(code)` to record the response status. Only in the `gym` client mode."""
    if not inprocess_otel_endpoint() or inprocess_otel_client_mode() != "gym":
        yield _NoCall()
        return
    from opentelemetry import context, propagate
    from opentelemetry.trace import SpanKind, StatusCode, set_span_in_context
    # nemo_gym/telemetry/spans.py client_span + server_utils._traced_request.
    span = _tracer().start_span(f"HTTP {method.upper()}", kind=SpanKind.CLIENT)
    token = context.attach(set_span_in_context(span))
    try:
        headers = {}
        propagate.inject(headers)  # inside the span: the callee's SERVER span is its child
        attributes = {"http.request.method": method.upper(), "url.full": url.split("?", 1)[0]}
        if ROLLOUT_ID.get():
            attributes["nemo.gym.rollout.id"] = ROLLOUT_ID.get()
        span.set_attributes(attributes)
        yield _GymCall(span, headers)
    except Exception as error:
        span.record_exception(error)
        span.set_status(StatusCode.ERROR, str(error))
        raise
    finally:
        context.detach(token)
        span.end()


def _instrument(app):
    """Sets up tracing for this process and instruments `app` as Gym does; returns the app to serve."""
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.instrumentation.fastapi import FastAPIInstrumentor
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    name = os.environ["NEMO_GYM_CONFIG_PATH"]
    server_type = server_entry(run_config(), name)[0]
    group = os.environ.get("OTEL_SERVICE_NAME") or "nemo"
    provider = TracerProvider(resource=Resource.create({
        "service.name": f"{group}/{name}", "nemo.gym.server.name": name, "nemo.gym.server.type": server_type,
        "nemo.gym.service_group": group,
        "process.pid": os.getpid()}))  # the pid is the test's own addition: spans -> processes
    endpoint = inprocess_otel_endpoint().rstrip("/")
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{endpoint}/v1/traces"),
                                                   schedule_delay_millis=100))
    trace.set_tracer_provider(provider)  # flushed at exit (shutdown_on_exit)
    if inprocess_otel_client_mode() == "aiohttp":
        from opentelemetry.instrumentation.aiohttp_client import AioHttpClientInstrumentor
        AioHttpClientInstrumentor().instrument(tracer_provider=provider)

    # A pure-ASGI wrapper (the prefix-stripping middleware) becomes an `add_middleware` of the
    # FastAPI app, as Gym adds its RolloutContextMiddleware / _CaptureMiddleware; the
    # instrumentor then wraps the whole middleware stack, outside them.
    wrappers = []
    while not isinstance(app, FastAPI):
        wrappers.append(type(app))
        app = app.app
    for wrapper in reversed(wrappers):
        app.add_middleware(wrapper)
    FastAPIInstrumentor.instrument_app(app, tracer_provider=provider, exclude_spans=["receive", "send"])
    return app
