"""Where a rollout's time goes ([rollout-insight]), on the real, unmodified nemo-gym servers
(simple_agent, example_single_tool_call, openai_model in front of the canned upstream), Gym's
telemetry off, ROLLOUTS rollouts posted at once, the upstream answering after UPSTREAM_DELAY_S
and every SLOW_EVERY-th call SLOW_EXTRA_S later still (0.3 s, every 50th 12 s later). gym-tracer runs with its defaults plus
--health-listen (the live view) and a short metric interval.

Checked:
1. every rollout's `gym.rollout` span carries the six `gym.rollout.phase.*_ms` attributes, and
   they sum to its duration (1 ms of rounding);
2. each rollout's phases equal (1 ms per phase) the ones this test computes itself from the
   exported spans of its trace: its own walk of the critical path, the phase of each span's
   time decided from which server (by pid) exported it, as the issue defines the phases;
   `gym.rollout.model_calls` / `tool_calls` equal the model-server and tool SERVER spans under
   it; its token totals the sum over its calls to the model server;
3. the rollouts that hold a slow upstream call (the upstream's own log says which calls were
   slow; their CLIENT spans are found by duration) are stragglers with model_ms >= the extra
   delay; the straggler flags agree with the rule computed here from the exported rollouts
   (3x the median of the agent's rollouts completed before, once 20 had), and the
   `rollout_stragglers` counter and the `gym.rollouts.stragglers` metric count them exactly;
4. `gym.server.queue_delay` and `gym.server.loop.utilization` are reported for all three
   servers, `gym.rollout.phase.duration` for the agent, one point per phase, each counting
   every rollout;
5. `GET /rollouts`, polled during the run, listed rollouts in flight (known ids, the agent's
   name, one of the six phases); a straggler listed while its slow call was in flight was in
   `model`; the completed figures at the end count every rollout;
6. `gym-tracer top`, run in tmux while the slow calls are in flight, shows the stragglers at the
   top of its screen (the captured screen, as a person sees it).

Needs target/gym-venv (`cargo xtask setup`) and tmux.
"""

import collections
import json
import os
import shutil
import subprocess
import threading
import time

from gym_expect import children_by_parent, parent_key, span_key, spans_by_key
from harness import agent_binary, free_ports, http_get, wait_until
from real_gym.launch import RealGymRun
from test_real_gym import SPANS_PER_ROLLOUT, gym_venv, tree_size
from test_task_lineage import attached_tracer, expected_tree, stop_when_exported

# CI's sizes; INSIGHT_ROLLOUTS, INSIGHT_UPSTREAM_DELAY_S and INSIGHT_SLOW_EXTRA_S run the same
# checks at another scale by hand (a straggler must still take 3x the median).
ROLLOUTS = int(os.environ.get("INSIGHT_ROLLOUTS", "256"))
UPSTREAM_DELAY_S = float(os.environ.get("INSIGHT_UPSTREAM_DELAY_S", "0.3"))
SLOW_EVERY = 50
# The issue asked for 6 s. At 256 in flight on two CPUs the median rollout takes ~2.2 s, so a
# 6 s call makes a rollout only 10-15 % longer than 3x the median: a slower day would
# unflag it. With 12 s it is about twice the threshold.
SLOW_EXTRA_S = float(os.environ.get("INSIGHT_SLOW_EXTRA_S", "12"))
JUDGE_ENVIRONMENT = "equivalence_llm_judge"
JUDGE_ROLLOUTS = 64
PHASES = ["model", "tool", "verify", "queue", "external", "agent"]
STRAGGLER_FACTOR = 3
STRAGGLER_MIN_COMPLETED = 20
MS = 1_000_000
SHORT_TYPES = {"responses_api_agents": "agent", "responses_api_models": "model", "resources_servers": "resources"}
# The agent orders completed rollouts as they are released, this test by their end: two that
# end together may be taken in either order, which moves the median by one rollout. A flag
# that differs is accepted only this close to the threshold.
BORDERLINE = 0.02
INSIGHT_COUNTERS = ["rollouts_completed", "rollout_stragglers", "rollouts_not_gathered", "rollout_spans_after_end",
                    "rollout_spans_evicted", "rollout_spans_outside_tree", "live_requests_untracked"]


def attributes(span):
    return span["attributes"]


def server_type_of(span, types_by_pid):
    return types_by_pid.get(span["resource"]["process.pid"])


def walk_phases(root, children, type_of):
    """This test's own critical path of the subtree under `root`: ns per phase. Walking back
    from the end, the child that finished last before the cursor holds the path; the time no
    child covers is the span's own, whose phase is: model inside a model server's span (and
    below it); on a call, queue when its callee is traced (peer.service, or its SERVER span
    below it) else external; a resources server's span verify inside /verify, else tool; the
    rest agent."""
    phases = collections.Counter()

    def context_of(span, inherited):
        kind = type_of(span)
        if inherited == "model" or kind == "model":
            return "model"
        if span["kind"] == "CLIENT":
            return inherited
        if kind == "resources":
            is_verify = span["name"] == "gym.verify" or attributes(span).get("http.route") == "/verify"
            return "verify" if inherited == "verify" or is_verify else "tool"
        return "agent"

    def own_phase(span, context):
        if context == "model":
            return "model"
        if span["kind"] == "CLIENT":
            callee = "peer.service" in attributes(span) or any(
                c["kind"] == "SERVER" for c in children[span_key(span)])
            return "queue" if callee else "external"
        return context

    def walk(span, low, high, inherited, depth=0):
        floor = max(span["start_time_unix_nano"], low)
        cursor = min(span["end_time_unix_nano"], high)
        if cursor <= floor:
            return
        context = context_of(span, inherited)
        own = own_phase(span, context)
        for child in sorted(children[span_key(span)], key=lambda c: c["end_time_unix_nano"], reverse=True):
            if child["start_time_unix_nano"] >= cursor or child["end_time_unix_nano"] <= floor:
                continue
            child_end = min(child["end_time_unix_nano"], cursor)
            phases[own] += cursor - child_end
            walk(child, floor, child_end, context, depth + 1)
            cursor = max(child["start_time_unix_nano"], floor)
            if cursor <= floor:
                break
        phases[own] += cursor - floor

    walk(root, root["start_time_unix_nano"], root["end_time_unix_nano"], "agent")
    return phases


def subtree(root, children):
    out, todo = [], [root]
    while todo:
        span = todo.pop()
        out.append(span)
        todo.extend(children[span_key(span)])
    return out


def phase_problems(rollout_spans, children, type_of, want_counts=None):
    """Checks (1) and (2) for every rollout; `want_counts`: the (model_calls, tool_calls) the
    environment makes, when fixed."""
    problems = []
    for span in rollout_spans:
        a = attributes(span)
        rid = a["nemo.gym.rollout.id"]
        got = {phase: a.get(f"gym.rollout.phase.{phase}_ms") for phase in PHASES}
        if None in got.values():
            problems.append(f"{rid}: phases missing: {got}")
            continue
        duration_ms = (span["end_time_unix_nano"] - span["start_time_unix_nano"]) / MS
        if abs(sum(got.values()) - duration_ms) > 1:
            problems.append(f"{rid}: phases sum to {sum(got.values())} ms, the span lasts {duration_ms:.3f} ms")
        want = walk_phases(span, children, type_of)
        off = {p: (got[p], round(want[p] / MS, 3)) for p in PHASES if abs(got[p] - want[p] / MS) > 1}
        if off:
            problems.append(f"{rid}: phases (agent's, this test's) differ: {off}")
        below = subtree(span, children)
        below_by_key = spans_by_key(below)
        model_servers = [s for s in below if s["kind"] == "SERVER" and type_of(s) == "model"]
        tools = [s for s in below if s["kind"] == "SERVER" and type_of(s) == "resources"
                 and attributes(s).get("http.route") not in ("/seed_session", "/verify")
                 and type_of(below_by_key[parent_key(s)]) == "agent"]
        counts = (a.get("gym.rollout.model_calls"), a.get("gym.rollout.tool_calls"))
        if counts != (len(model_servers), len(tools)) or (want_counts and counts != want_counts):
            problems.append(f"{rid}: model_calls, tool_calls = {counts}, spans say "
                            f"({len(model_servers)}, {len(tools)}); the environment makes {want_counts}")
        calls = [below_by_key[parent_key(s)] for s in model_servers]
        for key in ("gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"):
            want_tokens = sum(attributes(c).get(key, 0) for c in calls)
            if a.get(key) != want_tokens:
                problems.append(f"{rid}: {key} = {a.get(key)}, its model calls say {want_tokens}")
    return problems


def print_phase_split(rollout_spans):
    """The phases of the median and of the slowest rollout (for the record)."""
    ordered = sorted(rollout_spans, key=lambda s: s["end_time_unix_nano"] - s["start_time_unix_nano"])
    for label, span in (("median", ordered[len(ordered) // 2]), ("slowest", ordered[-1])):
        a = attributes(span)
        split = ", ".join(f"{p} {a[f'gym.rollout.phase.{p}_ms']}" for p in PHASES)
        print(f"{label} rollout {a['nemo.gym.rollout.id']}: "
              f"{(span['end_time_unix_nano'] - span['start_time_unix_nano']) / 1e9:.2f} s = {split} ms")


class Poller:
    """GET /rollouts every POLL_S in a thread of its own, keeping every answer."""

    POLL_S = 0.5

    def __init__(self, port):
        self.url = f"http://127.0.0.1:{port}/rollouts"
        self.views = []
        self.errors = []
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        while not self.stopped.is_set():
            try:
                status, body = http_get(self.url, timeout=5)
                self.views.append((time.time_ns(), json.loads(body)))
            except OSError as error:
                self.errors.append(repr(error))
            self.stopped.wait(self.POLL_S)

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.stopped.set()
        self.thread.join(10)


class TopInTmux:
    """`gym-tracer top` in a detached tmux session of a fixed size; `screen()` captures it."""

    def __init__(self, port):
        self.session = f"gym-tracer-top-{port}"
        subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)
        subprocess.run(["tmux", "new-session", "-d", "-s", self.session, "-x", "200", "-y", "40",
                        f"{agent_binary()} top --agent 127.0.0.1:{port}"], check=True)

    def screen(self):
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.session], check=True,
                              capture_output=True, text=True).stdout

    def screen_with_stragglers(self):
        """The screen, once its first rollout row is a straggler's (else None)."""
        screen = self.screen()
        lines = screen.splitlines()
        header = next((i for i, line in enumerate(lines) if "ROLLOUT" in line and "PHASE" in line), None)
        return screen if header is not None and "STRAGGLER" in lines[header + 1] else None

    def quit(self):
        subprocess.run(["tmux", "send-keys", "-t", self.session, "q"], capture_output=True)
        time.sleep(0.5)
        alive = subprocess.run(["tmux", "has-session", "-t", self.session], capture_output=True).returncode == 0
        subprocess.run(["tmux", "kill-session", "-t", self.session], capture_output=True)
        return not alive


def test_rollouts_carry_their_phases_stragglers_are_named_and_the_live_view_shows_them(agents):
    assert shutil.which("tmux"), "tmux is not installed: `cargo xtask setup` installs it (as root)"
    run = RealGymRun(gym_venv(), upstream_delay_s=UPSTREAM_DELAY_S)
    run.canned.slow_every, run.canned.slow_extra_s = SLOW_EVERY, SLOW_EXTRA_S
    health_port = free_ports(1)[0]
    top = poller = None
    try:
        run.start()
        by_pid = {pid: name for name, pid in run.pids.items()}
        types_by_pid = {pid: SHORT_TYPES[run.server_type(name)] for name, pid in run.pids.items()}
        tracer = lambda *extra: agents(discover=True, extra_args=extra, metric_interval=2)  # noqa: E731
        agent = attached_tracer(tracer, run, "--health-listen", str(health_port))
        poller = Poller(health_port).start()
        driving = threading.Thread(target=lambda: setattr(run, "batch", run.drive_rollouts(ROLLOUTS)))
        driving.start()
        # While the slow calls are in flight, the stragglers come to the top of the screen.
        top = TopInTmux(health_port)
        screen = wait_until(top.screen_with_stragglers, 120, lambda: f"a straggler on top's screen:\n{top.screen()}",
                            interval=0.2)
        top_quit = top.quit()
        # Without a terminal: one plain snapshot, the same view.
        snapshot = subprocess.run([str(agent_binary()), "top", "--agent", f"http://127.0.0.1:{health_port}/"],
                                  capture_output=True, text=True, timeout=30)
        driving.join(600)
        upstream = run.upstream_requests()
        spans, summary = stop_when_exported(agent, run, SPANS_PER_ROLLOUT * ROLLOUTS)
        poller.stop()
        metric_lines = agent.lines()
    finally:
        if poller:
            poller.stop()
        run.stop()

    print("\ninsight counters:", {k: summary.get(k) for k in INSIGHT_COUNTERS})
    types = set(types_by_pid.values())
    assert types == {"agent", "model", "resources"}, types_by_pid
    name_of_type = {kind: by_pid[pid] for pid, kind in types_by_pid.items()}
    batch = run.batch
    assert [r["status"] for r in batch] == [200] * ROLLOUTS
    ids = {f"{r['task_index']}-{r['rollout_index']}" for r in batch}

    def type_of(span):
        return server_type_of(span, types_by_pid)

    children = children_by_parent(spans)
    rollout_spans = [s for s in spans if s["name"] == "gym.rollout"]
    assert sorted(attributes(s)["nemo.gym.rollout.id"] for s in rollout_spans) == sorted(ids)

    # (1) and (2): the phases.
    problems = phase_problems(rollout_spans, children, type_of, want_counts=(2, 1))
    assert not problems, f"{len(problems)} rollouts wrong:\n" + "\n".join(problems[:20])
    print_phase_split(rollout_spans)

    # (3): stragglers.
    slow_calls = [r for r in upstream if r.get("slow")]
    assert len(slow_calls) == sum(1 for r in upstream if r["n"] % SLOW_EVERY == 0) >= 1, len(slow_calls)
    model_pid = run.pids[name_of_type["model"]]
    slow_client_spans = [s for s in spans if s["kind"] == "CLIENT" and s["resource"]["process.pid"] == model_pid
                         and s["end_time_unix_nano"] - s["start_time_unix_nano"] >= SLOW_EXTRA_S * 1e9]
    assert len(slow_client_spans) == len(slow_calls), (len(slow_client_spans), len(slow_calls))
    holding = {s["trace_id"] for s in slow_client_spans}
    flagged = {s["trace_id"] for s in rollout_spans if attributes(s).get("gym.rollout.straggler") is True}
    by_trace = {s["trace_id"]: s for s in rollout_spans}
    for trace in holding:
        a = attributes(by_trace[trace])
        assert a["gym.rollout.phase.model_ms"] >= SLOW_EXTRA_S * 1000, a
    ordered = sorted(rollout_spans, key=lambda s: s["end_time_unix_nano"])
    by_rule, near_threshold, durations = set(), set(), []
    for span in ordered:
        duration = span["end_time_unix_nano"] - span["start_time_unix_nano"]
        if len(durations) >= STRAGGLER_MIN_COMPLETED:
            threshold = STRAGGLER_FACTOR * sorted(durations)[(len(durations) + 1) // 2 - 1]
            if duration > threshold:
                by_rule.add(span["trace_id"])
            if abs(duration / threshold - 1) < BORDERLINE:
                near_threshold.add(span["trace_id"])
        durations.append(duration)
    median_s = sorted(durations)[len(durations) // 2] / 1e9
    print(f"\n{ROLLOUTS} rollouts: median {median_s:.2f} s, {len(slow_calls)} slow calls in "
          f"{len(holding)} rollouts, {len(flagged)} stragglers ({len(by_rule)} by this test's rule)")
    assert holding <= flagged, f"rollouts holding a slow call not flagged: {sorted(holding - flagged)}"
    assert (flagged ^ by_rule) <= near_threshold, \
        f"flagged but not by the rule: {flagged - by_rule}; by the rule, not flagged: {by_rule - flagged}"
    assert summary["rollout_stragglers"] == len(flagged)
    assert summary["rollouts_completed"] == ROLLOUTS
    for counter in INSIGHT_COUNTERS[2:]:
        assert summary[counter] == 0, (counter, summary[counter])

    # (4): metrics (cumulative: the last point of each series is the total).
    def last_points(name):
        latest = {}
        for line in metric_lines:
            if line.get("metric") == name:
                key = (line["resource"].get("process.pid"), json.dumps(line["attributes"], sort_keys=True))
                latest[key] = line
        return list(latest.values())

    agent_pid = run.pids[name_of_type["agent"]]
    phase_points = last_points("gym.rollout.phase.duration")
    assert sorted(p["attributes"]["gym.rollout.phase"] for p in phase_points) == sorted(PHASES)
    assert {p["resource"]["process.pid"] for p in phase_points} == {agent_pid}
    assert [p["count"] for p in phase_points] == [ROLLOUTS] * len(PHASES)
    queue_pids = {p["resource"]["process.pid"] for p in last_points("gym.server.queue_delay")}
    loop_pids = {p["resource"]["process.pid"] for p in last_points("gym.server.loop.utilization")}
    assert queue_pids == set(run.pids.values()) == loop_pids, (queue_pids, loop_pids, run.pids)
    for point in last_points("gym.server.loop.utilization"):
        assert 0.0 <= point["value"] <= 1.0, point
    straggler_points = last_points("gym.rollouts.stragglers")
    assert [p["value"] for p in straggler_points] == [len(flagged)], straggler_points

    # (5): the live view.
    views = [v for _, v in poller.views]
    listed = [r for v in views for r in v["rollouts"]]
    assert listed, "no rollout was ever listed in flight"
    assert {r["phase"] for r in listed} <= set(PHASES)
    assert {r["agent"] for r in listed} == {name_of_type["agent"]}
    assert {r["rollout_id"] for r in listed if r["rollout_id"]} <= ids
    assert all(r["elapsed_s"] >= 0 for r in listed)
    assert any(r["straggler"] for r in listed), "no straggler was ever listed"
    # The agent makes the view once a second: an answer polled at t shows the rollout as it
    # was up to a second before. So a poll counts as inside a slow call from 1.5 s after the
    # call started (its view is from within the call) until 0.5 s before it ended.
    slow_windows = collections.defaultdict(list)
    for s in slow_client_spans:
        slow_windows[s["trace_id"]].append((s["start_time_unix_nano"] + MS * 1500,
                                            s["end_time_unix_nano"] - MS * 500))
    in_slow_call = [(r["phase"], r["span"]["server"], r["span"]["name"]) for t, v in poller.views
                    for r in v["rollouts"]
                    if any(low <= t <= high for low, high in slow_windows.get(r["trace_id"], []))]
    # In the model server: model — in its call to the upstream, placed by task lineage (on for
    # model servers) as it is written, or in its request. Or not placed yet: in Gym's default
    # configuration the agent's own /v1/responses calls the model with nothing that names its
    # request until the answer (the echoed response id), so until then the rollout is seen in
    # that request (or in its /run, when its self-call is not placed yet either).
    allowed = {("model", name_of_type["model"], "HTTP POST"),
               ("model", name_of_type["model"], "POST /v1/responses"),
               ("agent", name_of_type["agent"], "POST /v1/responses"),
               ("agent", name_of_type["agent"], "POST /run")}
    assert in_slow_call and set(in_slow_call) <= allowed, collections.Counter(in_slow_call)
    assert ("model", name_of_type["model"], "HTTP POST") in in_slow_call, collections.Counter(in_slow_call)
    for _, view in poller.views:
        for r in view["rollouts"]:
            kind = {name: kind for kind, name in name_of_type.items()}[r["span"]["server"]]
            consistent = {"model": {"model"}, "agent": {"agent"}, "tool": {"resources"}, "verify": {"resources"},
                          "queue": {"agent", "resources"}, "external": {"agent", "resources"}}[r["phase"]]
            assert kind in consistent, r
    assert views[-1]["completed"]["count"] == ROLLOUTS
    assert {s["name"] for s in views[-1]["servers"]} == set(run.pids), views[-1]["servers"]

    # (6): top's screen, as captured; its plain snapshot.
    assert snapshot.returncode == 0, snapshot.stderr
    snapshot_lines = snapshot.stdout.splitlines()
    assert snapshot_lines[0].startswith(f"gym-tracer top — http://127.0.0.1:{health_port} — "), snapshot_lines[0]
    assert snapshot_lines[2].split() == ["ROLLOUT", "AGENT", "ELAPSED", "PHASE", "NOW", "IN", "MODEL", "TOOLS"]
    print(screen)
    assert top_quit, "top did not quit on q"
    lines = screen.splitlines()
    assert lines[0].startswith("gym-tracer top — http://127.0.0.1:"), lines[0]
    header = next(i for i, line in enumerate(lines) if "ROLLOUT" in line and "PHASE" in line)
    rows = [line.strip("│ ") for line in lines[header + 1:] if line.startswith("│") and line.strip("│ ")]
    rows = rows[:next(i for i, row in enumerate(rows) if row.startswith("SERVER"))]
    marked = [row for row in rows if row.endswith("STRAGGLER")]
    assert marked and rows[:len(marked)] == marked, "stragglers are not the first rows:\n" + "\n".join(rows)
    for row in rows:
        assert row.split()[0] in ids and any(f" {phase} " in row for phase in PHASES), row
    for name in run.pids:
        assert any(name in line for line in lines[header + 2:]), f"{name} not on the screen"


def test_a_judge_inside_verify_is_model_time_under_verify(agents):
    """Another shape: equivalence_llm_judge (its /verify calls the judge model server),
    JUDGE_ROLLOUTS at once, Gym's default configuration, the default --task-lineage auto (the
    judge calls are placed under their /verify). (1) and (2) as above for every rollout; every
    rollout spends time in verify; the judge calls count as model calls: over all rollouts,
    model_calls adds up to the upstream's own count of the calls it answered (every model
    call of a rollout is one upstream call), policy and judge."""
    run = RealGymRun(gym_venv(), environment=JUDGE_ENVIRONMENT, upstream_delay_s=UPSTREAM_DELAY_S)
    try:
        run.start()
        types_by_pid = {pid: SHORT_TYPES[run.server_type(name)] for name, pid in run.pids.items()}
        tracer = lambda *extra: agents(discover=True, extra_args=extra)  # noqa: E731
        agent = attached_tracer(tracer, run)
        batch = run.drive_rollouts(JUDGE_ROLLOUTS)
        upstream = run.upstream_summary()
        spans, summary = stop_when_exported(agent, run, tree_size(expected_tree(run)) * JUDGE_ROLLOUTS)
    finally:
        run.stop()
    assert [(r["status"], r["reward"]) for r in batch] == [(200, r["expected_reward"]) for r in batch]
    ids = sorted(f"{r['task_index']}-{r['rollout_index']}" for r in batch)
    children = children_by_parent(spans)
    rollout_spans = [s for s in spans if s["name"] == "gym.rollout"]
    assert sorted(attributes(s)["nemo.gym.rollout.id"] for s in rollout_spans) == ids

    def type_of(span):
        return server_type_of(span, types_by_pid)

    problems = phase_problems(rollout_spans, children, type_of)
    assert not problems, f"{len(problems)} rollouts wrong:\n" + "\n".join(problems[:20])
    print_phase_split(rollout_spans)
    no_verify = [attributes(s)["nemo.gym.rollout.id"] for s in rollout_spans
                 if attributes(s)["gym.rollout.phase.verify_ms"] <= 0]
    assert not no_verify, f"rollouts with no verify time: {no_verify}"
    judge_calls = sum(n for key, n in upstream["counts"].items() if key.endswith(" judge"))
    model_calls = sum(attributes(s)["gym.rollout.model_calls"] for s in rollout_spans)
    assert judge_calls > 0 and model_calls == upstream["requests"], (model_calls, upstream)
    assert summary["rollouts_completed"] == JUDGE_ROLLOUTS
    for counter in INSIGHT_COUNTERS[2:]:
        assert summary[counter] == 0, (counter, summary[counter])


def test_top_says_what_to_do_when_no_agent_answers():
    """`gym-tracer top` against an address where no agent listens: exit 1, and the message names
    the address and the option that serves the live view."""
    port = free_ports(1)[0]
    result = subprocess.run([str(agent_binary()), "top", "--agent", str(port)], capture_output=True, text=True,
                            timeout=30)
    assert result.returncode == 1, result
    assert f"no live view from the agent at http://127.0.0.1:{port}" in result.stderr, result.stderr
    assert f"gym-tracer run --health-listen 127.0.0.1:{port}" in result.stderr, result.stderr
    assert result.stdout == ""
