"""The task-context reads on the CPython minors pyenv has on this machine kind: the same
stdlib-only asyncio server (support/servers/stdlib_asyncio_app.py) under each, traced by
`--pid`, 40 requests 8 at a time, each making two calls.

A minor the tracer knows (3.12, 3.13) is read: every call hangs under exactly the request
that made it (the handler's task writes the response, so its context binds the calls; the
first calls, made while their request was the only one in flight, by that). One
it does not know (3.11) is reported (`python_runtimes_off`, a log line), never misread: its
calls get no parent where several requests are in flight, each counted, and never a wrong
one. A minor pyenv lacks is a failure, not a skip: the machine kind provides all three.

Task lineage (`--task-lineage on`) on each minor it knows: the FastAPI causality app
(support/servers/causality_app.py, its `/gather/{n}` handler making its two calls in
asyncio.gather children) under uvicorn, on 3.13 (target/venv) and 3.12 (target/venv-py312),
100 requests in flight: every call under exactly its request, each decided by lineage. And an
interpreter without the symbols the probe needs — the same 3.13 with a stripped copy of
`_asyncio` first on its path — is reported (lineage_processes_off, a log line naming the file
and the reason), never misread: its calls are left to the other evidence (none here: counted,
never wrong)."""

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from harness import ROOT, free_port, wait_listening, wait_until
from span_ids import parent_key, span_key

APP = Path(__file__).resolve().parent / "support" / "servers" / "stdlib_asyncio_app.py"
REQUESTS, AT_A_TIME = 40, 8
UNDECIDED = ["parents_ambiguous", "parents_no_evidence", "parents_no_request_in_flight", "parents_contradicted"]
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


def wrong_and_orphans(calls, fronts):
    """Of the CLIENT spans `calls` (each to /leaf/n/i): the paths of those under another than
    their request n's SERVER span (`fronts[n]`, in its trace), and how many have no parent."""
    wrong, orphans = [], 0
    for call in calls:
        path = "/" + call["attributes"]["url.full"].split("://", 1)[1].split("/", 1)[1]
        n = int(LEAF.match(path).group(1))
        if parent_key(call) is None:
            orphans += 1
        elif parent_key(call) != span_key(fronts[n]):
            wrong.append(path)
    return wrong, orphans


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
    wrong, orphans = wrong_and_orphans(calls, fronts)
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


LINEAGE_REQUESTS, LINEAGE_AT_A_TIME = 200, 100


def lineage_python(minor):
    python = ROOT / "target" / ("venv" if minor == "3.13" else "venv-py312") / "bin" / "python"
    if not python.exists():
        pytest.fail(f"no {python}: run `cargo xtask setup` (it makes the 3.12 venv too)", pytrace=False)
    return python


def stripped_asyncio(directory):
    """A copy of the 3.13 venv's `_asyncio` module with its symbol table stripped, in
    `directory` (put first on PYTHONPATH, it is the one imported)."""
    import _asyncio  # the test venv is pyenv's 3.13.0, like the server's
    copy = Path(directory) / Path(_asyncio.__file__).name
    shutil.copy(_asyncio.__file__, copy)
    subprocess.run(["strip", "--strip-all", str(copy)], check=True)
    return copy


@pytest.mark.parametrize("minor,stripped", [("3.13", False), ("3.12", False), ("3.13", True)],
                         ids=["3.13", "3.12", "3.13-stripped-asyncio"])
def test_task_lineage_on_each_cpython_minor(server_factory, agents, minor, stripped):
    with tempfile.TemporaryDirectory(prefix="stripped-asyncio-") as directory:
        env = {}
        if stripped:
            module = stripped_asyncio(directory)
            env["PYTHONPATH"] = f"{directory}:{Path(__file__).resolve().parent / 'support'}"
        python = lineage_python(minor)
        leaf = server_factory(app="servers.causality_app:app", python=python, env=env)
        front = server_factory(app="servers.causality_app:app", python=python,
                               env={**env, "CAUSALITY_DOWNSTREAM": leaf.base_url})
        agent = agents([front.pid, leaf.pid], extra_args=["--task-lineage", "on"])
        agent.wait_for_routes(front.pid)

        def one(n):
            with urllib.request.urlopen(f"http://127.0.0.1:{front.port}/gather/{n}", timeout=60) as response:
                assert response.status == 200

        with ThreadPoolExecutor(LINEAGE_AT_A_TIME) as pool:
            list(pool.map(one, range(LINEAGE_REQUESTS)))
        calls = lambda: [s for s in agent.spans() if s["resource"].get("process.pid") == front.pid  # noqa: E731
                         and s["kind"] == "CLIENT"]
        wait_until(lambda: len(calls()) >= 2 * LINEAGE_REQUESTS, 20,
                   lambda: f"{2 * LINEAGE_REQUESTS} CLIENT spans, have {len(calls())}")
        agent.stop()
    assert agent.returncode == 0, agent.stderr()
    summary = agent.summary()
    fronts = {int(s["attributes"]["url.path"].split("/")[2]): s for s in agent.spans()
              if s["kind"] == "SERVER" and s["resource"].get("process.pid") == front.pid}
    assert sorted(fronts) == list(range(LINEAGE_REQUESTS))
    wrong, orphans = wrong_and_orphans(calls(), fronts)
    print(f"\nPython {minor}{' (stripped _asyncio)' if stripped else ''}: {len(calls())} calls, {orphans} without "
          f"a parent, {len(wrong)} wrong; " + ", ".join(f"{k}={v}" for k, v in summary.items()
                                                        if k.startswith(("parents_", "lineage_"))))
    assert not wrong, f"calls under a wrong request: {wrong[:20]}"
    assert len(calls()) == 2 * LINEAGE_REQUESTS
    if not stripped:
        assert orphans == 0, summary
        assert summary["parents_by_lineage"] == 2 * LINEAGE_REQUESTS, summary
        assert (summary["lineage_processes"], summary["lineage_processes_off"]) == (2, 0), summary
    else:
        # Both servers import the stripped module: neither is probed, each said once.
        assert (summary["lineage_processes"], summary["lineage_processes_off"]) == (0, 2), summary
        assert summary["parents_by_lineage"] == 0 and summary["lineage_tasks_probed"] == 0, summary
        for pid in (front.pid, leaf.pid):
            assert re.search(rf"pid {pid}: task lineage is off \(no_symbols\): {re.escape(str(module))} has no "
                             r"_asyncio_Task___init__ symbol", agent.stderr()), agent.stderr()
        # The gather children's calls: nothing else tells them apart; each counted, none guessed.
        assert orphans == sum(summary[name] for name in UNDECIDED), summary
