"""End-to-end tests of [gym-semantics]: the real agent with `--discover gym`, against Gym-shaped
servers launched as Gym launches them (gym_launch.py). Every expectation is derived from the
requests the test sent, per the output contract: SERVER span names, routes and attributes, the
gym.* INTERNAL spans, rollout ids, resources, span groups, discovery, and the gym metrics."""

import collections
import json
import re
import time
from dataclasses import dataclass, replace

import pytest
from aiohttp.http import SERVER_SOFTWARE as AIOHTTP_USER_AGENT

from gym_expect import (assert_attached, assert_resource, children_by_parent, gym_attributes, gym_rollout_id,
                        semantic_attributes, span_key)
from gym_launch import (AGENT, DEFAULT_SERVERS, MODEL, PROMPT, RESOURCES, SECRET, USER_AGENT, drive_rollouts,
                        rollout_mix, run_body, split_prefix)
from harness import wait_until
from servers.gym_common import CANARY, SECRET_HEADERS

DEFAULT_CAPTURE = 4096
HEAD_ALLOWANCE = 512  # the request line and headers of every request here fit in this
QUERY_SECRET = "token=QUERY-never-export"
NEVER_EXPORTED = [SECRET, PROMPT.split(":")[0], "QUERY-never-export"]

# Routes Gym itself defines (the tracer knows them without a harvest), per server type.
# Routes every Gym server has (server_utils.py, FastAPI's docs), whatever its type.
SHARED_ROUTES = {"/", "/health", "/healthz", "/livez", "/readyz", "/stats", "/openapi.json", "/docs",
                 "/docs/oauth2-redirect", "/redoc"}
GYM_ROUTES = {
    AGENT: {"/run", "/v1/responses", "/aggregate_metrics", "/v1/agent_sessions", "/v1/agent_sessions/close"},
    MODEL: {"/v1/chat/completions", "/v1/responses", "/v1/messages"},
    RESOURCES: {"/seed_session", "/close_session", "/verify", "/aggregate_metrics", "/reverify_mode"},
}
SEMANTIC = {  # (server type, SERVER span name) -> (semantic span, its span group)
    (AGENT, "POST /run"): ("gym.rollout", "rollout"),
    (AGENT, "POST /v1/responses"): ("gym.agent.responses", "agent"),
    (RESOURCES, "POST /verify"): ("gym.verify", "verify"),
    (MODEL, "POST /v1/chat/completions"): ("gym.model.chat_completions", "model_call"),
    (MODEL, "POST /v1/responses"): ("gym.model.responses", "model_call"),
    (MODEL, "POST /v1/messages"): ("gym.model.messages", "model_call"),
}
PER_ROLLOUT = {"server", "http_client", "rollout", "verify", "agent", "model_call"}

# Requests sent straight to each server: every Gym route, plain and under /ng-rollout/<id>
# (with and without /training-token-capture), malformed ids, a query string, a 404 and a 405.
DIRECT_CALLS = [
    (AGENT, "POST", "/v1/responses", {"input": PROMPT}),
    (AGENT, "POST", "/ng-rollout/q-1/v1/responses", {"input": PROMPT}),
    (AGENT, "POST", "/ng-rollout/q.2/training-token-capture/v1/responses", {"input": PROMPT}),
    (AGENT, "POST", "/aggregate_metrics", {"verify_responses": [{"reward": 1.0}]}),
    (AGENT, "GET", "/health", None),
    (MODEL, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    (MODEL, "POST", "/ng-rollout/m_1/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]}),
    (MODEL, "POST", "/ng-rollout/m-2/training-token-capture/v1/responses", {"input": PROMPT}),
    (MODEL, "POST", "/v1/messages", {"messages": [{"role": "user", "content": PROMPT}]}),
    (MODEL, "POST", "/ng-rollout/.hidden/v1/messages", {"messages": []}),  # malformed id: served, no id
    (MODEL, "GET", "/no/such/route/12345", None),  # 404, an unknown path
    (RESOURCES, "POST", "/ng-rollout/s-1/seed_session", {}),
    (RESOURCES, "POST", f"/ng-rollout/s-1/verify?{QUERY_SECRET}", {"reward": 0.0}),
    (RESOURCES, "POST", "/verify", {"raise": True}),  # the verifier raises: 500
    (RESOURCES, "POST", "/ng-rollout/-bad/verify", {}),  # malformed id: Gym's middleware 404s it
    (RESOURCES, "GET", "/verify", None),  # 405
    (RESOURCES, "GET", "/ng-rollout/s-1/reverify_mode", None),
    (RESOURCES, "POST", "/ng-rollout/s-1/close_session", {}),
    (RESOURCES, "POST", "/aggregate_metrics", {"verify_responses": [{"reward": 0.5}]}),
    (RESOURCES, "GET", "/health", None),
    (RESOURCES, "POST", "/ng-rollout/s-1/get_weather", {"city": "Paris"}),  # the app's own routes
    (RESOURCES, "GET", "/items/42", None),
]


# ---- what the servers saw, derived from what was sent ----

@dataclass(frozen=True)
class Seen:
    """One request a Gym server saw, as its SERVER span must show it."""
    server: str
    name: str
    method: str
    path: str
    status: int
    rollout_id: str | None
    user_agent: str


def visible_run_id(body, capture):
    """The id of a /run body as far as the tracer sees it: the first `capture` bytes of the
    request (the whole body, or a cut one whose visible part already decides the id — an
    `_ng_rollout_id` and an `_ng_attempt_index`, which nothing later can override), else the
    body's last TAIL_BYTES (the run of complete members that ends the object, read as the
    whole object: Gym appends its `_ng_*` fields last). Indices seen only in the head decide
    nothing (an `_ng_rollout_id` could follow and take precedence): no id, never a wrong one."""
    try:
        rollout_id = gym_rollout_id(body)
    except ValueError:
        return None
    if rollout_id is None:
        return None
    if len(json.dumps(body)) + HEAD_ALLOWANCE <= capture:
        return rollout_id
    items = list(body.items())
    if "_ng_rollout_id" in body and "_ng_attempt_index" in body:
        last = max(i for i, (key, _) in enumerate(items) if key.startswith("_ng_"))
        end = len(json.dumps(dict(items[:last + 1]))) - 1
        if end + HEAD_ALLOWANCE <= capture:
            return rollout_id
        assert end > capture, "a test body must not straddle the capture limit"
    return tail_run_id(items)


TAIL_BYTES = 512  # the last bytes of a body the kernel reports past the capture


def tail_run_id(items):
    """The id Gym's rule gives the longest run of last members whose separating comma is in
    the body's last TAIL_BYTES (json.dumps's `, ` and `: `), if that run names one."""
    for start in range(1, len(items)):
        run = dict(items[start:])
        if len(", " + json.dumps(run)[1:]) <= TAIL_BYTES:
            names = "_ng_rollout_id" in run or ("_ng_task_index" in run and "_ng_rollout_index" in run)
            try:
                return gym_rollout_id(run) if names else None
            except ValueError:
                return None
    return None


def known_route(server, path, harvest=True):
    """The route template of `path` on `server`, or None: Gym's routes, and the app's own when
    harvested (`harvest` True), or only the templates given with --route (`harvest` a set)."""
    route, _ = split_prefix(path)
    extra = server.routes if harvest is True else set(harvest or ())
    for template in GYM_ROUTES[server.type] | SHARED_ROUTES | extra:
        if re.fullmatch(re.sub(r"\\\{[^/]+?\\\}", "[^/]+", re.escape(template)), route):
            return template
    return None


def seen(server, method, path, status, user_agent, harvest=True):
    """The request as its server saw it; the rollout id from the path's prefix."""
    route, rollout_id = split_prefix(path)
    name = f"{method} {known_route(server, path, harvest) or re.sub(r'/[0-9]+(?=/|$)', '/{id}', route)}"
    return Seen(server.name, name, method, path.split("?", 1)[0], status, rollout_id, user_agent)


def agent_calls(run, sent):
    """The calls support/servers/gym_agent.py makes for one request (Gym's, through aiohttp)."""
    route, _ = split_prefix(sent.path)
    if run[sent.server].type != AGENT or sent.method != "POST":
        return []
    if route == "/run":
        try:
            rollout_id = gym_rollout_id(sent.body)
        except ValueError:
            return []  # Gym rejects a malformed id before any call
        prefix = f"/ng-rollout/{rollout_id}" if rollout_id else ""
        verify_status = 500 if sent.body.get("raise") else 200
        return [seen(run.model, "POST", f"{prefix}/v1/responses", 200, AIOHTTP_USER_AGENT),
                seen(run.resources, "POST", f"{prefix}/verify", verify_status, AIOHTTP_USER_AGENT)]
    if route == "/v1/responses":
        return [seen(run.model, "POST", sent.path, 200, AIOHTTP_USER_AGENT)]
    return []


def seen_by_servers(run, sent, capture=DEFAULT_CAPTURE, harvest=True):
    """Every request the servers saw: each one the test sent, plus the agent's calls for it."""
    result = []
    for s in sent:
        request = seen(run[s.server], s.method, s.path, s.status, USER_AGENT, harvest)
        if run[s.server].type == AGENT and request.name == "POST /run":
            request = replace(request, rollout_id=visible_run_id(s.body, capture))
        result += [request, *agent_calls(run, s)]
    return result


def semantic(server, name, status, groups):
    """The semantic span a SERVER span must have as its child, or None."""
    span, group = SEMANTIC.get((server.type, name), (None, None))
    return span if span and group in groups and status not in (404, 405) else None


def direct_calls(run):
    return [run.first(server_type).send(method, path, body) for server_type, method, path, body in DIRECT_CALLS]


def assert_agent_answers(sent):
    """The test's own expectations agree with the servers: /run statuses and rollout ids."""
    for s in sent:
        if s.path != "/run":
            continue
        try:
            rollout_id = gym_rollout_id(s.body)
        except ValueError:
            assert s.status == 500
            continue
        assert s.status == (500 if s.body.get("raise") else 200), s.response
        if s.status == 200:
            assert s.json()["rollout_id"] == rollout_id


# ---- what the tracer reported ----

def our_spans(agent, run):
    pids = run.by_pid()
    return [span for span in agent.spans() if span["resource"].get("process.pid") in pids]


def our_points(agent, run, metric):
    pids = run.by_pid()
    return [point for point in agent.metric_points(metric) if point["resource"].get("process.pid") in pids]


def finish(agent, run, expected, groups=PER_ROLLOUT):
    """Waits for the expected SERVER + semantic spans, stops the agent (SIGINT), returns our spans."""
    by_name = {s.name: s for s in run.servers.values()}
    want = sum(("server" in groups) + bool(semantic(by_name[e.server], e.name, e.status, groups)) for e in expected)
    wait_until(lambda: sum(s["kind"] != "CLIENT" for s in our_spans(agent, run)) >= want, 15,
               f"{want} SERVER and gym.* spans")
    time.sleep(0.5)  # room for a span too many to show up
    agent.stop()
    assert agent.returncode == 0, agent.stderr()
    print(agent.log_messages()[-1])  # the counters, shown if the test fails
    return our_spans(agent, run)


def assert_server_spans(spans, run, expected, harvest=True, groups=PER_ROLLOUT, *, summary):
    """SERVER spans: exactly one per request seen, with the contract's name and attributes."""
    by_pid = run.by_pid()
    server_spans = [span for span in spans if span["kind"] == "SERVER"]
    actual = collections.Counter()
    for span in server_spans:
        server, attributes = by_pid[span["resource"]["process.pid"]], span["attributes"]
        actual[Seen(server.name, span["name"], attributes.get("http.request.method"), attributes.get("url.path"),
                    attributes.get("http.response.status_code"), attributes.get("nemo.gym.rollout.id"),
                    attributes.get("user_agent.original"))] += 1
        assert attributes["url.scheme"] == "http"
        assert attributes["server.address"] == "127.0.0.1"
        assert attributes["server.port"] == server.port
        assert attributes["client.address"] == "127.0.0.1"
        assert attributes["network.protocol.version"] == "1.1"
        assert attributes["nemo.gym.server.name"] == server.name
        assert span["status"] == ("ERROR" if attributes["http.response.status_code"] >= 500 else "UNSET")
        route = known_route(server, attributes["url.path"], harvest)
        if route is None:
            assert "http.route" not in attributes, span
        elif attributes["http.response.status_code"] not in (404, 405):  # no handler ran: no claim
            assert attributes.get("http.route") == route, span
        assert_resource(span["resource"], server, server.env.get("OTEL_SERVICE_NAME", "nemo"))
    wanted = collections.Counter(expected) if "server" in groups else collections.Counter()
    assert (wanted - actual, actual - wanted) == ({}, {}), "(SERVER spans missing, SERVER spans unexpected)"
    if "http_client" in groups:
        assert_client_spans(spans, run, expected, summary, with_servers="server" in groups)
    return server_spans


def assert_client_spans(spans, run, expected, summary, with_servers=True):
    """CLIENT spans (the http_client group): exactly one per call a traced server made (the
    agent's, through aiohttp), to the server, method, path and status the callee saw, from the
    agent's process; a root only where the agent's summary counts its parent undecided
    (exactly as many roots as undecided parents); with SERVER spans on, each the parent of
    exactly that call's SERVER span."""
    by_pid, by_port = run.by_pid(), {server.port: server for server in run.servers.values()}
    want = collections.Counter((e.server, e.method, e.path, e.status)
                               for e in expected if e.user_agent == AIOHTTP_USER_AGENT)
    served = children_by_parent(s for s in spans if s["kind"] == "SERVER")
    got, problems, roots = collections.Counter(), [], 0
    for span in (s for s in spans if s["kind"] == "CLIENT"):
        attributes = span["attributes"]
        callee = by_port.get(attributes.get("server.port"))
        path = "/" + attributes["url.full"].split("://", 1)[1].split("/", 1)[1]
        got[(callee.name if callee else None, attributes.get("http.request.method"), path,
             attributes.get("http.response.status_code"))] += 1
        if by_pid[span["resource"]["process.pid"]].type != AGENT:
            problems.append(f"CLIENT {path} of {by_pid[span['resource']['process.pid']].name}")
        roots += not span["parent_span_id"]
        below = [s["attributes"]["url.path"] for s in served.get(span_key(span), [])]
        if with_servers and below != [path]:
            problems.append(f"CLIENT {path} (span {span['span_id']}): SERVER spans below it {below}")
    assert (want - got, got - want) == ({}, {}), "(CLIENT spans missing, CLIENT spans unexpected)"
    undecided = sum(summary[name] for name in ("parents_no_evidence", "parents_ambiguous", "parents_no_request_in_flight",
                                               "parents_contradicted"))
    assert roots == undecided, f"{roots} CLIENT spans without a parent, {undecided} parents counted undecided"
    assert not problems, f"{len(problems)} CLIENT spans wrong:\n" + "\n".join(problems[:20])


def assert_semantic_spans(spans, run, groups=PER_ROLLOUT):
    """Each SERVER span has exactly its semantic INTERNAL child (or none), with the same trace,
    timing and rollout id; no other INTERNAL span exists (a root, or one in another trace than
    its parent, is left over)."""
    by_pid = run.by_pid()
    children = children_by_parent(s for s in spans if s["kind"] == "INTERNAL")
    for parent in (span for span in spans if span["kind"] == "SERVER"):
        server, attributes = by_pid[parent["resource"]["process.pid"]], parent["attributes"]
        name = semantic(server, parent["name"], attributes["http.response.status_code"], groups)
        found = children.pop(span_key(parent), [])
        assert [child["name"] for child in found] == ([name] if name else []), parent
        for child in found:
            assert (child["start_time_unix_nano"], child["end_time_unix_nano"]) == \
                   (parent["start_time_unix_nano"], parent["end_time_unix_nano"])
            rollout_id = attributes.get("nemo.gym.rollout.id")
            assert gym_attributes(child) == semantic_attributes(child["name"], server.name, rollout_id)
            assert child["resource"] == parent["resource"]
    assert not children, f"INTERNAL spans without a SERVER parent: {dict(children)}"


def assert_nothing_secret(agent):
    for text in NEVER_EXPORTED:
        assert text not in agent.stdout_text(), f"{text!r} exported"
        assert text not in agent.stderr(), f"{text!r} printed"


# ---- tests ----

def test_every_gym_route_gets_its_server_and_semantic_spans(gym, tracer):
    """Rollouts of every id variant plus a direct call to every route: one SERVER span per
    request any server saw (name without the /ng-rollout prefix, url.path with it, route,
    status, rollout id, user agent, attributes, resource), its gym.* child, no span of the
    tracer's own /openapi.json harvest, and no secret, prompt or query string in the output."""
    run = gym()
    agent = tracer()
    assert_attached(agent, run)
    sent = drive_rollouts(run, rollout_mix(11)) + direct_calls(run)
    assert_agent_answers(sent)
    expected = seen_by_servers(run, sent)
    spans = finish(agent, run, expected)
    assert_server_spans(spans, run, expected, summary=agent.summary())
    assert_semantic_spans(spans, run)
    assert not [span for span in agent.spans() if span["attributes"].get("url.path") == "/openapi.json"]
    assert_nothing_secret(agent)


@pytest.mark.parametrize("capture", [None, 1024], ids=["default-capture", "capture-1024"])
def test_rollout_id_from_a_run_body_larger_than_the_capture(gym, tracer, capture):
    """/run bodies three times the capture: the id when its fields come first and decide it,
    or when they come after the big field (Gym's order: the body's tail shows them); none,
    never a wrong one, when the indices come first and the body's tail does not name them;
    the downstream calls carry it in their prefix."""
    run = gym()
    agent = tracer(*(["--capture-bytes", str(capture)] if capture else []))
    assert_attached(agent, run)
    size = capture or DEFAULT_CAPTURE
    bodies = [
        # Indices first, but an _ng_rollout_id could still follow and win: undecided, no id.
        run_body(7, 1, attempt=1, padding=3 * size),
        run_body(rollout_id="big-first", attempt=0, padding=3 * size),  # decided: the id
        run_body(8, 2, attempt=1, padding=3 * size, ids_first=False),  # after the big field: the tail's
        run_body(rollout_id="big-after", attempt=3, padding=3 * size, ids_first=False),
    ]
    sent = drive_rollouts(run, bodies)
    assert_agent_answers(sent)
    expected = seen_by_servers(run, sent, capture=size)
    assert [e.rollout_id for e in expected if e.name == "POST /run"] == [None, "big-first", "8-2-a1", "big-after-a3"]
    spans = finish(agent, run, expected)
    assert_server_spans(spans, run, expected, summary=agent.summary())
    assert_semantic_spans(spans, run)


def test_resource_names_each_server_after_its_gym_name(gym, tracer):
    """service.name is nemo/<server name>, or <OTEL_SERVICE_NAME>/<server name> when the
    server's own environment sets OTEL_SERVICE_NAME."""
    run = gym(env={"example_verifier": {"OTEL_SERVICE_NAME": "my-gym"}})
    agent = tracer()
    assert_attached(agent, run)
    sent = drive_rollouts(run, rollout_mix(3))
    expected = seen_by_servers(run, sent)
    spans = finish(agent, run, expected)
    assert_server_spans(spans, run, expected, summary=agent.summary())  # checks each span's resource
    assert {span["resource"]["service.name"] for span in spans} == {
        "nemo/simple_agent", "nemo/policy_model", "my-gym/example_verifier"}


@pytest.mark.parametrize("how, spec, groups", [
    pytest.param("flag", "default", {"job", "server", "http_client", "rollout"}, id="flag-default"),
    pytest.param("env", "default", {"job", "server", "http_client", "rollout"}, id="env-default"),
    pytest.param("flag", "server", {"server"}, id="flag-server"),
    pytest.param("flag", "server,verify,model_call", {"server", "verify", "model_call"}, id="flag-list"),
])
def test_span_groups_gate_each_kind_of_span(gym, tracer, how, spec, groups):
    """Only the enabled groups' spans: every SERVER span still, gym.* spans only of enabled
    groups, no CLIENT span without http_client."""
    run = gym()
    agent = tracer("--span-groups", spec) if how == "flag" else tracer(env={"NEMO_GYM_OTEL_SPAN_GROUPS": spec})
    assert_attached(agent, run)
    sent = drive_rollouts(run, rollout_mix(11)) + direct_calls(run)
    expected = seen_by_servers(run, sent)
    spans = finish(agent, run, expected, groups)
    assert_server_spans(spans, run, expected, summary=agent.summary(), groups=groups)
    assert_semantic_spans(spans, run, groups)
    if "http_client" not in groups:
        assert {span["kind"] for span in spans} <= {"SERVER", "INTERNAL"}


def test_discovers_servers_that_start_later_and_outlives_those_that_exit(gym, tracer):
    """Servers started after the agent are attached (stderr line) and traced; one that exits is
    reported and the agent runs on, attaches a later one, and outlives them all."""
    run = gym(servers={**DEFAULT_SERVERS, "late_verifier": RESOURCES}, launch=False)
    agent = tracer()
    run.start("simple_agent", "policy_model", "example_verifier")
    assert_attached(agent, run, "simple_agent", "policy_model", "example_verifier")
    sent = drive_rollouts(run, rollout_mix(4))

    run.stop("example_verifier")
    agent.wait_for_stderr(f"pid {run['example_verifier'].pid} exited")
    assert agent.process.poll() is None, "the agent keeps running when a server exits"
    run.start("late_verifier")
    assert_attached(agent, run, "late_verifier")
    sent += [run["late_verifier"].send("POST", "/ng-rollout/late-1/verify", {"reward": 1.0}),
             run.model.send("POST", "/v1/messages", {"messages": []})]
    assert_agent_answers(sent)
    expected = seen_by_servers(run, sent)

    run.stop()
    for server in (run.agent, run.model, run["late_verifier"]):
        agent.wait_for_stderr(f"pid {server.pid} exited")
    time.sleep(2)
    assert agent.process.poll() is None, "with --discover the agent runs on when every server has exited"
    spans = finish(agent, run, expected)
    assert_server_spans(spans, run, expected, summary=agent.summary())
    assert_semantic_spans(spans, run)


def test_gym_metrics_after_sigint(gym, tracer):
    """The final export: gym.rollout.duration_ms counts the /run calls, gym.verify.duration_ms
    the /verify calls, gym.verify.calls splits them by succeeded (< 500), success_rate is their
    ratio, each per nemo.gym.server.name; http.server.request.duration counts every request."""
    run = gym()
    agent = tracer()
    assert_attached(agent, run)
    sent = drive_rollouts(run, rollout_mix(22)) + [
        run.resources.send("POST", "/verify", {"reward": 0.0}),
        run.resources.send("POST", "/ng-rollout/v-1/verify", {"raise": True}),
        run.resources.send("POST", "/ng-rollout/v-2/verify", {}),
    ]
    expected = seen_by_servers(run, sent)
    finish(agent, run, expected)
    runs = [e for e in expected if e.name == "POST /run"]
    verifies = [e for e in expected if e.name == "POST /verify"]
    succeeded = sum(e.status < 500 for e in verifies)
    assert 0 < succeeded < len(verifies)
    agent_name, resources_name = {"nemo.gym.server.name": run.agent.name}, {"nemo.gym.server.name": run.resources.name}

    [rollout] = our_points(agent, run, "gym.rollout.duration_ms")
    assert (rollout["type"], rollout["unit"], rollout["attributes"], rollout["count"]) == \
           ("histogram", "ms", agent_name, len(runs))
    assert_resource(rollout["resource"], run.agent)
    [verify] = our_points(agent, run, "gym.verify.duration_ms")
    assert (verify["type"], verify["unit"], verify["attributes"], verify["count"]) == \
           ("histogram", "ms", resources_name, len(verifies))
    assert_resource(verify["resource"], run.resources)
    calls = our_points(agent, run, "gym.verify.calls")
    assert {p["type"] for p in calls} == {"sum"}
    assert all(p["attributes"] == {**resources_name, "succeeded": p["attributes"]["succeeded"]} for p in calls)
    assert {p["attributes"]["succeeded"]: p["value"] for p in calls} == {True: succeeded,
                                                                          False: len(verifies) - succeeded}
    [rate] = our_points(agent, run, "gym.verify.success_rate")
    assert (rate["type"], rate["attributes"]) == ("gauge", resources_name)
    assert rate["value"] == pytest.approx(succeeded / len(verifies))

    by_name = {s.name: s for s in run.servers.values()}
    counts = collections.Counter()
    for point in our_points(agent, run, "http.server.request.duration"):
        a = point["attributes"]
        assert point["unit"] == "s"
        counts[(a["nemo.gym.server.name"], a["http.request.method"], a["http.response.status_code"],
                a.get("http.route"))] += point["count"]
        assert_resource(point["resource"], by_name[a["nemo.gym.server.name"]])
    assert counts == collections.Counter(
        (e.server, e.method, e.status, known_route(by_name[e.server], e.path)) for e in expected)


@pytest.mark.parametrize("user_routes", [(), ("/items/{item_id}",)], ids=["no-routes", "with-route-flag"])
def test_without_route_harvest_only_gym_routes_are_templates(gym, tracer, user_routes):
    """--no-route-harvest: Gym's own routes (/verify, /health) still get http.route; the app's
    others do not, and a numeric id in them is named {id} in the span name only — unless a
    --route template names it."""
    run = gym()
    agent = tracer("--no-route-harvest", *[arg for route in user_routes for arg in ("--route", route)])
    sent = [run.resources.send("GET", "/health"), run.resources.send("POST", "/ng-rollout/h-1/verify", {}),
            run.resources.send("POST", "/get_weather", {"city": "Oslo"}), run.resources.send("GET", "/items/7"),
            run.model.send("POST", "/ng-rollout/h-1/v1/responses", {"input": PROMPT})]
    expected = seen_by_servers(run, sent, harvest=set(user_routes))
    items = "GET /items/{item_id}" if user_routes else "GET /items/{id}"
    assert {e.name for e in expected} >= {"POST /get_weather", items, "GET /health"}
    spans = finish(agent, run, expected)
    assert_server_spans(spans, run, expected, summary=agent.summary(), harvest=set(user_routes))
    assert_semantic_spans(spans, run)


@pytest.mark.parametrize("output", ["json", "otlp"])
def test_secret_headers_and_cookies_are_never_exported(gym, tracer, receiver, output):
    """Credentials on the wire, inbound (the test's client sends Authorization, x-api-key and a
    Cookie) and outbound (the agent server sends them to its peers; every server answers with
    a Set-Cookie): the canary is in none of the tracer's output, its log, or what an OTLP
    collector receives (spans, metrics, resources)."""
    run = gym()
    otlp = ["--otlp-endpoint", receiver.http_endpoint, "--otlp-protocol", "http/protobuf"] if output == "otlp" else []
    agent = tracer(*otlp)
    assert_attached(agent, run)
    sent = [run.agent.send("POST", "/run", body, headers=SECRET_HEADERS) for body in rollout_mix(4)]
    sent += [run.model.send("POST", "/v1/responses", {"input": PROMPT}, headers=SECRET_HEADERS),
             run.resources.send("POST", "/ng-rollout/c-1/verify", {"reward": 1.0}, headers=SECRET_HEADERS)]
    expected = seen_by_servers(run, sent)
    if output == "otlp":
        wait_until(lambda: len(receiver.received.spans) >= len(expected), 15, f"{len(expected)} spans received")
        time.sleep(0.5)
        agent.stop()
        assert agent.returncode == 0, agent.stderr()
        received = repr((receiver.received.spans, receiver.received.metric_points,
                         receiver.received.histogram_points))
        assert CANARY not in received, "a credential reached the collector"
        assert not any(CANARY.encode() in payload for payload in receiver.received.payloads), \
            "a credential reached the collector (in a field the receiver does not decode)"
        assert {s["name"] for s in receiver.received.spans} >= {"POST /run", "POST /verify"}
        assert receiver.received.histogram_points, "the final metric export was checked too"
    else:
        spans = finish(agent, run, expected)
        assert_server_spans(spans, run, expected, summary=agent.summary())
    assert CANARY not in agent.stdout_text(), "a credential was exported"
    assert CANARY not in agent.stderr(), "a credential was logged"
    assert_nothing_secret(agent)
