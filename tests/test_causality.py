"""Which inbound request made an outbound call, in a plain FastAPI app without Gym (no
rollout ids, no cookies, no gym.* spans): the tracer attached by `--pid` to the app and to
the leaf server it calls (support/servers/causality_app.py), 300 requests 100 at a time.

The test knows the truth: request n arrives as `/<kind>/n` and calls `/leaf/n/0` and
`/leaf/n/1`, so each CLIENT span's url.full names the SERVER span that made it. A parent is
never wrong: a CLIENT span with a parent hangs under exactly its own request's SERVER span,
and every leaf's SERVER span under exactly the CLIENT span that called it (the agent sees
both ends of that connection, in every case).

With task lineage (`--task-lineage on`: a uprobe on `Task.__init__` records which request
root each task descends from) every call has its parent whatever task made it: the handler's
own (plain), the task BaseHTTPMiddleware runs the app in (middleware), asyncio.gather's
children (gather); each decided by lineage (parents_by_lineage counts every call).

Without it (`--task-lineage off`), the task contexts alone decide the plain handler's calls
(its task makes them and writes the response); behind BaseHTTPMiddleware and under
asyncio.gather the calls run in other tasks than the one writing the response, and with a
hundred requests in flight nothing else tells them apart: every one of them is left without a
parent but those made while their request was the only one in flight (and, rarely, one whose
own task's context decides it), and counted as such (parents_no_evidence and the other
undecided counters sum to exactly the calls left without a parent, the parents_by_* counters
to exactly the calls with one)."""

import collections
import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import wait_until
from span_ids import parent_key, span_key, spans_by_key

REQUESTS = 300
AT_A_TIME = 100
CALLS_PER_REQUEST = 2
UNDECIDED = ["parents_ambiguous", "parents_no_evidence", "parents_no_request_in_flight", "parents_contradicted"]
DECIDED = ["parents_by_lineage", "parents_by_rollout_id", "parents_by_session", "parents_by_task_context",
           "parents_by_echoed_id", "parents_by_response_context", "parents_by_only_inbound", "parents_by_nesting",
           "parents_by_spawn"]
EVIDENCE = ["parents_by_lineage", "parents_by_rollout_id", "parents_by_session", "parents_by_task_context",
            "parents_by_echoed_id", "parents_by_response_context", "parents_by_only_inbound", "parents_by_nesting",
            "parents_by_spawn", "processes_spawned_in_requests", "processes_spawned_outside_requests",
            "lineage_roots_without_request",
            *UNDECIDED, "task_context_conflicts", "task_context_regroups", "cross_process_links",
            "spans_flushed_unmatched", "events_lost_in_kernel", "python_runtimes_read", "python_threads_registered",
            "context_chains_read", "context_chains_empty", "context_thread_unknown", "context_reads_failed",
            "context_records_lost", "lineage_processes", "lineage_processes_off", "lineage_tasks_probed",
            "lineage_request_roots", "lineage_inherited", "lineage_creator_unseen", "lineage_calls_unseen",
            "lineage_calls_no_task", "lineage_requests_unmatched", "lineage_conflicts"]
LEAF_PATH = re.compile(r"^/leaf/(\d+)/(\d+)$")

KINDS = [
    # (kind = the inbound path's first segment, the app, --task-lineage, whether every call has
    # its parent)
    pytest.param("plain", "servers.causality_app:app", "on", True, id="plain-lineage"),
    pytest.param("middleware", "servers.causality_app:middleware_app", "on", True, id="middleware-lineage"),
    pytest.param("gather", "servers.causality_app:app", "on", True, id="gather-lineage"),
    pytest.param("plain", "servers.causality_app:app", "off", True, id="plain"),
    pytest.param("middleware", "servers.causality_app:middleware_app", "off", False, id="middleware"),
    pytest.param("gather", "servers.causality_app:app", "off", False, id="gather"),
    # Each call made by a `curl` process the handler spawned: the spawn's lineage names the
    # request (parents_by_spawn).
    pytest.param("spawn", "servers.causality_app:app", "on", True, id="spawn-lineage"),
]


def drive(port, kind):
    def one(n):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/{kind}/{n}", timeout=30) as response:
            assert response.status == 200
            return response.read()

    with ThreadPoolExecutor(AT_A_TIME) as pool:
        list(pool.map(one, range(REQUESTS)))


def path_of_url(url):
    return "/" + url.split("://", 1)[1].split("/", 1)[1]


@pytest.mark.parametrize("kind,app,lineage,all_parented", KINDS)
def test_calls_hang_under_the_request_that_made_them(server_factory, agents, kind, app, lineage, all_parented):
    leaf = server_factory(app="servers.causality_app:app")
    front = server_factory(app=app, env={"CAUSALITY_DOWNSTREAM": leaf.base_url})
    agent = agents([front.pid, leaf.pid], extra_args=["--task-lineage", lineage])
    for server in (front, leaf):
        agent.wait_for_routes(server.pid)

    drive(front.port, kind)

    def side(span):
        """The leaf, or the front (with the processes it spawned)."""
        return "leaf" if span["resource"].get("process.pid") == leaf.pid else "front"

    def spans_of(which, span_kind):
        return [s for s in agent.spans() if side(s) == which and s["kind"] == span_kind]

    want = {("front", "SERVER"): REQUESTS, ("front", "CLIENT"): REQUESTS * CALLS_PER_REQUEST,
            ("leaf", "SERVER"): REQUESTS * CALLS_PER_REQUEST}
    wait_until(lambda: all(len(spans_of(*key)) >= n for key, n in want.items()), 20,
               lambda: f"spans {want}, have { {key: len(spans_of(*key)) for key in want} }")
    time.sleep(1.0)  # the stitch delay, and room for a span too many
    agent.stop()
    assert agent.returncode == 0, agent.stderr()
    summary = agent.summary()
    evidence = {name: summary.get(name) for name in EVIDENCE}

    spans = agent.spans()
    by_key = spans_by_key(spans)
    counts = collections.Counter((side(s), s["kind"]) for s in spans)
    assert counts == want, f"{counts}\n{evidence}"

    # The truth: request n's SERVER span, and which leaf call each CLIENT span is.
    inbound = {}
    for span in spans_of("front", "SERVER"):
        match = re.fullmatch(rf"/{kind}/(\d+)", span["attributes"]["url.path"])
        assert match and span["attributes"]["http.response.status_code"] == 200, span
        inbound[int(match.group(1))] = span
    assert sorted(inbound) == list(range(REQUESTS))
    clients = {}
    for span in spans_of("front", "CLIENT"):
        match = LEAF_PATH.match(path_of_url(span["attributes"]["url.full"]))
        assert match, span
        clients[(int(match.group(1)), int(match.group(2)))] = span
    assert len(clients) == REQUESTS * CALLS_PER_REQUEST

    wrong, orphans = [], []
    for (n, i), span in sorted(clients.items()):
        parent = parent_key(span)
        if parent is None:
            orphans.append((n, i))
        elif parent[1] != inbound[n]["span_id"]:
            other = by_key.get(parent)
            wrong.append(f"/leaf/{n}/{i} under " + (f"{other['kind']} {other['attributes'].get('url.path')}"
                                                    if other else f"unknown span {parent[1]}"))
        elif parent != span_key(inbound[n]):
            wrong.append(f"/leaf/{n}/{i}: parent right, trace {span['trace_id']} vs {inbound[n]['trace_id']}")
    wrong_leaves = []
    for span in spans_of("leaf", "SERVER"):
        path = span["attributes"]["url.path"]
        match = LEAF_PATH.match(path)
        assert match, span
        caller = clients[(int(match.group(1)), int(match.group(2)))]
        # The agent sees both ends of the connection: every leaf request has its caller.
        if parent_key(span) is None:
            wrong_leaves.append(f"leaf SERVER {path} without a parent")
        elif parent_key(span) != span_key(caller):
            other = by_key.get(parent_key(span))
            if other:
                where = f"{other['kind']} {other['attributes'].get('url.full')}"
            elif span["parent_span_id"] == caller["span_id"]:  # a parent is its caller only in its trace
                where = f"its caller's span id, in trace {span['trace_id']}, not its caller's {caller['trace_id']}"
            else:
                where = "an unknown span"
            wrong_leaves.append(f"leaf SERVER {path} under {where}")

    undecided = sum(summary[name] for name in UNDECIDED)
    print(f"\n[{kind}] CLIENT spans {len(clients)}: parented {len(clients) - len(orphans)}, without a parent "
          f"{len(orphans)}, wrong {len(wrong)}; leaf SERVER spans without their caller {len(wrong_leaves)}; "
          f"undecided counted {undecided}")
    for name, value in evidence.items():
        print(f"  {name} = {value}")

    context = f"\nevidence counters: {evidence}"
    assert not wrong, f"{len(wrong)} calls under a wrong parent:\n" + "\n".join(wrong[:30]) + context
    assert not wrong_leaves, f"{len(wrong_leaves)} leaf requests not under their caller:\n" + \
        "\n".join(wrong_leaves[:30]) + context
    # Every CLIENT span left without a parent is counted once, by why; none more.
    assert undecided == len(orphans), \
        f"{len(orphans)} calls without a parent, {undecided} counted undecided: {orphans[:30]}" + context
    if all_parented:
        assert not orphans, f"{len(orphans)} calls without a parent: {orphans[:30]}" + context
    else:
        # A hundred handlers in flight, their calls in tasks that never write a response:
        # nothing tells them apart, and nothing is guessed. Only a call written while its
        # request was the only one in flight (the run's last, draining) has a parent: that
        # request (checked above).
        servers = list(inbound.values())
        alone = {key for key, span in clients.items()
                 if sum(s["start_time_unix_nano"] <= span["start_time_unix_nano"] <= s["end_time_unix_nano"]
                        for s in servers) == 1}
        parented = set(clients) - set(orphans)
        assert alone <= parented, f"parented {sorted(parented)[:20]}, alone in flight {sorted(alone)[:20]}" + context
        # A call may still be decided by its own task's context when that task happened to
        # write (seen once in a middleware run: 1 of 600); each parented call is counted by
        # the evidence that decided it, and none is wrong (above).
        decided = sum(summary[name] for name in DECIDED)
        assert decided == len(parented), f"{len(parented)} calls parented, {decided} counted decided" + context
        assert len(alone) < REQUESTS, f"{len(alone)} calls made alone: the requests did not overlap" + context
    calls = REQUESTS * CALLS_PER_REQUEST
    if lineage == "on":
        # Both servers probed; every call decided by lineage; every request's root born for
        # it (the leaf's and the front's requests, and each server's route harvest).
        if kind == "spawn":
            # The curl processes are traced too: those a rescan met are not CPython (each counted
            # once, as lineage off), and their calls are placed by the spawns' lineage.
            assert summary["lineage_processes"] == 2, context
            assert summary["lineage_processes_off"] <= summary["processes_spawned_in_requests"], context
        else:
            assert summary["lineage_processes"] == 2 and summary["lineage_processes_off"] == 0, context
        if kind == "spawn":
            assert (summary["parents_by_spawn"], summary["parents_by_lineage"]) == (calls, 0), context
            assert summary["processes_spawned_in_requests"] == calls, context
        else:
            assert summary["parents_by_lineage"] == calls, context
        roots = summary["lineage_request_roots"]
        if kind == "spawn":
            # The loop also reads the children's pipes: a root created right after such a
            # read is born without its request, counted, and its spawns wait for its response.
            roots += summary["lineage_roots_without_request"]
        assert roots == REQUESTS + calls + 2, context
        assert summary["lineage_conflicts"] == 0 and summary["lineage_creator_unseen"] == 0, context
    else:
        assert summary["lineage_processes"] == 0 and summary["parents_by_lineage"] == 0, context
        assert summary["lineage_tasks_probed"] == 0, context
