"""The task-context reads on the CPython minors pyenv has on this machine kind: the same
stdlib-only asyncio server (support/servers/stdlib_asyncio_app.py) under each, traced by
`--pid`, 40 requests 8 at a time, each making two calls.

A minor the tracer knows (3.12, 3.13) is read: every call hangs under exactly the request
that made it (the handler's task writes the response, so its context binds the calls; the
first calls, made while their request was the only one in flight, by that). One
it does not know (3.11) is reported (`python_runtimes_off`, a log line), never misread: its
calls get no parent where several requests are in flight, each counted, and never a wrong
one. A minor pyenv lacks is a failure, not a skip: the machine kind provides all three."""

import collections
import os
import re
import subprocess
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import free_port, wait_listening, wait_until

APP = Path(__file__).resolve().parent / "support" / "servers" / "stdlib_asyncio_app.py"
REQUESTS, AT_A_TIME = 40, 8
UNDECIDED = ["parents_ambiguous", "parents_no_evidence", "parents_none", "parents_contradicted"]
LEAF = re.compile(r"^/leaf/(\d+)/(\d+)$")


def pyenv_python(version):
    root = Path(os.environ.get("PYENV_ROOT") or Path.home() / ".pyenv")
    python = root / "versions" / version / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no {python}: this machine kind provides pyenv's Python {version}", pytrace=False)
    return python


@pytest.fixture
def stdlib_server():
    started = []

    def start(version):
        port = free_port()
        process = subprocess.Popen([str(pyenv_python(version)), str(APP), str(port)])
        started.append(process)
        wait_listening(process, port, f"the stdlib asyncio app on Python {version}")
        return process, port

    yield start
    for process in started:
        process.terminate()
        process.wait(timeout=10)


def drive(port):
    def one(n):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/front/{n}", timeout=30) as response:
            assert response.status == 200

    with ThreadPoolExecutor(AT_A_TIME) as pool:
        list(pool.map(one, range(REQUESTS)))


@pytest.mark.parametrize("version,known", [("3.13.0", True), ("3.12.1", True), ("3.11.7", False)])
def test_task_contexts_on_each_cpython_minor(stdlib_server, agents, version, known):
    process, port = stdlib_server(version)
    agent = agents([process.pid])
    drive(port)
    spans = lambda: [s for s in agent.spans() if s["resource"].get("process.pid") == process.pid]  # noqa: E731
    wait_until(lambda: len(spans()) >= REQUESTS * 5, 20, lambda: f"{REQUESTS * 5} spans, have {len(spans())}")
    agent.stop()
    assert agent.returncode == 0, agent.stderr()
    summary = agent.summary()
    assert summary["python_runtimes_read"] == (1 if known else 0), summary
    assert summary["python_runtimes_off"] == (0 if known else 1), summary
    if not known:
        assert f"pid {process.pid}" in agent.stderr() and "3.11" in agent.stderr(), agent.stderr()

    by_kind = collections.defaultdict(list)
    for span in spans():
        by_kind[span["kind"]].append(span)
    fronts = {int(s["attributes"]["url.path"].split("/")[2]): s for s in by_kind["SERVER"]
              if s["attributes"]["url.path"].startswith("/front/")}
    assert sorted(fronts) == list(range(REQUESTS))
    calls = by_kind["CLIENT"]
    assert len(calls) == 2 * REQUESTS
    wrong, orphans = [], 0
    for call in calls:
        path = "/" + call["attributes"]["url.full"].split("://", 1)[1].split("/", 1)[1]
        n = int(LEAF.match(path).group(1))
        if not call["parent_span_id"]:
            orphans += 1
        elif call["parent_span_id"] != fronts[n]["span_id"]:
            wrong.append(path)
    print(f"\nPython {version}: {len(calls)} calls, {orphans} without a parent, {len(wrong)} wrong; "
          + ", ".join(f"{k}={v}" for k, v in summary.items() if k.startswith(("parents_", "python_", "context_"))))
    assert not wrong, f"calls under a wrong request: {wrong}"
    if known:
        # Mostly by the task context their request's response was written under; the first
        # ones, made while their request was the only one in flight, by that (and the other
        # call of that handler by its task context).
        decided = sum(value for name, value in summary.items() if name.startswith("parents_by_"))
        assert orphans == 0 and decided == 2 * REQUESTS, summary
        assert summary["parents_by_response_context"] >= REQUESTS, summary
    else:
        assert summary["context_chains_read"] == 0, "an unknown interpreter is never read"
        assert sum(summary[name] for name in UNDECIDED) >= orphans, summary
