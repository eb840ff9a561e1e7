"""Issues #16 and #47: a rollout in a real trace UI, across two hosts. The real nemo-gym
servers (Gym's default: telemetry and observability off), the model server on host B (a
network namespace joined by a veth pair, tests/support/netns.py), the agent and the resources
server on host A; one gym-tracer per host, by --pid, host A's with `--inject-traceparent
remote`; both export over OTLP to one real Arize Phoenix (tests/support/trace_ui.py: offline,
a fresh database, on A), configured as a user would, with OpenTelemetry's per-signal
variables:

    OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=http://127.0.0.1:PORT/v1/traces  (A: used as it is;
                                      B: Phoenix's gRPC port at A's address)
    OTEL_TRACES_EXPORTER=otlp,console     (the same spans to Phoenix and as JSON lines)
    OTEL_METRICS_EXPORTER=console         (Phoenix takes no metrics: they stay on stdout)

One rollout alone, then 8 at once. Then:
- each rollout is one trace in Phoenix, holding exactly the spans both tracers' JSON lines
  have in it (the same span ids, parents, names, OpenInference kinds and rollout ids), and the
  JSON-lines trace is the expected tree of test_real_gym.py, so Phoenix's is too: host B's
  model spans under host A's CLIENT spans, joined by the header A's kernel wrote;
- the kinds are what the evidence decides: gym.rollout AGENT, gym.verify EVALUATOR, the tool
  call's SERVER span TOOL (with tool.name), the model calls (the agent's to the model server,
  the model server's upstream) LLM with their model and token counts, the agent's call to its
  own /v1/responses AGENT; a plain SERVER span has none (UNKNOWN in Phoenix);
- headless Chromium opens the rollout's trace page and shows its spans by name, both hosts'
  (rendered, not merely in the HTML); the screenshot is kept under target/phoenix/;
- neither agent counted a failed export or a dropped span, and every span each built reached
  Phoenix.

Needs root (the namespace), target/gym-venv and target/phoenix-venv, and Debian's chromium
(`cargo xtask setup`); skipped only when setup was told to leave them out
(GYM_REAL_VENV_SKIPPED / GYM_PHOENIX_SKIPPED), a failure otherwise."""

import collections
import contextlib
import json
import os
import shutil

import pytest

from browser import render
from harness import ROOT, wait_until
from netns import TwoHosts
from test_real_gym import (EXPECTED_TREE, SPANS_PER_ROLLOUT, attached_tracer, canonical, drive_at_once, gym_venv,
                           harvest, render_shapes, tree_shape)
from real_gym.launch import AGENT, MODEL, RESOURCES, SERVER_TYPES, RealGymRun
from trace_ui import Phoenix, phoenix_venv

SOLO = (2, 0)
AT_ONCE = [(task, 1) for task in range(8)]
EXAMPLE_ROWS = 5
SCREENSHOTS = ROOT / "target" / "phoenix"
# What the trace page must show of a rollout: one span per server and kind of span.
ON_THE_PAGE = ["POST /run", "gym.rollout", "gym.agent.responses", "gym.model.responses", "POST /get_weather",
               "POST /seed_session", "gym.verify"]


@pytest.fixture
def phoenix():
    skipped = os.environ.get("GYM_PHOENIX_SKIPPED")
    if skipped:
        pytest.skip(f"Phoenix and Chromium were left out on purpose ({skipped})")
    if not (phoenix_venv() / "bin" / "phoenix").exists():
        pytest.fail(f"no Phoenix at {phoenix_venv()}: run `cargo xtask setup` (or `cargo xtask test --no-phoenix` "
                    "to skip this test on purpose)", pytrace=False)
    if shutil.which("chromium") is None:
        pytest.fail("no chromium on PATH: run `cargo xtask setup` as root (it installs Debian's chromium)",
                    pytrace=False)
    server = Phoenix()
    try:
        yield server.start()
    finally:
        server.stop()
        print(f"\nPhoenix log (tail):\n{server.log_tail(15)}")


def phoenix_view(span):
    """What Phoenix shows of a span, in the JSON-lines' terms."""
    return {
        "span_id": span["context"]["span_id"],
        "parent_span_id": span["parent_id"],
        "name": span["name"],
        "kind": span["span_kind"],
        "rollout_id": span["attributes"].get("nemo.gym.rollout.id"),
    }


def json_view(span):
    return {
        "span_id": span["span_id"],
        "parent_span_id": span["parent_span_id"] or None,  # a root's is "" in the JSON lines
        "name": span["name"],
        "kind": span["attributes"].get("openinference.span.kind", "UNKNOWN"),
        "rollout_id": span["attributes"].get("nemo.gym.rollout.id"),
    }


def test_rollouts_in_phoenix_are_the_json_lines_trees(phoenix, agents):
    venv = gym_venv()
    on_b = (MODEL,)
    with contextlib.ExitStack() as stack:
        hosts = stack.enter_context(TwoHosts())
        run = RealGymRun(venv, access_log=True,
                         hosts={name: hosts.b_address if name in on_b else hosts.a_address for name in SERVER_TYPES},
                         netns={name: hosts.b_exec for name in on_b}, upstream_netns=hosts.b_exec)
        stack.enter_context(run)
        pids = run.pids
        by_pid = {pid: name for name, pid in pids.items()}
        pids_a = {name: pid for name, pid in pids.items() if name not in on_b}
        pids_b = {name: pid for name, pid in pids.items() if name in on_b}
        exports = {"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_METRICS_EXPORTER": "console"}
        tracer_a = attached_tracer(lambda env: agents(
            list(pids_a.values()), extra_args=["--inject-traceparent", "remote"], env=env), pids_a, env={
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": phoenix.traces_url, **exports})
        start_line = next(m for m in tracer_a.log_messages() if "→" in m)
        assert f"spans: OTLP/HTTP {phoenix.traces_url} and JSON lines on stdout; metrics: JSON lines on stdout" \
            in start_line, start_line
        # Host B reaches Phoenix on A's address: its gRPC port listens on every interface.
        tracer_b = attached_tracer(lambda env: agents(list(pids_b.values()), wrapper=hosts.b_enter, env=env), pids_b,
                                   env={"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"http://{hosts.a_address}:{phoenix.grpc_port}",
                                        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc", **exports})

        def body_options(task):
            return {"row_index": task % EXAMPLE_ROWS}

        rollouts = [SOLO, *AT_ONCE]
        results = {SOLO: run.drive_rollout(*SOLO, **body_options(SOLO[0]))}
        results.update(drive_at_once(run, AT_ONCE, body_options))
        assert {key: r["reward"] for key, r in results.items()} == {key: 1.0 for key in rollouts}, results

        ids = [f"{task}-{rollout}" for task, rollout in rollouts]

        def ours():
            return [s for s in tracer_a.spans() + tracer_b.spans() if s["resource"].get("process.pid") in by_pid
                    and not harvest(s["attributes"].get("http.request.method"), s["attributes"].get("url.path"))]

        wait_until(lambda: len(ours()) >= SPANS_PER_ROLLOUT * len(rollouts), 30,
                   lambda: f"{SPANS_PER_ROLLOUT * len(rollouts)} spans, got {len(ours())}")
        for agent in (tracer_a, tracer_b):
            agent.stop()
            assert agent.returncode == 0, agent.stderr()
            summary = agent.summary()
            for counter in ("span_exports_failed", "spans_lost_in_export", "spans_dropped_queue_full",
                            "spans_discarded_exporter_none"):
                assert summary[counter] == 0, f"{counter}: {summary}"
            assert summary["spans_exported"] == len(agent.spans()), (summary["spans_exported"], len(agent.spans()))
            # Metrics went to stdout as the variables said, not to Phoenix (which would answer 405).
            assert any(line.get("metric") == "http.server.request.duration" for line in agent.lines()), \
                "no metrics on stdout"
        assert tracer_a.summary()["traceparents_injected"] == 2 * len(rollouts), tracer_a.summary()
        assert tracer_b.summary()["parents_from_traceparent"] == 2 * len(rollouts), tracer_b.summary()

    spans = ours()
    by_trace = collections.defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    # A rollout's trace: the one tracer A's kernel gave its /run (its gym.rollout span's).
    traces = {s["attributes"]["nemo.gym.rollout.id"]: s["trace_id"] for s in spans if s["name"] == "gym.rollout"}
    assert sorted(traces) == sorted(ids) and len(set(traces.values())) == len(ids), traces
    problems, kinds = [], collections.Counter()
    for rollout_id in ids:
        trace_id = traces[rollout_id]
        ours_in_trace = by_trace.get(trace_id, [])
        shape = tree_shape(ours_in_trace, by_pid)
        if shape != [canonical(EXPECTED_TREE)]:
            problems.append(f"rollout {rollout_id}: the JSON lines are not the expected tree:\n"
                            + "\n".join(render_shapes(shape)))
        # Phoenix stores spans a little after accepting them.
        stored = wait_until(lambda: (lambda got: got if len(got) >= len(ours_in_trace) else None)(
            phoenix.spans(trace_id)), 20, f"rollout {rollout_id}'s {len(ours_in_trace)} spans in Phoenix")
        want = sorted((json_view(s) for s in ours_in_trace), key=lambda v: v["span_id"])
        got = sorted((phoenix_view(s) for s in stored), key=lambda v: v["span_id"])
        if got != want:
            problems.append(f"rollout {rollout_id}: Phoenix has\n  {json.dumps(got)}\nthe JSON lines\n  {json.dumps(want)}")
        for span in ours_in_trace:
            server = by_pid[span["resource"]["process.pid"]]
            kinds[(server, span["kind"], span["name"], json_view(span)["kind"])] += 1
    assert not problems, "\n".join(problems[:6])

    # The kinds the evidence decides, per rollout (the tree has 2 model calls, 1 tool call).
    n = len(ids)
    assert kinds[(AGENT, "INTERNAL", "gym.rollout", "AGENT")] == n, kinds
    assert kinds[(AGENT, "INTERNAL", "gym.agent.responses", "AGENT")] == n, kinds
    assert kinds[(MODEL, "INTERNAL", "gym.model.responses", "LLM")] == 2 * n, kinds
    assert kinds[(RESOURCES, "INTERNAL", "gym.verify", "EVALUATOR")] == n, kinds
    assert kinds[(RESOURCES, "SERVER", "POST /get_weather", "TOOL")] == n, kinds
    assert kinds[(MODEL, "CLIENT", "HTTP POST", "LLM")] == 2 * n, kinds  # the upstream calls
    # The agent's calls to the model server are model calls; its call to its own /v1/responses
    # runs a turn of the agent (gym.agent.responses), so it is AGENT, not LLM.
    assert kinds[(AGENT, "CLIENT", "HTTP POST", "LLM")] == 2 * n, kinds
    assert kinds[(AGENT, "CLIENT", "HTTP POST", "AGENT")] == n, kinds
    for name in ("POST /run", "POST /verify", "POST /seed_session"):
        assert not [k for k in kinds if k[2] == name and k[3] != "UNKNOWN"], kinds
    upstream = [s for s in spans if by_pid[s["resource"]["process.pid"]] == MODEL and s["kind"] == "CLIENT"]
    for span in upstream:
        a = span["attributes"]
        assert a["llm.model_name"] == a["gen_ai.response.model"], a
        assert a["llm.token_count.prompt"] == a["gen_ai.usage.input_tokens"], a
        assert a["llm.token_count.total"] == a["gen_ai.usage.input_tokens"] + a["gen_ai.usage.output_tokens"], a
    tool = next(s for s in spans if s["name"] == "POST /get_weather")
    assert tool["attributes"]["tool.name"] == "get_weather", tool

    # The rollout alone, as a person opens it: its trace page shows its spans.
    solo = f"{SOLO[0]}-{SOLO[1]}"
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    screenshot = SCREENSHOTS / f"rollout-{solo}.png"
    url = phoenix.trace_url(traces[solo])
    page = render(url, ON_THE_PAGE, screenshot, timeout=90)
    print(f"\nrollout {solo}: {url} showed its spans after {page.seconds:.1f} s; screenshot {screenshot}")
    assert not page.missing, f"{url} did not show {page.missing} (screenshot {screenshot}); the page said:\n" \
                             f"{page.text[:3000]}"
    assert screenshot.stat().st_size > 20_000, "the screenshot is (nearly) blank"
