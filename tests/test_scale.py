"""Gym-sized pools of idle keep-alive connections (issue #15): aiohttp's connector keeps up to
1,024 connections per host idle between the calls that reuse them, and every request on every
one of them must be one span, or its loss counted by reason.

Also the measurement behind the issue's table (run as root from the repository root):

    target/venv/bin/python tests/test_scale.py 2048 8192 16384
"""

import asyncio
import collections
import resource
import subprocess
import sys
import time

from harness import TESTS_DIR, Agent, UvicornServer, free_port, wait_for_health, wait_until
from span_ids import shared_span_ids
from test_hostile import metrics, rss_kib, wait_accepted

IDLE_CONNECTIONS = 16_384
FRESH_REQUESTS = 200
#: Connections opened at a time: below uvicorn's backlog, so none waits in a SYN queue.
OPEN_BATCH = 1_024
#: Requests in flight at a time across all connections.
CONCURRENCY = 256
#: The agent memory an open connection costs, as --help of --max-connections states it
#: (measured: ~2 KiB each, 2,048 to 16,384 idle connections, with their request history).
AGENT_KIB_PER_CONNECTION = 3


class IdleServer(UvicornServer):
    """The Gym-shaped server with a backlog for a burst of connections and a keep-alive
    timeout longer than the test, so the idle pool stays open until the client closes it."""

    def start(self):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", self.app, "--host", "127.0.0.1", "--port", str(self.port),
             "--loop", self.loop, "--http", self.http, "--no-access-log", "--log-level", "warning",
             "--backlog", str(OPEN_BATCH * 2), "--timeout-keep-alive", "3600"],
            env=self.env, cwd=TESTS_DIR,
        )
        wait_for_health(self.port)
        return self


def raise_nofile(needed):
    """Raises this process's RLIMIT_NOFILE (the server inherits it) to the hard limit; returns
    the limits to restore."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard >= needed, f"RLIMIT_NOFILE hard limit {hard} is below the {needed} this test needs"
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return soft, hard


async def post_verify_on(stream, tag):
    """One POST /verify on an open keep-alive connection, named by its User-Agent."""
    reader, writer = stream
    body = b'{"answer": "42"}'
    writer.write(b"POST /verify HTTP/1.1\r\nHost: scale\r\nUser-Agent: " + tag.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(body)).encode() + b"\r\n\r\n" + body)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    await reader.readexactly(length)


async def drive(port, idle, fresh, on_pool_idle, on_batch_open=None):
    """Opens `idle` connections with one request each, holds them all idle, calls
    `on_pool_idle()`, sends a second request on each, then `fresh` on new connections.
    `on_batch_open()`, if given, runs after each batch of connections opens, before its first
    requests. Returns the User-Agent of every request sent."""
    limit = asyncio.Semaphore(CONCURRENCY)
    sent = []

    async def request(stream, tag):
        async with limit:
            await post_verify_on(stream, tag)
        sent.append(tag)

    pool = []
    for start in range(0, idle, OPEN_BATCH):
        batch = [await asyncio.open_connection("127.0.0.1", port)
                 for _ in range(min(OPEN_BATCH, idle - start))]
        pool += batch
        if on_batch_open:
            await asyncio.get_running_loop().run_in_executor(None, on_batch_open)
        await asyncio.gather(*(request(s, f"idle-{start + i}-first") for i, s in enumerate(batch)))
    await asyncio.get_running_loop().run_in_executor(None, on_pool_idle)
    await asyncio.gather(*(request(s, f"idle-{i}-second") for i, s in enumerate(pool)))
    for i in range(fresh):
        stream = await asyncio.open_connection("127.0.0.1", port)
        await request(stream, f"fresh-{i}")
        stream[1].close()
    for _, writer in pool:
        writer.close()
    return sent


def run_idle_pool(idle, fresh=FRESH_REQUESTS, agent_args=(), evicted_before_requests=None):
    """The issue's scenario against the real agent; what it saw, by measure. With
    `evicted_before_requests`, the first requests wait until the server has accepted every
    connection and the agent has counted that many evictions."""
    limits = raise_nofile(idle + 2_000)
    server = IdleServer()
    health_port = free_port()
    seen = {}
    try:
        server.start()
        agent = Agent([server.pid], extra_args=["--no-route-harvest", "--health-listen", str(health_port),
                                                *agent_args]).start()
        try:
            time.sleep(1.0)
            seen["rss_kib_before"] = rss_kib(agent.process.pid)

            def on_pool_idle():
                wait_accepted(server.port)
                time.sleep(1.5)  # a /metrics refresh
                seen["connections_tracked"] = metrics(health_port)["gym_tracer_connections_tracked"]
                seen["rss_kib"] = rss_kib(agent.process.pid)

            def on_batch_open():
                wait_accepted(server.port)
                wait_until(lambda: metrics(health_port)["gym_tracer_connections_evicted_total"]
                           >= evicted_before_requests, 20, f"{evicted_before_requests} connections evicted")

            seen["sent"] = asyncio.run(drive(server.port, idle, fresh, on_pool_idle,
                                             on_batch_open if evicted_before_requests is not None else None))
            time.sleep(1.0)  # the stitch delay and a drain
        finally:
            agent.stop(timeout=60)
    finally:
        server.stop()
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)
    assert agent.returncode == 0, agent.stderr()
    spans = agent.spans()
    # The run-wide check Agent.close() makes for the tests' agents: this one is stopped, not closed.
    shared = shared_span_ids(spans)
    assert not shared, f"gym-tracer exported {len(shared)} span ids on more than one span:\n" + "\n".join(shared[:20])
    seen["spans"] = collections.Counter(
        s["attributes"].get("user_agent.original") for s in spans
        if s["kind"] == "SERVER" and s["name"] == "POST /verify")
    seen["summary"] = agent.summary()
    return seen


#: Counters of requests the kernel or the agent did not follow, by reason: all 0 when nothing
#: was lost.
LOSS_COUNTERS = [
    "events_lost_in_kernel", "sockets_untracked_map_full", "transfers_on_unknown_sockets",
    "socket_calls_untracked_map_full", "data_without_connection", "connections_dropped",
    "connections_evicted", "connections_evicted_for_memory", "requests_evicted",
    "requests_dropped_overflow",
]


def test_every_request_on_sixteen_thousand_idle_keep_alive_connections_is_one_span():
    seen = run_idle_pool(IDLE_CONNECTIONS)
    sent, spans, summary = seen["sent"], seen["spans"], seen["summary"]
    assert len(sent) == 2 * IDLE_CONNECTIONS + FRESH_REQUESTS
    missing = [tag for tag in sent if spans[tag] == 0]
    twice = [tag for tag in sent if spans[tag] > 1]
    assert not missing, f"{len(missing)} requests without a span, e.g. {missing[:5]}; {summary}"
    assert not twice, f"{len(twice)} requests with more than one span, e.g. {twice[:5]}"
    assert sum(spans.values()) == len(sent)
    assert {name: summary[name] for name in LOSS_COUNTERS} == dict.fromkeys(LOSS_COUNTERS, 0)
    # The agent's own high-water mark: the whole pool at once.
    assert summary["connections_tracked_peak"] >= IDLE_CONNECTIONS, summary
    # What the pool costs the agent: at most the per-connection cost --help states, times
    # the pool, on top of what the agent held before it.
    grown_kib = seen["rss_kib"] - seen["rss_kib_before"]
    assert grown_kib <= AGENT_KIB_PER_CONNECTION * IDLE_CONNECTIONS, (seen["rss_kib_before"], seen["rss_kib"])
    assert seen["rss_kib"] <= 128 * 1024, "the issue's bound for 16,384 open connections"


def test_past_max_connections_the_loss_is_counted_by_reason():
    max_connections = 256
    idle = 512
    # The first requests wait until every connection is accepted and the table has evicted
    # the stalest: otherwise how many are traced depends on how uvicorn's accepts and the
    # first requests interleave (CI: all 512 once, 267 another time).
    seen = run_idle_pool(idle, fresh=20, agent_args=["--max-connections", str(max_connections)],
                         evicted_before_requests=idle - max_connections)
    sent, spans, summary = seen["sent"], seen["spans"], seen["summary"]
    untraced = sum(1 for tag in sent if spans[tag] == 0)
    by_kind = collections.Counter((tag.rsplit("-", 1)[-1] if tag.startswith("idle") else "fresh", spans[tag] > 0)
                                  for tag in sent)
    print(f"\ntraced by kind: {dict(by_kind)}; untraced {untraced}; "
          + ", ".join(f"{k}={summary[k]}" for k in ("connections_evicted", "transfers_on_unknown_sockets",
                                                    "connections_tracked_peak", "connections_dropped")))
    # Exact: the first requests come after the evictions, so only the max_connections
    # accepted last are tracked; in the second round no connection opens, so the same
    # max_connections most recently active ones are tracked and their requests traced, the
    # others' not; every fresh connection is tracked.
    assert by_kind[("first", True)] == max_connections, by_kind
    assert by_kind[("first", False)] == idle - max_connections, by_kind
    assert by_kind[("second", True)] == max_connections, by_kind
    assert by_kind[("second", False)] == idle - max_connections, by_kind
    assert by_kind[("fresh", True)] == 20 and ("fresh", False) not in by_kind, by_kind
    # Each connection past the limit evicted the stalest idle one: one per connection opened
    # beyond the limit, at most one more per fresh connection (each closes before the next
    # opens, freeing its slot, unless its close is seen late).
    assert idle - max_connections <= summary["connections_evicted"] <= idle - max_connections + 20, summary
    # Each untraced request is counted where the kernel no longer knows its socket, at least
    # once: the counter counts transfers (reads and writes, some merged), not requests (two
    # runs: 915 and 1,308 for 501 untraced), so no exact figure holds.
    assert summary["transfers_on_unknown_sockets"] >= untraced, summary
    assert summary["connections_tracked_peak"] == max_connections, summary


def main():
    print("| N idle connections | requests | SERVER spans | lost | `connections_tracked` while open "
          "| agent RSS before → while open | loss counters |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for idle in [int(arg) for arg in sys.argv[1:]] or [2048, 8192, 16384]:
        seen = run_idle_pool(idle)
        traced = sum(min(seen["spans"][tag], 1) for tag in seen["sent"])
        counted = {name: value for name, value in seen["summary"].items()
                   if name in LOSS_COUNTERS and value}
        print(f"| {idle:,} | {len(seen['sent']):,} | {traced:,} | {len(seen['sent']) - traced:,} "
              f"| {seen['connections_tracked']:,} | {seen['rss_kib_before'] // 1024} → {seen['rss_kib'] // 1024} MiB | {counted or 0} |",
              flush=True)


if __name__ == "__main__":
    main()
