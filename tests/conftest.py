import os

import pytest

from harness import Agent, UvicornServer
from otlp_receiver import OtlpReceiver


def pytest_configure(config):
    if os.geteuid() != 0:
        raise pytest.UsageError("the integration tests load eBPF programs: run them as root (cargo xtask test)")


@pytest.fixture
def server_factory():
    servers = []

    def start(**kwargs):
        server = UvicornServer(**kwargs).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


@pytest.fixture
def receiver():
    receiver = OtlpReceiver().start()
    yield receiver
    receiver.stop()


@pytest.fixture
def tracer():
    """Starts gym-tracer with `--discover gym` (plus any flags); a test that does not stop it
    itself gets it killed at teardown."""
    agents = []

    def start(*extra_args, env=None):
        agent = Agent(discover=True, extra_args=extra_args, env=env)
        agents.append(agent)
        return agent.start()

    yield start
    for agent in agents:
        if agent.process and agent.process.poll() is None:
            agent.process.kill()
            agent.process.wait()
