"""The real nemo-gym 0.7.0 servers (simple_agent, openai_model against a canned upstream,
example_single_tool_call), launched as `ng_run` launches them (tests/support/real_gym/launch.py),
traced by gym-tracer with `--discover gym` through one rollout.

The oracle for the SERVER spans is what the servers themselves logged: uvicorn's access log
(one line per request: method, raw path, status). Each request after the agent attached must
have exactly one SERVER span named after its route, the Gym routes their gym.* child.

Needs target/gym-venv (`cargo xtask setup`); skipped only when setup was told to leave it out
(`cargo xtask test --no-gym-venv` sets GYM_REAL_VENV_SKIPPED), a failure otherwise.
"""

import collections
import hashlib
import os
import socket
import time
from pathlib import Path

import pytest

from gym_launch import split_prefix
from harness import ROOT, wait_until
from real_gym.launch import AGENT, API_KEY, MODEL, RESOURCES, SERVER_TYPES, RealGymRun

TASK, ROLLOUT = 3, 1
RUN_ID = f"{TASK}-{ROLLOUT}"
SEMANTIC = {  # (server name, SERVER span name) -> the gym.* child it must have
    (AGENT, "POST /run"): "gym.rollout",
    (AGENT, "POST /v1/responses"): "gym.agent.responses",
    (MODEL, "POST /v1/responses"): "gym.model.responses",
    (MODEL, "POST /v1/chat/completions"): "gym.model.chat_completions",
    (RESOURCES, "POST /verify"): "gym.verify",
}
# Never in the tracer's output: the key in the YAML, the model's and the tool's text (and the prompt).
NEVER_EXPORTED = [API_KEY, "It is cold in", "is cold."]


def rollout_trace_id(rollout_id):
    """The trace id the tracer derives from a rollout id (README, "Across hosts")."""
    return hashlib.sha256(f"nemo.gym.rollout/{rollout_id}".encode()).hexdigest()[:32]


def _model_call():
    """The agent's call to the model, which calls its (canned) OpenAI upstream in turn."""
    upstream = ("HTTP POST", MODEL, [])
    return ("HTTP POST", AGENT, [("POST /v1/responses", MODEL, [("gym.model.responses", MODEL, [upstream])])])


# One rollout as Gym's own telemetry draws it: (span name, server, children), order-free.
EXPECTED_TREE = ("POST /run", AGENT, [("gym.rollout", AGENT, [
    ("HTTP POST", AGENT, [("POST /seed_session", RESOURCES, [])]),
    ("HTTP POST", AGENT, [("POST /v1/responses", AGENT, [("gym.agent.responses", AGENT, [
        _model_call(),
        ("HTTP POST", AGENT, [("POST /get_weather", RESOURCES, [])]),
        _model_call(),
    ])])]),
    ("HTTP POST", AGENT, [("POST /verify", RESOURCES, [("gym.verify", RESOURCES, [])])]),
])])


def canonical(node):
    name, server, children = node
    return (name, server, tuple(sorted(canonical(child) for child in children)))


def tree_shape(spans, by_pid):
    """The spans as canonical trees, from their parent_span_id edges (roots: parent not among them)."""
    ids = {s["span_id"] for s in spans}
    children = collections.defaultdict(list)
    for span in spans:
        children[span["parent_span_id"]].append(span)

    def node(span):
        return canonical((span["name"], by_pid[span["resource"]["process.pid"]],
                          [node(child) for child in children[span["span_id"]]]))

    return [node(span) for span in spans if span["parent_span_id"] not in ids]


def gym_venv():
    skipped = os.environ.get("GYM_REAL_VENV_SKIPPED")
    if skipped:
        pytest.skip(f"the real-Gym venv was left out on purpose ({skipped})")
    venv = Path(os.environ.get("GYM_REAL_VENV") or ROOT / "target" / "gym-venv")
    if not (venv / "bin" / "python").exists():
        pytest.fail(f"no real-Gym venv at {venv}: run `cargo xtask setup` (or `cargo xtask test "
                    "--no-gym-venv` to skip this test on purpose)", pytrace=False)
    return venv


def harvest(method, path):
    """A route-harvest request (GET /openapi.json). Left out on both sides: another
    gym-tracer with --discover gym running on this machine (a concurrent test run) finds and
    harvests these servers too, and to this tracer that is an ordinary client's request. That
    a tracer's own harvest never becomes a span is tested in test_gym_semantics.py."""
    return (method, path) == ("GET", "/openapi.json")


def new_requests(run, before):
    """Requests each server logged since `before` (its access-log lengths), harvests aside."""
    out = []
    for name, entries in run.access_log_paths().items():
        for method, path, status in entries[before[name]:]:
            if not harvest(method, path):
                out.append((name, method, path, int(status)))
    return out


def wait_for_requests(run, before, count, timeout=15):
    def enough():
        seen = new_requests(run, before)
        return seen if len(seen) >= count else None

    return wait_until(enough, timeout, lambda: f"{count} requests in the access logs: {run.access_log_paths()}")


@pytest.fixture
def real_gym():
    venv = gym_venv()
    runs = []

    def start(**kwargs):
        run = RealGymRun(venv, access_log=True, **kwargs)
        runs.append(run)
        return run.start()

    yield start
    for run in runs:
        run.stop()


@pytest.mark.parametrize("observability", [False, True], ids=["plain", "observability"])
def test_one_real_rollout(real_gym, tracer, observability):
    """One rollout through the real servers: every request they served has its SERVER span
    (route name, http.route, url.path, status, rollout id from the /ng-rollout prefix), the
    Gym routes their gym.* child (gym.rollout on /run with the id from the body), resources
    named nemo/<server name>, the rollout and verify metrics, and no secret in the output.
    With observability on, the agent prefixes its model and resources calls with
    /ng-rollout/<id>/ (except the tool call, which Gym sends unprefixed)."""
    run = real_gym(observability=observability)
    pids = run.pids
    by_pid = {pid: name for name, pid in pids.items()}
    agent = tracer()
    for name, pid in pids.items():
        agent.wait_for_stderr(f"attached pid {pid} as {name} ({SERVER_TYPES[name]})")
        agent.wait_for_routes(pid)

    before = {name: len(entries) for name, entries in run.access_log_paths().items()}
    result = run.drive_rollout(task_index=TASK, rollout_index=ROLLOUT)
    assert result["reward"] == 1.0, result
    upstream = run.upstream_requests()
    assert [(r["method"], r["path"], r["auth_ok"]) for r in upstream] == [("POST", "/v1/responses", True)] * 2

    # What the servers served, in Gym's order: /run -> seed_session -> the agent's own
    # /v1/responses -> model (tool call) -> get_weather -> model (answer) -> verify.
    prefix = f"/ng-rollout/{RUN_ID}" if observability else ""
    expected_paths = collections.Counter([
        (AGENT, "POST", "/run", 200),
        (RESOURCES, "POST", f"{prefix}/seed_session", 200),
        (AGENT, "POST", f"{prefix}/v1/responses", 200),
        (MODEL, "POST", f"{prefix}/v1/responses", 200),
        (RESOURCES, "POST", "/get_weather", 200),  # tool calls go out unprefixed
        (MODEL, "POST", f"{prefix}/v1/responses", 200),
        (RESOURCES, "POST", f"{prefix}/verify", 200),
    ])
    served = wait_for_requests(run, before, sum(expected_paths.values()))
    assert collections.Counter(served) == expected_paths, run.access_log_paths()

    # Wait for the SERVER spans, then stop the agent (SIGINT: final metric export).
    wait_until(lambda: sum(s["kind"] == "SERVER" and s["resource"].get("process.pid") in by_pid
                           for s in agent.spans()) >= len(served), 15, f"{len(served)} SERVER spans")
    time.sleep(0.5)
    agent.stop()
    assert agent.returncode == 0, agent.stderr()
    spans = [s for s in agent.spans() if s["resource"].get("process.pid") in by_pid]

    # Resources: nemo/<server name>, the type from the config, the pid of the server.
    for span in spans:
        name = by_pid[span["resource"]["process.pid"]]
        resource = span["resource"]
        assert resource["service.name"] == f"nemo/{name}", resource
        assert resource["nemo.gym.server.name"] == name, resource
        assert resource["nemo.gym.server.type"] == run.server_type(name) == SERVER_TYPES[name], resource
        assert resource["host.name"] == socket.gethostname(), resource

    # SERVER spans: exactly the requests the servers served.
    server_spans = [s for s in spans if s["kind"] == "SERVER"
                    and not harvest(s["attributes"].get("http.request.method"), s["attributes"].get("url.path"))]
    actual = collections.Counter()
    for span in server_spans:
        a = span["attributes"]
        actual[(by_pid[span["resource"]["process.pid"]], a.get("http.request.method"), a.get("url.path"),
                a.get("http.response.status_code"))] += 1
    assert actual == collections.Counter(served), "\n".join(
        [f"{s['name']} {s['attributes']}" for s in server_spans] + agent.stderr().splitlines()[-5:])
    for span in server_spans:
        name, a = by_pid[span["resource"]["process.pid"]], span["attributes"]
        route, prefix_id = split_prefix(a["url.path"])
        assert span["name"] == f"{a['http.request.method']} {route}", span
        assert a.get("http.route") == route, span  # Gym routes, and /get_weather from /openapi.json
        assert a["nemo.gym.server.name"] == name, span
        assert a["server.port"] == int(run.urls[name].rsplit(":", 1)[1]), span
        if route == "/run":
            assert a.get("nemo.gym.rollout.id") == RUN_ID, span
        elif prefix_id is not None:
            assert a.get("nemo.gym.rollout.id") == prefix_id, span

    # gym.* children: same trace, same timing, the server's name and the SERVER span's id.
    children = collections.defaultdict(list)
    for span in spans:
        if span["kind"] == "INTERNAL":
            children[span["parent_span_id"]].append(span)
    for parent in server_spans:
        name = by_pid[parent["resource"]["process.pid"]]
        want = SEMANTIC.get((name, parent["name"]))
        found = children.pop(parent["span_id"], [])
        assert [c["name"] for c in found] == ([want] if want else []), parent
        for child in found:
            assert child["trace_id"] == parent["trace_id"]
            assert (child["start_time_unix_nano"], child["end_time_unix_nano"]) == \
                   (parent["start_time_unix_nano"], parent["end_time_unix_nano"])
            rollout_id = parent["attributes"].get("nemo.gym.rollout.id")
            assert child["attributes"] == {"nemo.gym.server.name": name,
                                           **({"nemo.gym.rollout.id": rollout_id} if rollout_id else {})}
    assert not children, f"INTERNAL spans without a SERVER parent: {dict(children)}"

    def only(server, span_name):
        found = [s for s in server_spans if by_pid[s["resource"]["process.pid"]] == server and s["name"] == span_name]
        assert found, f"no {span_name} SERVER span on {server}"
        return found

    [run_span] = only(AGENT, "POST /run")
    [rollout] = [s for s in spans if s["kind"] == "INTERNAL" and s["parent_span_id"] == run_span["span_id"]]
    assert rollout["name"] == "gym.rollout"
    assert rollout["attributes"] == {"nemo.gym.server.name": AGENT, "nemo.gym.rollout.id": RUN_ID}
    model_calls = only(MODEL, "POST /v1/responses")
    assert len(model_calls) == 2
    [verify_span] = only(RESOURCES, "POST /verify")
    assert verify_span["attributes"]["http.route"] == "/verify"
    if observability:
        for span in [*model_calls, verify_span]:
            assert span["attributes"]["nemo.gym.rollout.id"] == RUN_ID, span
        assert verify_span["attributes"]["url.path"] == f"/ng-rollout/{RUN_ID}/verify"

    # Metrics from the final export.
    def points(metric):
        return [p for p in agent.metric_points(metric) if p["resource"].get("process.pid") in by_pid]

    [rollout_ms] = points("gym.rollout.duration_ms")
    assert (rollout_ms["type"], rollout_ms["unit"], rollout_ms["count"]) == ("histogram", "ms", 1)
    assert rollout_ms["attributes"] == {"nemo.gym.server.name": AGENT}
    [verify_ms] = points("gym.verify.duration_ms")
    assert (verify_ms["count"], verify_ms["attributes"]) == (1, {"nemo.gym.server.name": RESOURCES})
    calls = {p["attributes"]["succeeded"]: p["value"] for p in points("gym.verify.calls") if p["value"]}
    assert calls == {True: 1}, points("gym.verify.calls")
    [rate] = points("gym.verify.success_rate")
    assert rate["value"] == pytest.approx(1.0)
    durations = collections.Counter()
    for point in points("http.server.request.duration"):
        a = point["attributes"]
        if harvest(a["http.request.method"], a.get("http.route")):
            continue
        durations[(a["nemo.gym.server.name"], a["http.request.method"], a["http.response.status_code"],
                   a.get("http.route"))] += point["count"]
    assert durations == collections.Counter(
        (server, method, status, split_prefix(path)[0]) for server, method, path, status in served)

    # Stitching: the whole rollout is one trace — the agent's call to its own /v1/responses
    # and the model and tool calls beneath it included — with its id derived from the rollout id.
    traced = [s for s in spans if not harvest(s["attributes"].get("http.request.method"),
                                              s["attributes"].get("url.path"))]
    assert {s["trace_id"] for s in traced} == {rollout_trace_id(RUN_ID)}, agent.log_messages()[-1]
    assert tree_shape(traced, by_pid) == [canonical(EXPECTED_TREE)], agent.log_messages()[-1]

    prompt = run.rollout_body(TASK, ROLLOUT)["responses_create_params"]["input"][-1]["content"]
    for text in [*NEVER_EXPORTED, prompt]:
        assert text not in agent.stdout_text(), f"{text!r} exported"
        assert text not in agent.stderr(), f"{text!r} printed"
