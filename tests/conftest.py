"""Fixtures every test module shares. Each one tears down what it started, also when the test
fails, so no test leaks a server, a receiver or an agent into the next."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

# The support programs (harness, receiver, launchers, Gym-shaped servers) live in
# tests/support and import each other by bare name, as they do when run as scripts; the test
# modules import them the same way.
sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))

from gym_launch import GymRun  # noqa: E402
from harness import Agent, UvicornServer  # noqa: E402
from otlp_receiver import OtlpReceiver  # noqa: E402


def pytest_configure(config):
    if os.geteuid() != 0:
        raise pytest.UsageError("the integration tests load eBPF programs: run them as root (cargo xtask test)")
    # The tests stop servers with SIGINT, as Ctrl-C does. A shell that runs a command in the
    # background without job control (CI runners, `nohup cmd &`) starts it with SIGINT ignored,
    # and every child inherits that: uvicorn then ignores the stop and each real-Gym test waited
    # out its 15 s before SIGKILL. A handled signal is reset to its default by exec, so a
    # handler here gives every process the tests start the default.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def server_factory():
    servers = []

    def start(spawn=subprocess.Popen, **kwargs):
        """`UvicornServer(**kwargs)`, started with `spawn` (a Popen-like callable)."""
        server = UvicornServer(**kwargs)
        servers.append(server)
        return server.start(spawn)

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def receiver():
    """An OTLP receiver, started; at teardown, no two spans it got may share a span id."""
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()
    receiver.assert_span_ids_unique()


@pytest.fixture
def collector():
    """An OTLP receiver that is NOT started: each test starts, stops and restarts it. At
    teardown, as for `receiver`, no two spans one got may share a span id."""
    receivers = []

    def make(**kwargs):
        receiver = OtlpReceiver(**kwargs)
        receivers.append(receiver)
        return receiver

    yield make
    for receiver in receivers:
        receiver.delay_s = 0
        receiver.stop()
    for receiver in receivers:
        receiver.assert_span_ids_unique()


@pytest.fixture
def agents():
    """Makes gym-tracer agents (`Agent(...)` arguments; started unless start=False). At teardown
    each one still running is stopped, or killed, and its stderr printed (pytest shows it for a
    failed test); then each one's spans are checked for shared span ids (`Agent.close`)."""
    made = []

    def make(*args, start=True, **kwargs):
        agent = Agent(*args, **kwargs)
        made.append(agent)
        return agent.start() if start else agent

    yield make
    failure = None
    for agent in made:  # every one closed, also after one failed its check
        try:
            agent.close()
        except Exception as error:
            failure = failure or error
    if failure is not None:
        raise failure


@pytest.fixture
def tracer(agents):
    """Starts gym-tracer with `--discover gym` (plus any flags)."""

    def start(*extra_args, env=None):
        return agents(discover=True, extra_args=extra_args, env=env)

    return start


@pytest.fixture
def gym():
    """Launches Gym-shaped runs (gym_launch.GymRun); every server is stopped at teardown."""
    runs = []

    def start(servers=None, env=None, launch=True):
        run = GymRun(servers, env)
        runs.append(run)
        return run.start() if launch else run

    yield start
    for run in runs:
        run.stop()
