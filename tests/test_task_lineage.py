"""Task lineage (`gym-tracer run --task-lineage`): an LLM judge's call, written by a task the
resources server's /verify handler spawned, hangs under the rollout whose /verify caused it,
with hundreds of rollouts in flight at once.

Why this needs a test of its own: a Gym resources server that judges with an LLM calls its
judge model server from /verify with nothing in the call that names the rollout -- no cookie,
no id in the body, and (Gym's default configuration) no /ng-rollout/<id> prefix either -- and
the call is written by a task of the handler's (Starlette's middleware runs the endpoint in a
task group; arena_judge's two judge calls are asyncio.gather children), not by the task that
read the request. With 256 /verify requests in flight, nothing but the task's lineage (which
request-root task it descends from, recorded by a uprobe on `_asyncio` Task.__init__) tells
which one a judge call belongs to. Under `--task-lineage auto` (the default) the judge's
resources server and the model servers are probed (a model server's upstream call carries no
evidence either, unless the implementation echoes the upstream's response id), not the agent.

The real nemo-gym servers (tests/support/real_gym/launch.py) for two judge environments of the
package, Gym's telemetry off, the canned upstream answering after UPSTREAM_DELAY_S, traced by
gym-tracer with `--discover gym`:
- equivalence_llm_judge: one judge call per rollout, `POST /v1/responses` to policy_model (the
  policy's own model server; at most 64 at once, its `judge_endpoint_max_concurrency`);
- arena_judge: two judge calls per rollout under asyncio.gather, `POST /v1/chat/completions`
  to a model server of their own (arena_judge_judge_model);
each with Gym's default configuration ("gym-default") and with observability on
("observability": the agent's calls, and the judge calls made under the /ng-rollout/<id>
/verify, carry the /ng-rollout/<id>/ prefix). WARMUPS rollouts are driven one at a time first
(their rollout ids apart, excluded from the per-rollout checks, counted in the summary's), then
ROLLOUTS at once, every LOSE_EVERY-th decided "lose" by the upstream's judge. Checked:
1. every rollout answered 200 with the reward (and verdict) the upstream decided, no failure_kind;
2. every rollout is exactly one trace (its id derived from the rollout id) holding exactly the
   environment's expected tree (expected_tree: derived from simple_agent's /run and
   /v1/responses and the environment's verify(), see there), no span outside the rollouts'
   traces, tree_size spans per rollout;
3. every judge CLIENT span hangs under its own rollout's gym.verify, the judge model server's
   SERVER span under that CLIENT span (and, with observability, carries the rollout's id);
4. every span is in its parent's trace and inside its parent's time window (1 ms of slack;
   CLIENT -> SERVER edges cross processes, stamped from the same clock);
5. the agent's summary: parents_by_lineage = the judge calls of every rollout driven (warm-ups
   included) plus the model servers' upstream calls (the upstream's count of the POSTs it
   answered), lineage_processes = 1 + the model servers, lineage_processes_off = 0, lineage_conflicts = 0, no
   event lost in the kernel, no outbound call without a parent (parents_no_evidence,
   parents_ambiguous, parents_contradicted, parents_no_request_in_flight all 0);
6. no secret (the API key) nor any text of a prompt, an answer or a verdict is exported.

The contrast (test_judge_calls_without_lineage_are_roots): equivalence_llm_judge, Gym default,
CONTRAST_ROLLOUTS at once, `--task-lineage off`. A judge call then has a parent only where the
resources server had exactly one inbound request in flight as the call was written (the
warm-ups, and the batch's first or last /verify alone, if any): every other judge call is a
root, counted in parents_no_evidence, the rollout's trace ends at gym.verify, and the judge's
subtree is a trace of its own. A judge call that has a parent has its own rollout's gym.verify.

The summary's counters are the whole agent's: nothing else
Gym-shaped may run on the machine meanwhile (`cargo xtask test` runs one test at a time).

Needs target/gym-venv with arena_judge's packages (`cargo xtask setup`; see test_real_gym.py).
"""

import collections
import time

import pytest

from gym_expect import children_by_parent, parent_key, rollout_trace_id, span_key, spans_by_key
from harness import wait_until
from real_gym.canned_upstream import LOSE, POLICY_ANSWER
from real_gym.launch import API_KEY, JUDGE_CALLS, RealGymRun, upstream_verdict
from test_real_gym import canonical, gym_venv, harvest, render_shapes, rollout_problems, tree_shape, tree_size

ROLLOUTS = 256
CONTRAST_ROLLOUTS = 64
WARMUPS = 2
WARMUP_ROLLOUT = 900  # the warm-ups' rollout index: ids "0-900", "1-900", apart from the batch's
LOSE_EVERY = 4  # the upstream's judge decides against every 4th rollout (reward 0.0)
UPSTREAM_DELAY_S = 1.0
# See the module docstring: the agent's echoed-id edges under a saturated event loop.
MODES = {"gym-default": False, "observability": True}
CASES = [(environment, mode) for environment in JUDGE_CALLS for mode in MODES]
# Room between a span's and its parent's clocks: the same machine's, converted per process.
SLACK_NS = 1_000_000
# The counters that say an outbound call got no parent, or a doubtful one.
UNPARENTED = ["parents_no_evidence", "parents_ambiguous", "parents_contradicted", "parents_no_request_in_flight"]
# Printed for every case (any other counter with "parents" or "lineage" in its name too).
SHOWN = ["events_lost_in_kernel", "spans_flushed_unmatched", "task_context_conflicts", "cross_process_links"]
# The judge's model-server route and the gym.* span under it, by judge path.
JUDGE_SPANS = {"/v1/responses": ("POST /v1/responses", "gym.model.responses"),
               "/v1/chat/completions": ("POST /v1/chat/completions", "gym.model.chat_completions")}
# Never in the tracer's output (beside the rows' own texts, read per run): the key in the
# YAML, what the canned upstream answers (the policy's answer, the judges' reasoning), the
# verdict marker, and the judges' prompt templates.
NEVER_EXPORTED = [
    API_KEY, POLICY_ANSWER, LOSE, "reasoned step by step", "the same answer as the GOLD reference",
    "does not match the GOLD reference", "My own answer agrees with Assistant", "My final verdict is",
    "You are a meticulous STEM grader", "Please act as an impartial judge",
]


def model_call(caller, model, route="POST /v1/responses", semantic="gym.model.responses"):
    """`caller`'s CLIENT span to `model`: the model server's SERVER span, its gym.model.* span,
    and the model server's own CLIENT span to its (canned, untraced) upstream."""
    return ("HTTP POST", caller, [(route, model, [(semantic, model, [("HTTP POST", model, [])])])])


def expected_tree(run):
    """One rollout of `run`'s judge environment: (span name, server, children), order-free.

    simple_agent's /run (responses_api_agents/simple_agent/app.py `run`): POST /seed_session
    to the resources server, POST /v1/responses to the agent itself, POST /verify to the
    resources server. Its /v1/responses (`_create_episode`): one model call, since these rows
    offer no tools and the canned policy answers with a final message. The resources server's
    verify: equivalence_llm_judge one judge call (`check_twice_swap: false`, and no rescue pass
    for a lost first pass: `check_full_generation_on_fail: false`), arena_judge two
    (`asyncio.gather` of `_judge_once` both ways round). A model server's SERVER span has its
    gym.model.* child and that its CLIENT span to the upstream. 18 spans for
    equivalence_llm_judge, 22 for arena_judge (4 more for its second judge call)."""
    path, per_rollout = JUDGE_CALLS[run.environment]
    route, semantic = JUDGE_SPANS[path]
    agent, resources = run.agent, run.resources
    return ("POST /run", agent, [("gym.rollout", agent, [
        ("HTTP POST", agent, [("POST /seed_session", resources, [])]),
        ("HTTP POST", agent, [("POST /v1/responses", agent, [("gym.agent.responses", agent, [
            model_call(agent, run.policy_model),
        ])])]),
        ("HTTP POST", agent, [("POST /verify", resources, [("gym.verify", resources, [
            model_call(resources, run.judge_model, route, semantic) for _ in range(per_rollout)
        ])])]),
    ])])


def without_judge(tree):
    """`tree` with gym.verify's children (the judge calls) cut: what a rollout's trace holds
    when its judge calls are roots."""
    name, server, children = tree
    if name == "gym.verify":
        return (name, server, [])
    return (name, server, [without_judge(child) for child in children])


def judge_subtree(run):
    """One judge call's subtree (its CLIENT span the root)."""
    route, semantic = JUDGE_SPANS[JUDGE_CALLS[run.environment][0]]
    return model_call(run.resources, run.judge_model, route, semantic)


@pytest.fixture
def judge_gym():
    """Starts RealGymRun(environment=..., observability=...) with the upstream's delay; every
    run is stopped at teardown."""
    venv = gym_venv()
    runs = []

    def start(environment, observability):
        run = RealGymRun(venv, environment=environment, observability=observability, upstream_delay_s=UPSTREAM_DELAY_S)
        runs.append(run)
        run.start()
        assert run.judge_model is not None, f"{environment}: no judge model server in {run.roles}"
        return run

    yield start
    for run in runs:
        run.stop()


def attached_tracer(tracer, run, *extra_args):
    """gym-tracer with --discover gym (and `extra_args`), once it has attached to every server
    of `run` and harvested its routes."""
    agent = tracer(*extra_args)
    for name, pid in run.pids.items():
        agent.wait_for_stderr(f"attached pid {pid} as {name} ({run.server_type(name)})", timeout=30)
        agent.wait_for_routes(pid, timeout=30)
    return agent


def drive(run, n, rollout_offset, concurrency=None, lose=None):
    """`n` rollouts (drive_rollouts), checked as (1): [] of problems if each answered 200 with
    the reward and verdict the upstream decided and no failure_kind. Returns (results, ids,
    problems)."""
    results = run.drive_rollouts(n, concurrency, lose=lose, rollout_offset=rollout_offset)
    problems = []
    for r in results:
        rollout_id = f"{r['task_index']}-{r['rollout_index']}"
        want_verdict = upstream_verdict(run.environment, r["decided"], run.canned.judge_labels)
        if (r["status"], r["reward"], r["failure_kind"], r["verdict"]) != (200, r["expected_reward"], None,
                                                                          want_verdict):
            problems.append(f"rollout {rollout_id} ({r['decided']}): status {r['status']}, reward {r['reward']} "
                            f"(want {r['expected_reward']}), verdict {r['verdict']!r} (want {want_verdict!r}), "
                            f"failure_kind {r['failure_kind']!r}, error {r['error']!r}")
    ids = [f"{r['task_index']}-{r['rollout_index']}" for r in results]
    assert len(set(ids)) == n, f"rollout ids not distinct: {collections.Counter(ids).most_common(3)}"
    return results, ids, problems


def traced_spans(agent, run):
    """The spans of `run`'s servers (a concurrent test's tracer may harvest them: left out)."""
    pids = set(run.pids.values())
    return [s for s in agent.spans() if s["resource"].get("process.pid") in pids
            and not harvest(s["attributes"].get("http.request.method"), s["attributes"].get("url.path"))]


def stop_when_exported(agent, run, want):
    """Waits (softly: a missing span is for the checks to report) until `want` spans of `run`
    are out, lets a span too many come, stops the agent; returns the spans and the summary."""
    try:
        wait_until(lambda: len(traced_spans(agent, run)) >= want, 60, f"{want} spans", interval=0.5)
    except AssertionError:
        pass
    time.sleep(1.0)  # room for a span too many
    agent.stop()
    assert agent.returncode == 0, agent.stderr()[-5000:]
    return traced_spans(agent, run), agent.summary()


def describe(span, by_pid):
    a = span["attributes"]
    return (f"{span['kind']} {span['name']} of {by_pid.get(span['resource']['process.pid'], '?')} "
            f"{a.get('url.path') or a.get('url.full', '')} (span {span['span_id']}, parent "
            f"{span['parent_span_id'] or '-'}, trace {span['trace_id']}, rollout {a.get('nemo.gym.rollout.id', '?')})")


def judge_edge_problems(spans, rollout_ids, run, by_pid):
    """Check (3): in each rollout's trace, every judge CLIENT span of the resources server has
    the rollout's own gym.verify as parent, the judge model server's SERVER span under it
    names it as parent (and, with observability, carries the rollout's id); so many judge
    calls as the environment makes. Also every judge CLIENT span anywhere is in some rollout's
    trace."""
    resources, judge = run.pids[run.resources], run.pids[run.judge_model]
    path, per_rollout = JUDGE_CALLS[run.environment]
    route, _ = JUDGE_SPANS[path]
    by_trace = collections.defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    served = children_by_parent(s for s in spans if s["kind"] == "SERVER" and s["resource"]["process.pid"] == judge)
    problems = []
    for rollout_id in rollout_ids:
        members = by_trace.get(rollout_trace_id(rollout_id), [])
        verifies = [s for s in members if s["name"] == "gym.verify" and s["resource"]["process.pid"] == resources]
        if len(verifies) != 1:
            problems.append(f"rollout {rollout_id}: {len(verifies)} gym.verify spans in its trace")
            continue
        [verify] = verifies
        calls = [s for s in members if s["kind"] == "CLIENT" and s["resource"]["process.pid"] == resources]
        if len(calls) != per_rollout:
            problems.append(f"rollout {rollout_id}: {len(calls)} judge CLIENT spans in its trace, want {per_rollout}")
        for call in calls:
            if parent_key(call) != span_key(verify):
                problems.append(f"rollout {rollout_id}: {describe(call, by_pid)} is not under its gym.verify "
                                f"{verify['span_id']}")
            below = served.get(span_key(call), [])  # in the call's trace: one elsewhere is not under it
            if len(below) != 1:
                problems.append(f"rollout {rollout_id}: {describe(call, by_pid)} has {len(below)} SERVER spans of "
                                f"{run.judge_model} under it")
                continue
            [server] = below
            if server["name"] != route:
                problems.append(f"rollout {rollout_id}: under {call['span_id']}: {describe(server, by_pid)}")
            if run.observability and server["attributes"].get("nemo.gym.rollout.id") != rollout_id:
                problems.append(f"rollout {rollout_id}: {describe(server, by_pid)} is not the rollout's "
                                f"(its /ng-rollout prefix)")
    traces = {rollout_trace_id(rollout_id) for rollout_id in rollout_ids}
    outside = [s for s in spans if s["kind"] == "CLIENT" and s["resource"]["process.pid"] == resources
               and s["trace_id"] not in traces]
    if outside:
        problems.append(f"{len(outside)} judge CLIENT spans in no rollout's trace, e.g. "
                        + "; ".join(describe(s, by_pid) for s in outside[:3]))
    return problems


def parent_anywhere(span, by_key, by_id):
    """`span`'s parent: in its trace, else the span of its parent id in another trace (span ids
    are unique over the run, checked at teardown), so that a check can say the edge crosses
    traces; None if no span has that id."""
    return by_key.get(parent_key(span)) or by_id.get(span["parent_span_id"])


def timing_problems(spans, by_pid):
    """Check (4): every span with a parent among `spans` is in its parent's trace and starts
    and ends within it (SLACK_NS either side)."""
    by_key, by_id = spans_by_key(spans), {s["span_id"]: s for s in spans}
    problems = []
    for span in spans:
        parent = parent_anywhere(span, by_key, by_id)
        if parent is None:
            continue
        if parent["trace_id"] != span["trace_id"]:
            problems.append(f"{describe(span, by_pid)} is in another trace than its parent {describe(parent, by_pid)}")
        early = parent["start_time_unix_nano"] - span["start_time_unix_nano"]
        late = span["end_time_unix_nano"] - parent["end_time_unix_nano"]
        if early > SLACK_NS or late > SLACK_NS:
            problems.append(f"{describe(span, by_pid)} starts {early / 1e6:.3f} ms before, ends {late / 1e6:.3f} ms "
                            f"after its parent {describe(parent, by_pid)}")
    return problems


def secret_problems(agent, run):
    """Check (6): none of NEVER_EXPORTED, nor the rows' prompts, questions, baselines and
    expected answers (the longer ones), in the agent's output or log."""
    texts = set(NEVER_EXPORTED)
    for row in range(run.example_rows()):
        body = run.example_row(row)
        texts.add(body["responses_create_params"]["input"][-1]["content"])
        texts |= {body[key] for key in ("question", "baseline_answer", "expected_answer")
                  if isinstance(body.get(key), str) and len(body[key]) >= 12}
    stdout, stderr = agent.stdout_text(), agent.stderr()
    return [f"{text[:60]!r} {'exported' if text in stdout else 'logged'}"
            for text in sorted(texts) if text in stdout or text in stderr]


def report(case, counters):
    return [f"[{case}] summary:"] + [f"  {name} = {value}" for name, value in counters.items()]


def shown_counters(summary):
    names = [n for n in summary if "parents" in n or "lineage" in n] + SHOWN
    return {name: summary.get(name) for name in names}


@pytest.mark.parametrize("environment,mode", CASES, ids=[f"{e}-{m}" for e, m in CASES])
def test_judge_calls_hang_under_their_rollout(judge_gym, tracer, environment, mode):
    """(1)-(6) of the module docstring for one environment and mode: ROLLOUTS at once after
    WARMUPS alone, under the default --task-lineage auto."""
    run = judge_gym(environment, MODES[mode])
    by_pid = {pid: name for name, pid in run.pids.items()}
    agent = attached_tracer(tracer, run)
    tree = expected_tree(run)
    per_rollout, judge_calls = tree_size(tree), JUDGE_CALLS[environment][1]

    _, warmup_ids, warmup_problems = drive(run, WARMUPS, WARMUP_ROLLOUT, concurrency=1)
    results, ids, result_problems = drive(run, ROLLOUTS, 0, lose=LOSE_EVERY)
    upstream = run.upstream_summary()
    spans, summary = stop_when_exported(agent, run, per_rollout * (WARMUPS + ROLLOUTS))

    # (1) what the rollouts answered, and the upstream's count of judge calls.
    driven = WARMUPS + ROLLOUTS
    path = JUDGE_CALLS[environment][0]
    judged = upstream["counts"].get(f"POST {path} judge", 0)
    assert judged == judge_calls * driven, f"the upstream answered {judged} judge calls, want {judge_calls} x {driven}"
    problems = warmup_problems + result_problems
    assert not problems, f"{len(problems)} of {driven} rollouts answered wrong:\n" + "\n".join(problems[:10])
    lost = sum(r["lose"] for r in results)

    # The warm-ups' traces aside (by their derived ids), shown but not checked.
    warmup_traces = {rollout_trace_id(rollout_id) for rollout_id in warmup_ids}
    batch = [s for s in spans if s["trace_id"] not in warmup_traces]
    warmups = [s for s in spans if s["trace_id"] in warmup_traces]

    counters = shown_counters(summary)
    case = f"{environment} {mode}"
    lines = report(case, counters)
    lines[1:1] = [f"  {driven} rollouts ({WARMUPS} warm-ups alone, {ROLLOUTS} at once, {lost} decided lose), "
                  f"{len(spans)} spans ({len(warmups)} in the warm-ups' traces), want {per_rollout} per rollout"]
    print("\n" + "\n".join(lines))

    # (2) one trace per rollout, exactly the expected tree, nothing besides.
    tree_issues = rollout_problems(batch, ids, by_pid, expected_tree=tree)
    warm_shapes = tree_shape(warmups, by_pid)
    if warm_shapes != [canonical(tree)] * WARMUPS:
        print(f"  (the warm-ups' traces are not {WARMUPS} expected trees:)\n"
              + "\n".join("    " + line for line in render_shapes(warm_shapes)))
    # (3) the judge edges; (4) the time windows (warm-ups' spans included).
    edge_issues = judge_edge_problems(batch, ids, run, by_pid)
    time_issues = timing_problems(spans, by_pid)
    # (5) the agent's own account: each judge call and each upstream call decided by lineage, the
    # judge's resources server and the model servers probed, nothing left without a parent or lost.
    upstream_calls = sum(n for key, n in upstream["counts"].items() if key.startswith("POST "))
    want = {"parents_by_lineage": judge_calls * driven + upstream_calls,
            "lineage_processes": 1 + len(run.model_servers), "lineage_processes_off": 0,
            "lineage_conflicts": 0, "parents_decided_late": 0, "events_lost_in_kernel": 0,
            **{name: 0 for name in UNPARENTED}}
    counter_issues = [f"summary {name} = {summary.get(name)}, want {value}" for name, value in want.items()
                      if summary.get(name) != value]
    resources = run.pids[run.resources]
    if not any(m.startswith(f"pid {resources}: task lineage on") for m in agent.log_messages()):
        counter_issues.append(f"no log line says {run.resources} (pid {resources}) is probed")
    # (6) nothing secret.
    secrets = secret_problems(agent, run)

    failures = tree_issues + edge_issues + time_issues + counter_issues + secrets
    if failures:
        print("\n".join(failures[:200]))
    assert not failures, "\n".join(
        lines + [f"{len(tree_issues)} tree, {len(edge_issues)} judge-edge, {len(time_issues)} timing, "
                 f"{len(counter_issues)} summary, {len(secrets)} secret problems; first ones:"]
        + tree_issues[:8] + edge_issues[:8] + time_issues[:8] + counter_issues + secrets
        + ["expected tree:"] + render_shapes([canonical(tree)]))


def in_flight(servers, instant):
    """How many of the SERVER spans `servers` were being served at `instant` (ns)."""
    return sum(s["start_time_unix_nano"] <= instant <= s["end_time_unix_nano"] for s in servers)


def test_judge_calls_without_lineage_are_roots(judge_gym, tracer):
    """The contrast: equivalence_llm_judge, Gym's default configuration, `--task-lineage off`,
    WARMUPS alone then CONTRAST_ROLLOUTS at once. A judge call has no evidence of its rollout
    but the resources server having one inbound request in flight as it was written: exactly
    those judge calls have a parent (their own rollout's gym.verify, which they lie within);
    every other is a root, counted in parents_no_evidence, heading a trace of the judge's
    subtree alone, and its rollout's trace ends at gym.verify. Nothing is counted for lineage."""
    environment = "equivalence_llm_judge"
    run = judge_gym(environment, False)
    by_pid = {pid: name for name, pid in run.pids.items()}
    agent = attached_tracer(tracer, run, "--task-lineage", "off")
    tree = expected_tree(run)
    subtree = judge_subtree(run)
    resources = run.pids[run.resources]

    _, warmup_ids, warmup_problems = drive(run, WARMUPS, WARMUP_ROLLOUT, concurrency=1)
    results, ids, result_problems = drive(run, CONTRAST_ROLLOUTS, 0, lose=LOSE_EVERY)
    spans, summary = stop_when_exported(agent, run, tree_size(tree) * (WARMUPS + CONTRAST_ROLLOUTS))
    problems = warmup_problems + result_problems
    assert not problems, "\n".join(problems[:10])
    all_ids = warmup_ids + ids
    driven = len(all_ids)

    # Which judge calls had one inbound request in flight in the resources server as they
    # started (its SERVER spans: /seed_session and /verify alike).
    inbound = [s for s in spans if s["kind"] == "SERVER" and s["resource"]["process.pid"] == resources]
    calls = [s for s in spans if s["kind"] == "CLIENT" and s["resource"]["process.pid"] == resources]
    alone = {span_key(c) for c in calls if in_flight(inbound, c["start_time_unix_nano"]) == 1}
    parented = {span_key(c) for c in calls if parent_key(c)}
    roots = [c for c in calls if not parent_key(c)]
    by_key, by_id = spans_by_key(spans), {s["span_id"]: s for s in spans}

    counters = shown_counters(summary)
    lines = report(f"{environment} gym-default --task-lineage off", counters)
    lines[1:1] = [f"  {driven} rollouts ({WARMUPS} warm-ups alone, {CONTRAST_ROLLOUTS} at once), {len(calls)} "
                  f"judge calls: {len(parented)} with a parent, {len(roots)} roots; {len(alone)} written with one "
                  f"inbound request in flight"]
    print("\n" + "\n".join(lines))

    issues = []
    if len(calls) != driven:
        issues.append(f"{len(calls)} judge CLIENT spans, want {driven}")
    if parented != alone:
        for key in sorted(parented ^ alone):
            call = by_key[key]
            issues.append(f"{describe(call, by_pid)}: {'a parent' if key in parented else 'a root'}, yet "
                          f"{in_flight(inbound, call['start_time_unix_nano'])} inbound requests in flight")
    # Never wrong: a parent is the own rollout's gym.verify (its trace the rollout's), the call
    # within it.
    for key in sorted(parented):
        call = by_key[key]
        parent = parent_anywhere(call, by_key, by_id)
        if parent is None or parent["name"] != "gym.verify" or parent["trace_id"] != call["trace_id"] \
                or parent["resource"]["process.pid"] != resources \
                or parent["attributes"].get("nemo.gym.rollout.id") not in all_ids \
                or call["trace_id"] != rollout_trace_id(parent["attributes"]["nemo.gym.rollout.id"]) \
                or not (parent["start_time_unix_nano"] - SLACK_NS <= call["start_time_unix_nano"]
                        <= call["end_time_unix_nano"] <= parent["end_time_unix_nano"] + SLACK_NS):
            issues.append(f"{describe(call, by_pid)}: its parent is "
                          + (describe(parent, by_pid) if parent else "no span exported"))
    # The traces: rollouts whose judge call has a parent hold the whole tree, the others the
    # tree without it; each root judge call heads a trace of the judge's subtree alone.
    joined = collections.Counter(by_key[c]["trace_id"] for c in parented)
    whole = [rollout_id for rollout_id in all_ids if joined[rollout_trace_id(rollout_id)]]
    cut = [rollout_id for rollout_id in all_ids if not joined[rollout_trace_id(rollout_id)]]
    rollout_traces = {rollout_trace_id(rollout_id) for rollout_id in all_ids}
    in_rollouts = [s for s in spans if s["trace_id"] in rollout_traces]
    for group, shape in [(whole, tree), (cut, without_judge(tree))]:
        if group:
            traces = {rollout_trace_id(rollout_id) for rollout_id in group}
            issues += rollout_problems([s for s in in_rollouts if s["trace_id"] in traces], group, by_pid,
                                       expected_tree=shape)
    by_trace = collections.defaultdict(list)
    for span in spans:
        if span["trace_id"] not in rollout_traces:
            by_trace[span["trace_id"]].append(span)
    root_traces = {c["trace_id"] for c in roots}
    for trace_id, members in by_trace.items():
        shapes = tree_shape(members, by_pid)
        if trace_id not in root_traces or shapes != [canonical(subtree)]:
            issues.append(f"trace {trace_id} ({len(members)} spans, no rollout's) is not one judge call's subtree:\n"
                          + "\n".join("    " + line for line in render_shapes(shapes)))
    if len(root_traces) != len(roots):
        issues.append(f"{len(roots)} root judge calls in {len(root_traces)} traces")
    # The summary: every root judge call counted as without evidence, and nothing else left
    # without a parent; nothing probed, nothing decided by lineage.
    want = {"parents_by_lineage": 0, "lineage_processes": 0, "lineage_tasks_probed": 0, "events_lost_in_kernel": 0,
            "parents_no_evidence": len(roots), "parents_ambiguous": 0, "parents_contradicted": 0, "parents_no_request_in_flight": 0}
    issues += [f"summary {name} = {summary.get(name)}, want {value}" for name, value in want.items()
               if summary.get(name) != value]
    if not roots:
        issues.append(f"no judge call is a root: {CONTRAST_ROLLOUTS} at once never overlapped?")
    issues += secret_problems(agent, run)
    if issues:
        print("\n".join(issues[:200]))
    assert not issues, "\n".join(lines + issues[:30])
