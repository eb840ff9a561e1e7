import os

import pytest

from harness import UvicornServer
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
