"""Issue #46: Gym's other server shapes, each with every rollout one whole trace at 64 in flight
in Gym's default configuration (no path prefixes), the upstream answering after 1 s.

The model servers without an echo of their upstream's response id (`vllm_model`,
`azure_openai_model`) are driven by tests/test_real_gym.py's concurrent test, which runs each
model server of Gym in turn through the same rollout. This module drives the shapes whose call
graph is another one:

- MCP: example_mcp_weather's resources server with its tools exposed over MCP, driven by
  haystack_agent's packaged MCP pipeline (tests/support/real_gym/configs/mcp_weather_haystack.yaml).
  The agent's MCP client (the mcp SDK over httpx) runs in haystack's background event loop, in
  another thread than the handler that serves the rollout: the handler's task, its context and
  its lineage are not the writer's. What ties its calls to the rollout is the session token Gym
  mints for it (`X-NeMo-Gym-Session-Token`), which the handler's request carried too.

- codex_agent: environments/codex_math's servers with the agent's
  model calls made by the `codex` CLI it spawns per rollout, through Gym's model server
  (tests/support/real_gym/configs/codex_math_model_server.yaml). Each rollout spawns a few
  hundred processes (the CLI's shell snapshot, lsb_release, git, ...).

The oracle for which requests a rollout makes is the servers' own access logs (uvicorn's, one
line per request): the rollout driven alone first makes exactly the requests its trace must
hold, and the 64 driven at once make 64 times those.
"""

import collections
import difflib
import os
import time
from pathlib import Path

import pytest

from gym_expect import CONTAINMENT_SLACK_NS, containment_problems, rollout_trace_id
from harness import ROOT, wait_until
from real_gym.launch import RealGymRun
from test_real_gym import canonical, gym_venv, harvest, render_shapes, tree_shape, tree_size

MCP_CONFIG = Path(__file__).resolve().parent / "support" / "real_gym" / "configs" / "mcp_weather_haystack.yaml"
UPSTREAM_DELAY_S = 1.0
AT_ONCE = 64
# What says how a call got its parent, or why not (printed, and the undecided ones asserted 0).
COUNTERS = [
    "parents_by_session", "parents_by_task_context", "parents_by_rollout_id", "parents_by_echoed_id",
    "parents_by_lineage", "parents_by_response_context", "parents_by_only_inbound", "parents_ambiguous",
    "parents_no_evidence", "parents_contradicted", "parents_no_request_in_flight", "task_context_conflicts",
    "cross_process_links", "events_lost_in_kernel", "lineage_processes",
]
# How the processes a handler spawns are counted (printed; asserted for the codex shape).
SPAWN_COUNTERS = ["parents_by_spawn", "processes_spawned_in_requests", "processes_spawned_outside_requests",
                  "forks_followed", "processes_execd", "fork_threads_ignored", "forks_unfollowed_filter_full"]
UNDECIDED = ["parents_ambiguous", "parents_no_evidence", "parents_contradicted", "parents_no_request_in_flight",
             "events_lost_in_kernel"]


@pytest.fixture
def mcp_gym():
    run = RealGymRun(gym_venv(), access_log=True, config_path=MCP_CONFIG, upstream_delay_s=UPSTREAM_DELAY_S)
    try:
        yield run.start()
    finally:
        run.stop()


def access_log_since(run, before):
    """(server, method, path) of each request the servers logged since `before`."""
    return collections.Counter(
        (name, method, path)
        for name, entries in run.access_log_paths().items()
        for method, path, _status in entries[before.get(name, 0):]
        if not harvest(method, path))


def access_log_lengths(run):
    return {name: len(entries) for name, entries in run.access_log_paths().items()}


def attached_tracer(run, tracer):
    """A tracer (--discover gym) that attached every server of `run` and harvested its routes."""
    agent = tracer()
    for name, pid in run.pids.items():
        agent.wait_for_stderr(f"attached pid {pid} as {name} ({run.server_type(name)})", timeout=30)
        agent.wait_for_routes(pid, timeout=30)
    return agent


def solo_rollout(run):
    """One rollout driven alone: the requests the servers logged for it."""
    before = access_log_lengths(run)
    solo = run.drive_rollout(AT_ONCE, 0, row_index=0, timeout=120)
    assert solo.get("reward") is not None, solo
    return wait_until(lambda: access_log_since(run, before) or None, 10, "the solo rollout's requests")


def rollouts_at_once(run, solo_requests):
    """AT_ONCE rollouts driven at once, each making exactly the solo rollout's requests (the
    access logs say so); the rollout ids, the solo one first."""
    before = access_log_lengths(run)
    results = run.drive_rollouts(AT_ONCE, AT_ONCE)
    failed = [r for r in results if r["status"] != 200]
    assert not failed, failed[:3]
    batch = wait_until(lambda: (lambda seen: seen if sum(seen.values()) >= AT_ONCE * sum(solo_requests.values())
                                else None)(access_log_since(run, before)), 30, "the batch's requests")
    assert batch == collections.Counter({k: AT_ONCE * n for k, n in solo_requests.items()}), (batch, solo_requests)
    rollout_ids = [f"{AT_ONCE}-0"] + [f"{r['task_index']}-{r['rollout_index']}" for r in results]
    assert len(set(rollout_ids)) == AT_ONCE + 1
    return rollout_ids


def stopped_with(agent, ours, total):
    """Waits for `total` of `ours()`, stops the tracer; its spans (`ours()`) and summary."""
    try:
        wait_until(lambda: len(ours()) >= total, 30, f"{total} spans", interval=0.5)
    except AssertionError:
        pass  # the checks after say what is missing
    time.sleep(1.0)
    agent.stop()
    assert agent.returncode == 0, agent.stderr()[-5000:]
    return ours(), agent.summary()


def expected_tree(run, mcp_requests):
    """One MCP rollout as the agent's code makes it (responses_api_agents/haystack_agent/app.py):
    /run seeds the session, calls its own /v1/responses (with the session token) and verifies;
    that handler makes the model calls (the canned upstream: one tool call, then the answer) and
    the MCP requests the access log counted for the rollout run alone."""
    agent, resources, model = run.agent, run.resources, run.policy_model
    upstream = ("HTTP POST", model, [])
    model_call = ("HTTP POST", agent, [("POST /v1/responses", model, [("gym.model.responses", model, [upstream])])])
    mcp_calls = [(f"HTTP {method}", agent, [(f"{method} /mcp", resources, [])])
                 for (_server, method, _path), n in sorted(mcp_requests.items()) for _ in range(n)]
    return ("POST /run", agent, [("gym.rollout", agent, [
        ("HTTP POST", agent, [("POST /seed_session", resources, [])]),
        ("HTTP POST", agent, [("POST /v1/responses", agent, [("gym.agent.responses", agent, [
            model_call, model_call, *mcp_calls])])]),
        ("HTTP POST", agent, [("POST /verify", resources, [("gym.verify", resources, [])])]),
    ])])


def trace_problems(spans, rollout_ids, want, by_pid):
    """Each rollout's trace exactly `want`, no span outside the rollouts' traces, every span
    within its parent's time (`open_end`: see containment_problems)."""
    by_trace = collections.defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    owners = {rollout_trace_id(r): r for r in rollout_ids}
    problems = []
    for rollout_id in rollout_ids:
        shapes = tree_shape(by_trace.get(rollout_trace_id(rollout_id), []), by_pid)
        if shapes != [canonical(want)]:
            diff = difflib.unified_diff(render_shapes([canonical(want)]), render_shapes(shapes), "expected",
                                        f"rollout {rollout_id}", lineterm="", n=1)
            problems.append("\n".join(diff))
    strays = {t: members for t, members in by_trace.items() if t not in owners}
    if strays:
        problems.append(f"{sum(map(len, strays.values()))} spans in no rollout's trace:\n" + "\n".join(
            "\n".join(render_shapes(tree_shape(members, by_pid))) for members in strays.values()))
    problems += containment_problems(spans)[:20]
    return problems


def test_mcp_calls_from_a_background_loop_hang_under_their_rollout(mcp_gym, tracer):
    run = mcp_gym
    by_pid = {pid: name for name, pid in run.pids.items()}
    agent = attached_tracer(run, tracer)
    solo_requests = solo_rollout(run)
    mcp_requests = collections.Counter({k: n for k, n in solo_requests.items() if k[2] == "/mcp"})
    assert mcp_requests[(run.resources, "POST", "/mcp")] >= 2, f"no MCP session: {solo_requests}"
    want = expected_tree(run, mcp_requests)
    rollout_ids = rollouts_at_once(run, solo_requests)
    total = tree_size(want) * len(rollout_ids)

    def ours():
        return [s for s in agent.spans() if s["resource"].get("process.pid") in by_pid
                and not harvest(s["attributes"].get("http.request.method"), s["attributes"].get("url.path"))]

    spans, summary = stopped_with(agent, ours, total)
    print(f"\n[mcp] {len(spans)} spans, {len(rollout_ids)} rollouts x {tree_size(want)}; MCP requests per rollout "
          f"{dict(mcp_requests)}")
    for name in COUNTERS:
        print(f"  {name} = {summary.get(name)}")
    problems = trace_problems(spans, rollout_ids, want, by_pid)
    assert not problems, "\n".join(problems[:10]) + "\n\nexpected:\n" + "\n".join(render_shapes([canonical(want)]))
    assert len(spans) == total
    assert {name: summary.get(name) for name in UNDECIDED} == {name: 0 for name in UNDECIDED}



CODEX_CONFIG = Path(__file__).resolve().parent / "support" / "real_gym" / "configs" / "codex_math_model_server.yaml"
CODEX = "codex"  # the CLI's native binary (the npm shim `codex` runs it): its spans' executable name


def codex_cli():
    """The directory `cargo xtask setup` installs the `codex` CLI's npm shim in."""
    path = Path(os.environ.get("GYM_CODEX_CLI") or ROOT / "target" / "codex-cli" / "node_modules" / ".bin")
    if not (path / "codex").exists():
        pytest.fail(f"no `codex` CLI in {path}: run `cargo xtask setup` (npm install @openai/codex@0.144.4)",
                    pytrace=False)
    return path


@pytest.fixture
def codex_gym():
    venv, cli = gym_venv(), codex_cli()
    run = RealGymRun(venv, access_log=True, config_path=CODEX_CONFIG, upstream_delay_s=UPSTREAM_DELAY_S,
                     extra_path=[cli])
    try:
        yield run.start()
    finally:
        run.stop()


def codex_tree(run, model_calls):
    """One codex rollout as the agent's code makes it (responses_api_agents/codex_agent/app.py):
    /run seeds the session, spawns `codex exec` (whose model calls, streamed /v1/responses to
    Gym's model server, hang under the rollout that spawned it) and verifies."""
    agent, resources, model = run.agent, run.resources, run.policy_model
    model_call = ("HTTP POST", CODEX, [("POST /v1/responses", model, [("gym.model.responses", model, [
        ("HTTP POST", model, [])])])])
    return ("POST /run", agent, [("gym.rollout", agent, [
        ("HTTP POST", agent, [("POST /seed_session", resources, [])]),
        *[model_call] * model_calls,
        ("HTTP POST", agent, [("POST /verify", resources, [("gym.verify", resources, [])])]),
    ])])


def test_codex_cli_calls_hang_under_the_rollout_that_spawned_it(codex_gym, tracer):
    """codex_agent runs the `codex` CLI (@openai/codex from npm: a node shim and its native
    binary) per rollout; the CLI's model calls hang under the /run that spawned it, one trace per
    rollout at 64 in flight, and the hundreds of processes each rollout spawns (the CLI's own
    helpers) lose no kernel event."""
    run = codex_gym
    servers = {pid: name for name, pid in run.pids.items()}
    agent = attached_tracer(run, tracer)
    solo_requests = solo_rollout(run)
    model_calls = solo_requests[(run.policy_model, "POST", "/v1/responses")]
    assert model_calls >= 1, solo_requests
    want = codex_tree(run, model_calls)
    rollout_ids = rollouts_at_once(run, solo_requests)
    total = tree_size(want) * len(rollout_ids)

    def ours():
        return [s for s in agent.spans() if (s["resource"].get("process.pid") in servers
                                             or s["resource"].get("process.executable.name") == CODEX)
                and not harvest(s["attributes"].get("http.request.method"), s["attributes"].get("url.path"))]

    spans, summary = stopped_with(agent, ours, total)
    by_pid = dict(servers)
    cli_pids = collections.defaultdict(set)  # trace -> the pids its CLI spans came from
    for span in spans:
        pid = span["resource"].get("process.pid")
        if pid not in servers:
            by_pid[pid] = CODEX
            cli_pids[span["trace_id"]].add(pid)
    print(f"\n[codex] {len(spans)} spans, {len(rollout_ids)} rollouts x {tree_size(want)}; model calls per "
          f"rollout {model_calls}")
    for name in COUNTERS + SPAWN_COUNTERS:
        print(f"  {name} = {summary.get(name)}")
    problems = trace_problems(spans, rollout_ids, want, by_pid)
    assert not problems, "\n".join(problems[:10]) + "\n\nexpected:\n" + "\n".join(render_shapes([canonical(want)]))
    assert len(spans) == total
    # Each rollout's CLI is a process of its own.
    assert sorted(map(len, cli_pids.values())) == [1] * len(rollout_ids), cli_pids
    assert len(set().union(*cli_pids.values())) == len(rollout_ids)
    assert {name: summary.get(name) for name in UNDECIDED} == {name: 0 for name in UNDECIDED}
    assert summary["processes_spawned_in_requests"] == len(rollout_ids)
    assert summary["parents_by_spawn"] == model_calls * len(rollout_ids)
    check_streamed_answers(spans, by_pid, model_calls * len(rollout_ids))


def check_streamed_answers(spans, by_pid, calls):
    """The CLI reads Gym's model server's answer as server-sent events and closes at the last
    one; the server writes the chunk that closes the stream later, when its saturated loop
    gets to it (seconds at 64 in flight). Both spans end with the last event (the
    containment check above), and both record the time to the first: the server wrote it
    before the CLI read it."""
    by_id = {span["span_id"]: span for span in spans}
    first_event = "gym_tracer.response.time_to_first_event"
    pairs = [(by_id[span["parent_span_id"]], span) for span in spans
             if span["kind"] == "SERVER" and span["name"] == "POST /v1/responses"
             and by_pid.get(by_id[span["parent_span_id"]]["resource"].get("process.pid")) == CODEX]
    assert len(pairs) == calls

    def first_event_ns(span):
        return span["start_time_unix_nano"] + round(span["attributes"][first_event] * 1e9)

    waits = sorted(server["attributes"][first_event] for _, server in pairs)
    print(f"  model server's time to first event: median {waits[len(waits) // 2]:.3f} s, max {waits[-1]:.3f} s")
    for client, server in pairs:
        for span in (client, server):
            # 1 µs: the attribute is seconds as a double.
            assert span["start_time_unix_nano"] < first_event_ns(span) <= span["end_time_unix_nano"] + 1_000, span
        assert client["attributes"]["gen_ai.response.time_to_first_chunk"] == client["attributes"][first_event]
        assert first_event_ns(server) <= first_event_ns(client) + CONTAINMENT_SLACK_NS, (client, server)
