"""Model calls over HTTPS, and what they cost in tokens.

The real nemo-gym servers of test_real_gym.py, with `openai_model` calling its canned OpenAI
upstream over TLS (tests/support/real_gym/launch.py, `upstream_tls=True`: a self-signed
certificate the servers trust through SSL_CERT_FILE). Gym's aiohttp speaks TLS through
CPython's `_ssl` and a memory BIO (uvloop's SSL protocol): on the socket there is only
ciphertext, and the plaintext exists only at libssl's SSL_write_ex / SSL_read_ex. That is where
gym-tracer must read it for the upstream call to be a span at all. Checked, traced with
`--discover gym` as test_real_gym.py does, over one rollout alone and then 8 at once:

- every rollout is still exactly EXPECTED_TREE, its model server's upstream call (an
  `HTTP POST` CLIENT span under gym.model.responses) included, with `url.scheme` https and
  `url.full` https://127.0.0.1:PORT/v1/responses;
- each upstream call carries the OpenTelemetry GenAI attributes: `gen_ai.operation.name`
  chat, `gen_ai.request.model` (what the request body asked for), `gen_ai.response.model`,
  `gen_ai.usage.input_tokens` / `output_tokens`. The oracle is the upstream's own log: its
  usage differs per call, so the (input, output) pairs over the spans must be the logged ones,
  and the `gen_ai.client.token.usage` and `gen_ai.client.operation.duration` metrics must add
  up to them;
- the plaintext carries the API key and the prompts: the key, the word "Bearer" and a canary
  in every prompt are nowhere in what the tracer exported (as JSON lines, or over OTLP) or
  logged.

And a streamed answer (server-sent events, the usage only in the last event, after a few
TLS records of deltas) is read the same: a client attached by `--pid` makes K streamed calls
to each API of the upstream.

Where `model` is: openai_model sets `body["model"]` last and Gym serializes with orjson
(compact, in insertion order), so in Gym's upstream requests it is the body's last key, in
its last 512 bytes (which the tracer reads of every request body) however long the prompt;
the test checks that in the upstream's log and then wants `gen_ai.request.model` on every
call. The streaming client puts it first, as OpenAI's SDKs do.

Needs target/gym-venv for the first test, as test_real_gym.py (skipped only when setup was
told to leave it out), and the `openssl` command for the certificate.
"""

import collections
import difflib
import json
import os
import secrets
import subprocess
import sys

import pytest

from harness import SUPPORT_DIR, wait_until
from real_gym.canned_upstream import MODEL as RESPONSE_MODEL
from real_gym.canned_upstream import STREAM_EVENT_GAP_S
from real_gym.launch import API_KEY, MODEL, PADDING, CannedUpstream, RealGymRun
from test_real_gym import (EXPECTED_TREE, NEVER_EXPORTED, SPANS_PER_ROLLOUT, attached_tracer, canonical,
                           drive_at_once, expected_requests, gym_venv, harvest, render_shapes, rollout_trace_id,
                           tree_shape, wait_for_requests)

SOLO = (5, 0)  # driven alone first, its body not padded: (task index, rollout index)
AT_ONCE = [(task, 1) for task in range(8)]  # then these together, each body ~11 KB
EXAMPLE_ROWS = 5  # rows in example_single_tool_call's example.jsonl; task i uses row i % 5
BODY_BYTES = 11_000
TAIL_BYTES = 512  # the tracer reads the last 512 bytes of every request body (docs/how-it-works.md)
# In every prompt the model server sends upstream; new each run, so no earlier output has it.
CANARY = f"prompt-canary-{secrets.token_hex(8)}"
# The Authorization header's scheme: no part of the header may be exported.
SECRETS = [API_KEY, "Bearer", CANARY, *NEVER_EXPORTED]
REQUEST_MODEL = "canned-model"  # openai_model's `openai_model` in launch.run_config
STREAM_CLIENT = SUPPORT_DIR / "real_gym" / "stream_client.py"
STREAM_CALLS = 3  # K streamed calls to each API
STREAM_MODEL = "gpt-canned-streaming"  # what the streaming client asks for (the answer says canned-model)
TOKEN_UNIT, DURATION_UNIT = "{token}", "s"  # the GenAI semantic conventions' units


# ---- what the tracer exported ----

class Exported:
    """What the tracer exported: JSON lines on its stdout, or (with an OTLP `receiver`) what
    that receiver got."""

    def __init__(self, agent, receiver=None):
        self.agent, self.receiver = agent, receiver
        self.otlp = receiver is not None

    def spans(self):
        if self.otlp:
            with self.receiver.received.lock:
                return list(self.receiver.received.spans)
        return self.agent.spans()

    def histograms(self, name, pids):
        """The points of histogram `name` from the processes `pids`: the newest per (process,
        attributes), so cumulative exports are counted once."""
        if self.otlp:
            with self.receiver.received.lock:
                points = [p for p in self.receiver.received.histogram_points if p["metric"] == name]
        else:
            points = self.agent.metric_points(name)
        newest = {}
        for point in points:
            pid = point["resource"].get("process.pid")
            if pid not in pids:
                continue
            key = (pid, tuple(sorted(point["attributes"].items())))
            if key not in newest or newest[key]["time_unix_nano"] <= point["time_unix_nano"]:
                newest[key] = point
        return list(newest.values())

    def assert_never_exported(self, texts):
        """None of `texts` in the tracer's stdout, its log, or any OTLP export request."""
        stdout, stderr = self.agent.stdout_text(), self.agent.stderr()
        payloads = b""
        if self.otlp:
            with self.receiver.received.lock:
                payloads = b"\0".join(self.receiver.received.payloads)
        for text in texts:
            assert text not in stdout, f"{text!r} exported"
            assert text not in stderr, f"{text!r} logged"
            assert text.encode() not in payloads, f"{text!r} exported over OTLP"


def otlp_env(receiver):
    return {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.http_endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}


def of_pids(spans, pids):
    return [s for s in spans if s["resource"].get("process.pid") in pids]


def usage_of(span):
    """(input tokens, output tokens) as the span says."""
    a = span["attributes"]
    return a.get("gen_ai.usage.input_tokens"), a.get("gen_ai.usage.output_tokens")


def logged_usage(call):
    return call["usage"]["input"], call["usage"]["output"]


def assert_genai_span(span, url, request_model):
    """An OpenAI-API call over HTTPS as a CLIENT span: its URL, a 200, the GenAI attributes."""
    a = span["attributes"]
    assert (span["kind"], span["name"]) == ("CLIENT", "HTTP POST"), span
    assert a.get("url.scheme") == "https", span
    assert a.get("url.full") == url, span
    assert a.get("http.response.status_code") == 200, span
    assert a.get("gen_ai.operation.name") == "chat", span
    assert a.get("gen_ai.request.model") == request_model, span
    assert a.get("gen_ai.response.model") == RESPONSE_MODEL, span
    tokens = usage_of(span)
    assert all(type(n) is int for n in tokens), json.dumps(a)


def assert_genai_metrics(exported, pids, calls):
    """gen_ai.client.token.usage (a point per token type) and gen_ai.client.operation.duration
    from `pids`: one measurement per call, the token sums those of the upstream's log."""
    tokens = collections.defaultdict(lambda: [0, 0])
    for point in exported.histograms("gen_ai.client.token.usage", pids):
        assert point["unit"] == TOKEN_UNIT, point
        assert point["attributes"].get("gen_ai.operation.name") == "chat", point
        count_sum = tokens[point["attributes"].get("gen_ai.token.type")]
        count_sum[0] += point["count"]
        count_sum[1] += point["sum"]
    assert dict(tokens) == {
        "input": [len(calls), sum(c["usage"]["input"] for c in calls)],
        "output": [len(calls), sum(c["usage"]["output"] for c in calls)],
    }
    durations = exported.histograms("gen_ai.client.operation.duration", pids)
    assert all(point["unit"] == DURATION_UNIT for point in durations), durations
    assert sum(point["count"] for point in durations) == len(calls), durations


def tree_problems(spans, rollout_ids, by_pid):
    """How `spans` differ from one EXPECTED_TREE per rollout, each in its rollout's trace and
    nothing else: a list of findings, empty when they do not."""
    by_trace = collections.defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    want = [canonical(EXPECTED_TREE)]
    problems = []
    for rollout_id in sorted(rollout_ids):
        members = by_trace.pop(rollout_trace_id(rollout_id), [])
        shapes = tree_shape(members, by_pid)
        if shapes != want:
            diff = difflib.unified_diff(render_shapes(want), render_shapes(shapes), "expected",
                                        f"rollout {rollout_id}", lineterm="", n=2)
            problems.append(f"rollout {rollout_id}: {len(members)} spans, {len(shapes)} roots, not the expected "
                            "tree:\n" + "\n".join("    " + line for line in diff))
    for trace_id, members in by_trace.items():
        problems.append(f"trace {trace_id} is no rollout's ({len(members)} spans):\n" + "\n".join(
            "    " + line for line in render_shapes(tree_shape(members, by_pid))))
    return problems


# ---- the real Gym servers, their model calling upstream over HTTPS ----

@pytest.fixture
def https_gym():
    """Starts real Gym runs whose model server calls the canned upstream over HTTPS."""
    venv = gym_venv()
    runs = []

    def start(**kwargs):
        run = RealGymRun(venv, access_log=True, upstream_tls=True, **kwargs)
        runs.append(run)
        return run.start()

    yield start
    for run in runs:
        run.stop()


@pytest.mark.parametrize("export", ["json", "otlp"])
def test_https_upstream_rollouts_keep_their_tree(https_gym, tracer, receiver, export):
    """One rollout alone, then 8 at once (bodies ~11 KB), through the real servers with the
    model's upstream on HTTPS: every rollout is one trace with exactly EXPECTED_TREE, its two
    upstream calls https CLIENT spans with the GenAI attributes and the logged usage, the
    GenAI metrics add up to the log, and no key, "Bearer" or prompt canary is exported."""
    run = https_gym()
    pids = run.pids
    by_pid = {pid: name for name, pid in pids.items()}
    model_pid = pids[MODEL]
    otlp = export == "otlp"
    agent = attached_tracer(lambda: tracer(env=otlp_env(receiver) if otlp else None), pids)
    exported = Exported(agent, receiver if otlp else None)
    upstream_url = f"https://127.0.0.1:{run.upstream_port}/v1/responses"

    def body_options(task):
        return {"row_index": task % EXAMPLE_ROWS, "prompt_suffix": f" ({CANARY})", "pad_to": BODY_BYTES}

    rollouts = [SOLO, *AT_ONCE]
    rollout_ids = {f"{task}-{rollout}" for task, rollout in rollouts}
    assert len(rollout_ids) == len(rollouts)
    calls_before = len(run.upstream_requests())
    before = {name: len(entries) for name, entries in run.access_log_paths().items()}
    results = {SOLO: run.drive_rollout(*SOLO, row_index=SOLO[0] % EXAMPLE_ROWS, prompt_suffix=f" ({CANARY})")}
    results.update(drive_at_once(run, AT_ONCE, body_options))
    assert {key: result["reward"] for key, result in results.items()} == {key: 1.0 for key in rollouts}, results

    # The upstream's log: every call after the tracer attached, authorized, not streamed, with
    # `model` in the body's tail (openai_model sets it last), and its own usage.
    calls = run.upstream_requests()[calls_before:]
    assert collections.Counter((c["method"], c["path"], c["auth_ok"], c["stream"], c["model"]) for c in calls) == \
        {("POST", "/v1/responses", True, False, REQUEST_MODEL): 2 * len(rollouts)}, calls
    for call in calls:
        assert call["body_bytes"] - call["model_offset"] <= TAIL_BYTES, call
    assert sum(call["body_bytes"] > BODY_BYTES // 2 for call in calls) == 2 * len(AT_ONCE)  # the padded prompts
    assert len({logged_usage(call) for call in calls}) == len(calls)

    expected_paths = collections.Counter(
        request for rollout_id in rollout_ids for request in expected_requests(rollout_id, False))
    served = wait_for_requests(run, before, sum(expected_paths.values()), timeout=30)
    assert collections.Counter(served) == expected_paths, run.access_log_paths()

    def ours():
        return [s for s in of_pids(exported.spans(), by_pid)
                if not harvest(s["attributes"].get("http.request.method"), s["attributes"].get("url.path"))]

    def upstream_spans(spans):
        return [s for s in spans if s["kind"] == "CLIENT" and s["resource"]["process.pid"] == model_pid]

    # The SERVER spans, then (softly: a missing span is the assertions' to report) all of them.
    wait_until(lambda: sum(s["kind"] == "SERVER" for s in ours()) >= len(served), 20, f"{len(served)} SERVER spans")
    try:
        wait_until(lambda: len(ours()) >= SPANS_PER_ROLLOUT * len(rollouts)
                   and len(upstream_spans(ours())) >= len(calls), 10, "every span")
    except AssertionError:
        pass
    agent.stop()
    assert agent.returncode == 0, agent.stderr()
    if otlp:
        assert agent.stdout_text() == "", "with an OTLP endpoint nothing goes to stdout"
    spans = ours()

    # Every TLS record found its connection, tied by the length of the records its writes made
    # (Gym's aiohttp on uvloop encrypts into a memory BIO: no socket call inside SSL_write).
    tls = {name: value for name, value in agent.summary().items() if name.startswith("tls_")}
    print(f"TLS counters: {tls}")
    assert tls["tls_records_unmatched"] == 0 and tls["tls_sessions_by_syscall"] == 0, tls
    # The uprobes are attached per traced process (the default --tls-probe-scope): each of the
    # three servers maps the same libssl.so.3.
    assert tls["tls_sessions_by_record_length"] >= 1 and tls["tls_libraries_probed"] == len(pids), tls
    assert tls["tls_records"] >= 2 * len(calls), tls  # at least a write and a read per call

    # The upstream calls: https, the URL without a query, the GenAI attributes, the log's usage.
    upstream = upstream_spans(spans)
    assert len(upstream) == len(calls), [(s["name"], s["attributes"]) for s in upstream]
    for span in upstream:
        assert_genai_span(span, upstream_url, REQUEST_MODEL)
        assert span["attributes"].get("server.address") == "127.0.0.1", span
        assert span["attributes"].get("server.port") == run.upstream_port, span
    assert collections.Counter(map(usage_of, upstream)) == collections.Counter(map(logged_usage, calls))
    # The agent's calls to the model and resources servers stay plain http.
    for span in spans:
        if span["kind"] == "CLIENT" and span not in upstream:
            assert span["attributes"].get("url.scheme") == "http", span
            assert span["attributes"].get("url.full", "").startswith("http://127.0.0.1:"), span

    # Every rollout is one trace of exactly EXPECTED_TREE, the upstream call under
    # gym.model.responses as over plain HTTP.
    problems = tree_problems(spans, rollout_ids, by_pid)
    assert not problems, "\n".join(problems[:40]) + "\n\nexpected tree:\n" + "\n".join(
        render_shapes([canonical(EXPECTED_TREE)])) + f"\nsummary: {agent.summary()}"

    # Metrics: one token-usage and one duration measurement per upstream call, the log's sums.
    assert_genai_metrics(exported, {model_pid}, calls)

    prompts = {run.example_row(row)["responses_create_params"]["input"][-1]["content"] for row in range(EXAMPLE_ROWS)}
    exported.assert_never_exported([*SECRETS, *sorted(prompts), PADDING.strip()])


# ---- a streaming client ----

def _clean_env(**extra):
    return dict({k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM_"))}, **extra)


def test_streamed_response_usage_is_read(agents, tmp_path):
    """K streamed calls to /v1/responses, then K to /v1/chat/completions, from an aiohttp
    client attached by `--pid`, to the canned upstream on HTTPS: 2K https CLIENT spans, each a
    200 with the GenAI attributes and exactly its call's usage, which the upstream sent only in
    the stream's last event (`response.completed`; the `"choices": []` chunk before
    `data: [DONE]`)."""
    upstream = CannedUpstream(tmp_path, tls=True).start()
    client = subprocess.Popen(
        [sys.executable, str(STREAM_CLIENT), "--base-url", f"{upstream.base_url}/v1", "--model", STREAM_MODEL,
         "--calls", str(STREAM_CALLS)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp_path / "client.err", "wb"), text=True,
        env=_clean_env(SSL_CERT_FILE=str(upstream.cert)),
    )
    try:
        assert client.stdout.readline().strip() == "ready", (tmp_path / "client.err").read_text()
        agent = agents([client.pid])
        orders = {"api_key": API_KEY, "prompt": f"What is the weather in San Francisco? ({CANARY})"}
        client.stdin.write(json.dumps(orders) + "\n")
        client.stdin.flush()
        lines = []
        while (line := client.stdout.readline().strip()) not in ("done", ""):
            lines.append(json.loads(line))
        assert line == "done", (tmp_path / "client.err").read_text()

        # The upstream's log, in order, and what the client read of each stream.
        calls = upstream.requests()
        paths = ["/v1/responses"] * STREAM_CALLS + ["/v1/chat/completions"] * STREAM_CALLS
        assert [(c["method"], c["path"], c["auth_ok"], c["stream"], c["model"]) for c in calls] == \
            [("POST", path, True, True, STREAM_MODEL) for path in paths], calls
        assert [(r["path"], r["status"], r["usage"], r["model"]) for r in lines] == \
            [(c["path"], 200, c["usage"], RESPONSE_MODEL) for c in calls], lines
        assert all(r["content_type"].startswith("text/event-stream") and r["events"] > 2 for r in lines), lines

        def client_spans():
            return [s for s in of_pids(agent.spans(), {client.pid}) if s["kind"] == "CLIENT"]

        try:
            wait_until(lambda: len(client_spans()) >= len(calls), 15, f"{len(calls)} CLIENT spans")
        except AssertionError:
            pass  # the assertions below say what is missing
        agent.stop()
        assert agent.returncode == 0, agent.stderr()
    finally:
        client.stdin.close()
        try:
            client.wait(10)
        except subprocess.TimeoutExpired:
            client.kill()
            client.wait()
        upstream.stop()

    # One span per call, in the order made (one connection, one call at a time).
    spans = sorted(client_spans(), key=lambda s: s["start_time_unix_nano"])
    assert len(spans) == len(calls), [(s["name"], s["attributes"]) for s in spans]
    for span, call, read in zip(spans, calls, lines):
        assert_genai_span(span, f"{upstream.base_url}{call['path']}", STREAM_MODEL)
        assert usage_of(span) == logged_usage(call), (span, call)
        # The time to the first event, in both keys: the upstream slept before writing it (and
        # before each event after it), and the client read it after the span's request left.
        first_event = span["attributes"]["gym_tracer.response.time_to_first_event"]
        assert span["attributes"]["gen_ai.response.time_to_first_chunk"] == first_event
        assert STREAM_EVENT_GAP_S <= first_event <= read["first_event_s"], (span, read)
        duration_s = (span["end_time_unix_nano"] - span["start_time_unix_nano"]) / 1e9
        assert read["events"] * STREAM_EVENT_GAP_S <= duration_s <= read["elapsed_s"], (span, read)
    assert all(s["kind"] == "CLIENT" for s in of_pids(agent.spans(), {client.pid}))
    exported = Exported(agent)
    assert_genai_metrics(exported, {client.pid}, calls)
    exported.assert_never_exported([*SECRETS, "It is cold in", "San Francisco?"])


def test_tls_the_probes_cannot_see_is_said_once_and_followed_by_its_syscalls(agents, tmp_path):
    """wget encrypts with GnuTLS, which the uprobes do not cover: a client attached by `--pid`
    (a shell that execs wget once the agent is ready, so the agent follows the exec) that
    fetches twice over HTTPS. The agent says once that it cannot read that TLS (a log line
    naming GnuTLS, `tls_processes_unprobed` 1), exports no HTTP span for it, and exports each
    connection as one `TLS` CLIENT span: the upstream's address, connect to close, the bytes of
    records each way."""
    upstream = CannedUpstream(tmp_path, tls=True).start()
    go = tmp_path / "go"
    url = f"{upstream.base_url}/v1/models"
    # Two separate wget runs in one process would be two execs; one wget with two URLs keeps
    # one process and (no keep-alive across hosts' paths is guaranteed) one or two
    # connections: counted from the upstream's side below.
    script = (f"while [ ! -e {go} ]; do sleep 0.02; done; exec wget -q -O /dev/null "
              f"--ca-certificate={upstream.cert} --no-http-keep-alive {url} {url}")
    client = subprocess.Popen(["sh", "-c", script], stderr=open(tmp_path / "wget.err", "wb"))
    try:
        agent = agents([client.pid])
        go.touch()
        assert client.wait(30) == 0, (tmp_path / "wget.err").read_text()
        wait_until(lambda: len([s for s in agent.spans() if s["name"] == "TLS"]) >= 2, 15, "two TLS spans")
        agent.stop()
        assert agent.returncode == 0, agent.stderr()
        calls = upstream.requests()
    finally:
        if client.poll() is None:
            client.kill()
        upstream.stop()

    assert [(c["method"], c["path"]) for c in calls] == [("GET", "/v1/models")] * 2, calls
    spans = of_pids(agent.spans(), {client.pid})
    assert [s["name"] for s in spans] == ["TLS", "TLS"], [(s["name"], s["attributes"]) for s in spans]
    for span in spans:
        a = span["attributes"]
        assert span["kind"] == "CLIENT" and span["parent_span_id"] == "", span
        assert (a["server.address"], a["server.port"], a["tls.protocol.name"]) == \
            ("127.0.0.1", upstream.port, "tls"), span
        # A TLS 1.3 handshake alone is more than 500 bytes each way.
        assert a["gym_tracer.connection.bytes_sent"] > 500 and a["gym_tracer.connection.bytes_received"] > 500, span
        assert span["end_time_unix_nano"] > span["start_time_unix_nano"], span
    summary = agent.summary()
    assert (summary["tls_processes_unprobed"], summary["tls_connections_unread"], summary["tls_records"]) == \
        (1, 2, 0), summary
    said = [m for m in agent.log_messages() if "opened a TLS connection" in m]
    assert len(said) == 1 and "libgnutls" in said[0], said
