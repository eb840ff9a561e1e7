"""What the tracer must show of a Gym-shaped run (gym_launch.GymRun), shared by the test
modules that check it: Gym's rollout id rule, each server's resource, and its attachment."""

import hashlib
import os
import socket
import sys

from gym_launch import ROLLOUT_ID
# Re-exported: the checkers take their span keys from here, with the rest of what a run must show.
from span_ids import children_by_parent, parent_key, shared_span_ids, span_key, spans_by_key  # noqa: F401


# The OpenInference kind each gym.* span carries (docs/outputs.md, "A trace UI"): what LLM-trace UIs
# such as Arize Phoenix show it as.
OPENINFERENCE_KINDS = {"gym.rollout": "AGENT", "gym.agent.responses": "AGENT", "gym.model.responses": "LLM",
                       "gym.model.chat_completions": "LLM", "gym.model.messages": "LLM", "gym.verify": "EVALUATOR"}


def semantic_attributes(name, server_name, rollout_id):
    """Every attribute of the gym.* span `name`: the server's name, the rollout id where known,
    and its OpenInference kind."""
    return {"nemo.gym.server.name": server_name, "openinference.span.kind": OPENINFERENCE_KINDS[name],
            **({"nemo.gym.rollout.id": rollout_id} if rollout_id else {})}


# What the agent adds to a gym.rollout span when the rollout ends (docs/insight.md, "Where a rollout's
# time goes"): its phases and calls, always; its token totals where its model calls said.
ROLLOUT_INSIGHT = {f"gym.rollout.phase.{phase}_ms" for phase in ("model", "tool", "verify", "queue", "external",
                                                                   "agent")} | {"gym.rollout.model_calls",
                                                                               "gym.rollout.tool_calls"}
ROLLOUT_INSIGHT_OPTIONAL = {"gym.rollout.straggler", "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"}


def gym_attributes(span):
    """A gym.* span's attributes as Gym's own telemetry has them: a gym.rollout's insight
    attributes taken out, after checking that it has all of them (and no other)."""
    attributes = dict(span["attributes"])
    if span["name"] == "gym.rollout":
        added = {key for key in attributes if key in ROLLOUT_INSIGHT | ROLLOUT_INSIGHT_OPTIONAL}
        assert ROLLOUT_INSIGHT <= added, f"gym.rollout without its phases: {attributes}"
        for key in added:
            del attributes[key]
    return attributes


def rollout_trace_id(rollout_id):
    """The trace id the tracer derives from a rollout id (docs/how-it-works.md, "Across hosts")."""
    return hashlib.sha256(f"nemo.gym.rollout/{rollout_id}".encode()).hexdigest()[:32]


def gym_rollout_id(body):
    """Gym's maybe_rollout_id_from_run_body, written anew; ValueError for a malformed id."""
    explicit = body.get("_ng_rollout_id")
    if explicit is not None:
        if not (isinstance(explicit, str) and ROLLOUT_ID.match(explicit)):
            raise ValueError(explicit)
        rollout_id = explicit
    elif body.get("_ng_task_index") is None or body.get("_ng_rollout_index") is None:
        return None
    else:
        rollout_id = f"{body['_ng_task_index']}-{body['_ng_rollout_index']}"
    attempt = body.get("_ng_attempt_index")
    return f"{rollout_id}-a{int(attempt)}" if attempt is not None and int(attempt) > 0 else rollout_id


def expected_resource(server, group="nemo"):
    exe = os.path.realpath(sys.executable)
    return {
        "service.name": f"{group}/{server.name}", "nemo.gym.server.name": server.name,
        "nemo.gym.server.type": server.type, "nemo.gym.service_group": group, "process.pid": server.pid,
        "process.executable.name": os.path.basename(exe), "process.executable.path": exe,
        "host.name": socket.gethostname(),
    }


def assert_resource(resource, server, group="nemo"):
    expected = expected_resource(server, group)
    assert {key: resource.get(key) for key in expected} == expected


def assert_attached(agent, run, *names, routes=True):
    """Each server attached, and (unless --no-route-harvest) its route table harvested."""
    for server in [run[n] for n in names] if names else run.servers.values():
        agent.wait_for_stderr(f"attached pid {server.pid} as {server.name} ({server.type})")
        if routes:
            agent.wait_for_routes(server.pid)


# How far a child may start before or end after its parent (ns): the agent stamps both from
# one clock (the kernel's), so a child outside by more than this hangs under a look-alike
# span (a rollout's other model call, which the shape alone cannot tell apart).
CONTAINMENT_SLACK_NS = 1_000_000


def containment_problems(spans, slack_ns=CONTAINMENT_SLACK_NS):
    """The spans of `spans` that start before or end after their parent (when it is among
    `spans`) by more than `slack_ns`, as lines; [] if none."""
    by_key = spans_by_key(spans)
    problems = []
    for span in spans:
        parent = by_key.get(parent_key(span))
        if parent is None:
            continue
        early = parent["start_time_unix_nano"] - span["start_time_unix_nano"]
        late = span["end_time_unix_nano"] - parent["end_time_unix_nano"]
        if early > slack_ns or late > slack_ns:
            problems.append(
                f"{span['kind']} {span['name']} (span {span['span_id']}) outside its parent {parent['kind']} "
                f"{parent['name']} (span {parent['span_id']}): starts {early / 1e6:.3f} ms before it, ends "
                f"{late / 1e6:.3f} ms after it")
    return problems

