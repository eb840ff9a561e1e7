"""The real nemo-gym 0.7.0 servers (simple_agent, openai_model against a canned upstream,
example_single_tool_call), launched as `ng_run` launches them (tests/support/real_gym/launch.py),
traced by gym-tracer with `--discover gym` through one rollout.

The oracle for the SERVER spans is what the servers themselves logged: uvicorn's access log
(one line per request: method, raw path, status). Each request after the agent attached must
have exactly one SERVER span named after its route, the Gym routes their gym.* child.

Needs target/gym-venv (`cargo xtask setup`); skipped only when setup was told to leave it out
(`cargo xtask test --no-gym-venv` sets GYM_REAL_VENV_SKIPPED), a failure otherwise. nemo-gym
0.7.0 declares Requires-Python >=3.13.14; the venv is pyenv's CPython 3.13.0, the newest this
machine kind has (no newer 3.13 is reachable from its registries), so nemo-gym and ray are
installed with `--no-deps --ignore-requires-python` (README, "The two commands").
"""

import collections
import difflib
import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from gym_expect import (children_by_parent, containment_problems, gym_attributes, parent_key, rollout_trace_id,
                        semantic_attributes, span_key)
from gym_launch import split_prefix
from harness import ROOT, agent_binary, wait_until
from real_gym.launch import AGENT, API_KEY, MODEL, PADDING, RESOURCES, SERVER_TYPES, RealGymRun

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
    """The spans as canonical trees, from their parent_span_id edges within a trace (roots:
    parent not among them)."""
    keys = {span_key(s) for s in spans}
    children = children_by_parent(spans)

    def node(span):
        return canonical((span["name"], by_pid[span["resource"]["process.pid"]],
                          [node(child) for child in children[span_key(span)]]))

    return [node(span) for span in spans if parent_key(span) not in keys]


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


def attached_tracer(tracer, pids, env=None):
    """gym-tracer with --discover gym (in `env`), once it has attached to every server and
    harvested its routes."""
    agent = tracer(env=env) if env else tracer()
    for name, pid in pids.items():
        agent.wait_for_stderr(f"attached pid {pid} as {name} ({SERVER_TYPES[name]})")
        agent.wait_for_routes(pid)
    return agent


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


def span_facts_trees(spans):
    """Every span's facts but its ids (names, kind, times, status, attributes, trace id, the
    process and its Gym resource), as canonical trees of its parent edges: what a replay must
    give again. Span ids are random per run; the host's process and host attributes are not
    read by a replay."""
    keys = {span_key(s) for s in spans}
    children = children_by_parent(spans)
    resource_keys = ("service.name", "process.pid", "nemo.gym.server.name", "nemo.gym.server.type")

    def node(span):
        facts = (span["trace_id"], span["name"], span["kind"], span["start_time_unix_nano"],
                 span["end_time_unix_nano"], json.dumps(span.get("status"), sort_keys=True),
                 json.dumps(span["attributes"], sort_keys=True),
                 tuple(span["resource"].get(key) for key in resource_keys))
        return (facts, tuple(sorted(node(child) for child in children[span_key(span)])))

    return sorted(node(span) for span in spans if parent_key(span) not in keys)


@pytest.mark.parametrize("observability", [False, True], ids=["plain", "observability"])
def test_one_real_rollout(real_gym, tracer, observability, tmp_path):
    """One rollout through the real servers: every request they served has its SERVER span
    (route name, http.route, url.path, status, rollout id from the /ng-rollout prefix), the
    Gym routes their gym.* child (gym.rollout on /run with the id from the body), resources
    named nemo/<server name>, the rollout and verify metrics, and no secret in the output.
    With observability on, the agent prefixes its model and resources calls with
    /ng-rollout/<id>/ (except the tool call, which Gym sends unprefixed). The run is recorded
    (`--record`), and `gym-tracer replay` makes the very same spans of it again."""
    run = real_gym(observability=observability)
    pids = run.pids
    by_pid = {pid: name for name, pid in pids.items()}
    recording = tmp_path / "run.rec"
    agent = attached_tracer(tracer, pids, env={"GYM_TRACER_RECORD": str(recording)})

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

    # gym.* children: same trace (keyed by it), same timing, the server's name and the SERVER
    # span's id; an INTERNAL root, or one in another trace than its SERVER parent, is left over.
    children = children_by_parent(s for s in spans if s["kind"] == "INTERNAL")
    for parent in server_spans:
        name = by_pid[parent["resource"]["process.pid"]]
        want = SEMANTIC.get((name, parent["name"]))
        found = children.pop(span_key(parent), [])
        assert [c["name"] for c in found] == ([want] if want else []), parent
        for child in found:
            assert (child["start_time_unix_nano"], child["end_time_unix_nano"]) == \
                   (parent["start_time_unix_nano"], parent["end_time_unix_nano"])
            rollout_id = parent["attributes"].get("nemo.gym.rollout.id")
            assert gym_attributes(child) == semantic_attributes(child["name"], name, rollout_id)
    assert not children, f"INTERNAL spans without a SERVER parent: {dict(children)}"

    def only(server, span_name):
        found = [s for s in server_spans if by_pid[s["resource"]["process.pid"]] == server and s["name"] == span_name]
        assert found, f"no {span_name} SERVER span on {server}"
        return found

    [run_span] = only(AGENT, "POST /run")
    [rollout] = [s for s in spans if s["kind"] == "INTERNAL" and parent_key(s) == span_key(run_span)]
    assert rollout["name"] == "gym.rollout"
    assert gym_attributes(rollout) == semantic_attributes("gym.rollout", AGENT, RUN_ID)
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

    # The recording, fed to the tracer again without a kernel: the same spans, in the same
    # trees, and what the core counted on stderr.
    replay = subprocess.run([str(agent_binary()), "replay", str(recording)], capture_output=True, text=True,
                            timeout=60)
    assert replay.returncode == 0, replay.stderr
    replayed = [json.loads(line) for line in replay.stdout.splitlines()]
    live = agent.spans()
    assert len(replayed) == len(live) > 0
    assert span_facts_trees(replayed) == span_facts_trees(live)
    assert f"{len(live)} spans" in replay.stderr, replay.stderr
    for text in [*NEVER_EXPORTED, prompt]:
        assert text not in replay.stdout, f"{text!r} exported by the replay"


# ---- many rollouts at once ----

SOLO = (64, 0)  # driven alone first: (task index, rollout index)
AT_ONCE = [(task, 1) for task in range(64)]  # then all of these together
UPSTREAM_DELAY_S = 1.0  # a model that takes its time: the rollouts overlap for seconds
# The shapes driven at once: (Gym's observability on, the policy model server) by test id.
# openai_model echoes its upstream's response id; vllm_model (the one Gym trains with) and
# azure_openai_model (the OpenAI SDK over httpx) answer with an id of their own.
SHAPES = {
    "plain": (False, "openai_model"),
    "observability": (True, "openai_model"),
    "vllm_model": (False, "vllm_model"),
    "azure_openai_model": (False, "azure_openai_model"),
}
# The path each model server calls its upstream at.
UPSTREAM_PATHS = {
    "openai_model": "/v1/responses",
    "vllm_model": "/v1/chat/completions",
    "azure_openai_model": "/openai/deployments/canned-model/chat/completions?api-version=2024-10-21",
}
EXAMPLE_ROWS = 5  # rows in example_single_tool_call's example.jsonl; task i uses row i % 5
BODY_BYTES = 11_000  # as example_multi_step's rows: the `_ng_*` ids only in the body's tail
# The agent's summary counters that say how each outbound call got its parent (or why not).
EVIDENCE_COUNTERS = [
    "parents_by_lineage", "lineage_processes", "lineage_tasks_probed", "lineage_calls_unseen",
    "lineage_calls_no_task", "lineage_calls_unreadable", "lineage_creator_unreadable", "parents_by_rollout_id", "parents_by_session", "parents_by_task_context", "parents_by_echoed_id",
    "parents_by_response_context", "parents_by_only_inbound", "parents_by_nesting", "parents_ambiguous",
    "parents_no_evidence", "parents_contradicted", "parents_no_request_in_flight", "task_context_conflicts",
    "task_context_regroups", "cross_process_links", "spans_flushed_unmatched", "spans_released_early",
    "events_lost_in_kernel", "python_runtimes_read", "python_runtimes_off", "python_processes_not_python",
    "python_threads_registered", "python_threads_not_registered", "context_chains_read", "context_chains_empty",
    "context_thread_unknown", "context_not_a_context", "context_reads_failed", "context_records_lost",
]


def tree_size(node):
    return 1 + sum(tree_size(child) for child in node[2])


SPANS_PER_ROLLOUT = tree_size(EXPECTED_TREE)


def render_tree(node, depth=0):
    name, server, children = node
    return ["  " * depth + f"{name} [{server}]"] + [line for child in children for line in render_tree(child, depth + 1)]


def render_shapes(shapes):
    return [line for shape in shapes for line in render_tree(shape)] or ["(no spans)"]


def expected_requests(rollout_id, observability):
    prefix = f"/ng-rollout/{rollout_id}" if observability else ""
    return [
        (AGENT, "POST", "/run", 200),
        (RESOURCES, "POST", f"{prefix}/seed_session", 200),
        (AGENT, "POST", f"{prefix}/v1/responses", 200),
        (MODEL, "POST", f"{prefix}/v1/responses", 200),
        (RESOURCES, "POST", "/get_weather", 200),
        (MODEL, "POST", f"{prefix}/v1/responses", 200),
        (RESOURCES, "POST", f"{prefix}/verify", 200),
    ]


def rollout_problems(spans, rollout_ids, by_pid, expected_tree=EXPECTED_TREE, traces=None):
    """What is wrong with the rollouts' traces in `spans` (by_pid: pid -> server name), [] if
    nothing: for every rollout id, every span that carries it or is in its trace is in that one
    trace, that trace is exactly `expected_tree` (default EXPECTED_TREE) and holds no span of
    another rollout; every span lies within its parent's time (1 ms of slack); no span is in no
    rollout's trace, and there are tree_size(expected_tree) spans per rollout. A rollout's trace
    is its derived one, or `traces[rollout_id]` (what its /run span says, where the agent's
    kernel gave /run its trace: --inject-traceparent)."""
    by_trace = collections.defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)

    given = traces
    trace_of = {rollout_id: given.get(rollout_id, "none") if given is not None else rollout_trace_id(rollout_id)
                for rollout_id in rollout_ids}
    trace_owner = {trace_id: rollout_id for rollout_id, trace_id in trace_of.items()}
    want = [canonical(expected_tree)]
    problems = []
    if len(trace_owner) != len(trace_of):
        problems.append(f"two rollouts share a trace: {trace_of}")
    for rollout_id in rollout_ids:
        trace_id = trace_of[rollout_id]
        carrying = [s for s in spans if s["attributes"].get("nemo.gym.rollout.id") == rollout_id
                    or s["trace_id"] == trace_id]
        traces = collections.Counter(s["trace_id"] for s in carrying)
        if set(traces) != {trace_id}:
            problems.append(f"rollout {rollout_id}: its spans are in {len(traces)} traces: " + ", ".join(
                f"{t} ({trace_owner.get(t, 'no rollout')}'s): {n} spans" for t, n in traces.items()))
            for t in traces:
                if t != trace_id:
                    problems += [f"    foreign trace {t}:"] + [
                        f"      {line}" for line in render_shapes(tree_shape(by_trace[t], by_pid))]
        members = by_trace.get(trace_id, [])
        shapes = tree_shape(members, by_pid)
        if shapes != want:
            diff = difflib.unified_diff(render_shapes(want), render_shapes(shapes), "expected", f"rollout {rollout_id}",
                                        lineterm="", n=2)
            problems.append(f"rollout {rollout_id}: {len(members)} spans, {len(shapes)} roots, not the expected tree:\n"
                            + "\n".join("    " + line for line in diff))
        others = {k: v for k, v in collections.Counter(s["attributes"].get("nemo.gym.rollout.id")
                                                       for s in members).items() if k not in (None, rollout_id)}
        if others:
            problems.append(f"rollout {rollout_id}: its trace holds spans of other rollouts: {others}")
    strays = [s for t, members in by_trace.items() if t not in trace_owner for s in members]
    if strays:
        problems.append(f"{len(strays)} spans in no rollout's trace:\n" + "\n".join(
            f"    trace {t}:\n" + "\n".join("      " + line for line in render_shapes(tree_shape(members, by_pid)))
            for t, members in by_trace.items() if t not in trace_owner))
    # The shape cannot tell a rollout's two model calls apart: time does.
    outside = containment_problems(spans)
    if outside:
        problems.append(f"{len(outside)} spans outside their parent's time:\n" + "\n".join(
            f"    {line}" for line in outside[:20]))
    per_rollout = tree_size(expected_tree)
    if len(spans) != per_rollout * len(rollout_ids):
        problems.append(f"{len(spans)} spans, want {len(rollout_ids)} x {per_rollout}: "
                        f"{collections.Counter((s['kind'], s['name']) for s in spans)}")
    return problems


def drive_at_once(run, rollouts, body_options):
    """The rollouts all at once (one thread each, released together by a barrier), each
    with `body_options(task)` for its body: their results by (task, rollout); any error
    fails."""
    barrier = threading.Barrier(len(rollouts))
    results, errors = {}, {}

    def one(task, rollout):
        try:
            barrier.wait(30)
            results[(task, rollout)] = run.drive_rollout(task, rollout, **body_options(task))
        except BaseException as error:  # noqa: BLE001 - reported below
            errors[(task, rollout)] = repr(error)

    threads = [threading.Thread(target=one, args=key) for key in rollouts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(90)
    assert not errors, errors
    return results


@pytest.mark.parametrize("shape", list(SHAPES))
def test_concurrent_real_rollouts_are_one_trace_each(real_gym, tracer, shape):
    """Issues #13 and #46: at Gym's real concurrency every rollout is one trace with exactly
    the tree of a rollout run alone, whichever model server Gym runs. One rollout alone, then
    64 at once, the upstream answering after 1 s, each with its own (task, rollout) and an
    ~11 KB body (as example_multi_step's rows) whose `_ng_*` ids are in its tail only, through
    the real servers: for every rollout id, every span that carries it or is in its derived
    trace is in that one trace, that trace is exactly EXPECTED_TREE and holds no span of
    another rollout, and there is no span besides these 65 trees."""
    observability, model_impl = SHAPES[shape]
    run = real_gym(observability=observability, model_impl=model_impl, upstream_delay_s=UPSTREAM_DELAY_S)
    pids = run.pids
    by_pid = {pid: name for name, pid in pids.items()}
    agent = attached_tracer(tracer, pids)

    def body_options(task):
        return {"row_index": task % EXAMPLE_ROWS, "pad_to": BODY_BYTES}

    rollouts = [SOLO, *AT_ONCE]
    ids = {f"{task}-{rollout}": (task, rollout) for task, rollout in rollouts}
    assert len(ids) == len(rollouts)
    body = json.dumps(run.rollout_body(*SOLO, **body_options(SOLO[0])))
    assert len(body) == BODY_BYTES and body.rindex('"_ng_task_index"') > BODY_BYTES - 200, len(body)

    before = {name: len(entries) for name, entries in run.access_log_paths().items()}
    results = {SOLO: run.drive_rollout(*SOLO, **body_options(SOLO[0]))}
    results.update(drive_at_once(run, AT_ONCE, body_options))
    assert {key: result["reward"] for key, result in results.items()} == {key: 1.0 for key in rollouts}, results
    upstream = run.upstream_requests()
    assert collections.Counter((r["method"], r["path"], r["auth_ok"]) for r in upstream) == \
        {("POST", UPSTREAM_PATHS[model_impl], True): 2 * len(rollouts)}

    expected_paths = collections.Counter(
        request for rollout_id in ids for request in expected_requests(rollout_id, observability))
    served = wait_for_requests(run, before, sum(expected_paths.values()), timeout=30)
    assert collections.Counter(served) == expected_paths, run.access_log_paths()

    def ours():
        return [s for s in agent.spans() if s["resource"].get("process.pid") in by_pid
                and not harvest(s["attributes"].get("http.request.method"), s["attributes"].get("url.path"))]

    # The SERVER spans, then (softly: a missing span is the assertion's to report) all of them.
    wait_until(lambda: sum(s["kind"] == "SERVER" for s in ours()) >= len(served), 20, f"{len(served)} SERVER spans")
    try:
        wait_until(lambda: len(ours()) >= SPANS_PER_ROLLOUT * len(rollouts), 5, "every span")
    except AssertionError:
        pass
    time.sleep(1.0)  # the stitch delay, and room for a span too many
    agent.stop()
    assert agent.returncode == 0, agent.stderr()
    spans = ours()
    summary = agent.summary()
    evidence = {name: summary.get(name) for name in EVIDENCE_COUNTERS}
    print(f"\n[{shape}] {len(spans)} spans, "
          f"{len(rollouts)} rollouts x {SPANS_PER_ROLLOUT}; evidence counters:")
    for name, value in evidence.items():
        print(f"  {name} = {value}")

    problems = rollout_problems(spans, ids, by_pid)
    if problems:
        print("\n".join(problems))
    assert not problems, "\n".join(problems[:40]) + f"\n\nexpected tree:\n" + "\n".join(
        render_shapes([canonical(EXPECTED_TREE)])) + f"\nevidence counters: {evidence}\nsummary: {summary}"

    prompts = {run.example_row(row)["responses_create_params"]["input"][-1]["content"] for row in range(EXAMPLE_ROWS)}
    for text in [*NEVER_EXPORTED, *sorted(prompts), PADDING.strip()]:
        assert text not in agent.stdout_text(), f"{text!r} exported"
        assert text not in agent.stderr(), f"{text!r} printed"
