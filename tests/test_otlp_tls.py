"""OTLP in production: the real agent, attached by PID to a real uvicorn server, exporting to
the real OTLP receiver over TLS (a CA, server and client certificates made with the openssl
CLI), with mutual TLS, an authorization header and gzip, and to a collector it cannot trust."""

import collections
import subprocess

import pytest

from harness import post_verify, wait_until
from otlp_receiver import OtlpReceiver, Tls

PROTOCOLS = ["grpc", "http/protobuf"]
REQUESTS = 3
TOKEN = "test-token"


def openssl(directory, *args):
    subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)


def make_ca(directory, name):
    openssl(directory, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
            "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")


def make_leaf(directory, name, ca, extensions):
    openssl(directory, "req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
    (directory / f"{name}.ext").write_text(
        "basicConstraints=critical,CA:FALSE\nkeyUsage=critical,digitalSignature\n" + extensions
    )
    openssl(directory, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext")


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """ca.pem signs server.pem (for 127.0.0.1 and localhost) and client.pem; other-ca.pem signs
    nothing here."""
    directory = tmp_path_factory.mktemp("pki")
    make_ca(directory, "ca")
    make_ca(directory, "other-ca")
    make_leaf(directory, "server", "ca", "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    make_leaf(directory, "client", "ca", "extendedKeyUsage=clientAuth\n")
    return directory


@pytest.fixture
def tls_receiver(pki):
    receivers = []

    def start(mutual=False):
        tls = Tls(cert=str(pki / "server.pem"), key=str(pki / "server.key"),
                  client_ca=str(pki / "ca.pem") if mutual else None)
        receiver = OtlpReceiver(tls=tls).start()
        receivers.append(receiver)
        return receiver

    yield start
    for receiver in receivers:
        receiver.stop()
    for receiver in receivers:
        receiver.assert_span_ids_unique()


def endpoint_of(receiver, protocol):
    return receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint


def trace_with_otlp(agents, server, receiver, protocol, *otlp_args):
    """Starts the agent on `server` exporting to `receiver`, sends REQUESTS requests and returns
    the running agent."""
    agent = agents(
        [server.pid],
        extra_args=["--otlp-endpoint", endpoint_of(receiver, protocol), "--otlp-protocol", protocol, *otlp_args],
    )
    agent.wait_for_routes(server.pid)
    post_verify(server.port, REQUESTS)
    return agent


def assert_everything_arrived(agent, receiver, server):
    assert agent.returncode == 0, agent.stderr()
    spans = receiver.received.spans
    assert collections.Counter(span["name"] for span in spans) == {"POST /verify": REQUESTS}
    assert {span["resource"]["process.pid"] for span in spans} == {server.pid}
    points = receiver.received.latest_histograms("http.server.request.duration")
    assert {point["attributes"]["http.response.status_code"]: point["count"] for point in points} == {200: REQUESTS}
    summary = agent.summary()
    assert (summary["spans_exported"], summary["spans_lost_in_export"]) == (REQUESTS, 0), agent.stderr()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_otlp_over_tls(server_factory, tls_receiver, pki, protocol, agents):
    server = server_factory()
    receiver = tls_receiver()
    agent = trace_with_otlp(agents, server, receiver, protocol, "--otlp-ca-file", str(pki / "ca.pem"))
    wait_until(lambda: len(receiver.received.spans) >= REQUESTS, 10, f"{REQUESTS} spans received")
    agent.stop()
    assert_everything_arrived(agent, receiver, server)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_otlp_over_mutual_tls_with_an_auth_header_and_gzip(server_factory, tls_receiver, pki, protocol, agents):
    server = server_factory()
    receiver = tls_receiver(mutual=True)
    agent = trace_with_otlp(
        agents, server, receiver, protocol,
        "--otlp-ca-file", str(pki / "ca.pem"),
        "--otlp-client-cert", str(pki / "client.pem"),
        "--otlp-client-key", str(pki / "client.key"),
        "--otlp-headers", f"authorization=Bearer%20{TOKEN}",
        "--otlp-compression", "gzip",
    )
    wait_until(lambda: len(receiver.received.spans) >= REQUESTS, 10, f"{REQUESTS} spans received")
    agent.stop()
    assert_everything_arrived(agent, receiver, server)

    requests = receiver.received.request_headers
    assert len({request["path"] for request in requests}) == 2, "span and metric exports"
    assert [request["headers"].get("authorization") for request in requests] == [f"Bearer {TOKEN}"] * len(requests)
    if protocol == "http/protobuf":  # gRPC: test_grpc_exports_are_really_gzip_compressed
        assert [request["headers"].get("content-encoding") for request in requests] == ["gzip"] * len(requests)
    assert TOKEN not in agent.stderr(), "header values are never logged"


def test_grpc_exports_are_really_gzip_compressed(server_factory, agents):
    """gRPC hides the encoding from the receiver's handler: a receiver that refuses gzip shows
    that --otlp-compression gzip compresses."""
    server = server_factory()
    receiver = OtlpReceiver(grpc_gzip=False).start()
    try:
        agent = trace_with_otlp(agents, server, receiver, "grpc", "--otlp-compression", "gzip")
        agent.wait_for_stderr("spans failed")
        agent.stop()
    finally:
        receiver.stop()
    receiver.assert_span_ids_unique()
    assert agent.returncode == 0, agent.stderr()
    assert receiver.received.spans == []
    assert any("spans failed" in message and "Unimplemented" in message for message in agent.log_messages())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_collector_with_an_untrusted_certificate_gets_nothing(server_factory, tls_receiver, pki, protocol, agents):
    server = server_factory()
    receiver = tls_receiver()
    agent = trace_with_otlp(
        agents, server, receiver, protocol, "--otlp-ca-file", str(pki / "other-ca.pem"), "--otlp-timeout", "1000"
    )
    agent.wait_for_stderr("spans failed")
    assert agent.process.poll() is None, "the agent keeps running when exports fail"
    agent.stop()

    assert agent.returncode == 0, agent.stderr()
    assert receiver.received.spans == [] and receiver.received.histogram_points == []
    assert receiver.received.request_headers == []
    summary = agent.summary()
    assert (summary["spans_exported"], summary["spans_lost_in_export"]) == (0, REQUESTS), agent.stderr()
    assert any("final metric export" in message and "failed" in message for message in agent.log_messages()), (
        agent.stderr()
    )
    assert any("UnknownIssuer" in message and "--otlp-ca-file" in message for message in agent.log_messages()), (
        "the log says why and what to check"
    )
    if protocol == "http/protobuf":
        assert receiver.tls_handshakes_failed > 0
    # One warning for the outage, not one per batch.
    assert sum("spans failed" in message for message in agent.log_messages()) == 1


def test_a_ca_file_that_is_not_pem_stops_the_agent_at_startup(server_factory, tls_receiver, pki, agents):
    server = server_factory()
    receiver = tls_receiver()
    agent = agents(
        [server.pid],
        extra_args=["--otlp-endpoint", receiver.http_endpoint, "--otlp-ca-file", str(pki / "ca.key")],
        start=False,
    )
    with pytest.raises(RuntimeError) as failure:
        agent.start()
    assert f"--otlp-ca-file {pki / 'ca.key'}: no PEM certificate in it" in str(failure.value)
