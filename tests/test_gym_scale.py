"""Gym's production concurrency ([gym-scale]): thousands of rollouts in flight against a model
that takes a second, through the real, unmodified nemo-gym servers (simple_agent, the
example_single_tool_call resources server, openai_model in front of the canned upstream),
Gym's telemetry off, traced by gym-tracer with `--discover gym` and its defaults.

Why this needs a test of its own: with ROLLOUTS rollouts posted to the agent at once, Gym's
agent server saturates: a request sits in its socket buffer for tens of seconds before the
server reads it, and a model call's answer is written long after the call ended. Nothing the
tracer decides may depend on how long that takes: a server end waits for its traced caller's
start however late, an undecided call waits for its evidence while the requests that could
be its parent are in flight, a span goes out once nothing can change it.

One rollout is driven alone first (the first rollout after attach, with the model slower than
anything the tracer once waited for), then ROLLOUTS at once, each with an ~11 KB body whose
`_ng_*` ids are in its tail only (as example_multi_step's rows). Checked, in Gym's default
configuration and with observability on (the /ng-rollout/<id> prefixes):
1. every rollout answered 200 with reward 1.0, and all ROLLOUTS were in flight at once at the
   peak (from the driver's own clock: each POST's start before any answer's end);
2. the lone first rollout is exactly one trace with EXPECTED_TREE; every rollout of the batch
   is one trace (its id derived from the rollout id) with exactly EXPECTED_TREE, no span of
   another rollout in it, no span outside the rollouts' traces;
3. every span is in its parent's trace and inside its parent's time window (1 ms of slack):
   a swapped pair of look-alike calls leaves one of them outside its parent's window;
4. the agent's account: every traced-to-traced call linked (cross_process_links = 6 per
   rollout: /seed_session, the agent's own /v1/responses, two model calls, /get_weather,
   /verify), every local call linked or given up by a named reason (local_calls = links +
   the local_calls_unlinked_* + the other ends' own parents), the ones given up exactly the
   model server's calls to its (untraced) upstream, no caller unseen, no span released early
   or decided late, no call undecided, nothing lost in the kernel.

GYM_SCALE_ROLLOUTS sets ROLLOUTS (default 2,048) for a run by hand at another scale.

Needs target/gym-venv (`cargo xtask setup`; see test_real_gym.py). The summary's counters are
the whole agent's: nothing else Gym-shaped may run on the machine meanwhile.
"""

import os

import pytest

from gym_expect import rollout_trace_id
from real_gym.launch import RealGymRun
from test_real_gym import (BODY_BYTES, EXPECTED_TREE, SPANS_PER_ROLLOUT, canonical, gym_venv, render_shapes,
                           rollout_problems, tree_shape)
from test_task_lineage import UNPARENTED, attached_tracer, stop_when_exported, timing_problems

# CI's size; GYM_SCALE_ROLLOUTS=4096 (or more) runs the same checks at another scale by hand.
ROLLOUTS = int(os.environ.get("GYM_SCALE_ROLLOUTS", "2048"))
FIRST_ROLLOUT = 900  # the lone first rollout's index: id "0-900", apart from the batch's
UPSTREAM_DELAY_S = 1.0
TRACED_CALLS_PER_ROLLOUT = 6  # the SERVER spans of EXPECTED_TREE but /run (the driver's)
UPSTREAM_CALLS_PER_ROLLOUT = 2  # the model server's CLIENT spans: the upstream is not traced
LINK_OUTCOMES = ["cross_process_links", "local_calls_parented_by_header", "spans_flushed_unmatched",
                 "local_calls_unlinked_next_request", "local_calls_unlinked_closed",
                 "local_calls_unlinked_process_exit", "local_calls_unlinked_shutdown"]


def peak_in_flight(results):
    """The most rollouts in flight at one instant, by the driver's clock (start_ns, end_ns)."""
    events = sorted([(r["start_ns"], 1) for r in results] + [(r["end_ns"], -1) for r in results],
                    key=lambda e: (e[0], e[1]))
    peak = now = 0
    for _, step in events:
        now += step
        peak = max(peak, now)
    return peak


def answer_problems(results):
    return [f"rollout {r['task_index']}-{r['rollout_index']}: status {r['status']}, reward {r['reward']}, "
            f"error {r['error']!r}" for r in results if (r["status"], r["reward"]) != (200, 1.0)]


@pytest.mark.parametrize("observability", [False, True], ids=["gym-default", "observability"])
def test_thousands_of_rollouts_in_flight_are_one_trace_each(tracer, observability):
    run = RealGymRun(gym_venv(), observability=observability, upstream_delay_s=UPSTREAM_DELAY_S)
    try:
        run.start()
        by_pid = {pid: name for name, pid in run.pids.items()}
        agent = attached_tracer(tracer, run)
        first = run.drive_rollouts(1, rollout_offset=FIRST_ROLLOUT, pad_to=BODY_BYTES)
        batch = run.drive_rollouts(ROLLOUTS, pad_to=BODY_BYTES)
        upstream = run.upstream_requests()
        spans, summary = stop_when_exported(agent, run, SPANS_PER_ROLLOUT * (1 + ROLLOUTS))
    finally:
        run.stop()

    # (1) the answers, and the overlap.
    problems = answer_problems(first + batch)
    assert not problems, f"{len(problems)} rollouts answered wrong:\n" + "\n".join(problems[:10])
    peak = peak_in_flight(batch)
    assert peak == ROLLOUTS, f"only {peak} of {ROLLOUTS} rollouts were in flight at once"
    durations = sorted((r["end_ns"] - r["start_ns"]) / 1e9 for r in batch)
    driven = 1 + ROLLOUTS
    assert len(upstream) == UPSTREAM_CALLS_PER_ROLLOUT * driven, f"{len(upstream)} upstream requests"

    first_id = f"{first[0]['task_index']}-{first[0]['rollout_index']}"
    ids = [f"{r['task_index']}-{r['rollout_index']}" for r in batch]
    assert len(set(ids)) == ROLLOUTS
    first_trace = rollout_trace_id(first_id)
    lone = [s for s in spans if s["trace_id"] == first_trace]
    rest = [s for s in spans if s["trace_id"] != first_trace]

    links = {name: summary.get(name) for name in LINK_OUTCOMES}
    mode = "observability" if observability else "gym-default"
    print(f"\n[{mode}] {driven} rollouts, peak {peak} in flight, rollout latency p50 "
          f"{durations[len(durations) // 2]:.1f} s, max {durations[-1]:.1f} s; {len(spans)} spans; "
          f"local_calls = {summary.get('local_calls')}: {links}; callers_unseen = {summary.get('callers_unseen')}")

    # (2) the lone first rollout, and the batch.
    lone_shapes = tree_shape(lone, by_pid)
    lone_issues = [] if lone_shapes == [canonical(EXPECTED_TREE)] else [
        f"the lone first rollout {first_id}: {len(lone)} spans:\n" + "\n".join(render_shapes(lone_shapes))]
    tree_issues = rollout_problems(rest, ids, by_pid)
    # (3) traces and time windows.
    time_issues = timing_problems(spans, by_pid)
    # (4) the agent's account.
    outcomes = sum(summary.get(name, 0) for name in LINK_OUTCOMES)
    unlinked = sum(summary.get(name, 0) for name in LINK_OUTCOMES if name.startswith("local_calls_unlinked"))
    want = {"cross_process_links": TRACED_CALLS_PER_ROLLOUT * driven, "local_calls": outcomes,
            "callers_unseen": 0, "spans_released_early": 0, "parents_decided_late": 0,
            "spans_flushed_unmatched": 0, "events_lost_in_kernel": 0, "stitch_nodes_refused": 0,
            **{name: 0 for name in UNPARENTED}}
    counter_issues = [f"summary {name} = {summary.get(name)}, want {value}" for name, value in want.items()
                      if summary.get(name) != value]
    if unlinked != len(upstream):
        counter_issues.append(f"{unlinked} local calls given up, want the {len(upstream)} upstream calls")

    failures = lone_issues + tree_issues + time_issues + counter_issues
    assert not failures, "\n".join(
        [f"{len(lone_issues)} first-rollout, {len(tree_issues)} tree, {len(time_issues)} timing, "
         f"{len(counter_issues)} summary problems; first ones:"]
        + lone_issues + tree_issues[:8] + time_issues[:8] + counter_issues
        + ["expected tree:"] + render_shapes([canonical(EXPECTED_TREE)]))
