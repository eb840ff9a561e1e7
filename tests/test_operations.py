"""Operating the agent: configuration layering (flag > env > file > default) as the running
agent applies it, check-config, the health endpoint, and the structured log."""

import json
import re
import subprocess
import urllib.error
import urllib.request

from harness import agent_binary, free_port, http_get, wait_until


def write_config(tmp_path, text):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_config_layers_reach_the_exported_spans(server_factory, tmp_path, agents):
    server = server_factory()
    config = write_config(tmp_path, f"""
pid = [{server.pid}]
server-name = "file-server"
service-name = "file-group"
resource-attributes = "team=file"
""")
    env = {"OTEL_SERVICE_NAME": "env-group", "OTEL_RESOURCE_ATTRIBUTES": "team=env,k8s.node.name=env-node"}
    flags = ["--config", str(config), "--resource-attributes", "team=flag"]
    agent = agents(extra_args=flags, env=env)
    for _ in range(3):
        assert http_get(f"{server.base_url}/health")[0] == 200
    agent.stop()
    assert agent.returncode == 0, agent.stderr()
    spans = agent.spans()
    assert len(spans) == 3, agent.stderr()
    resource = spans[0]["resource"]
    assert resource["nemo.gym.server.name"] == "file-server", "file beats default"
    assert resource["service.name"] == "env-group/file-server", "env beats file"
    assert resource["team"] == "flag", "flag beats env"
    assert "k8s.node.name" not in resource, "a flag replaces the env value, it does not merge"

    # check-config reports the same values and says where each came from.
    shown = subprocess.run(
        [str(agent_binary()), "--config", str(config), "check-config", "--resource-attributes", "team=flag"],
        env=dict(agent.env, **env), capture_output=True, text=True, timeout=30,
    )
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.splitlines()
    assert f'pid = ["{server.pid}"]  # file' in lines, shown.stdout
    assert 'service-name = "env-group"  # env' in lines, shown.stdout
    assert 'resource-attributes = "team=flag"  # flag' in lines, shown.stdout
    assert 'max-stitching-spans = 100000  # default' in lines, shown.stdout


def test_check_config_rejects_what_run_would_reject(tmp_path):
    binary = str(agent_binary())
    env = {"PATH": "/usr/bin:/bin"}

    def check(*args, config=None):
        argv = [binary] + (["--config", str(write_config(tmp_path, config))] if config else []) + ["check-config", *args]
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)

    unknown = check(config='discover = "gym"\notlp-endpont = "http://c:4317"\n')
    assert unknown.returncode != 0 and "unknown key `otlp-endpont`" in unknown.stderr, unknown.stderr

    secret = "sk-live-0123456789"
    masked = check("--discover", "gym", "--otlp-endpoint", "https://collector:4317",
                   "--otlp-headers", f"authorization=Bearer {secret}")
    assert masked.returncode == 0, masked.stderr
    assert 'otlp-headers = "authorization=***"  # flag' in masked.stdout
    assert secret not in masked.stdout + masked.stderr

    plain_tls = check("--discover", "gym", "--otlp-endpoint", "http://collector:4317", "--otlp-ca-file", "/etc/hostname")
    assert plain_tls.returncode != 0 and "https://" in plain_tls.stderr, plain_tls.stderr

    nothing = check()
    assert nothing.returncode != 0 and "--discover gym" in nothing.stderr, nothing.stderr

    # `run` validates the same way before loading anything into the kernel.
    run = subprocess.run([binary, "run", "--discover", "gym", "--otlp-endpoint", "collector:4317"],
                         env=env, capture_output=True, text=True, timeout=30)
    assert run.returncode != 0 and "http:// or https://" in run.stderr, run.stderr


def health_port(agent):
    message = agent.wait_for_stderr("serving /healthz and /metrics on http://")
    return int(re.search(r":(\d+)$", message).group(1))


def get(url):
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_health_endpoint_serves_status_and_counters(server_factory, agents):
    server = server_factory()
    agent = agents(pids=[server.pid], extra_args=["--health-listen", "127.0.0.1:0"])
    base = f"http://127.0.0.1:{health_port(agent)}"
    status, body = get(f"{base}/healthz")
    assert status == 200, body
    health = json.loads(body)
    assert health["status"] == "ok" and health["probes_attached"] is True
    assert health["exporter"]["reachable"] is True

    requests = 5
    for _ in range(requests):
        assert http_get(f"{server.base_url}/health")[0] == 200

    def counters():
        status, text = get(f"{base}/metrics")
        assert status == 200
        return text, dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))

    def all_counted():
        # /metrics is a snapshot refreshed every second; a span is exported after the 500 ms
        # stitch delay, so both counters are polled until they reach the exact count. The
        # agent's own route-harvest request is an exchange too, counted as ignored
        # (agent.rs, handle_exchange), and exports nothing.
        text, values = counters()
        ours = int(values["gym_tracer_requests_traced_total"]) - int(values["gym_tracer_self_requests_ignored_total"])
        done = ours == requests and int(values["gym_tracer_spans_exported_total"]) == requests
        return (text, values) if done else None

    text, values = wait_until(all_counted, 10, lambda: f"{requests} exchanges and spans exported:\n{counters()[0]}")
    assert values["gym_tracer_processes_traced"] == "1", text
    assert values["gym_tracer_probes_attached"] == "1", text
    assert values["gym_tracer_events_lost_in_kernel_total"] == "0", text
    assert int(values["gym_tracer_spans_exported_total"]) >= 5, text
    assert get(f"{base}/nope")[0] == 404
    request = urllib.request.Request(f"{base}/healthz", data=b"x", method="POST")
    try:
        urllib.request.urlopen(request, timeout=5)
        raise AssertionError("POST was accepted")
    except urllib.error.HTTPError as error:
        assert error.code == 405
    agent.stop()
    assert agent.returncode == 0, agent.stderr()


def test_health_turns_unhealthy_while_the_collector_is_unreachable(server_factory, agents):
    server = server_factory()
    closed_port = free_port()  # nothing listens there
    agent = agents(pids=[server.pid], extra_args=[
        "--health-listen", "127.0.0.1:0", "--otlp-endpoint", f"http://127.0.0.1:{closed_port}",
        "--otlp-protocol", "http/protobuf", "--otlp-timeout", "2000",
    ])
    base = f"http://127.0.0.1:{health_port(agent)}"
    assert get(f"{base}/healthz")[0] == 200, "nothing failed yet"
    assert http_get(f"{server.base_url}/health")[0] == 200
    def unhealthy():
        answer = get(f"{base}/healthz")
        return answer if answer[0] == 503 else None

    status, body = wait_until(unhealthy, 20, "/healthz answering 503", interval=0.3)
    assert status == 503, body
    health = json.loads(body)
    assert health["exporter"]["reachable"] is False and health["exporter"]["last_error"], body
    assert health["probes_attached"] is True
    agent.stop()
    assert agent.returncode == 0, agent.stderr()
    assert agent.summary()["spans_lost_in_export"] >= 1, agent.log_messages()[-1]


def test_log_is_structured_and_levelled(server_factory, agents):
    server = server_factory()
    agent = agents(pids=[server.pid])
    agent.wait_for_stderr(f"attached pid {server.pid}")
    agent.stop()
    records = agent.log()
    assert records and all(record["level"] in {"INFO", "WARN", "ERROR", "DEBUG"} for record in records), records
    assert all("timestamp" in record and "message" in record for record in records)
    attached = next(r for r in records if r["message"].startswith(f"attached pid {server.pid}"))
    assert attached["pid"] == server.pid, "structured fields, not only text"

    quiet = agents(pids=[server.pid], env={"RUST_LOG": "warn"})
    quiet.stop()
    assert quiet.returncode == 0
    assert not any(r["message"].startswith("attached pid") for r in quiet.log()), quiet.stderr()

    text = agents(pids=[server.pid], extra_args=["--log-format", "text"])
    text.stop()
    lines = text.stderr().splitlines()
    assert any(f"attached pid {server.pid}" in line and not line.startswith("{") for line in lines), lines
