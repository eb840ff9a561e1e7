"""Issue #17 [exact-edges]: the real nemo-gym servers split over two hosts, one gym-tracer per
host, sharing nothing, and every cross-host call is an exact parent edge, or, where the server
on B cannot know the rollout of a request, a root that says why it is one.

Two topologies (tests/support/netns.py makes host B, a network namespace joined by a veth pair;
host A is the root network namespace, 10.231.N.1; host B is netns gtb-<hex>, 10.231.N.2):

"resources-on-b":
    host A: example_single_tool_call_simple_agent (agent)  --->  host B: example_single_tool_call
            policy_model (model) ---> canned upstream (127.0.0.1)          (resources)
            gym-tracer A (--pid agent --pid model)                  gym-tracer B (--pid resources)
  The agent calls the resources server at 10.231.N.2 (seed_session, get_weather, verify: three
  calls per rollout).

"model-on-b":
    host A: agent  --->  host B: policy_model (model) ---> canned upstream (B's 127.0.0.1)
            example_single_tool_call (resources)
            gym-tracer A (--pid agent --pid resources)      gym-tracer B (--pid model)
  The agent calls the model server at 10.231.N.2 (two calls per rollout); the model server
  calls its upstream on B's own loopback, so the upstream runs in B's namespace too.

Neither tracer sees the other end of a cross-host call: tracer A exports the CLIENT span,
tracer B the SERVER span, and each derives the id of that request's span from its TCP sequence
number, so B's SERVER span can name A's CLIENT span as its parent with nothing passed between
them -- when B also knows the request's rollout (its trace).

One rollout alone, then 64 at once (256 in the "inject" cases; the (task, rollout) pairs,
bodies and padding of test_real_gym's concurrent test), with Gym's observability on (the /ng-rollout/<id>/ prefixes:
"prefixes") and off ("gym-default"). Where B's server knows each request's rollout (every case
but model-on-b gym-default), checked over the union of both tracers' output:
a. every rollout is one trace (its derived id) holding exactly EXPECTED_TREE, the tree of a
   rollout traced on one host;
b. every CLIENT span of tracer A to host B's address has exactly one SERVER span of tracer B
   under it, in the same trace, and every SERVER span of B has such a CLIENT parent in A;
c. no span outside the rollouts' traces, SPANS_PER_ROLLOUT spans per rollout in all.
model-on-b also checks tracer B's summary: cross_host_parents = 2 per rollout, no unjoined.

model-on-b gym-default: the model server cannot know the rollout of its requests (no prefix, no
id in the body, no cookie on its first call), so gym-tracer must not join them, and say so:
d. every SERVER span of B is a root marked gym_tracer.parent.unjoined=caller_on_other_host,
   and tracer B counts them (cross_host_unjoined = 2 per rollout, cross_host_parents = 0);
e. each of those SERVER spans' trace holds exactly the model's subtree of EXPECTED_TREE and
   nothing else; no span of B is in a rollout's derived trace or names a span of A as parent;
f. on A every rollout is one trace holding EXPECTED_TREE without the model's subtrees (the
   agent's CLIENT spans to the model, still exported, are leaves), and nothing besides.
In every case no secret or prompt text is in either tracer's output.

"inject": the gym-default cases again, tracer A run with `--inject-traceparent remote`. A's
kernel gives each inbound request without a header its trace as it reads it (/run's, from
rollout collection), hands it over the loopback calls of the handler born for it (the agent's
self-call), and writes `traceparent: 00-<trace>-<span of the CLIENT span A exports>-01` into
every call to B, from a handler's first; calls on A go out unchanged. B's tracer takes the
header as the SERVER span's parent and keeps its trace. So Gym's default joins as the prefixes
do, in both topologies:
g. (a)-(c), a rollout's trace being the one A's kernel gave its /run (its gym.rollout span's);
h. tracer A wrote exactly one header per call to B and none else (traceparents_injected = the
   calls to B; not_known, not_delivered, failed 0), and handed its loopback calls' trace over
   instead; tracer B took every parent from a header (parents_from_traceparent = the calls to
   B, cross_host_parents and cross_host_unjoined 0).

Needs root (the namespace), iproute2 and nsenter, and target/gym-venv (see test_real_gym.py).
"""

import collections
import contextlib
import time

import pytest

from harness import Agent, wait_until
from netns import TwoHosts
from gym_expect import children_by_parent, parent_key, rollout_trace_id, shared_span_ids, span_key, spans_by_key
from real_gym.launch import MODEL, PADDING, RESOURCES, SERVER_TYPES, RealGymRun
from test_real_gym import (AT_ONCE, BODY_BYTES, EXAMPLE_ROWS, EXPECTED_TREE, NEVER_EXPORTED, SOLO,
                           SPANS_PER_ROLLOUT, attached_tracer, canonical, drive_at_once, expected_requests, gym_venv,
                           harvest, render_shapes, rollout_problems, tree_shape, tree_size, wait_for_requests)

# Topology -> the servers on host B (the rest are on host A).
TOPOLOGIES = {"resources-on-b": (RESOURCES,), "model-on-b": (MODEL,)}
OBSERVABILITY = {"prefixes": True, "gym-default": False}
# (topology, observability) where B's server cannot know its requests' rollout: no cross-host join.
UNJOINABLE = {("model-on-b", False)}
# Summary counters that say how spans were joined across hosts (or not).
COUNTER_WORDS = ("edge", "unjoined", "cross")
UNJOINED = "gym_tracer.parent.unjoined"  # set on a SERVER span left a root: why
INJECT = ("--inject-traceparent", "remote")
INJECT_COUNTERS = ("traceparents_injected", "traceparents_handed_over", "traceparents_not_known", "traceparents_carried",
                   "traceparents_head_unscanned", "traceparents_owner_answered", "traceparents_not_delivered",
                   "traceparents_failed", "traces_published", "traces_unsettled")
# With --inject-traceparent remote, Gym's production-sized batch: 256 rollouts in flight.
INJECT_AT_ONCE = [(task, 1) for task in range(256)]
# Both tracers stamp spans from the same machine's clock; room for their conversions to differ.
CLOCK_SLACK_NS = 1_000_000


def cross_host_calls(node, host_b):
    """How many calls in the tree `node` go from a server not in `host_b` to one in it."""
    name, server, children = node
    return sum((server not in host_b and child[1] in host_b) + cross_host_calls(child, host_b) for child in children)


def local_calls(node, host_b):
    """How many calls in the tree `node` a server not in `host_b` makes to one not in it (or to
    its upstream, a leaf CLIENT span): the calls on host A."""
    name, server, children = node
    own = name.startswith("HTTP ") and server not in host_b and (not children or children[0][1] not in host_b)
    return own + sum(local_calls(child, host_b) for child in children)


def split_tree(node, host_b):
    """`node` without the subtrees of the servers in `host_b` called from a server not in it
    (the callers' CLIENT spans stay, as leaves), and those subtrees."""
    name, server, children = node
    kept, cut = [], []
    for child in children:
        if server not in host_b and child[1] in host_b:
            cut.append(child)
        else:
            pruned, below = split_tree(child, host_b)
            kept.append(pruned)
            cut += below
    return (name, server, kept), cut


def describe(span, host="?"):
    a = span["attributes"]
    return (f"{host}'s {span['kind']} {span['name']} {a.get('url.path') or a.get('url.full', '')} (rollout "
            f"{a.get('nemo.gym.rollout.id', '?')}, span {span['span_id']}, trace {span['trace_id']})")


def edge_problems(spans_a, spans_b, b_address):
    """Checks (b): the number of exact cross-host edges, and what is wrong with the rest."""
    calls = [s for s in spans_a if s["kind"] == "CLIENT" and s["attributes"].get("server.address") == b_address]
    served = [s for s in spans_b if s["kind"] == "SERVER"]
    # An edge joins two spans of one trace: by (trace, span id). By span id alone only to tell
    # an edge named in another trace from none (span ids are unique over the run, checked apart).
    under, named = children_by_parent(served), collections.defaultdict(list)
    for span in served:
        named[span["parent_span_id"]].append(span)
    by_key, by_id = spans_by_key(calls), {s["span_id"]: s for s in calls}
    exact, problems, tally = 0, [], collections.Counter()
    for call in calls:
        found = named.get(call["span_id"], [])  # whatever their trace
        if len(found) == 1 and under.get(span_key(call)) == found:  # that one in the call's trace
            exact += 1
            continue
        if len(found) != 1:
            tally[f"A's CLIENT span to B with {len(found)} SERVER spans of B under it"] += 1
            problems.append(f"{describe(call, 'A')}: {len(found)} SERVER spans of B under it")
        else:
            tally["A's CLIENT span to B whose SERVER span of B is in another trace"] += 1
            problems.append(f"{describe(call, 'A')}: its SERVER span of B is in trace {found[0]['trace_id']}")
    for span in served:
        if parent_key(span) in by_key:
            continue
        parent = by_id.get(span["parent_span_id"])  # in another trace, if any
        why = span["attributes"].get(UNJOINED)
        if not span["parent_span_id"]:  # a root: "" in gym-tracer's output
            reason = "a root" + (f" ({UNJOINED}={why})" if why else "")
            what = reason
        elif parent is None:
            reason = "its parent is no CLIENT span of A"
            what = f"parent_span_id {span['parent_span_id']} is no CLIENT span of A to {b_address}"
        else:
            reason = "its CLIENT parent of A is in another trace"
            what = f"its CLIENT parent of A is in trace {parent['trace_id']}"
        tally[f"B's SERVER {span['name']}: {reason}"] += 1
        problems.append(f"{describe(span, 'B')}: {what}")
    return exact, calls, served, problems, tally


def unjoined_problems(spans_a, spans_b, b_address, rollout_ids, subtree, by_pid):
    """Checks (d), (e) of B's spans where B cannot join: what is wrong, and the counts
    (A's CLIENT spans to B, B's SERVER spans, those joined to a span of A, those marked unjoined)."""
    calls = [s for s in spans_a if s["kind"] == "CLIENT" and s["attributes"].get("server.address") == b_address]
    served = [s for s in spans_b if s["kind"] == "SERVER"]
    # By span id alone, whatever the trace: B names no span of A at all (stricter than within a trace).
    a_ids = {s["span_id"] for s in spans_a}
    spans = spans_a + spans_b
    by_trace = collections.defaultdict(list)
    for span in spans:
        by_trace[span["trace_id"]].append(span)
    problems = []
    joined = [s for s in spans_b if s["parent_span_id"] in a_ids]
    for span in joined:
        problems.append(f"{describe(span, 'B')}: names span {span['parent_span_id']} of A as its parent (a guessed edge)")
    marked = []
    for span in served:
        a = span["attributes"]
        if span["name"] != "POST /v1/responses":
            problems.append(f"{describe(span, 'B')}: not POST /v1/responses")
        if span["parent_span_id"]:  # a root's is "" in gym-tracer's output
            problems.append(f"{describe(span, 'B')}: parent_span_id {span['parent_span_id']}, want none (a root)")
        if a.get(UNJOINED) != "caller_on_other_host":
            problems.append(f"{describe(span, 'B')}: {UNJOINED}={a.get(UNJOINED)!r}, want 'caller_on_other_host'")
        elif not span["parent_span_id"]:
            marked.append(span)
        shapes = tree_shape(by_trace[span["trace_id"]], by_pid)
        if shapes != [canonical(subtree)]:
            problems.append(f"{describe(span, 'B')}: its trace holds {len(by_trace[span['trace_id']])} spans, not "
                            f"exactly the model's subtree:\n" + "\n".join("    " + line for line in render_shapes(shapes)))
    served_traces = {s["trace_id"] for s in served}
    outside = [s for s in spans_b if s["trace_id"] not in served_traces]
    if outside:
        problems.append(f"{len(outside)} spans of B in no trace of a SERVER span of B: "
                        + "; ".join(describe(s, "B") for s in outside[:5]))
    derived = {rollout_trace_id(rollout_id): rollout_id for rollout_id in rollout_ids}
    for span in spans_b:
        if span["trace_id"] in derived:
            problems.append(f"{describe(span, 'B')}: in rollout {derived[span['trace_id']]}'s derived trace")
    call_keys = {span_key(s) for s in calls}
    under_calls = [s for s in spans if parent_key(s) in call_keys]
    if under_calls:
        problems.append(f"{len(under_calls)} spans under A's CLIENT spans to B (want them leaves): "
                        + "; ".join(describe(s) for s in under_calls[:5]))
    return calls, served, joined, marked, problems


CASES = [(topology, label, False) for topology in TOPOLOGIES for label in OBSERVABILITY]
CASES += [(topology, "gym-default", True) for topology in TOPOLOGIES]


@pytest.mark.parametrize("topology,label,inject", CASES,
                         ids=[f"{t}-{label}" + "-inject" * inject for t, label, inject in CASES])
def test_cross_host_edges_are_exact(topology, label, inject):
    venv = gym_venv()
    observability = OBSERVABILITY[label]
    on_b = TOPOLOGIES[topology]
    on_a = tuple(name for name in SERVER_TYPES if name not in on_b)
    joinable = (topology, observability) not in UNJOINABLE or inject
    with contextlib.ExitStack() as stack:
        # Torn down in reverse: the tracers, then the servers (and upstream), then host B.
        hosts = stack.enter_context(TwoHosts())
        # The model server calls its upstream at 127.0.0.1: on B, B's loopback, so the upstream is on B too.
        run = RealGymRun(venv, access_log=True, observability=observability,
                         hosts={name: hosts.b_address if name in on_b else hosts.a_address for name in SERVER_TYPES},
                         netns={name: hosts.b_exec for name in on_b},
                         upstream_netns=hosts.b_exec if MODEL in on_b else None)
        stack.enter_context(run)
        pids = run.pids
        by_pid = {pid: name for name, pid in pids.items()}
        pids_a = {name: pids[name] for name in on_a}
        pids_b = {name: pids[name] for name in on_b}

        def tracer_on(host_pids, wrapper=(), extra_args=()):
            """gym-tracer with --pid for each server of one host, once it attached them all
            and harvested their routes; stopped (or killed) at teardown."""
            agent = Agent(pids=list(host_pids.values()), wrapper=wrapper, extra_args=extra_args)
            stack.callback(agent.close)
            return attached_tracer(lambda: agent.start(), host_pids)

        # nsenter, not `ip netns exec`: the latter mounts a fresh /sys, without tracefs.
        tracer_a = tracer_on(pids_a, extra_args=INJECT if inject else ())
        tracer_b = tracer_on(pids_b, wrapper=hosts.b_enter)

        def body_options(task):
            return {"row_index": task % EXAMPLE_ROWS, "pad_to": BODY_BYTES}

        at_once = INJECT_AT_ONCE if inject else AT_ONCE
        rollouts = [SOLO, *at_once]
        ids = {f"{task}-{rollout}": (task, rollout) for task, rollout in rollouts}
        assert len(ids) == len(rollouts)

        before = {name: len(entries) for name, entries in run.access_log_paths().items()}
        results = {SOLO: run.drive_rollout(*SOLO, **body_options(SOLO[0]))}
        results.update(drive_at_once(run, at_once, body_options))
        assert {key: result["reward"] for key, result in results.items()} == {key: 1.0 for key in rollouts}, results
        if MODEL in on_b:  # the model's upstream, on B's loopback, asked from inside B
            upstream = run.upstream_requests()
            assert collections.Counter((r["method"], r["path"], r["auth_ok"]) for r in upstream) == \
                {("POST", "/v1/responses", True): 2 * len(rollouts)}, upstream

        expected_paths = collections.Counter(
            request for rollout_id in ids for request in expected_requests(rollout_id, observability))
        served = wait_for_requests(run, before, sum(expected_paths.values()), timeout=30)
        assert collections.Counter(served) == expected_paths, run.access_log_paths()

        def ours(agent, host_pids):
            return [s for s in agent.spans() if s["resource"].get("process.pid") in host_pids.values()
                    and not harvest(s["attributes"].get("http.request.method"), s["attributes"].get("url.path"))]

        # Each tracer's SERVER spans, then (softly: a missing span is the assertions' to report) all.
        for agent, host_pids, host in [(tracer_a, pids_a, "A"), (tracer_b, pids_b, "B")]:
            want = sum(name in host_pids for name, *_ in served)
            wait_until(lambda: sum(s["kind"] == "SERVER" for s in ours(agent, host_pids)) >= want, 20,
                       lambda: f"{want} SERVER spans from tracer {host}:\n{agent.stderr()[-3000:]}")
        try:
            wait_until(lambda: len(ours(tracer_a, pids_a)) + len(ours(tracer_b, pids_b))
                       >= SPANS_PER_ROLLOUT * len(rollouts), 5, "every span")
        except AssertionError:
            pass
        time.sleep(1.5)  # the stitch delay, and room for a span too many
        for agent, host in [(tracer_a, "A"), (tracer_b, "B")]:
            agent.stop()
            assert agent.returncode == 0, f"tracer {host}:\n{agent.stderr()}"

        spans_a, spans_b = ours(tracer_a, pids_a), ours(tracer_b, pids_b)
        spans = spans_a + spans_b
        counters = {host: {k: v for k, v in agent.summary().items() if any(w in k for w in COUNTER_WORDS)}
                    for agent, host in [(tracer_a, "A"), (tracer_b, "B")]}

        cross_per_rollout = cross_host_calls(EXPECTED_TREE, on_b)
        want_edges = cross_per_rollout * len(rollouts)
        case = f"{topology} {label}" + " inject" * inject
        a_tree, cut = split_tree(EXPECTED_TREE, on_b)
        if joinable:
            # (a), (c): every rollout one trace of exactly EXPECTED_TREE, nothing besides; with
            # injection, the trace A's kernel gave its /run and wrote into its calls to B (what
            # its gym.rollout span, which names the rollout, is in).
            traces = {s["attributes"].get("nemo.gym.rollout.id"): s["trace_id"] for s in spans_a
                      if s["name"] == "gym.rollout"} if inject else None
            problems = rollout_problems(spans, ids, by_pid, traces=traces)
            # (b): the cross-host edges.
            exact, calls, served_b, edge_issues, tally = edge_problems(spans_a, spans_b, hosts.b_address)
            for what, found in [(f"CLIENT spans of A to {hosts.b_address}", len(calls)),
                                ("SERVER spans of B", len(served_b))]:
                if found != want_edges:
                    edge_issues.insert(0, f"{found} {what}, want {len(rollouts)} x {cross_per_rollout}")
            edges_line = (f"{exact}/{want_edges} cross-host edges exact over {len(rollouts)} rollouts, "
                          f"{len(at_once)} at once")
            want_counters = {"cross_host_parents": 0 if inject else want_edges, "cross_host_unjoined": 0,
                             "parents_from_traceparent": want_edges if inject else 0}
            expected_trees = [canonical(EXPECTED_TREE)]
        else:
            # (f): on A, every rollout one trace of EXPECTED_TREE without the model's subtrees.
            [subtree] = {canonical(node) for node in cut}  # the same subtree under every call
            problems = rollout_problems(spans_a, ids, by_pid, expected_tree=a_tree)
            # (d), (e): B's spans roots, marked, each trace the model's subtree alone.
            calls, served_b, joined, marked, edge_issues = unjoined_problems(
                spans_a, spans_b, hosts.b_address, ids, subtree, by_pid)
            for what, found in [(f"CLIENT spans of A to {hosts.b_address}", len(calls)),
                                ("SERVER spans of B", len(served_b))]:
                if found != want_edges:
                    edge_issues.insert(0, f"{found} {what}, want {len(rollouts)} x {cross_per_rollout}")
            if len(spans_b) != tree_size(subtree) * want_edges:
                edge_issues.insert(0, f"{len(spans_b)} spans of B, want {want_edges} x {tree_size(subtree)}")
            tally = {}
            edges_line = (f"{len(joined)}/{want_edges} joined (by design), {len(marked)}/{want_edges} marked "
                          f"unjoined over {len(rollouts)} rollouts, {len(at_once)} at once")
            want_counters = {"cross_host_parents": 0, "cross_host_unjoined": want_edges}
            expected_trees = [canonical(a_tree), subtree]
        # One run over two hosts: no span id on two spans of it, whichever tracer exported them
        # (each tracer's own are checked as it closes).
        edge_issues[:0] = [f"tracers A and B: {line}" for line in shared_span_ids(tracer_a.spans() + tracer_b.spans())]
        if topology == "model-on-b" or inject:
            # Tracer B's own account of its cross-host parents.
            summary_b = tracer_b.summary()
            for name, want in want_counters.items():
                if summary_b.get(name) != want:
                    edge_issues.insert(0, f"tracer B's summary {name} = {summary_b.get(name)}, want {want}")

        if inject:
            # (i): tracer A's account of its headers: one on every call to B from its first, and
            # no other call changed (each call on A handed its trace over instead).
            injected = tracer_a.summary()
            want_a = {"traceparents_injected": want_edges, "traceparents_failed": 0, "traceparents_not_delivered": 0}
            for name, want in want_a.items():
                if injected.get(name) != want:
                    edge_issues.insert(0, f"tracer A's summary {name} = {injected.get(name)}, want {want}")
            # Every call on A went out unchanged: handed over, or (a request uvicorn starts from
            # the task that answered the one before it on its connection, which no read names:
            # lineage_roots_without_request) sent without a known trace.
            on_a_calls = local_calls(EXPECTED_TREE, on_b) * len(rollouts)
            handed = injected.get("traceparents_handed_over", 0) + injected.get("traceparents_not_known", 0)
            if handed != on_a_calls or injected.get("traceparents_not_known", 0) > injected.get(
                    "lineage_roots_without_request", 0):
                edge_issues.insert(0, f"tracer A handed over {injected.get('traceparents_handed_over')} calls on A "
                                      f"and knew no trace for {injected.get('traceparents_not_known')} (roots without "
                                      f"request {injected.get('lineage_roots_without_request')}), want "
                                      f"{on_a_calls} in all")
            edges_line += "; A: " + ", ".join(f"{name.removeprefix('traceparents_')}={injected.get(name)}"
                                              for name in INJECT_COUNTERS)

        report = [
            f"[{case}] {hosts!r}",
            f"  tracer A ({', '.join(on_a)}): {len(spans_a)} spans; tracer B ({', '.join(on_b)}): {len(spans_b)} "
            f"spans; want {len(rollouts)} rollouts x {SPANS_PER_ROLLOUT} = {SPANS_PER_ROLLOUT * len(rollouts)}",
            f"  {case}: {edges_line}",
            *(f"  tracer {host} {name} = {value}" for host, found in counters.items() for name, value in found.items()),
        ]
        if tally:
            report += ["  edges not exact:"] + [f"    {n} x {what}" for what, n in sorted(tally.items())]
        print("\n" + "\n".join(report + problems + edge_issues))

        failures = problems + edge_issues
        assert not failures, "\n".join(
            report + [f"{len(problems)} rollout problems, {len(edge_issues)} edge problems; first ones:"]
            + problems[:12] + edge_issues[:20]
            + ["expected tree(s):"] + render_shapes(expected_trees))

        prompts = {run.example_row(row)["responses_create_params"]["input"][-1]["content"]
                   for row in range(EXAMPLE_ROWS)}
        for agent, host in [(tracer_a, "A"), (tracer_b, "B")]:
            for text in [*NEVER_EXPORTED, *sorted(prompts), PADDING.strip()]:
                assert text not in agent.stdout_text(), f"{text!r} exported by tracer {host}"
                assert text not in agent.stderr(), f"{text!r} printed by tracer {host}"
