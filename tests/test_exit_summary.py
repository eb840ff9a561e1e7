"""The exit summary a person reads: the real agent, attached by PID to a real uvicorn server,
stopped with SIGINT. With a text log it prints a verdict and, grouped by stage, only the
counters that moved and mean a loss or an undecided parent; with a JSON log it writes one
record with the verdict and every counter. Both are compared with the counters of the
summary file, and with what the test itself sent.

The oracle for what moved is the test's own: it sends N requests, so a clean run exports N
spans and a run whose collector never answers loses exactly N, at shutdown."""

import json
import re

from harness import post_verify

REQUESTS = 12  # POST /verify, each one SERVER span (attached by --pid, no server type)
SUMMARY_HEAD = "gym-tracer stopped after "


def summary_block(agent):
    """The exit summary's lines: the verdict line and the indented lines under it."""
    lines = agent.stderr().splitlines()
    heads = [i for i, line in enumerate(lines) if line.startswith(SUMMARY_HEAD)]
    assert len(heads) == 1, f"one exit summary, not {len(heads)}:\n{agent.stderr()}"
    block = [lines[heads[0]]]
    for line in lines[heads[0] + 1:]:
        if not line.startswith("  "):
            break
        block.append(line)
    return block


def rows(block):
    """(name, value) of each counter row (the lines between `traced` and `every counter`)."""
    found = {}
    for line in block[2:]:
        match = re.match(r"^  (?:\S.{0,10})?\s+([a-z_]+)\s+([\d,]+)  \S", line)
        if match:
            found[match.group(1)] = int(match.group(2).replace(",", ""))
    return found


def traced_figures(block):
    traced = block[1]
    assert traced.startswith("  traced"), block
    found = re.findall(r"([\d,]+) (process(?:es)?|requests?|spans? exported)\b", traced)
    plural = {"process": "processes", "request": "requests", "span exported": "spans exported"}
    return {plural.get(label, label): int(number.replace(",", "")) for number, label in found}


def run_and_stop(agents, server, *args):
    agent = agents([server.pid], extra_args=["--log-format", "text", "--no-route-harvest", *args])
    post_verify(server.port, REQUESTS)
    agent.stop(timeout=60)
    assert agent.returncode == 0, agent.stderr()
    return agent, agent.summary()


def test_a_clean_run_says_nothing_lost_and_what_it_traced(server_factory, agents):
    server = server_factory()
    agent, summary = run_and_stop(agents, server)
    block = summary_block(agent)
    print("\n" + "\n".join(block))

    assert block[0].endswith(": nothing lost"), block
    assert traced_figures(block) == {"processes": 1, "requests": REQUESTS, "spans exported": REQUESTS}
    assert (summary["processes_attached"], summary["requests_traced"], summary["spans_exported"]) == \
        (1, REQUESTS, REQUESTS), summary
    assert rows(block) == {}, "nothing moved that is a loss or an undecided parent"
    assert block[-1].strip().startswith("every counter: --summary-file"), block
    assert not any(line.startswith("stopped.") or " stopped. " in line for line in agent.stderr().splitlines()), \
        "the old one-line counter dump is gone"


def test_a_collector_that_never_answers_is_a_verdict_of_spans_lost(server_factory, collector, agents):
    server = server_factory()
    receiver = collector()  # never started: the endpoint refuses connections
    agent, summary = run_and_stop(
        agents, server, "--otlp-endpoint", receiver.http_endpoint, "--otlp-timeout", "500",
        "--shutdown-timeout", "1000")
    block = summary_block(agent)
    print("\n" + "\n".join(block))

    assert summary["spans_dropped_undelivered_at_shutdown"] == REQUESTS, summary
    assert re.search(rf": {REQUESTS} spans lost \(see below, and docs/troubleshooting.md#every-counter\)$",
                     block[0]), block
    assert traced_figures(block) == {"processes": 1, "requests": REQUESTS, "spans exported": 0}
    moved = rows(block)
    assert moved == {"spans_dropped_undelivered_at_shutdown": REQUESTS}, block
    assert any(line.startswith("  export ") and "spans_dropped_undelivered_at_shutdown" in line for line in block), \
        "grouped under its stage"
    # Each printed row is the summary file's value; retries that failed are not a loss of their own.
    assert all(summary[name] == value for name, value in moved.items())
    assert summary["span_exports_failed"] >= 1 and "span_exports_failed" not in moved


def test_a_json_log_gets_one_record_with_the_verdict_and_every_counter(server_factory, collector, agents):
    server = server_factory()
    receiver = collector()
    agent = agents([server.pid], extra_args=[
        "--log-format", "json", "--no-route-harvest", "--otlp-endpoint", receiver.http_endpoint,
        "--otlp-timeout", "500", "--shutdown-timeout", "1000"])
    post_verify(server.port, REQUESTS)
    agent.stop(timeout=60)
    assert agent.returncode == 0, agent.stderr()
    records = [record for record in agent.log() if record.get("message") == "stopped"]
    assert len(records) == 1, agent.stderr()
    record = records[0]
    assert record["verdict"] == f"{REQUESTS} spans lost", record
    counters = json.loads(record["counters"])
    summary = agent.summary()
    assert counters == {name: value for name, value in summary.items() if name != "events_lost_by_cpu"}
    assert counters["spans_dropped_undelivered_at_shutdown"] == REQUESTS
    assert SUMMARY_HEAD not in agent.stderr(), "no text block in a JSON log"
