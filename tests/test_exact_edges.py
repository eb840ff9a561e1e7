"""Issue #17 [exact-edges]: the real nemo-gym servers split over two hosts, one gym-tracer per
host, sharing nothing, and every cross-host call is an exact parent edge.

Topology (tests/support/netns.py makes host B, a network namespace joined by a veth pair):

    host A: root network namespace, 10.231.N.1          host B: netns gtb-<hex>, 10.231.N.2
      example_single_tool_call_simple_agent (agent)  --->  example_single_tool_call (resources)
      policy_model (model) ---> canned upstream            gym-tracer B (--pid resources)
                                (127.0.0.1)
      gym-tracer A (--pid agent --pid model)

The agent calls the resources server at 10.231.N.2 (seed_session, get_weather, verify: three
calls per rollout), over a real TCP connection between the hosts. Neither tracer sees the other
end of those calls: tracer A exports the CLIENT span, tracer B the SERVER span, and each derives
the id of that request's span from its TCP sequence number, so B's SERVER span names A's CLIENT
span as its parent with nothing passed between them.

One rollout alone, then 16 at once (the (task, rollout) pairs, bodies and padding of
test_real_gym's concurrent test), with Gym's observability on (the /ng-rollout/<id>/ prefixes:
"prefixes") and off ("gym-default"). Checked over the union of both tracers' output:
a. every rollout is one trace (its derived id) holding exactly EXPECTED_TREE, the tree of a
   rollout traced on one host;
b. every CLIENT span of tracer A to host B's address has exactly one SERVER span of tracer B
   under it, in the same trace, and every SERVER span of B has such a CLIENT parent in A;
c. no span outside the rollouts' traces, SPANS_PER_ROLLOUT spans per rollout in all, and no
   secret or prompt text in either tracer's output.

Needs root (the namespace), iproute2 and nsenter, and target/gym-venv (see test_real_gym.py).
"""

import collections
import contextlib
import time

import pytest

from harness import Agent, wait_until
from netns import TwoHosts
from real_gym.launch import AGENT, MODEL, PADDING, RESOURCES, RealGymRun
from test_real_gym import (AT_ONCE, BODY_BYTES, EXAMPLE_ROWS, EXPECTED_TREE, NEVER_EXPORTED, SOLO,
                           SPANS_PER_ROLLOUT, attached_tracer, canonical, drive_at_once, expected_requests, gym_venv,
                           harvest, render_shapes, rollout_problems, wait_for_requests)

ON_A, ON_B = (AGENT, MODEL), (RESOURCES,)
# Summary counters that say how spans were joined across hosts (or not).
COUNTER_WORDS = ("edge", "unjoined", "cross")
UNJOINED = "gym_tracer.parent.unjoined"  # set on a SERVER span left a root: why


def cross_host_calls(node, host_b):
    """How many calls in the tree `node` go from a server not in `host_b` to one in it."""
    name, server, children = node
    return sum((server not in host_b and child[1] in host_b) + cross_host_calls(child, host_b) for child in children)


CROSS_HOST_CALLS_PER_ROLLOUT = cross_host_calls(EXPECTED_TREE, ON_B)  # seed_session, get_weather, verify


def describe(span, host="?"):
    a = span["attributes"]
    return (f"{host}'s {span['kind']} {span['name']} {a.get('url.path') or a.get('url.full', '')} (rollout "
            f"{a.get('nemo.gym.rollout.id', '?')}, span {span['span_id']}, trace {span['trace_id']})")


def edge_problems(spans_a, spans_b, b_address):
    """Checks (b): the number of exact cross-host edges, and what is wrong with the rest."""
    calls = [s for s in spans_a if s["kind"] == "CLIENT" and s["attributes"].get("server.address") == b_address]
    served = [s for s in spans_b if s["kind"] == "SERVER"]
    under = collections.defaultdict(list)
    for span in served:
        under[span["parent_span_id"]].append(span)
    by_id = {s["span_id"]: s for s in calls}
    exact, problems, tally = 0, [], collections.Counter()
    for call in calls:
        found = under.get(call["span_id"], [])
        if len(found) == 1 and found[0]["trace_id"] == call["trace_id"]:
            exact += 1
            continue
        if len(found) != 1:
            tally[f"A's CLIENT span to B with {len(found)} SERVER spans of B under it"] += 1
            problems.append(f"{describe(call, 'A')}: {len(found)} SERVER spans of B under it")
        else:
            tally["A's CLIENT span to B whose SERVER span of B is in another trace"] += 1
            problems.append(f"{describe(call, 'A')}: its SERVER span of B is in trace {found[0]['trace_id']}")
    for span in served:
        parent = by_id.get(span["parent_span_id"])
        if parent is not None and parent["trace_id"] == span["trace_id"]:
            continue
        why = span["attributes"].get(UNJOINED)
        if span["parent_span_id"] is None:
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


@pytest.mark.parametrize("observability", [True, False], ids=["prefixes", "gym-default"])
def test_cross_host_edges_are_exact(observability):
    venv = gym_venv()
    label = "prefixes" if observability else "gym-default"
    with contextlib.ExitStack() as stack:
        # Torn down in reverse: the tracers, then the servers, then host B.
        hosts = stack.enter_context(TwoHosts())
        run = RealGymRun(venv, access_log=True, observability=observability,
                         hosts={RESOURCES: hosts.b_address, AGENT: hosts.a_address, MODEL: hosts.a_address},
                         netns={RESOURCES: hosts.b_exec})
        stack.enter_context(run)
        pids = run.pids
        by_pid = {pid: name for name, pid in pids.items()}
        pids_a = {name: pids[name] for name in ON_A}
        pids_b = {name: pids[name] for name in ON_B}

        def tracer_on(host_pids, wrapper=()):
            """gym-tracer with --pid for each server of one host, once it attached them all
            and harvested their routes; stopped (or killed) at teardown."""
            agent = Agent(pids=list(host_pids.values()), wrapper=wrapper)
            stack.callback(agent.close)
            return attached_tracer(lambda: agent.start(), host_pids)

        # nsenter, not `ip netns exec`: the latter mounts a fresh /sys, without tracefs.
        tracer_a, tracer_b = tracer_on(pids_a), tracer_on(pids_b, wrapper=hosts.b_enter)

        def body_options(task):
            return {"row_index": task % EXAMPLE_ROWS, "pad_to": BODY_BYTES}

        rollouts = [SOLO, *AT_ONCE]
        ids = {f"{task}-{rollout}": (task, rollout) for task, rollout in rollouts}
        assert len(ids) == len(rollouts)

        before = {name: len(entries) for name, entries in run.access_log_paths().items()}
        results = {SOLO: run.drive_rollout(*SOLO, **body_options(SOLO[0]))}
        results.update(drive_at_once(run, AT_ONCE, body_options))
        assert {key: result["reward"] for key, result in results.items()} == {key: 1.0 for key in rollouts}, results

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

        # (a), (c): every rollout one trace of exactly EXPECTED_TREE, nothing besides.
        problems = rollout_problems(spans, ids, by_pid)
        # (b): the cross-host edges.
        exact, calls, served_b, edge_issues, tally = edge_problems(spans_a, spans_b, hosts.b_address)
        want_edges = CROSS_HOST_CALLS_PER_ROLLOUT * len(rollouts)
        for what, found in [(f"CLIENT spans of A to {hosts.b_address}", len(calls)),
                            ("SERVER spans of B", len(served_b))]:
            if found != want_edges:
                edge_issues.insert(0, f"{found} {what}, want {len(rollouts)} x {CROSS_HOST_CALLS_PER_ROLLOUT}")

        edges_line = (f"{exact}/{want_edges} cross-host edges exact over {len(rollouts)} rollouts, "
                      f"{len(AT_ONCE)} at once")
        report = [
            f"[{label}] {hosts!r}",
            f"  tracer A (agent, model): {len(spans_a)} spans; tracer B (resources): {len(spans_b)} spans; "
            f"want {len(rollouts)} rollouts x {SPANS_PER_ROLLOUT} = {SPANS_PER_ROLLOUT * len(rollouts)}",
            f"  {edges_line}",
            *(f"  tracer {host} {name} = {value}" for host, found in counters.items() for name, value in found.items()),
        ]
        if tally:
            report += ["  edges not exact:"] + [f"    {n} x {what}" for what, n in sorted(tally.items())]
        print("\n" + "\n".join(report + problems + edge_issues))

        failures = problems + edge_issues
        assert not failures, "\n".join(
            report + [f"{len(problems)} rollout problems, {len(edge_issues)} edge problems; first ones:"]
            + problems[:12] + edge_issues[:20]
            + ["expected tree:"] + render_shapes([canonical(EXPECTED_TREE)]))

        prompts = {run.example_row(row)["responses_create_params"]["input"][-1]["content"]
                   for row in range(EXAMPLE_ROWS)}
        for agent, host in [(tracer_a, "A"), (tracer_b, "B")]:
            for text in [*NEVER_EXPORTED, *sorted(prompts), PADDING.strip()]:
                assert text not in agent.stdout_text(), f"{text!r} exported by tracer {host}"
                assert text not in agent.stderr(), f"{text!r} printed by tracer {host}"
