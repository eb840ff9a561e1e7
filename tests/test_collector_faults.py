"""Collector faults: the real agent, attached by PID to a real uvicorn server, exporting to the
real OTLP receiver while it is down at start, goes down mid-run, answers slowly, refuses (gRPC
UNAVAILABLE / HTTP 503) or rejects for good (INVALID_ARGUMENT / 400). The agent keeps running,
holds spans in a bounded buffer, retries with backoff, counts every span it drops, delivers what
fit once the collector is back, and stops within --shutdown-timeout when it never comes back.

Also the agent's self-telemetry: its own counters arrive as `gym_tracer.*` metrics."""

import re
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness import post_verify, rss_kib, wait_until

PROTOCOLS = ["grpc", "http/protobuf"]


def endpoint_of(receiver, protocol):
    return receiver.grpc_endpoint if protocol == "grpc" else receiver.http_endpoint


def start_agent(agents, server, receiver, protocol, *args, metric_interval=3600, otlp_timeout_ms=1000):
    return agents(
        [server.pid],
        metric_interval=metric_interval,
        extra_args=[
            "--otlp-endpoint", endpoint_of(receiver, protocol), "--otlp-protocol", protocol,
            "--otlp-timeout", str(otlp_timeout_ms), "--no-route-harvest", *args,
        ],
    )


# A POST /verify to the Gym-shaped server, attached by --pid without a server type: its
# SERVER span and nothing else.
SPANS_PER_VERIFY = 1


def send_verify(server, count, pause_s=0.0, numbered_from=None):
    """Sends `count` POST /verify; returns `count`, so a test can add up what it sent."""
    post_verify(server.port, count, pause_s, numbered_from)
    return count


def stopped(agent):
    agent.stop(timeout=60)
    assert agent.returncode == 0, agent.stderr()
    summary = agent.summary()
    assert summary, agent.stderr()
    return summary


def assert_everything_delivered(agent, receiver, summary, sent, twice_possible=False):
    """Every request sent got its span, and every span reached the collector exactly once;
    nothing was dropped. With `twice_possible` (a slow collector that takes a batch whose
    answer comes too late, a collector stopped while it takes one), some may arrive twice."""
    produced = summary["spans_queued"]
    assert produced == sent * SPANS_PER_VERIFY, agent.stderr()
    assert summary["spans_dropped_queue_full"] == 0
    assert summary["spans_lost_in_export"] == 0, agent.stderr()
    assert summary["spans_exported"] == produced, agent.stderr()
    deliveries = receiver.received.span_deliveries()
    assert len(deliveries) == produced, agent.stderr()
    twice = sum(n - 1 for n in deliveries.values())
    print(f"\n{produced} spans delivered, {twice} of them more than once")
    if not twice_possible:
        assert twice == 0, f"{twice} spans delivered more than once: {deliveries.most_common(3)}"


def outage_over(agent):
    return agent.wait_for_stderr("the outage is over", timeout=90)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_collector_down_at_start_gets_everything_once_it_is_up(server_factory, collector, agents, protocol):
    server = server_factory()
    receiver = collector()
    agent = start_agent(agents, server, receiver, protocol)
    sent = send_verify(server, 20)
    agent.wait_for_stderr("spans failed")
    assert agent.process.poll() is None, "the agent keeps running"
    receiver.start()
    message = outage_over(agent)
    assert ", 0 dropped" in message, message
    summary = stopped(agent)
    assert_everything_delivered(agent, receiver, summary, sent)
    assert summary["spans_delivered_late"] == summary["spans_queued"]
    assert summary["span_exports_failed"] >= 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_collector_down_mid_run_gets_what_was_sent_meanwhile(server_factory, collector, agents, protocol):
    server = server_factory()
    receiver = collector().start()
    agent = start_agent(agents, server, receiver, protocol)
    sent = send_verify(server, 5)
    wait_until(lambda: receiver.received.spans, 20, "the first spans arrive")

    receiver.stop()
    sent += send_verify(server, 16, pause_s=1.0)  # requests go on for ~16 s while it is down
    agent.wait_for_stderr("spans failed")
    receiver.start()
    outage_over(agent)
    sent += send_verify(server, 5)
    time.sleep(1.5)  # the last batch goes out on the next tick
    summary = stopped(agent)
    assert_everything_delivered(agent, receiver, summary, sent, twice_possible=True)
    assert summary["spans_delivered_late"] >= 16, "the spans of the outage were held and sent later"
    assert summary["span_exports_failed"] >= 2, "it retried"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_slow_collector_is_retried_until_it_answers_in_time(server_factory, collector, agents, protocol):
    server = server_factory()
    receiver = collector()
    receiver.delay_s = 2.5  # longer than --otlp-timeout 1000
    receiver.start()
    agent = start_agent(agents, server, receiver, protocol)
    sent = send_verify(server, 10)
    agent.wait_for_stderr("spans failed", timeout=30)
    time.sleep(3)
    assert agent.process.poll() is None, "the agent keeps running"
    receiver.delay_s = 0
    outage_over(agent)
    summary = stopped(agent)
    assert_everything_delivered(agent, receiver, summary, sent, twice_possible=True)
    assert summary["span_exports_failed"] >= 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_refusing_collector_is_retried_then_delivered_to(server_factory, collector, agents, protocol):
    server = server_factory()
    receiver = collector()
    receiver.mode = "refuse"  # gRPC UNAVAILABLE / HTTP 503: retryable
    receiver.start()
    agent = start_agent(agents, server, receiver, protocol)
    sent = send_verify(server, 10)
    message = agent.wait_for_stderr("spans failed")
    assert "retrying with backoff" in message, message
    wait_until(lambda: receiver.refusals["refuse"] >= 3, 30, "the agent retries")
    assert receiver.received.spans == []
    receiver.mode = "accept"
    outage_over(agent)
    summary = stopped(agent)
    assert_everything_delivered(agent, receiver, summary, sent)
    assert summary["span_exports_failed"] >= 3


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_rejected_spans_are_dropped_and_counted_at_once(server_factory, collector, agents, protocol):
    server = server_factory()
    receiver = collector()
    receiver.mode = "reject"  # gRPC INVALID_ARGUMENT / HTTP 400: retrying cannot help
    receiver.start()
    agent = start_agent(agents, server, receiver, protocol)
    sent = send_verify(server, 10)
    message = agent.wait_for_stderr("spans failed")
    assert "spans_dropped_rejected" in message, message
    time.sleep(2)
    summary = stopped(agent)
    assert receiver.received.spans == []
    assert summary["spans_queued"] == sent * SPANS_PER_VERIFY > 0
    assert summary["spans_dropped_rejected"] == summary["spans_queued"], agent.stderr()
    assert summary["spans_dropped_export_buffer_full"] == 0
    assert summary["spans_dropped_undelivered_at_shutdown"] == 0, "nothing was kept for retry"


def test_spans_a_collector_rejects_in_a_partial_success_are_counted(server_factory, collector, agents):
    """OTLP/HTTP only: over gRPC the SDK's exporter reads the answer and only logs it."""
    server = server_factory()
    receiver = collector()
    receiver.mode = "partial"  # HTTP 200 with partial_success.rejected_spans = 1
    receiver.start()
    agent = start_agent(agents, server, receiver, "http/protobuf")
    sent = send_verify(server, 5) + send_verify(server, 5, pause_s=0.2)
    message = agent.wait_for_stderr("rejected 1 of its spans")
    assert "one span too old" in message and "spans_dropped_rejected" in message, message
    time.sleep(1)
    summary = stopped(agent)
    partial_answers = receiver.partial_answers
    assert summary["spans_queued"] == sent * SPANS_PER_VERIFY
    assert summary["spans_dropped_rejected"] == partial_answers > 0, agent.stderr()
    assert summary["spans_exported"] == summary["spans_queued"] - partial_answers, agent.stderr()
    assert len(receiver.received.span_ids()) == summary["spans_queued"], "every span was sent"
    assert sum("rejected 1 of its spans" in line for line in agent.log_messages()) == 1, "logged once"


def health_metrics(agent):
    message = agent.wait_for_stderr("serving /healthz and /metrics on http://")
    port = int(re.search(r":(\d+)$", message).group(1))
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {line.split(" ")[0]: int(line.split(" ")[1]) for line in text.splitlines()
            if line and not line.startswith("#") and "{" not in line}


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_a_full_buffer_drops_the_oldest_and_counts_them_exactly(server_factory, collector, agents, protocol):
    server = server_factory()
    receiver = collector()
    agent = start_agent(agents, server, receiver, protocol, "--export-buffer-spans", "5",
                        "--export-batch-size", "4", "--health-listen", "0")
    sent = 0
    for _ in range(6):
        sent += send_verify(server, 5, numbered_from=sent)
        time.sleep(0.7)  # several batches, so the buffer overflows more than once
    wait_until(lambda: health_metrics(agent)["gym_tracer_spans_dropped_export_buffer_full_total"] > 0, 20,
               "the buffer overflows")
    metrics = health_metrics(agent)
    assert 0 < metrics["gym_tracer_spans_buffered"] <= 5, metrics
    assert metrics["gym_tracer_exporter_reachable"] == 0

    receiver.start()
    outage_over(agent)
    summary = stopped(agent)
    produced = summary["spans_queued"]
    assert produced == sent * SPANS_PER_VERIFY, agent.stderr()
    exported = summary["spans_exported"]
    assert 0 < exported <= 5, "no more than the buffer held"
    assert exported + summary["spans_dropped_export_buffer_full"] == produced, agent.stderr()
    assert summary["spans_lost_in_export"] == summary["spans_dropped_export_buffer_full"]
    assert len(receiver.received.span_ids()) == exported
    # The spans that survived are those of the last requests: the buffer dropped the oldest.
    received = sorted(int(span["attributes"]["user_agent.original"].removeprefix("verify-"))
                      for span in receiver.received.spans)
    assert received == list(range(sent - exported, sent)), received


def test_the_memory_an_outage_took_is_given_back_once_delivered(server_factory, collector, agents):
    """Spans held through an outage are freed once delivered; the agent gives the freed heap
    back to the kernel (glibc kept it in its arenas: a DaemonSet's RSS stayed at the outage's
    high-water mark)."""
    server = server_factory()
    receiver = collector()
    agent = start_agent(agents, server, receiver, "http/protobuf", "--health-listen", "0")
    sent = send_verify(server, 200)
    before = rss_kib(agent.process.pid, "RssAnon")
    with ThreadPoolExecutor(8) as pool:  # ~16 MiB of spans held while the collector is down
        sent += sum(pool.map(lambda _: send_verify(server, 2000), range(8)))
    wait_until(lambda: health_metrics(agent)["gym_tracer_spans_buffered"] == sent, 30, "every span is held")
    peak = rss_kib(agent.process.pid, "RssAnon")
    assert peak - before > 8 * 1024, f"the held spans took {peak - before} KiB: too few to tell"

    receiver.start()
    outage_over(agent)
    wait_until(lambda: health_metrics(agent)["gym_tracer_spans_buffered"] == 0, 60, "every span is delivered")
    wait_until(lambda: rss_kib(agent.process.pid, "RssAnon") < before + (peak - before) / 2, 30,
               f"the agent's heap ({before} KiB before the outage, {peak} KiB at its peak) shrinks back")
    summary = stopped(agent)
    assert_everything_delivered(agent, receiver, summary, sent)


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_shutdown_with_the_collector_gone_is_bounded_and_counts_what_is_left(
        server_factory, collector, agents, protocol):
    server = server_factory()
    receiver = collector()
    receiver.delay_s = 20  # a collector that accepts connections and never answers in time
    receiver.start()
    agent = start_agent(agents, server, receiver, protocol, "--shutdown-timeout", "2000",
                        otlp_timeout_ms=15000)
    sent = send_verify(server, 10)
    time.sleep(1.5)
    started = time.monotonic()
    summary = stopped(agent)
    took = time.monotonic() - started
    # Not a timing figure: without the bound one attempt alone would take --otlp-timeout (15 s).
    assert took < 12, f"the agent took {took:.1f} s to stop with --shutdown-timeout 2000"
    assert summary["spans_exported"] == 0
    assert summary["spans_dropped_undelivered_at_shutdown"] == summary["spans_queued"] == sent * SPANS_PER_VERIFY, \
        agent.stderr()
    assert any("not delivered within --shutdown-timeout" in m for m in agent.log_messages()), agent.stderr()
    assert any("final metric export failed" in m for m in agent.log_messages()), agent.stderr()


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_self_telemetry_arrives_as_gym_tracer_metrics(server_factory, collector, agents, protocol):
    server = server_factory()
    receiver = collector().start()
    agent = start_agent(agents, server, receiver, protocol, metric_interval=1)
    send_verify(server, 10)

    def value(name, **attributes):
        points = [p for p in receiver.received.latest_points(name)
                  if p["resource"].get("service.name") == "gym-tracer"
                  and all(p["attributes"].get(k) == v for k, v in attributes.items())]
        return sum(p["value"] for p in points) if points else None

    exported = 10 * SPANS_PER_VERIFY
    wait_until(lambda: value("gym_tracer.spans.exported") == exported, 30,
               lambda: f"gym_tracer.spans.exported = {exported}, have {value('gym_tracer.spans.exported')}")
    assert value("gym_tracer.events.received") > 0
    lost = receiver.received.latest_points("gym_tracer.events.lost")
    assert lost and all(p["value"] == 0 for p in lost), lost
    assert all("cpu" in p["attributes"] for p in lost), lost
    assert value("gym_tracer.processes.traced") == 1
    assert value("gym_tracer.exports.failed", signal="traces") == 0
    assert value("gym_tracer.spans.dropped", reason="queue_full") == 0
    assert value("gym_tracer.memory.resident") > 0
    resource = receiver.received.latest_points("gym_tracer.events.received")[0]["resource"]
    assert resource["service.name"] == "gym-tracer"
    assert resource["service.instance.id"] and resource["service.version"] and resource["host.name"]
    units = {p["metric"]: p["unit"] for p in receiver.received.metric_points if p["metric"].startswith("gym_tracer.")}
    assert units["gym_tracer.events.received"] == "{event}"
    assert units["gym_tracer.memory.resident"] == "By"
    summary = stopped(agent)
    # The final export, at exit, says what the summary says.
    assert value("gym_tracer.events.received") == summary["events_in"]
    assert value("gym_tracer.spans.exported") == summary["spans_exported"] == len(receiver.received.span_ids())
    assert "events_lost_by_cpu" in summary, agent.log_messages()[-1]
    assert summary["events_lost_by_cpu"] and all(lost == 0 for lost in summary["events_lost_by_cpu"])


def test_self_telemetry_is_printed_among_the_json_metrics(server_factory, agents):
    server = server_factory()
    agent = agents([server.pid], extra_args=["--no-route-harvest"])
    send_verify(server, 5)
    time.sleep(1.5)
    summary = stopped(agent)  # the final export prints every metric once

    def points(name):
        return [p for p in agent.metric_points(name) if p["resource"].get("service.name") == "gym-tracer"]

    received = points("gym_tracer.events.received")
    assert received and received[-1]["value"] == summary["events_in"], agent.stdout_text()[-2000:]
    assert received[-1]["unit"] == "{event}"
    # Counted by what was printed, not by the agent's own account.
    assert [p["value"] for p in points("gym_tracer.spans.exported")] == [5 * SPANS_PER_VERIFY] == \
        [len(agent.spans())], agent.stdout_text()[-2000:]
    lost = points("gym_tracer.events.lost")
    assert lost and all(p["value"] == 0 and "cpu" in p["attributes"] for p in lost), lost
    held = {p["attributes"]["stage"]: p["value"] for p in points("gym_tracer.spans.held")}
    assert held == {"stitching": 0, "export_buffer": 0}, held
