"""Least privilege, end to end: `gym-tracer doctor` on the real kernel, and the real agent run
as an unprivileged uid (and as uid 0 with a reduced bounding set) holding only the documented
capabilities, against a real uvicorn server owned by root."""

import json
import os
import re
import subprocess
import urllib.request

import pytest

from harness import agent_binary

# The set the README, the systemd unit and the DaemonSet grant; names as setpriv spells them.
REQUIRED = ["bpf", "perfmon", "dac_read_search", "sys_ptrace"]
NOBODY = 65534

ROW = re.compile(r"^  (\S.*?)\s{2,}(ok|info|warn|FAIL|on|off)\s+(\S.*)$")


def setpriv(uid, caps):
    """A prefix that runs a command as `uid` with exactly `caps` in effect: ambient (so they
    survive the exec as a non-root uid) and nothing else in the bounding set."""
    spec = ",".join(["-all"] + [f"+{cap}" for cap in caps])
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
            f"--inh-caps={spec}", f"--ambient-caps={spec}", f"--bounding-set={spec}"]


def doctor(prefix=(), pids=()):
    args = [*prefix, str(agent_binary()), "doctor"]
    for pid in pids:
        args += ["--pid", str(pid)]
    result = subprocess.run(args, capture_output=True, text=True, timeout=60)
    rows = {}
    for line in result.stdout.splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = (match.group(2), match.group(3))
    return result, rows


def log_messages(stderr):
    """The messages of the agent's JSON-lines log (raw lines for anything else)."""
    messages = []
    for line in stderr.splitlines():
        try:
            messages.append(json.loads(line).get("message", ""))
        except json.JSONDecodeError:
            messages.append(line)
    return messages


def test_doctor_as_root_reports_a_working_host(server_factory):
    server = server_factory()
    result, rows = doctor(pids=[server.pid])
    assert result.returncode == 0, result.stdout + result.stderr
    for check in ["kernel", "BTF", "tracefs", "tracepoints", "ring buffer", "eBPF programs",
                  "CAP_BPF", "CAP_PERFMON", "CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE"]:
        assert rows[check][0] == "ok", f"{check}: {rows[check]}\n{result.stdout}"
    assert rows["tracepoints"][1].startswith("all 26 present")
    assert "sched/sched_process_fork" in rows["tracepoints"][1]
    assert "sched/sched_process_exec" in rows["tracepoints"][1]
    assert "detached; nothing was traced" in rows["eBPF programs"][1]
    assert rows[f"pid {server.pid}"][0] == "ok"
    for feature in ["tracing", "fork following", "discovery", "route harvest", "connection addresses"]:
        assert rows[feature][0] == "on", f"{feature}: {rows[feature]}"
    assert "FAIL" not in result.stdout


def test_doctor_without_capabilities_names_them_and_fails(server_factory):
    server = server_factory()
    result, rows = doctor(setpriv(NOBODY, []), pids=[server.pid])
    assert result.returncode != 0, result.stdout
    for capability in ["CAP_BPF", "CAP_PERFMON", "CAP_DAC_READ_SEARCH", "CAP_SYS_PTRACE"]:
        status, detail = rows[capability]
        assert status == "FAIL" and detail.startswith("missing:"), f"{capability}: {rows[capability]}"
    assert rows["in effect"][1] == f"uid {NOBODY}, CapEff none"
    assert rows["eBPF programs"][0] == "FAIL"
    assert "Operation not permitted" in rows["eBPF programs"][1]
    assert rows["tracing"][0] == "off"
    assert rows[f"pid {server.pid}"][0] == "warn"  # root's server: environ, exe and fd unreadable


def traced_requests(server, agent, count=3):
    for _ in range(count):
        with urllib.request.urlopen(f"{server.base_url}/health", timeout=10) as response:
            response.read()
    agent.wait_for_spans(count, timeout=10)


@pytest.mark.parametrize("uid", [NOBODY, 0], ids=["nobody-ambient", "root-bounding-set"])
def test_the_agent_traces_with_only_the_documented_capabilities(server_factory, agents, uid):
    server = server_factory()  # runs as root: the agent needs CAP_SYS_PTRACE for its /proc entries
    result, rows = doctor(setpriv(uid, REQUIRED), pids=[server.pid])
    assert result.returncode == 0, result.stdout
    assert rows[f"pid {server.pid}"][0] == "ok", rows[f"pid {server.pid}"]

    agent = agents([server.pid], start=False)
    agent.args = setpriv(uid, REQUIRED) + agent.args
    os.chmod(agent.workdir, 0o777)  # the ready file is written by the agent's uid
    agent.start()
    agent.wait_for_routes(server.pid)  # /proc/<pid>/fd → listening port → /openapi.json
    traced_requests(server, agent)
    agent.stop()
    assert agent.returncode == 0, agent.stderr()
    spans = [span for span in agent.spans() if span["attributes"].get("url.path") == "/health"]
    assert len(spans) == 3, agent.stdout_text()
    for span in spans:
        assert span["kind"] == "SERVER" and span["name"] == "GET /health"
        assert span["attributes"]["http.response.status_code"] == 200
        assert span["attributes"]["client.address"] == "127.0.0.1"
        assert span["resource"]["process.pid"] == server.pid
        # /proc/<pid>/exe of a root process: read thanks to CAP_SYS_PTRACE.
        assert span["resource"]["process.executable.path"].endswith(("python3", "python3.13", "python"))
    assert any("route templates" in message for message in agent.log_messages()), agent.stderr()


@pytest.mark.parametrize("missing", REQUIRED)
def test_without_one_required_capability_the_agent_names_it(server_factory, missing):
    server = server_factory()
    caps = [cap for cap in REQUIRED if cap != missing]
    result = subprocess.run(
        [*setpriv(NOBODY, caps), str(agent_binary()), "run", "--pid", str(server.pid)],
        capture_output=True, text=True, timeout=30,
    )
    assert result.returncode != 0
    errors = [message for message in log_messages(result.stderr) if "lacks" in message]
    assert len(errors) == 1, result.stderr
    name = f"CAP_{missing.upper()}"
    assert f"gym-tracer lacks {name} (" in errors[0]
    assert all(f"lacks CAP_{other.upper()}" not in errors[0] for other in caps)
    assert "AmbientCapabilities=CAP_BPF CAP_PERFMON CAP_DAC_READ_SEARCH CAP_SYS_PTRACE" in errors[0]
    assert "run it as root" in errors[0].lower()
