"""`cargo xtask bench`: what tracing costs a Gym-shaped server, measured side by side.

Method (also in docs/performance.md):
- The traced servers run on CPU 0 (the three of the /run fan-out too); wrk, the agent and the
  OTLP receiver run on CPU 1. Affinity is set on this process's thread around each spawn, so
  every thread a child starts later inherits it.
- Variants, each on freshly started servers, interleaved per repeat (A B C A B C ...) so that
  drift on a shared machine hits them alike: `untraced`; `gym-tracer` (attached by --pid,
  exporting OTLP/HTTP to the counting receiver); `otel` (the servers instrument themselves
  with OpenTelemetry's FastAPI + aiohttp-client instrumentation, exporting OTLP/HTTP to the
  same receiver). Each run: start servers, warm up with wrk (untimed; before the agent
  attaches), attach, run wrk for --duration, let exports settle, read /proc, stop.
  Also `tracer-no-ctx` (the task-context reads off), `tracer-lineage` (the task-lineage
  uprobe on every server: `--task-lineage on`) and, on /run, `tracer-inject`
  (`--inject-traceparent`, which also turns task lineage on in every server); the agent's
  lineage counters of a traced run are taken over the measured window only (its /metrics
  before, its exit summary after), so the warm-up's requests and tasks are not in them, and
  so is its eBPF programs' run time (kernel.bpf_stats_enabled during the load).
- Every figure of a row is the median over the repeats, taken figure by figure.

The results go to stdout (one table) and to target/bench/bench-<UTC time>.json and
target/bench/latest.json (every run's raw figures, the medians, machine and parameters).
"""

import argparse
import json
import os
import platform
import re
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager, nullcontext
from datetime import datetime, timezone
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
SUPPORT_DIR = ROOT / "tests" / "support"
sys.path.insert(0, str(SUPPORT_DIR))

from gym_launch import DEFAULT_SERVERS, RESOURCES, AGENT, GymRun, run_body  # noqa: E402
from harness import Agent, free_port  # noqa: E402

sys.path.insert(0, str(BENCH_DIR))
import bpf_stats  # noqa: E402
import gym_instructions  # noqa: E402
import gym_scale  # noqa: E402

SERVER_CPU, LOAD_CPU = 0, 1
# tracer-no-ctx: gym-tracer with --no-task-contexts, so that the kernel's task-context reads
# (issue #13) are priced on their own: the difference to gym-tracer is what they cost.
# tracer-inject: gym-tracer with --inject-traceparent (issues #17, #47), on the `run` workload only
# (the one whose servers make outbound calls): throughput and errors beside the others.
# tracer-lineage: gym-tracer with --task-lineage on, so that the uprobe on `_asyncio`'s
# Task.__init__ is priced on its own: the difference to gym-tracer (whose default, `auto`,
# probes none of the bench's servers: no resources server here names a model server) is what
# the probe hits cost the servers, and the agent's lineage_tasks_probed counts them.
VARIANTS = ("untraced", "gym-tracer", "tracer-lineage", "tracer-no-ctx", "tracer-inject", "otel")
TRACED = {"gym-tracer": [], "tracer-lineage": ["--task-lineage", "on"], "tracer-no-ctx": ["--no-task-contexts"],
          "tracer-inject": ["--inject-traceparent"]}
ONLY_ON = {"tracer-inject": "run"}
WORKLOADS = ("verify", "run")
# `--only lineage`: both workloads with these variants only (what the lineage lines need, and
# on /run the injection line: --inject-traceparent turns lineage on in every server).
LINEAGE_VARIANTS = ("untraced", "gym-tracer", "tracer-lineage", "tracer-inject", "otel")
# The agent's task-lineage counters, read as deltas over the measured window of every traced run.
LINEAGE_COUNTERS = ("lineage_tasks_probed", "lineage_request_roots", "lineage_roots_without_request",
                    "lineage_other_roots", "lineage_inherited", "lineage_creator_unseen",
                    "lineage_creator_unreadable", "parents_by_lineage")
CLK_TCK = os.sysconf("SC_CLK_TCK")
# After wrk ends: the agent releases spans as their chains settle (within its 100 ms tick), then exports.
SETTLE_SECONDS = 1.5
# Counters of the agent whose growth means a request was not traced or a span not delivered.
LOSS_COUNTERS = ("events_lost_in_kernel", "spans_dropped_queue_full", "requests_dropped_overflow",
                 "connections_dropped", "spans_lost_in_export")


class BenchError(Exception):
    """A precondition or a step failed; the message says what to do."""


# ---------------------------------------------------------------------------------------
# processes: pinning, /proc figures, cleanup
# ---------------------------------------------------------------------------------------

@contextmanager
def spawning_on(cpu):
    """Children spawned inside inherit CPU `cpu` (and so do all their later threads)."""
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def cpu_seconds(pid):
    """utime + stime of the whole process (every thread, live or exited), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def status_kib(pid, key):
    """A `kB` line of /proc/<pid>/status: VmHWM (peak RSS) or VmRSS."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise BenchError(f"/proc/{pid}/status has no {key}")


class Children:
    """Every long-lived process the bench starts, killed on any exit (error, Ctrl-C)."""

    def __init__(self):
        self.processes = []

    def add(self, process):
        self.processes.append(process)
        return process

    def kill_all(self):
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        self.processes.clear()


CHILDREN = Children()


def stop_agent(agent):
    if agent is not None and agent.process is not None and agent.process.poll() is None:
        agent.stop()


def start_agent(pids, receiver_url, health_port=None, servers=True, options=()):
    """gym-tracer on the load CPU, attached to `pids`; for `servers`, returns once it has
    harvested their routes (so every measured request is named as in production)."""
    extra = ["--otlp-endpoint", receiver_url, *options]
    if health_port:
        extra += ["--health-listen", str(health_port)]
    agent = Agent(pids, extra_args=extra)
    try:
        with spawning_on(LOAD_CPU):
            agent.start()
    finally:
        if agent.process is not None:
            CHILDREN.add(agent.process)
    for pid in pids if servers else ():
        agent.wait_for_routes(pid)
    return agent


class Counters(dict):
    """The agent's counters by name, from `source` (its exit summary or its /metrics). A name
    that is not there is a KeyError that says so: a renamed counter must fail the bench, not
    read as 0 (which would pass as "nothing lost")."""

    def __init__(self, values, source):
        super().__init__(values)
        self.source = source

    def __missing__(self, name):
        raise KeyError(f"the agent's {self.source} has no counter {name!r}: was it renamed? "
                       f"update bench/bench.py (it has: {', '.join(sorted(self))})")


def agent_metrics(port):
    """The agent's /metrics (Prometheus text) as {name: value}; refreshed by it every second."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return Counters({name: float(value) for name, value in
                     (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))},
                    "/metrics")


# ---------------------------------------------------------------------------------------
# the receiver
# ---------------------------------------------------------------------------------------

class Receiver:
    """bench/otlp_counter.py in its own process on the load CPU: spans per (pid, kind)."""

    def __init__(self):
        port_file = Path(tempfile.mkdtemp(prefix="gym-bench-")) / "port"
        with spawning_on(LOAD_CPU):
            self.process = CHILDREN.add(subprocess.Popen([sys.executable, str(BENCH_DIR / "otlp_counter.py"),
                                                          str(port_file)]))
        deadline = time.monotonic() + 20
        while not (port_file.exists() and port_file.read_text()):
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise BenchError("the OTLP receiver (bench/otlp_counter.py) did not start: see its error above")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text()}"

    def counts(self, pids):
        """{kind: spans} summed over `pids`."""
        with urllib.request.urlopen(f"{self.url}/counts", timeout=5) as response:
            by_pid = json.load(response)
        total = {}
        for pid in pids:
            for kind, n in by_pid.get(str(pid), {}).items():
                total[kind] = total.get(kind, 0) + n
        return total

    def wait_stable(self, pids, quiet_seconds=1.5, timeout=30):
        """The counts once they have not changed for `quiet_seconds`."""
        last, since = self.counts(pids), time.monotonic()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.2)
            now = self.counts(pids)
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_seconds:
                break
        return last


def minus(after, before):
    return {kind: n - before.get(kind, 0) for kind, n in after.items()}


# ---------------------------------------------------------------------------------------
# load: wrk with a Lua script for the POST bodies
# ---------------------------------------------------------------------------------------

def lua_string(text):
    return f"[==[{text}]==]"


def wrk_script(workload):
    """POST bodies as Gym sends them. /run: each request has its own task index (its own
    rollout id, so one trace per rollout as in a real run); /verify: one fixed body."""
    if workload == "run":
        prefix, suffix = json.dumps(run_body(task=987654321, rollout=0)).split("987654321")
        body = f"{lua_string(prefix)} .. n .. {lua_string(suffix)}"
        path = "/run"
    else:
        verify = {**run_body(task=1, rollout=0), "response": {"output_text": "The answer is 42."}}
        body = lua_string(json.dumps(verify))
        path = "/verify"
    # `n` counts the requests each thread generated (sent), `summary.requests` the responses
    # received: requests in flight when wrk stops are the difference.
    return f"""
n = 0
threads = {{}}
setup = function(thread) table.insert(threads, thread) end
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  n = n + 1
  return wrk.format("POST", "{path}", nil, {body})
end
done = function(summary, latency, requests)
  local e = summary.errors
  local sent = 0
  for _, thread in ipairs(threads) do sent = sent + thread:get("n") end
  io.write(string.format(
    'BENCH_JSON {{"requests": %d, "sent": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "errors": %d, "status_errors": %d}}\\n',
    summary.requests, sent, summary.duration, latency:percentile(50), latency:percentile(99),
    e.connect + e.read + e.write + e.timeout, e.status))
end
"""


def run_wrk(url, script_path, connections, duration):
    """wrk on the load CPU; returns requests, rps, p50/p99 (ms) and error counts."""
    args = ["taskset", "-c", str(LOAD_CPU), "wrk", "-t1", f"-c{connections}", f"-d{duration}s", "--timeout", "10s",
            "-s", str(script_path), url]
    try:
        out = subprocess.run(args, capture_output=True, text=True, timeout=duration + 60)
    except subprocess.TimeoutExpired as error:
        raise BenchError(f"wrk did not finish within {duration + 60} s: {' '.join(args)}") from error
    match = re.search(r"^BENCH_JSON (.*)$", out.stdout, re.M)
    if out.returncode != 0 or not match:
        raise BenchError(f"wrk failed ({out.returncode}): {out.stderr or out.stdout}")
    result = json.loads(match.group(1))
    seconds = result["duration_us"] / 1e6
    return {"requests": result["requests"], "sent": result["sent"], "seconds": seconds, "rps": result["requests"] / seconds,
            "p50_ms": result["p50_us"] / 1e3, "p99_ms": result["p99_us"] / 1e3,
            "errors": result["errors"], "non_2xx": result["status_errors"], "connections": connections}


# ---------------------------------------------------------------------------------------
# one measured run of (workload, variant)
# ---------------------------------------------------------------------------------------

def gym_run(workload, variant, receiver):
    servers = {"example_verifier": RESOURCES} if workload == "verify" else DEFAULT_SERVERS
    env = {}
    if variant == "otel":
        otel = {"GYM_TEST_INPROCESS_OTEL": receiver.url, "GYM_TEST_INPROCESS_OTEL_CLIENT": "aiohttp"}
        env = {name: otel for name in servers}
    run = GymRun(servers=servers, env=env)
    try:
        with spawning_on(SERVER_CPU):
            run.start()
    finally:
        CHILDREN.processes += [server.process for server in run.servers.values() if server.process]
    return run


def measure(workload, variant, params, receiver, scripts):
    """One run on fresh servers. CPU figures are per completed request."""
    run = gym_run(workload, variant, receiver)
    entry = run.first(RESOURCES if workload == "verify" else AGENT)
    url = f"{entry.base_url}/{workload}"
    pids = [server.pid for server in run.servers.values()]
    agent = None
    health_port = free_port() if variant in TRACED else None
    try:
        if variant in TRACED:
            # Before the warm-up: connections already open at attach are not traced, and the
            # agent server's aiohttp pool keeps the ones it opens to its peers.
            agent = start_agent(pids, receiver.url, health_port, options=TRACED[variant])
        warmup = run_wrk(url, scripts[workload], params.connections, params.warmup)
        spans_before = receiver.wait_stable(pids)  # the warm-up's spans, not counted
        entry_before = receiver.counts([entry.pid])
        metrics_before = None
        if agent:
            # The warm-up's tasks and calls are done (its spans are in): the agent's counters
            # now, from a /metrics snapshot taken after them (it refreshes every second).
            time.sleep(1.1)
            metrics_before = agent_metrics(health_port)
            probed = metrics_before["gym_tracer_lineage_processes_total"]
            if variant == "tracer-lineage" and probed < len(pids):
                raise BenchError(f"{workload}/{variant}: the agent probes task creations in {probed:.0f} of the "
                                 f"{len(pids)} servers (lineage_processes): see its log:\n{agent.stderr()[-4000:]}")
        server_cpu_before = sum(cpu_seconds(pid) for pid in pids)
        agent_cpu_before = cpu_seconds(agent.process.pid) if agent else 0.0
        # The agent's eBPF programs' own run time over the load (kernel.bpf_stats_enabled for
        # every traced variant alike: its accounting costs each of them the same).
        with bpf_stats.stats_enabled() if agent else nullcontext():
            bpf_before = bpf_stats.run_time(agent.process.pid) if agent else None
            load = run_wrk(url, scripts[workload], params.connections, params.duration)
            time.sleep(SETTLE_SECONDS)
            bpf_after = bpf_stats.run_time(agent.process.pid) if agent else None
        server_cpu = sum(cpu_seconds(pid) for pid in pids) - server_cpu_before
        result = dict(load, workload=workload, variant=variant,
                      server_cpu_us_per_req=1e6 * server_cpu / max(load["requests"], 1))
        if agent:
            result["bpf_us_per_req"] = (bpf_after[0] - bpf_before[0]) / 1e3 / max(load["requests"], 1)
            result["bpf_runs_per_req"] = (bpf_after[1] - bpf_before[1]) / max(load["requests"], 1)
        if agent:
            result["agent_cpu_us_per_req"] = 1e6 * (cpu_seconds(agent.process.pid) - agent_cpu_before) / max(
                load["requests"], 1)
            result["agent_peak_rss_kib"] = status_kib(agent.process.pid, "VmHWM")
            agent.stop()
            summary = Counters(agent.summary(), "exit summary (--summary-file)")
            result["agent_summary"] = summary
            result["events_lost"] = summary["events_lost_in_kernel"]
            result["agent_drops"] = sum(summary[name] for name in LOSS_COUNTERS)
            # The summary counts the warm-up's requests too.
            result["context_chains_per_req"] = summary["context_chains_read"] / max(warmup["sent"] + load["sent"], 1)
            # Outbound requests that left with a header, and those that could not (warm-up too).
            result["traceparents_injected_per_req"] = summary["traceparents_injected"] / max(
                warmup["sent"] + load["sent"], 1)
            result["traceparents_not_known_per_req"] = summary["traceparents_not_known"] / max(
                warmup["sent"] + load["sent"], 1)
            result["traceparents_failed"] = summary["traceparents_failed"]
            # Task lineage over the measured window alone: the exit summary less /metrics
            # before the load (the servers are idle in between and after it).
            window = {name: summary[name] - metrics_before[f"gym_tracer_{name}_total"] for name in LINEAGE_COUNTERS}
            result["lineage_window"] = window
            result["lineage_processes"] = summary["lineage_processes"]
            result["lineage_processes_off"] = summary["lineage_processes_off"]
            result["lineage_tasks_per_req"] = window["lineage_tasks_probed"] / max(load["sent"], 1)
            result["lineage_parents_per_req"] = window["parents_by_lineage"] / max(load["sent"], 1)
        elif variant == "otel":
            run.stop()  # the SDK flushes its batch processor at exit
        if variant != "untraced":
            spans = minus(receiver.wait_stable(pids), spans_before)
            entry_server_spans = minus(receiver.counts([entry.pid]), entry_before)
            result["spans"] = spans
            # Per request SENT: requests in flight when wrk stops are served (and traced) but
            # not among the responses wrk counts.
            result["spans_per_req"] = sum(spans.values()) / max(load["sent"], 1)
            result["entry_server_spans"] = entry_server_spans.get("SERVER", 0)
            result["server_spans_per_sent"] = result["entry_server_spans"] / max(load["sent"], 1)
            result["one_span_per_request"] = load["requests"] <= result["entry_server_spans"] <= load["sent"]
        return result
    finally:
        stop_agent(agent)
        run.stop()


# ---------------------------------------------------------------------------------------
# saturation: rising load on /verify traced by gym-tracer
# ---------------------------------------------------------------------------------------

def saturation(params, receiver, scripts):
    """One server and one agent; per step of wrk connections: req/s, SERVER spans vs
    requests, the agent's loss counters (deltas of its /metrics). A step is complete when every
    answered request has its SERVER span, no more spans than requests sent, and nothing was
    lost."""
    run = gym_run("verify", "gym-tracer", receiver)
    entry = run.resources
    health_port = free_port()
    agent = None
    steps = []
    try:
        run_wrk(f"{entry.base_url}/verify", scripts["verify"], 4, params.warmup)
        agent = start_agent([entry.pid], receiver.url, health_port)
        for connections in params.saturation_connections:
            spans_before = receiver.wait_stable([entry.pid])
            time.sleep(1.1)  # the /metrics snapshot is refreshed every second
            metrics_before = agent_metrics(health_port)
            load = run_wrk(f"{entry.base_url}/verify", scripts["verify"], connections, params.step_duration)
            spans = minus(receiver.wait_stable([entry.pid]), spans_before).get("SERVER", 0)
            time.sleep(1.1)
            metrics_after = agent_metrics(health_port)
            lost = {name: metrics_after[f"gym_tracer_{name}_total"] - metrics_before[f"gym_tracer_{name}_total"]
                    for name in LOSS_COUNTERS}
            complete = (load["requests"] <= spans <= load["sent"] and not any(lost.values())
                        and load["errors"] == 0)
            steps.append(dict(load, server_spans=spans, lost=lost, complete=complete))
            print(f"  saturation: {connections:4d} connections: {load['rps']:8.0f} req/s, "
                  f"{spans} SERVER spans for {load['requests']} answered / {load['sent']} sent, lost {sum(lost.values()):.0f}"
                  f" -> {'complete' if complete else 'INCOMPLETE'}", flush=True)
    finally:
        stop_agent(agent)
        run.stop()
    complete = [step["rps"] for step in steps if step["complete"]]
    return {"steps": steps, "max_complete_rps": max(complete) if complete else None}


# ---------------------------------------------------------------------------------------
# connection scale: thousands of idle keep-alive connections
# ---------------------------------------------------------------------------------------

def open_connections(port, sockets, target):
    """Opens connections until there are `target`, each after one GET /health answered 200."""
    while len(sockets) < target:
        sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n")
        reply = sock.recv(4096)
        if not reply.startswith(b"HTTP/1.1 200"):
            raise BenchError(f"GET /health on connection {len(sockets)} answered {reply[:40]!r}")
        sockets.append(sock)


def connection_scale(params, receiver):
    """The resources app under uvicorn with a long keep-alive (uvicorn closes idle connections
    after 5 s by default); agent RSS and its connections-tracked gauge at each step."""
    need = max(params.scale_connections) + 1024
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(need, soft), max(need, hard)))
    port, health_port = free_port(), free_port()
    with spawning_on(SERVER_CPU):
        server = CHILDREN.add(subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "servers.gym_resources:app", "--host", "127.0.0.1", "--port", str(port),
             "--loop", "uvloop", "--http", "httptools", "--no-access-log", "--log-level", "warning",
             "--timeout-keep-alive", "3600", "--backlog", "4096"],
            cwd=SUPPORT_DIR, env=dict(os.environ, PYTHONPATH=str(SUPPORT_DIR))))
    sockets, agent, samples = [], None, []
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise BenchError("the connection-scale server did not start listening") from None
                time.sleep(0.1)
        agent = start_agent([server.pid], receiver.url, health_port)

        def sample(label):
            time.sleep(2.2)  # the agent handles the last events; /metrics refreshes every second
            samples.append({"label": label, "connections_open": len(sockets),
                            "agent_rss_kib": status_kib(agent.process.pid, "VmRSS"),
                            "connections_tracked": agent_metrics(health_port)["gym_tracer_connections_tracked"]})
            print(f"  connections: {samples[-1]}", flush=True)

        sample("attached")
        for target in params.scale_connections:
            open_connections(port, sockets, target)
            sample(f"{target} open")
        for sock in sockets:
            sock.close()
        sockets.clear()
        sample("all closed")
        peak = status_kib(agent.process.pid, "VmHWM")
    finally:
        for sock in sockets:
            sock.close()
        stop_agent(agent)
        server.terminate()
        server.wait(10)
    base = samples[0]["agent_rss_kib"]
    top = max(samples, key=lambda s: s["connections_open"])
    per_connection = 1024 * (top["agent_rss_kib"] - base) / top["connections_open"]
    return {"samples": samples, "agent_peak_rss_kib": peak, "max_connections": top["connections_open"],
            "bytes_per_connection": per_connection}


# ---------------------------------------------------------------------------------------
# host-wide tax: an untraced process's syscalls with and without the agent
# ---------------------------------------------------------------------------------------

def build_tax_program(out_dir):
    binary = out_dir / "syscall_tax"
    source = BENCH_DIR / "syscall_tax.c"
    if not binary.exists() or binary.stat().st_mtime < source.stat().st_mtime:
        try:
            subprocess.run(["cc", "-O2", "-o", str(binary), str(source)], check=True)
        except (OSError, subprocess.CalledProcessError) as error:
            raise BenchError(f"could not compile {source} with cc ({error}): install a C compiler "
                             "(`apt-get install -y gcc`) and retry") from error
    return binary


PIPELINE_REQUESTS = 200_000
PIPELINE_REPEATS = 3


def pipeline_cost(binary, quick):
    """The agent's user space alone (tracer-userspace/src/pipeline/cost.rs): Gym-shaped kernel
    records through the pipeline core and the OTLP encoder, on the idle server CPU. Compute-bound
    and single-threaded, so it moves far less between runs than the whole-system figures."""
    requests, repeats = (PIPELINE_REQUESTS // 10, 1) if quick else (PIPELINE_REQUESTS, PIPELINE_REPEATS)
    runs = []
    for _ in range(repeats):
        out = subprocess.run(["taskset", "-c", str(SERVER_CPU), str(binary), str(requests)],
                             capture_output=True, text=True, check=True, timeout=600)
        runs.append([json.loads(line) for line in out.stdout.splitlines() if line.strip()])
    # The stitcher alone at N in flight (`stitch_ns_per_call`): its own lines.
    in_flight = {}
    for run in runs:
        for row in run:
            if "stitch_in_flight" in row:
                in_flight.setdefault(row["stitch_in_flight"], []).append(row["ns_per_call"])
    runs = [[row for row in run if "workload" in row] for run in runs]
    workloads = {}
    for row in runs[0]:
        name = row["workload"]
        rows = [r for run in runs for r in run if r["workload"] == name]
        workloads[name] = {key: statistics.median(r[key] for r in rows)
                           for key in ("pipeline_ns_per_request", "encode_ns_per_span", "ns_per_span")}
        workloads[name].update(spans_per_request=row["spans"] / row["requests"],
                               stitched_per_request=row["stitched"] / row["requests"])
    return {"requests": requests, "repeats": repeats, "workloads": workloads,
            "stitch_ns_per_call_by_in_flight": {n: statistics.median(v) for n, v in sorted(in_flight.items())}}


class FloorProbes:
    """The floor programs (`tracer-ebpf/src/floor.rs`, loaded by the `syscall_floor` example) on
    the load CPU while the block runs: `pid=None`, the agent's tracepoints with programs that
    return at once; a pid, the same with that process's plain reads and writes captured by the
    least a tracer can do (a tgid compare, a per-thread stash, one user copy, one ring record).
    `.counts` afterwards: records and bytes delivered, records lost."""

    def __init__(self, binary, pid=None):
        self.args = [str(binary), "empty"] if pid is None else [str(binary), "capture", str(pid)]
        self.process = None
        self.counts = None

    def __enter__(self):
        with spawning_on(LOAD_CPU):
            self.process = CHILDREN.add(subprocess.Popen(self.args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                                         stderr=subprocess.PIPE, text=True))
        if self.process.stdout.readline().strip() != "ready":
            self.process.kill()
            _, err = self.process.communicate()
            raise BenchError(f"the floor programs did not attach ({' '.join(self.args)}): {err.strip()}")
        return self

    def __exit__(self, *_):
        out, err = self.process.communicate("", timeout=60)
        if self.process.returncode != 0:
            raise BenchError(f"syscall_floor failed ({self.process.returncode}): {err.strip()}")
        self.counts = json.loads(out)
        return False


def host_tax(params, binary, receiver):
    """Alternating without the agent, with it (attached to an idle `sleep`, so nothing it sees
    is traced) and, given the `syscall_floor` example, with the floor's empty programs on the
    same tracepoints (what the kernel charges before a program does anything); the loop runs
    on the server CPU, now idle. Median ns per syscall of each."""
    def loop(mode):
        out = subprocess.run(["taskset", "-c", str(SERVER_CPU), str(binary), mode, str(params.tax_iterations)],
                             capture_output=True, text=True, check=True, timeout=120)
        return float(out.stdout)

    with spawning_on(LOAD_CPU):
        idle = CHILDREN.add(subprocess.Popen(["sleep", "infinity"]))
    variants = ("without", "with") + (("empty programs",) if params.syscall_floor else ())
    figures = {mode: {variant: [] for variant in variants} for mode in ("pipe", "socket", "getppid")}
    try:
        for _ in range(params.tax_repeats):
            for mode in figures:
                figures[mode]["without"].append(loop(mode))
            agent = start_agent([idle.pid], receiver.url, servers=False)
            try:
                for mode in figures:
                    figures[mode]["with"].append(loop(mode))
            finally:
                stop_agent(agent)
            if params.syscall_floor:
                with FloorProbes(params.syscall_floor):
                    for mode in figures:
                        figures[mode]["empty programs"].append(loop(mode))
    finally:
        idle.kill()
        idle.wait()
    result = {}
    for mode, runs in figures.items():
        without, with_agent = statistics.median(runs["without"]), statistics.median(runs["with"])
        result[mode] = {"runs": runs, "without_ns": without, "with_ns": with_agent,
                        "delta_ns": with_agent - without, "delta_pct": 100 * (with_agent - without) / without}
        if params.syscall_floor:
            empty = statistics.median(runs["empty programs"])
            result[mode].update(empty_programs_ns=empty, empty_programs_delta_ns=empty - without)
    return result


TRACED_TAX_MODES = ("untraced", "agent, not traced", "traced")
# With the syscall_floor example: the same loop under the floor programs (`FloorProbes`).
FLOOR_MODES = ("empty programs", "capture floor")


def traced_tax(params, binary, receiver):
    """What a traced process pays per syscall (#18: a traced read/write of a small HTTP
    message, ≤ 1 µs more): `syscall_tax http` on the server CPU, each run a fresh process on a
    fresh loopback connection, untraced without an agent, untraced with the agent attached to
    an idle `sleep`, and traced by `--pid` (the agent sees the connection open and captures all
    four messages of every exchange, and builds its two spans); given the `syscall_floor`
    example, also under its empty programs and captured by its floor programs, which show what
    of the traced figure the kernel charges any tracer of this kind. Interleaved, median ns per
    syscall; the agent's and the floor's losses are reported with them."""
    def loop(mode):
        with spawning_on(SERVER_CPU):
            tax = CHILDREN.add(subprocess.Popen([str(binary), "http", str(params.tax_iterations)],
                                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
        def exchanges(holder):
            """Runs the loop: ns per syscall, and the eBPF ns per syscall of the programs the
            process `holder` holds (None without one)."""
            before = bpf_stats.run_time(holder) if holder else None
            out, _ = tax.communicate("go\n", timeout=300)
            if tax.returncode != 0:
                raise BenchError(f"syscall_tax http failed ({tax.returncode}): {out}")
            spent = (bpf_stats.run_time(holder)[0] - before[0]) / (4 * params.tax_iterations) if holder else None
            return float(out), spent

        agent = None
        try:
            if mode in FLOOR_MODES:
                floor = FloorProbes(params.syscall_floor, tax.pid if mode == "capture floor" else None)
                with floor:
                    ns, spent = exchanges(floor.process.pid)
                return ns, floor.counts, spent
            if mode == "traced":
                agent = start_agent([tax.pid], receiver.url, servers=False)
            # Every program of the agent, whoever ran it: on a quiet host, the traced loop.
            ns, kernel_ns = exchanges(agent.process.pid if agent else None)
            lost = None
            if agent:
                agent.stop()
                summary = Counters(agent.summary(), "exit summary (--summary-file)")
                lost = summary["events_lost_in_kernel"]
            return ns, lost, kernel_ns
        finally:
            stop_agent(agent)
            if tax.poll() is None:
                tax.kill()

    with spawning_on(LOAD_CPU):
        idle = CHILDREN.add(subprocess.Popen(["sleep", "infinity"]))
    modes = TRACED_TAX_MODES + (FLOOR_MODES if params.syscall_floor else ())
    runs = {mode: [] for mode in modes}
    lost, kernel_ns, floor_counts, floor_kernel_ns = [], [], [], []
    try:
        with bpf_stats.stats_enabled():
            for _ in range(params.tax_repeats):
                runs["untraced"].append(loop("untraced")[0])
                agent = start_agent([idle.pid], receiver.url, servers=False)
                try:
                    runs["agent, not traced"].append(loop("agent, not traced")[0])
                finally:
                    stop_agent(agent)
                ns, lost_records, spent = loop("traced")
                runs["traced"].append(ns)
                lost.append(lost_records)
                kernel_ns.append(spent)
                if params.syscall_floor:
                    runs["empty programs"].append(loop("empty programs")[0])
                    ns, counts, spent = loop("capture floor")
                    runs["capture floor"].append(ns)
                    floor_counts.append(counts)
                    floor_kernel_ns.append(spent)
    finally:
        idle.kill()
        idle.wait()
    median = {mode: statistics.median(values) for mode, values in runs.items()}
    result = {"runs": runs, "median_ns": median, "events_lost": lost,
              "kernel_ns_per_syscall": statistics.median(kernel_ns),
              "traced_delta_ns": median["traced"] - median["untraced"],
              "untraced_delta_ns": median["agent, not traced"] - median["untraced"]}
    if params.syscall_floor:
        result.update(floor_counts=floor_counts,
                      floor_records_per_syscall=[c["records"] / (4 * params.tax_iterations) for c in floor_counts],
                      empty_programs_delta_ns=median["empty programs"] - median["untraced"],
                      capture_floor_delta_ns=median["capture floor"] - median["untraced"],
                      capture_floor_kernel_ns_per_syscall=statistics.median(floor_kernel_ns),
                      above_floor_ns=median["traced"] - median["capture floor"])
    return result


# ---------------------------------------------------------------------------------------
# ctx: the task-context reads alone, on a CPython writer
# ---------------------------------------------------------------------------------------

CONTEXT_MODES = ("untraced", "traced, no task contexts", "traced, task contexts")


def context_reads(params, receiver):
    """A CPython asyncio task sending `ctx_requests` requests (one message-start write and one
    read each) to an untraced sink, on the server CPU: its CPU µs per request without an
    agent, traced with --no-task-contexts, and traced with the reads on; interleaved, median
    of `tax_repeats`. The difference of the last two is what the reads cost the server."""
    python = sys.executable
    sink_port = free_port()
    with spawning_on(LOAD_CPU):
        sink = CHILDREN.add(subprocess.Popen([python, str(BENCH_DIR / "context_sink.py"), str(sink_port)],
                                             stdout=subprocess.PIPE, text=True))
    sink.stdout.readline()
    runs = {mode: [] for mode in CONTEXT_MODES}
    kernel_ns = {mode: [] for mode in CONTEXT_MODES[1:]}
    chains = []
    try:
        with bpf_stats.stats_enabled():
            for _ in range(params.ctx_repeats):
                for mode in CONTEXT_MODES:
                    writer = subprocess.Popen(
                        ["taskset", "-c", str(SERVER_CPU), python, str(BENCH_DIR / "context_writer.py"),
                         str(sink_port), str(params.ctx_requests)],
                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                    CHILDREN.add(writer)
                    agent = None
                    if mode != "untraced":
                        options = ["--no-task-contexts"] if mode == "traced, no task contexts" else []
                        agent = start_agent([writer.pid], receiver.url, servers=False, options=options)
                    try:
                        before = bpf_stats.run_time(agent.process.pid) if agent else None
                        out, _ = writer.communicate("go\n", timeout=300)
                        runs[mode].append(float(out))
                        if agent:
                            spent_ns = bpf_stats.run_time(agent.process.pid)[0] - before[0]
                            kernel_ns[mode].append(spent_ns / params.ctx_requests)
                            agent.stop()
                            if not options:
                                chains.append(Counters(agent.summary(), "exit summary")["context_chains_read"])
                    finally:
                        stop_agent(agent)
    finally:
        sink.kill()
        sink.wait()
    kernel_medians = {mode: statistics.median(values) for mode, values in kernel_ns.items()}
    medians_us = {mode: statistics.median(values) for mode, values in runs.items()}
    # The least of the runs: the one the machine's noise (interrupts, the other CPU's load
    # on the shared cache) disturbed least, which a per-request kernel cost cannot hide in.
    least_us = {mode: min(values) for mode, values in runs.items()}
    return {"requests": params.ctx_requests, "runs": runs, "median_us_per_req": medians_us,
            "least_us_per_req": least_us, "chains_read": chains, "kernel_ns_runs": kernel_ns,
            "kernel_ns_per_req": kernel_medians,
            "reads_kernel_ns": kernel_medians["traced, task contexts"] - kernel_medians["traced, no task contexts"],
            "reads_cost_us": medians_us["traced, task contexts"] - medians_us["traced, no task contexts"],
            "reads_cost_least_us": least_us["traced, task contexts"] - least_us["traced, no task contexts"]}


# ---------------------------------------------------------------------------------------
# lineage: the task-lineage uprobe per task created, on a CPython process alone
# ---------------------------------------------------------------------------------------

def wait_lineage_on(agent, health_port, timeout=30):
    """Until the agent counts a process whose task creations it probes (its /metrics; it looks
    again every few seconds at a process whose `_asyncio` was not loaded yet)."""
    deadline = time.monotonic() + timeout
    while agent_metrics(health_port)["gym_tracer_lineage_processes_total"] < 1:
        if time.monotonic() > deadline or agent.process.poll() is not None:
            raise BenchError(f"the agent did not put its task-lineage probe on the loop within {timeout} s "
                             f"(lineage_processes stays 0): see its log:\n{agent.stderr()[-4000:]}")
        time.sleep(0.2)


def lineage_loop(command, n, options, receiver):
    """One run of a loop program (`command`: it prints its CPU µs per iteration once it got a
    line on stdin) on the server CPU, without an agent (`options` None) or traced with
    `options`: (µs per iteration, the agent's eBPF ns per iteration, its exit summary)."""
    loop = CHILDREN.add(subprocess.Popen(["taskset", "-c", str(SERVER_CPU), sys.executable, *command],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
    agent = None
    try:
        # Both programs import asyncio before they read stdin: once `_asyncio` is mapped, the
        # agent finds it at attach (else it looks again seconds later).
        deadline = time.monotonic() + 20
        while "_asyncio" not in Path(f"/proc/{loop.pid}/maps").read_text():
            if time.monotonic() > deadline or loop.poll() is not None:
                raise BenchError(f"{' '.join(command)} did not load _asyncio: see its error above")
            time.sleep(0.02)
        if options is not None:
            health_port = free_port()
            agent = start_agent([loop.pid], receiver.url, health_port, servers=False, options=options)
            if "on" in options:
                wait_lineage_on(agent, health_port)
        before = bpf_stats.run_time(agent.process.pid) if agent else None
        out, _ = loop.communicate("go\n", timeout=300)
        if loop.returncode != 0:
            raise BenchError(f"{' '.join(command)} failed ({loop.returncode}): see its error above")
        if not agent:
            return float(out), None, None
        kernel_ns = (bpf_stats.run_time(agent.process.pid)[0] - before[0]) / n
        agent.stop()
        return float(out), kernel_ns, Counters(agent.summary(), "exit summary (--summary-file)")
    finally:
        stop_agent(agent)
        if loop.poll() is None:
            loop.kill()


def task_lineage_alone(params, receiver):
    """The two costs of task lineage to a CPython process, each on a loop of its own on the
    server CPU, traced with --task-lineage off and on (and, for the tasks, without an agent),
    interleaved, median and least of `ctx_repeats` runs, with the agent's eBPF run time
    (kernel.bpf_stats_enabled):
    - a probe hit: bench/lineage_tasks.py, an asyncio task creating and awaiting
      `lineage_tasks` tasks one after the other, no I/O; on − off per hit (lineage_tasks_probed
      ÷ tasks) is the uprobe trap and its program;
    - the reads at a message-start write: bench/context_writer.py (the ctx section's), an
      asyncio task's `ctx_requests` requests to an untraced sink, one message-start write
      each; on − off is the kernel's extra reads of the running task there.
    A workload's lineage cost is then about hits × the first + message-start writes × the
    second."""
    n, requests = params.lineage_tasks, params.ctx_requests
    task_modes = {"untraced": None, "traced, --task-lineage off": ["--task-lineage", "off"],
                  "traced, --task-lineage on": ["--task-lineage", "on"]}
    write_modes = {mode: options for mode, options in task_modes.items() if options}
    tasks = {mode: [] for mode in task_modes}
    writes = {mode: [] for mode in write_modes}
    task_kernel = {mode: [] for mode in write_modes}
    write_kernel = {mode: [] for mode in write_modes}
    hits, processes = [], []
    sink_port = free_port()
    with spawning_on(LOAD_CPU):
        sink = CHILDREN.add(subprocess.Popen([sys.executable, str(BENCH_DIR / "context_sink.py"), str(sink_port)],
                                             stdout=subprocess.PIPE, text=True))
    try:
        if sink.stdout.readline().strip() != "ready":
            raise BenchError("bench/context_sink.py did not start: see its error above")
        with bpf_stats.stats_enabled():
            for _ in range(params.ctx_repeats):
                for mode, options in task_modes.items():
                    us, kernel_ns, summary = lineage_loop([str(BENCH_DIR / "lineage_tasks.py"), str(n)], n, options,
                                                          receiver)
                    tasks[mode].append(us)
                    if summary is None:
                        continue
                    task_kernel[mode].append(kernel_ns)
                    probed = summary["lineage_tasks_probed"]
                    if "on" in options:
                        if probed < n:
                            raise BenchError(f"lineage, {mode}: the agent counted {probed:.0f} probe hits for {n} "
                                             "tasks created: the uprobe on Task.__init__ did not fire for each")
                        hits.append(probed / n)
                        processes.append(summary["lineage_processes"])
                    elif probed:
                        raise BenchError(f"lineage, {mode}: {probed:.0f} probe hits with --task-lineage off")
                for mode, options in write_modes.items():
                    us, kernel_ns, summary = lineage_loop(
                        [str(BENCH_DIR / "context_writer.py"), str(sink_port), str(requests)], requests, options,
                        receiver)
                    if summary["context_chains_read"] < requests:
                        raise BenchError(f"lineage, writes, {mode}: {summary['context_chains_read']:.0f} task "
                                         f"contexts read for {requests} message-start writes")
                    writes[mode].append(us)
                    write_kernel[mode].append(kernel_ns)
    finally:
        sink.kill()
        sink.wait()
    on, off = "traced, --task-lineage on", "traced, --task-lineage off"

    def summarise(runs, kernel):
        medians_us = {mode: statistics.median(values) for mode, values in runs.items()}
        least_us = {mode: min(values) for mode, values in runs.items()}
        kernel_medians = {mode: statistics.median(values) for mode, values in kernel.items()}
        return {"runs": runs, "median_us": medians_us, "least_us": least_us, "kernel_ns_runs": kernel,
                "kernel_ns": kernel_medians, "cost_us": medians_us[on] - medians_us[off],
                "cost_least_us": least_us[on] - least_us[off], "cost_kernel_ns": kernel_medians[on] - kernel_medians[off]}

    per_task = statistics.median(hits)
    task_figures = summarise(tasks, task_kernel)
    write_figures = summarise(writes, write_kernel)
    return {"repeats": params.ctx_repeats, "tasks": n, "requests": requests,
            "hits_per_task": hits, "lineage_processes": processes,
            # Per task created (one hit each) and per message-start write.
            "task_loop": task_figures, "write_loop": write_figures,
            "us_per_hit": task_figures["cost_us"] / per_task,
            "least_us_per_hit": task_figures["cost_least_us"] / per_task,
            "kernel_ns_per_hit": task_figures["cost_kernel_ns"] / per_task,
            "us_per_write": write_figures["cost_us"], "least_us_per_write": write_figures["cost_least_us"],
            "kernel_ns_per_write": write_figures["cost_kernel_ns"]}


# ---------------------------------------------------------------------------------------
# tls: an HTTPS client's cost per call with the SSL uprobes attached
# ---------------------------------------------------------------------------------------

# Mode: None (no agent), or (whom the agent traces, its options). "idle" is a CPython that has
# imported ssl and sleeps: an agent tracing it attaches the uprobes to the libssl file the
# client maps too. With `--tls-probe-scope library` the client (not traced) then pays what every
# other process on the host that uses that libssl pays; with the default (`process`) the
# breakpoints are in the idle process only. "untraced, agent --no-tls" is that agent without
# the uprobes: its difference to the two is the uprobes' part alone (the syscall tracepoints'
# filtering, the `tax` section's subject, is in all three).
TLS_MODES = {
    "untraced": None,
    "untraced, agent --no-tls": ("idle", ["--no-tls"]),
    "untraced, uprobes per library": ("idle", ["--tls-probe-scope", "library"]),
    "untraced, uprobes per process": ("idle", []),
    "traced, --no-tls": ("client", ["--no-tls"]),
    "traced, uprobes": ("client", []),
}
TLS_IDLE = "import ssl, time; print('ready', flush=True); time.sleep(1e6)"


def tls_certificate(out_dir):
    """A self-signed certificate for 127.0.0.1 (made once, kept in the out dir)."""
    cert, key = out_dir / "tls-bench-cert.pem", out_dir / "tls-bench-key.pem"
    if not (cert.exists() and key.exists()):
        args = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                "-keyout", str(key), "-out", str(cert), "-days", "3650", "-subj", "/CN=127.0.0.1",
                "-addext", "subjectAltName=IP:127.0.0.1"]
        out = subprocess.run(args, capture_output=True, text=True)
        if out.returncode != 0:
            raise BenchError(f"could not make the tls section's certificate ({' '.join(args)}): {out.stderr}")
    return cert, key


def mapped_libssl(pid):
    """The path of the libssl.so* file `pid` maps, or None."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(None, 5)
        if len(fields) == 6 and Path(fields[5]).name.startswith("libssl.so"):
            return Path(fields[5])
    return None


def sink_library_dir(out_dir):
    """A directory holding a copy of the libssl this Python maps, for the sink's
    LD_LIBRARY_PATH: a copy is another file, so the sink's own TLS calls do not hit the uprobes
    (which are attached to the file the client maps), and the eBPF figures are the client's
    alone. None when this Python maps no libssl (OpenSSL linked statically)."""
    import ssl  # noqa: F401  (maps libssl into this process)
    library = mapped_libssl(os.getpid())
    if library is None:
        return None
    directory = out_dir / "tls-sink-lib"
    directory.mkdir(exist_ok=True)
    shutil.copyfile(library, directory / library.name)
    return directory


def tls_calls(params, receiver):
    """A CPython HTTPS client (bench/tls_client.py: aiohttp if this Python has it, else
    asyncio streams) making `tls_requests` sequential calls on one keep-alive TLS connection to
    an untraced sink (bench/tls_sink.py) on the load CPU, the client pinned to the server CPU:
    its CPU µs per call in each of TLS_MODES, interleaved, median and least of `tls_repeats`
    runs; the agent's eBPF ns per call (kernel.bpf_stats_enabled). Checks that the uprobes
    fired for the traced client (tls_records), stayed silent for the untraced one, and that a
    libssl file was probed in the modes with uprobes."""
    python, n = sys.executable, params.tls_requests
    cert, key = tls_certificate(params.out_dir)
    library_dir = sink_library_dir(params.out_dir)
    sink_env = dict(os.environ)
    if library_dir:
        sink_env["LD_LIBRARY_PATH"] = ":".join(filter(None, [str(library_dir), os.environ.get("LD_LIBRARY_PATH")]))
    with spawning_on(LOAD_CPU):
        sink = CHILDREN.add(subprocess.Popen([python, str(BENCH_DIR / "tls_sink.py"), str(cert), str(key)],
                                             stdout=subprocess.PIPE, text=True, env=sink_env))
        idle = CHILDREN.add(subprocess.Popen([python, "-c", TLS_IDLE], stdout=subprocess.PIPE, text=True))
    runs = {mode: [] for mode in TLS_MODES}
    agent_modes = [mode for mode, agent in TLS_MODES.items() if agent]
    kernel_ns = {mode: [] for mode in agent_modes}
    kernel_runs = {mode: [] for mode in agent_modes}
    summaries = {mode: [] for mode in agent_modes}
    client_spans, calls = [], set()
    clients = set()
    try:
        ready = sink.stdout.readline().split()
        if len(ready) != 2 or ready[0] != "ready":
            raise BenchError("the HTTPS sink (bench/tls_sink.py) did not start: see its error above")
        port = ready[1]
        if idle.stdout.readline().strip() != "ready":
            raise BenchError("the idle CPython of the tls section did not start: see its error above")
        sink_libssl = mapped_libssl(sink.pid)
        sink_own_libssl = bool(library_dir and sink_libssl and sink_libssl.parent == library_dir)
        with bpf_stats.stats_enabled():
            for _ in range(params.tls_repeats):
                for mode, traced in TLS_MODES.items():
                    client = CHILDREN.add(subprocess.Popen(
                        ["taskset", "-c", str(SERVER_CPU), python, str(BENCH_DIR / "tls_client.py"), port, str(cert),
                         str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
                    # Its modules (ssl, aiohttp) are loaded: the agent finds libssl mapped at attach.
                    if client.stdout.readline().strip() != "ready":
                        raise BenchError("bench/tls_client.py did not start: see its error above")
                    agent = None
                    if traced:
                        whom, options = traced
                        agent = start_agent([client.pid if whom == "client" else idle.pid], receiver.url,
                                            servers=False, options=options)
                    try:
                        before = bpf_stats.run_time(agent.process.pid) if agent else None
                        out, _ = client.communicate("go\n", timeout=600)
                        if client.returncode != 0:
                            raise BenchError(f"bench/tls_client.py failed ({client.returncode}) in mode {mode!r}: "
                                             "see its error above")
                        figures = json.loads(out)
                        runs[mode].append(figures["us_per_req"])
                        clients.add(figures["client"])
                        calls.add(figures["calls"])
                        if agent:
                            spent_ns, spent_runs = (after - first for after, first in
                                                    zip(bpf_stats.run_time(agent.process.pid), before))
                            # Over every call the agent saw, the warm-up's and the handshake included.
                            kernel_ns[mode].append(spent_ns / figures["calls"])
                            kernel_runs[mode].append(spent_runs / figures["calls"])
                            agent.stop()
                            summary = Counters(agent.summary(), "exit summary (--summary-file)")
                            summaries[mode].append({name: summary[name] for name in
                                                    ("tls_records", "tls_records_unmatched", "tls_libraries_probed",
                                                     "tls_libraries_failed", "tls_processes_unprobed")})
                            check_tls_counters(mode, traced, summary, n)
                            if mode == "traced, uprobes":
                                # The agent exported every span before it exited.
                                client_spans.append(receiver.counts([client.pid]).get("CLIENT", 0))
                    finally:
                        stop_agent(agent)
    finally:
        for process in (sink, idle):
            process.kill()
            process.wait()
    medians_us = {mode: statistics.median(values) for mode, values in runs.items()}
    least_us = {mode: min(values) for mode, values in runs.items()}
    kernel_medians = {mode: statistics.median(values) for mode, values in kernel_ns.items()}
    runs_medians = {mode: statistics.median(values) for mode, values in kernel_runs.items()}
    base, base_least = medians_us["untraced"], least_us["untraced"]
    [calls] = calls  # warm-up included: the same in every run

    def cost(on, off):
        return {"us": medians_us[on] - medians_us[off], "least_us": least_us[on] - least_us[off],
                "ratio": (medians_us[on] - medians_us[off]) / base,
                "least_ratio": (least_us[on] - least_us[off]) / base_least,
                "kernel_ns": kernel_medians.get(on, 0.0) - kernel_medians.get(off, 0.0),
                "program_runs": runs_medians.get(on, 0.0) - runs_medians.get(off, 0.0)}

    def per_run(figures):
        # Of the uprobes alone: the client's CPU per extra program run (entry or return probe),
        # the trap and the program together; what carries to another machine's call counts.
        figures["us_per_program_run"] = (figures["us"] / figures["program_runs"]
                                         if figures["program_runs"] >= 0.5 else None)
        return figures

    return {"requests": n, "calls": calls, "repeats": params.tls_repeats, "client": sorted(clients),
            "sink_own_libssl": sink_own_libssl,
            "runs": runs, "median_us_per_req": medians_us, "least_us_per_req": least_us,
            "median_vs_untraced": {mode: value / base for mode, value in medians_us.items()},
            "least_vs_untraced": {mode: value / base_least for mode, value in least_us.items()},
            "kernel_ns_runs": kernel_ns, "kernel_ns_per_req": kernel_medians,
            "program_runs_runs": kernel_runs, "program_runs_per_req": runs_medians,
            "agent_counters": summaries,
            "tls_records_per_call": [s["tls_records"] / calls for s in summaries["traced, uprobes"]],
            "client_spans": client_spans, "client_spans_per_call": [spans / calls for spans in client_spans],
            # The uprobes on the traced client: traced with them against traced without.
            "uprobes_cost": per_run(cost("traced, uprobes", "traced, --no-tls")),
            # The client not traced, the uprobes attached for another process (per library file):
            # against no agent at all, and against an agent without uprobes (their part alone);
            # attached per process (the default), against an agent without uprobes.
            "attached_cost": cost("untraced, uprobes per library", "untraced"),
            "attached_uprobes_cost": per_run(cost("untraced, uprobes per library", "untraced, agent --no-tls")),
            "process_scope_cost": per_run(cost("untraced, uprobes per process", "untraced, agent --no-tls")),
            # Tracing the client at all, uprobes included, against no agent.
            "traced_cost": cost("traced, uprobes", "untraced")}


def check_tls_counters(mode, traced, summary, requests):
    """The uprobes fired for the traced client, not for the untraced one, and not at all with
    --no-tls; a libssl file was probed whenever they are on."""
    whom, options = traced
    uprobes = "--no-tls" not in options
    if uprobes and summary["tls_libraries_probed"] < 1:
        raise BenchError(f"tls, {mode}: the agent's tls_libraries_probed is {summary['tls_libraries_probed']}: no "
                         f"libssl file got the uprobes (tls_libraries_failed {summary['tls_libraries_failed']}; "
                         "see the agent's log)")
    if not uprobes and (summary["tls_libraries_probed"] or summary["tls_records"]):
        raise BenchError(f"tls, {mode}: with --no-tls the agent probed {summary['tls_libraries_probed']} libssl "
                         f"file(s) and saw {summary['tls_records']} tls_records")
    if uprobes and whom == "client" and summary["tls_records"] < 2 * requests:
        raise BenchError(f"tls, {mode}: the agent's tls_records is {summary['tls_records']} for {requests} HTTPS "
                         f"calls (at least {2 * requests}: a write and a read each): the uprobes did not fire")
    if whom == "idle" and summary["tls_records"]:
        raise BenchError(f"tls, {mode}: the agent reported {summary['tls_records']} tls_records of a client it does "
                         "not trace: the uprobes' PID filter let them through")


# ---------------------------------------------------------------------------------------
# soak: agent memory under steady load
# ---------------------------------------------------------------------------------------

def soak(params, receiver, scripts):
    """/verify under steady load for --soak seconds; agent RSS sampled at an interval. The
    slope is a least-squares fit over the second half (after warm-up allocations). The agent's
    gauges are sampled alongside, to tell what grows."""
    run = gym_run("verify", "gym-tracer", receiver)
    entry = run.resources
    health_port = free_port()
    agent, summary = None, {}
    interval = max(5.0, params.soak / 60)
    samples = []
    try:
        agent = start_agent([entry.pid], receiver.url, health_port)
        script = scripts["verify"]
        with spawning_on(LOAD_CPU):
            load = CHILDREN.add(subprocess.Popen(
                ["wrk", "-t1", f"-c{params.connections}", f"-d{params.soak}s", "-s", str(script),
                 f"{entry.base_url}/verify"], stdout=subprocess.PIPE, text=True))
        start = time.monotonic()
        while load.poll() is None:
            gauges = agent_metrics(health_port)
            samples.append({"seconds": round(time.monotonic() - start, 1),
                            "agent_rss_kib": status_kib(agent.process.pid, "VmRSS"),
                            **{name: gauges[f"gym_tracer_{name}"] for name in
                               ("connections_tracked", "spans_pending", "spans_buffered", "processes_traced")}})
            print(f"  soak: {samples[-1]}", flush=True)
            try:
                load.wait(interval)
            except subprocess.TimeoutExpired:
                pass
        match = re.search(r"^BENCH_JSON (.*)$", load.stdout.read(), re.M)
        requests = json.loads(match.group(1))["requests"] if match else None
        agent.stop()
        summary = agent.summary()
    finally:
        stop_agent(agent)
        run.stop()
    tail = samples[len(samples) // 2:]
    slope = None
    if len(tail) >= 2:
        mean_t = statistics.mean(s["seconds"] for s in tail)
        mean_r = statistics.mean(s["agent_rss_kib"] for s in tail)
        var = sum((s["seconds"] - mean_t) ** 2 for s in tail)
        slope = 60 * sum((s["seconds"] - mean_t) * (s["agent_rss_kib"] - mean_r) for s in tail) / var if var else 0.0
    return {"seconds": params.soak, "interval_s": interval, "requests": requests, "samples": samples,
            "slope_kib_per_min": slope, "agent_summary": summary}


# ---------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------

MEDIAN_FIELDS = ("rps", "p50_ms", "p99_ms", "server_cpu_us_per_req", "agent_cpu_us_per_req", "agent_peak_rss_kib",
                 "events_lost", "agent_drops", "spans_per_req", "server_spans_per_sent", "requests", "sent", "errors",
                 "non_2xx", "context_chains_per_req", "traceparents_injected_per_req",
                 "traceparents_not_known_per_req", "traceparents_failed", "lineage_processes", "lineage_processes_off",
                 "lineage_tasks_per_req", "lineage_parents_per_req", "bpf_us_per_req", "bpf_runs_per_req")


def medians(runs):
    """{(workload, variant): {field: median over the repeats}}, figure by figure."""
    rows = {}
    for run in runs:
        rows.setdefault((run["workload"], run["variant"]), []).append(run)
    table = {}
    for key, group in rows.items():
        table[key] = {field: statistics.median(r[field] for r in group)
                      for field in MEDIAN_FIELDS if all(field in r for r in group)}
        table[key]["repeats"] = len(group)
    for (workload, variant), row in table.items():
        base = table.get((workload, "untraced"))
        if base:
            row["rps_vs_untraced"] = row["rps"] / base["rps"]
            row["server_cpu_vs_untraced"] = row["server_cpu_us_per_req"] / base["server_cpu_us_per_req"]
    return table


def headline(table, workload):
    """gym-tracer's cost as a fraction of in-process OpenTelemetry's: in throughput, and in
    server CPU per request (steadier on a shared machine), and with the agent's CPU added."""
    tracer, otel = table.get((workload, "gym-tracer")), table.get((workload, "otel"))
    if not tracer or not otel or "rps_vs_untraced" not in tracer:
        return None
    cost_tracer, cost_otel = 1 - tracer["rps_vs_untraced"], 1 - otel["rps_vs_untraced"]
    cpu_tracer, cpu_otel = tracer["server_cpu_vs_untraced"] - 1, otel["server_cpu_vs_untraced"] - 1
    base_cpu = table[(workload, "untraced")]["server_cpu_us_per_req"]
    cpu_tracer_with_agent = cpu_tracer + tracer["agent_cpu_us_per_req"] / base_cpu
    return {"gym_tracer_throughput_cost": cost_tracer, "otel_throughput_cost": cost_otel,
            "gym_tracer_cost_fraction_of_otel": cost_tracer / cost_otel if cost_otel > 0 else None,
            "gym_tracer_server_cpu_cost": cpu_tracer, "gym_tracer_cpu_cost_with_agent": cpu_tracer_with_agent,
            "otel_server_cpu_cost": cpu_otel,
            "gym_tracer_cpu_cost_fraction_of_otel": cpu_tracer / cpu_otel if cpu_otel > 0 else None}


def context_cost(table, workload):
    """What the task-context reads cost, gym-tracer against gym-tracer --no-task-contexts:
    server and agent CPU per request, and chains read per request."""
    on, off = table.get((workload, "gym-tracer")), table.get((workload, "tracer-no-ctx"))
    if not on or not off:
        return None
    return {"server_cpu_us_per_req_on": on["server_cpu_us_per_req"],
            "server_cpu_us_per_req_off": off["server_cpu_us_per_req"],
            "server_cpu_us_per_req_delta": on["server_cpu_us_per_req"] - off["server_cpu_us_per_req"],
            "agent_cpu_us_per_req_on": on["agent_cpu_us_per_req"],
            "agent_cpu_us_per_req_off": off["agent_cpu_us_per_req"],
            "context_chains_per_req": on.get("context_chains_per_req")}


def lineage_cost(table, runs, workload):
    """What the task-lineage uprobe costs the servers, gym-tracer --task-lineage on against
    gym-tracer (whose `auto` probes none of the bench's servers): server CPU per request, the
    probe hits per request over the measured window (lineage_tasks_probed), and so the server
    CPU each hit cost; beside it in-process OpenTelemetry's cost against untraced. Percentages
    are of the untraced server CPU per request, the one base of both. Also the same difference
    repeat by repeat (the variants run interleaved, so a repeat's pair shares its drift)."""
    on, off = table.get((workload, "tracer-lineage")), table.get((workload, "gym-tracer"))
    base, otel = table.get((workload, "untraced")), table.get((workload, "otel"))
    if not on or not off or "lineage_tasks_per_req" not in on:
        return None

    def per_hit(delta_us, hits):
        return delta_us / hits if hits >= 0.5 else None

    delta = on["server_cpu_us_per_req"] - off["server_cpu_us_per_req"]
    hits = on["lineage_tasks_per_req"]
    base_us = base["server_cpu_us_per_req"] if base else None
    by_repeat = []
    for repeat in sorted({r["repeat"] for r in runs if r["workload"] == workload}):
        pair = {r["variant"]: r for r in runs if r["workload"] == workload and r["repeat"] == repeat}
        if "tracer-lineage" in pair and "gym-tracer" in pair:
            d = pair["tracer-lineage"]["server_cpu_us_per_req"] - pair["gym-tracer"]["server_cpu_us_per_req"]
            h = pair["tracer-lineage"]["lineage_tasks_per_req"]
            by_repeat.append({"repeat": repeat, "delta_us": d, "probe_hits_per_req": h, "us_per_hit": per_hit(d, h)})
    return {"server_cpu_us_per_req_lineage": on["server_cpu_us_per_req"],
            "server_cpu_us_per_req_gym_tracer": off["server_cpu_us_per_req"],
            "server_cpu_us_per_req_untraced": base_us,
            "delta_us": delta, "delta_pct_of_untraced": 100 * delta / base_us if base_us else None,
            "probe_hits_per_req": hits, "us_per_hit": per_hit(delta, hits),
            "parents_by_lineage_per_req": on["lineage_parents_per_req"],
            # Message-start writes whose task the kernel read (task contexts), per request.
            "writes_per_req": on["context_chains_per_req"],
            "lineage_processes": on["lineage_processes"], "lineage_processes_off": on["lineage_processes_off"],
            # gym-tracer's own (the default, auto): none of the bench's servers, so 0.
            "gym_tracer_probe_hits_per_req": off.get("lineage_tasks_per_req"),
            "agent_cpu_us_per_req_lineage": on["agent_cpu_us_per_req"],
            "agent_cpu_us_per_req_gym_tracer": off["agent_cpu_us_per_req"],
            "rps_lineage": on["rps"], "rps_gym_tracer": off["rps"],
            # gym-tracer with lineage against no tracing at all, and in-process OpenTelemetry.
            "lineage_total_us": on["server_cpu_us_per_req"] - base_us if base_us else None,
            "lineage_total_pct": 100 * (on["server_cpu_us_per_req"] / base_us - 1) if base_us else None,
            "otel_us": otel["server_cpu_us_per_req"] - base_us if otel and base_us else None,
            "otel_pct": 100 * (otel["server_cpu_us_per_req"] / base_us - 1) if otel and base_us else None,
            "by_repeat": by_repeat,
            # The median of the repeats' own differences: steadier than the difference of the
            # medians when a repeat's servers all ran slow or fast.
            "paired_delta_us": statistics.median(r["delta_us"] for r in by_repeat) if by_repeat else None,
            "paired_us_per_hit": (per_hit(statistics.median(r["delta_us"] for r in by_repeat), hits)
                                  if by_repeat else None)}


def injection_cost(table, runs):
    """What `--inject-traceparent` costs a Gym agent server per rollout (the run workload: one
    /run is one rollout), gym-tracer with it against gym-tracer without: the headers written
    per rollout, the task-lineage probe hits it turns on in every server, the agent's eBPF run
    time, and the servers' CPU (also repeat by repeat, the variants interleaved); beside it
    in-process OpenTelemetry's cost against untraced, its own spans and traceparent
    propagation included. The bench's servers are on one host, so the variant injects into
    every call (`all`): `remote` on a Gym spread over hosts writes into the calls between them
    only, and hands the trace over the others in the kernel (a map update instead)."""
    inject, plain = table.get(("run", "tracer-inject")), table.get(("run", "gym-tracer"))
    base, otel = table.get(("run", "untraced")), table.get(("run", "otel"))
    if not inject or not plain or "bpf_us_per_req" not in inject:
        return None
    base_us = base["server_cpu_us_per_req"] if base else None
    by_repeat = []
    for repeat in sorted({r["repeat"] for r in runs if r["workload"] == "run"}):
        pair = {r["variant"]: r for r in runs if r["workload"] == "run" and r["repeat"] == repeat}
        if "tracer-inject" in pair and "gym-tracer" in pair:
            by_repeat.append(pair["tracer-inject"]["server_cpu_us_per_req"] - pair["gym-tracer"]["server_cpu_us_per_req"])
    return {"headers_per_rollout": inject["traceparents_injected_per_req"],
            "not_known_per_rollout": inject["traceparents_not_known_per_req"],
            "failed": inject["traceparents_failed"],
            "probe_hits_per_rollout": inject["lineage_tasks_per_req"],
            "probe_hits_per_rollout_without": plain["lineage_tasks_per_req"],
            "bpf_us_per_rollout": inject["bpf_us_per_req"], "bpf_us_per_rollout_without": plain["bpf_us_per_req"],
            "bpf_runs_per_rollout": inject["bpf_runs_per_req"],
            "bpf_runs_per_rollout_without": plain["bpf_runs_per_req"],
            "server_cpu_us": inject["server_cpu_us_per_req"], "server_cpu_us_without": plain["server_cpu_us_per_req"],
            "server_cpu_us_untraced": base_us,
            "delta_us": inject["server_cpu_us_per_req"] - plain["server_cpu_us_per_req"],
            "paired_delta_us": statistics.median(by_repeat) if by_repeat else None, "by_repeat": by_repeat,
            "delta_pct_of_untraced": (100 * (inject["server_cpu_us_per_req"] - plain["server_cpu_us_per_req"])
                                      / base_us if base_us else None),
            "total_us": inject["server_cpu_us_per_req"] - base_us if base_us else None,
            "otel_us": otel["server_cpu_us_per_req"] - base_us if otel and base_us else None,
            "rps_vs_untraced": inject.get("rps_vs_untraced"), "rps_vs_untraced_without": plain.get("rps_vs_untraced"),
            "otel_rps_vs_untraced": otel.get("rps_vs_untraced") if otel else None}


def fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


# ---------------------------------------------------------------------------------------
# goals: issue #18's figures, each against its target and, where the kernel sets one, its floor
# ---------------------------------------------------------------------------------------

# A soak is flat when the second half's slope, carried over the whole run, moves the agent's
# RSS by less than this fraction of its mean: a leak of one byte per request at the soak's
# rate shows, the stitching graph breathing with the load does not.
SOAK_FLAT_FRACTION = 0.05


def goal(name, target, figures, met, floor=None, floor_above_target=False):
    """One row of the goals block. `met` None: the run lacks the sections it needs."""
    if met is None:
        status = "not measured in this run"
    elif met:
        status = "met"
    elif floor_above_target:
        status = "not met: this kernel's floor is above the target"
    else:
        status = "not met"
    return {"goal": name, "target": target, "figures": figures, "floor": floor, "status": status}


def goals(report):
    """Issue #18's goal figures from this run's sections: each with the figures it is judged
    on, the floor the kernel sets where the bench measures one, and whether it was met."""
    table, rows = report["table"], []
    traced = {w: table.get(f"{w}/gym-tracer") for w in WORKLOADS if table.get(f"{w}/gym-tracer")}
    per_span = {w: row["agent_cpu_us_per_req"] / row["spans_per_req"] for w, row in traced.items()
                if row.get("agent_cpu_us_per_req") and row.get("spans_per_req")}
    alone = report.get("pipeline_cost", {}).get("workloads", {})
    rows.append(goal(
        "agent CPU per exported span", "≤ 3 µs",
        ", ".join(f"{w} {us:.2f} µs" for w, us in per_span.items()) or "-",
        all(us <= 3 for us in per_span.values()) if per_span else None,
        floor=("the same work alone (pipeline): " + ", ".join(f"{w} {x['ns_per_span'] / 1000:.2f} µs"
                                                           for w, x in alone.items())) if alone else None))
    untraced_rps = {w: [r["rps"] for r in report["runs"] if r["workload"] == w and r["variant"] == "untraced"]
                    for w in traced}
    rows.append(goal(
        "traced server throughput and CPU per request", "≥ 0.99 × and ≤ +1 %",
        "; ".join(f"{w} {row['rps_vs_untraced']:.3f} ×, {100 * (row['server_cpu_vs_untraced'] - 1):+.1f} % "
                  f"(untraced repeats {min(untraced_rps[w]):.0f}–{max(untraced_rps[w]):.0f} req/s)"
                  for w, row in traced.items()) or "-",
        all(row["rps_vs_untraced"] >= 0.99 and row["server_cpu_vs_untraced"] <= 1.01 for row in traced.values())
        if traced else None))
    t = report.get("traced_tax")
    capture_floor = t.get("capture_floor_delta_ns") if t else None
    rows.append(goal(
        "traced read/write of a small HTTP message", "≤ +1000 ns",
        f"+{t['traced_delta_ns']:.0f} ns ({t['kernel_ns_per_syscall']:.0f} ns eBPF)" if t else "-",
        t["traced_delta_ns"] <= 1000 if t else None,
        floor=f"the least capture +{capture_floor:.0f} ns" if capture_floor is not None else None,
        floor_above_target=capture_floor is not None and capture_floor > 1000))
    h = report.get("host_tax")
    untraced = {}
    if h:
        untraced.update({mode: (h[mode]["delta_ns"], h[mode].get("empty_programs_delta_ns")) for mode in ("pipe", "socket")})
    if t:
        untraced["tcp"] = (t["untraced_delta_ns"], t.get("empty_programs_delta_ns"))
    floors = [f for _, f in untraced.values() if f is not None]
    rows.append(goal(
        "untraced process, per syscall of an instrumented kind", "≤ +150 ns",
        ", ".join(f"{mode} {delta:+.0f} ns" for mode, (delta, _) in untraced.items()) or "-",
        all(delta <= 150 for delta, _ in untraced.values()) if untraced else None,
        floor=("empty programs: " + ", ".join(f"{mode} {f:+.0f} ns" for mode, (_, f) in untraced.items()
                                                if f is not None)) if floors else None,
        floor_above_target=bool(floors) and min(floors) > 150))
    c = report.get("connections")
    scaled = c and c["max_connections"] >= 16384
    rows.append(goal(
        "16,384 keep-alive connections tracked", "agent RSS ≤ 128 MiB",
        f"{c['max_connections']} connections: peak {c['agent_peak_rss_kib'] / 1024:.1f} MiB" if c else "-",
        c["agent_peak_rss_kib"] <= 128 * 1024 if scaled else None))
    soak_report = report.get("soak")
    if soak_report and soak_report["seconds"] >= 600:
        # After the first minute: the start is the agent filling its steady-state tables.
        rss = [x["agent_rss_kib"] for x in soak_report["samples"] if x["seconds"] >= 60] or \
            [x["agent_rss_kib"] for x in soak_report["samples"]]
        drift_kib = soak_report["slope_kib_per_min"] * soak_report["seconds"] / 60
        rows.append(goal(
            "10-minute soak flat", f"second-half slope over the run < {100 * SOAK_FLAT_FRACTION:.0f} % of RSS",
            f"{soak_report['slope_kib_per_min']:+.1f} KiB/min ({drift_kib / 1024:+.2f} MiB over the run), RSS "
            f"{min(rss) / 1024:.1f}–{max(rss) / 1024:.1f} MiB after the first minute",
            abs(drift_kib) < SOAK_FLAT_FRACTION * statistics.mean(rss)))
    else:
        rows.append(goal("10-minute soak flat", "--soak 600", "-", None))
    return rows


def render(report):
    p, lines = report["parameters"], []
    machine = report["machine"]
    lines.append(f"gym-tracer bench  {report['started']}  commit {report['commit']}  kernel {machine['kernel']}  "
                 f"{machine['cpu']} x{machine['cpus']}")
    lines.append(f"servers on CPU {SERVER_CPU}; wrk (-t1 -c{p['connections']}), agent and OTLP receiver on CPU "
                 f"{LOAD_CPU}; {p['duration']} s per run after a {p['warmup']} s warm-up; {p['repeats']} repeat(s) "
                 f"interleaved; every figure is the median of the repeats")
    table = report["table"]
    if table:
        header = (f"{'workload':8} {'variant':14} {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'srv µs/req':>10} "
                  f"{'agent µs/req':>12} {'agent RSS MiB':>13} {'lost':>5} {'drops':>5} {'spans/req':>9} "
                  f"{'SERVER/sent':>11} {'req/s ×':>8} {'srv CPU ×':>9}")
        lines += ["", header, "-" * len(header)]
        for workload in WORKLOADS:
            for variant in VARIANTS:
                row = table.get(f"{workload}/{variant}")
                if not row:
                    continue
                rss = row.get("agent_peak_rss_kib")
                lines.append(
                    f"{workload:8} {variant:14} {row['rps']:7.0f} {row['p50_ms']:7.2f} {row['p99_ms']:7.2f} "
                    f"{row['server_cpu_us_per_req']:10.0f} {fmt(row.get('agent_cpu_us_per_req'), '12.1f'):>12} "
                    f"{fmt(rss and rss / 1024, '13.1f'):>13} {fmt(row.get('events_lost'), '5.0f'):>5} "
                    f"{fmt(row.get('agent_drops'), '5.0f'):>5} {fmt(row.get('spans_per_req'), '9.3f'):>9} "
                    f"{fmt(row.get('server_spans_per_sent'), '11.3f'):>11} "
                    f"{fmt(row.get('rps_vs_untraced'), '8.3f'):>8} {fmt(row.get('server_cpu_vs_untraced'), '9.3f'):>9}")
        lines.append(f"lost: ring-buffer records lost; drops: lost + spans, requests, connections dropped + failed "
                     f"exports; SERVER/sent: the entry server's SERVER spans per request wrk sent (1.000: one "
                     f"each; a request in flight when wrk stops may go unserved); spans/req: all spans of all "
                     f"servers per request sent; ×: against untraced")
        for workload, h in report["headline"].items():
            if h:
                lines.append(
                    f"{workload}: throughput cost gym-tracer {100 * h['gym_tracer_throughput_cost']:+.1f}%, in-process "
                    f"OTel {100 * h['otel_throughput_cost']:+.1f}% (ratio "
                    f"{fmt(h['gym_tracer_cost_fraction_of_otel'], '.3f', 'n/a')}); server CPU per request gym-tracer "
                    f"{100 * h['gym_tracer_server_cpu_cost']:+.1f}% ({100 * h['gym_tracer_cpu_cost_with_agent']:+.1f}% "
                    f"with the agent's), OTel {100 * h['otel_server_cpu_cost']:+.1f}% (ratio "
                    f"{fmt(h['gym_tracer_cpu_cost_fraction_of_otel'], '.3f', 'n/a')})")
        inject, c = table.get("run/tracer-inject"), report.get("injection")
        if inject and c:
            lines.append(
                f"run with --inject-traceparent (all; one /run is one rollout): {c['headers_per_rollout']:.2f} headers "
                f"written per rollout ({c['not_known_per_rollout']:.2f} calls whose trace was not known, "
                f"{c['failed']:.0f} failed; wrk errors {inject['errors']:.0f}, non-2xx {inject['non_2xx']:.0f}); "
                f"per rollout, with it and without: task-lineage probe hits {c['probe_hits_per_rollout']:.2f} and "
                f"{fmt(c['probe_hits_per_rollout_without'], '.2f')}, the agent's eBPF {c['bpf_us_per_rollout']:.1f} and "
                f"{c['bpf_us_per_rollout_without']:.1f} µs ({c['bpf_runs_per_rollout']:.0f} and "
                f"{c['bpf_runs_per_rollout_without']:.0f} program runs), server CPU {c['server_cpu_us']:.0f} and "
                f"{c['server_cpu_us_without']:.0f} µs ({c['delta_us']:+.1f} µs, "
                f"{fmt(c['delta_pct_of_untraced'], '+.1f', '?')} % of untraced; repeat by repeat "
                + ", ".join(f"{d:+.1f}" for d in c["by_repeat"])
                + f", median {fmt(c['paired_delta_us'], '+.1f', '?')} µs); gym-tracer with it against untraced "
                f"{fmt(c['total_us'], '+.1f', '?')} µs, in-process OpenTelemetry (its spans and propagation) "
                f"{fmt(c['otel_us'], '+.1f', '?')} µs; req/s × {fmt(c['rps_vs_untraced'], '.3f')} (without "
                f"{fmt(c['rps_vs_untraced_without'], '.3f')}, OpenTelemetry {fmt(c['otel_rps_vs_untraced'], '.3f')})")
        for workload, c in report.get("context_cost", {}).items():
            if c:
                lines.append(
                    f"{workload}: task-context reads ({fmt(c['context_chains_per_req'], '.2f')} chains/request): server "
                    f"CPU {c['server_cpu_us_per_req_on']:.0f} µs/req with, {c['server_cpu_us_per_req_off']:.0f} without "
                    f"({c['server_cpu_us_per_req_delta']:+.1f} µs); agent {c['agent_cpu_us_per_req_on']:.1f} vs "
                    f"{c['agent_cpu_us_per_req_off']:.1f} µs/req")
        for workload, c in report.get("lineage", {}).items():
            if c:
                spread = [r["delta_us"] for r in c["by_repeat"]]
                lines.append(
                    f"{workload}: task lineage: {c['delta_us']:+.1f} µs server CPU per request "
                    f"({fmt(c['delta_pct_of_untraced'], '+.1f', '?')} %) for {c['probe_hits_per_req']:.2f} probe hits "
                    f"per request ({fmt(c['us_per_hit'], '.1f', 'n/a')} µs each); in-process OpenTelemetry: "
                    f"{fmt(c['otel_us'], '+.1f', '?')} µs ({fmt(c['otel_pct'], '+.1f', '?')} %)")
                lines.append(
                    f"  server CPU {c['server_cpu_us_per_req_lineage']:.0f} µs/req with lineage, "
                    f"{c['server_cpu_us_per_req_gym_tracer']:.0f} without, {fmt(c['server_cpu_us_per_req_untraced'], '.0f')} "
                    f"untraced (gym-tracer with lineage, all told: {fmt(c['lineage_total_us'], '+.1f', '?')} µs, "
                    f"{fmt(c['lineage_total_pct'], '+.1f', '?')} %); repeat by repeat "
                    + ", ".join(f"{d:+.1f}" for d in spread) + " µs"
                    + f" (median {fmt(c['paired_delta_us'], '+.1f', '?')} µs, "
                    f"{fmt(c['paired_us_per_hit'], '.1f', 'n/a')} µs a hit)"
                    + f"; {c['lineage_processes']:.0f} processes probed, parents by lineage "
                    f"{c['parents_by_lineage_per_req']:.2f} per request; gym-tracer (auto) "
                    f"{fmt(c['gym_tracer_probe_hits_per_req'], '.2f')} hits per request"
                    + (f"; from the loops below ({c['probe_hits_per_req']:.2f} hits × "
                       f"{report['lineage_alone']['us_per_hit']:.2f} µs + {c['writes_per_req']:.2f} message-start writes "
                       f"× {report['lineage_alone']['kernel_ns_per_write'] / 1000:.2f} µs of eBPF): "
                       f"{c['expected_us']:+.1f} µs expected"
                       if c.get("expected_us") is not None else ""))
        lines.append("(a negative cost is below this machine's noise: compare with the spread of the runs in the JSON; "
                     "task lineage's % and OpenTelemetry's are of the untraced server CPU per request)")
    if report.get("saturation"):
        s = report["saturation"]
        lines.append("")
        steps = ", ".join(f"c={st['connections']}: {st['rps']:.0f} req/s {'ok' if st['complete'] else 'INCOMPLETE'}"
                          for st in s["steps"])
        lines.append(f"saturation (/verify, gym-tracer, {p['step_duration']} s per step): {steps}")
        lines.append(f"  highest rate with one SERVER span per request and zero loss: "
                     f"{fmt(s['max_complete_rps'], '.0f', 'none')} req/s")
    if report.get("connections"):
        c = report["connections"]
        lines.append("")
        lines.append("connection scale (idle keep-alive connections to a traced server, each after one request): "
                     + ", ".join(f"{x['label']}: agent RSS {x['agent_rss_kib'] / 1024:.1f} MiB, tracked "
                                 f"{fmt(x['connections_tracked'], '.0f')}" for x in c["samples"]))
        lines.append(f"  {c['max_connections']} connections: {c['bytes_per_connection']:.0f} bytes of agent RSS per "
                     f"connection; agent peak RSS {c['agent_peak_rss_kib'] / 1024:.1f} MiB")
    if report.get("host_tax"):
        lines.append("")
        lines.append(f"host-wide tax (an untraced process on CPU {SERVER_CPU}, median of {p['tax_repeats']} "
                     f"x {p['tax_iterations']} iterations):")
        for mode, t in report["host_tax"].items():
            what = {"pipe": "pipe write+read", "socket": "socketpair send+recv", "getppid": "getppid (no program)"}[mode]
            lines.append(f"  {what:20} {t['without_ns']:7.1f} ns/syscall without the agent, {t['with_ns']:7.1f} with "
                         f"({t['delta_ns']:+.1f} ns, {t['delta_pct']:+.1f}%)"
                         + (f"; the same tracepoints with empty programs {t['empty_programs_ns']:7.1f} "
                            f"({t['empty_programs_delta_ns']:+.1f} ns: the floor)" if "empty_programs_ns" in t else ""))
    if report.get("traced_tax"):
        t = report["traced_tax"]
        lines.append("")
        lines.append(f"traced syscalls (syscall_tax http on CPU {SERVER_CPU}: a small HTTP/1.1 request and response "
                     f"on its own loopback TCP connection, 4 syscalls an exchange, {p['tax_iterations']} exchanges, "
                     f"median of {p['tax_repeats']}): "
                     + ", ".join(f"{mode} {ns:.0f} ns" for mode, ns in t["median_ns"].items())
                     + f" per syscall; traced {t['traced_delta_ns']:+.0f} ns ({t['kernel_ns_per_syscall']:.0f} ns of "
                     f"it in the agent's eBPF programs), agent attached elsewhere {t['untraced_delta_ns']:+.0f} ns; "
                     f"records lost while traced: {t['events_lost']}")
        if "capture_floor_delta_ns" in t:
            lines.append(f"  floors on this kernel: the same tracepoints with empty programs "
                         f"{t['empty_programs_delta_ns']:+.0f} ns per syscall; the least capture (tgid compare, "
                         f"per-thread stash, one user copy, one ring record) {t['capture_floor_delta_ns']:+.0f} ns, "
                         f"{t['capture_floor_kernel_ns_per_syscall']:.0f} ns of it in its eBPF programs "
                         f"({min(t['floor_records_per_syscall']):.3f} records per syscall, lost "
                         f"{[c['lost'] for c in t['floor_counts']]}); gym-tracer above that floor "
                         f"{t['above_floor_ns']:+.0f} ns")
    if report.get("pipeline_cost"):
        c = report["pipeline_cost"]
        lines.append("")
        lines.append(f"agent user space alone (pipeline core + OTLP encoding of Gym-shaped kernel records, no kernel, no "
                     f"metrics; {c['requests']} requests on CPU {SERVER_CPU}, median of {c['repeats']}):")
        for name, w in c["workloads"].items():
            lines.append(f"  {name:14} {w['pipeline_ns_per_request'] / 1000:6.2f} µs per request in the pipeline "
                         f"({w['spans_per_request']:.0f} spans), encoding {w['encode_ns_per_span']:.0f} ns per span: "
                         f"{w['ns_per_span'] / 1000:.2f} µs per span")
        by_n = c.get("stitch_ns_per_call_by_in_flight") or {}
        if by_n:
            lines.append("  the stitcher with N rollouts in flight in one process, one call each placed by its rollout "
                         "id: " + ", ".join(f"{int(n):,} → {ns:.0f} ns" for n, ns in by_n.items()) + " per call")
    if report.get("context_reads"):
        c = report["context_reads"]
        lines.append("")
        lines.append(f"task-context reads alone (a CPython asyncio task on CPU {SERVER_CPU}, {c['requests']} requests of one "
                     f"message-start write + one read each, {p['ctx_repeats']} runs interleaved): writer CPU per "
                     f"request, median (least): "
                     + ", ".join(f"{mode} {value:.2f} ({c['least_us_per_req'][mode]:.2f}) µs"
                                 for mode, value in c["median_us_per_req"].items())
                     + f"; the reads cost {c['reads_cost_us']:+.2f} µs per request ({c['reads_cost_least_us']:+.2f} "
                     f"between the least); chains read per traced run: {sorted(set(c['chains_read']))}")
        lines.append("  the agent's eBPF programs, per request (kernel.bpf_stats_enabled, median): "
                     + ", ".join(f"{mode} {value:.0f} ns" for mode, value in c["kernel_ns_per_req"].items())
                     + f"; the reads: {c['reads_kernel_ns']:+.0f} ns per request")
    if report.get("lineage_alone"):
        c = report["lineage_alone"]
        t, w = c["task_loop"], c["write_loop"]

        def modes(figures):
            return ", ".join(f"{mode} {value:.2f} ({figures['least_us'][mode]:.2f})"
                             for mode, value in figures["median_us"].items())

        lines.append("")
        lines.append(f"task lineage alone (CPython loops on CPU {SERVER_CPU}, {c['repeats']} runs interleaved; CPU per "
                     f"iteration, median (least), µs):")
        lines.append(f"  creating and awaiting {c['tasks']} asyncio tasks, no I/O (bench/lineage_tasks.py): {modes(t)}; "
                     f"one probe hit ({min(c['hits_per_task']):.3f}-{max(c['hits_per_task']):.3f} per task): "
                     f"{c['us_per_hit']:+.2f} µs ({c['least_us_per_hit']:+.2f} between the least), "
                     f"{c['kernel_ns_per_hit']:+.0f} ns of it in the agent's eBPF programs")
        lines.append(f"  {c['requests']} requests of one message-start write each (bench/context_writer.py): {modes(w)}; "
                     f"the lineage reads at a write: {c['us_per_write']:+.2f} µs ({c['least_us_per_write']:+.2f} between "
                     f"the least), {c['kernel_ns_per_write']:+.0f} ns in the eBPF programs")
    if report.get("tls_calls"):
        t = report["tls_calls"]
        lines.append("")
        lines.append(f"HTTPS client calls ({', '.join(t['client'])} on CPU {SERVER_CPU}, {t['requests']} sequential "
                     f"POSTs on one keep-alive TLS connection to an untraced sink, {t['repeats']} runs interleaved): "
                     f"client CPU per call, median (least), and × untraced:")
        for mode, value in t["median_us_per_req"].items():
            kernel = t["kernel_ns_per_req"].get(mode)
            lines.append(f"  {mode:31} {value:8.2f} ({t['least_us_per_req'][mode]:8.2f}) µs  "
                         f"×{t['median_vs_untraced'][mode]:.4f} (×{t['least_vs_untraced'][mode]:.4f})"
                         + (f"  eBPF {kernel:6.0f} ns, {t['program_runs_per_req'][mode]:.1f} program runs"
                            if kernel is not None else ""))

        def cost(c):
            text = (f"{c['us']:+.2f} µs per call ({c['least_us']:+.2f} between the least), {100 * c['ratio']:+.2f}% "
                    f"of untraced ({100 * c['least_ratio']:+.2f}%); eBPF {c['kernel_ns']:+.0f} ns")
            if "us_per_program_run" in c:
                text += (f" in {c['program_runs']:+.1f} program runs, "
                         f"{fmt(c['us_per_program_run'], '.2f', 'n/a')} µs of client CPU each")
            return text

        lines.append(f"  the uprobes on the traced client (traced, uprobes − traced, --no-tls): {cost(t['uprobes_cost'])}")
        lines.append(f"  the client untraced, an agent tracing an idle CPython that maps the same libssl, uprobes "
                     f"per library file (uprobes per library − untraced): {cost(t['attached_cost'])}")
        lines.append(f"    the uprobes' part (uprobes per library − agent --no-tls): {cost(t['attached_uprobes_cost'])}")
        lines.append(f"    with the default per-process uprobes (uprobes per process − agent --no-tls): "
                     f"{cost(t['process_scope_cost'])}")
        lines.append(f"  tracing the client, uprobes included (traced, uprobes − untraced): {cost(t['traced_cost'])}")
        records, spans = t["tls_records_per_call"], t["client_spans_per_call"]
        sink = ("the sink maps its own copy of libssl, so its calls hit no uprobe" if t["sink_own_libssl"]
                else "the sink maps the same libssl: its calls are in the eBPF figures")
        lines.append(f"  traced with uprobes, per call: tls_records {min(records):.2f}-{max(records):.2f}, CLIENT spans "
                     f"{min(spans):.2f}-{max(spans):.2f}; eBPF: the agent's programs (kernel.bpf_stats_enabled), "
                     f"median per call over the {t['calls']} calls of a run (warm-up and handshake included); {sink}")
    if report.get("soak"):
        s = report["soak"]
        first, last = s["samples"][0]["agent_rss_kib"], s["samples"][-1]["agent_rss_kib"]
        lines.append("")
        lines.append(f"soak ({s['seconds']} s of /verify, {fmt(s['requests'], 'd', '?')} requests): agent RSS "
                     f"{first / 1024:.1f} -> {last / 1024:.1f} MiB, slope over the second half "
                     f"{fmt(s['slope_kib_per_min'], '+.1f')} KiB/min; at most "
                     f"{max(x['spans_pending'] for x in s['samples']):.0f} spans held for stitching, "
                     f"{fmt(max((x['spans_buffered'] for x in s['samples'] if 'spans_buffered' in x), default=None), '.0f', '?')} "
                     "buffered for export")
    if report.get("goals"):
        lines.append("")
        lines.append("goals (issue #18) in this run:")
        for g in report["goals"]:
            lines.append(f"  {g['goal']} ({g['target']}): {g['figures']}"
                         + (f"; floor: {g['floor']}" if g["floor"] else "") + f" -> {g['status']}")
    if report.get("gym_scale"):
        lines += ["", gym_scale.render(report["gym_scale"], report.get("pipeline_cost"))]
    if report.get("gym_instructions"):
        lines += ["", gym_instructions.render(report["gym_instructions"])]
    return "\n".join(lines)


def machine():
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"kernel": platform.release(), "cpu": cpu, "cpus": os.cpu_count()}


def git_commit():
    def git(*args):
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else ""
    commit = git("rev-parse", "--short", "HEAD") or "unknown"
    return commit + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------

SECTIONS = ("verify", "run", "lineage", "gym-scale", "gym-instructions", "saturation", "connections", "tax", "traced-tax", "ctx", "tls", "pipeline")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", required=True, type=Path, help="the gym-tracer binary")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "target" / "bench")
    parser.add_argument("--quick", action="store_true", help="short runs, one repeat: a smoke check (~2 min)")
    parser.add_argument("--duration", type=int, help="seconds of load per measured run (default 8, quick 3)")
    parser.add_argument("--repeats", type=int, help="repeats per variant; the table shows medians (default 3, quick 1)")
    parser.add_argument("--connections", type=int, default=32, help="wrk connections of the measured runs")
    parser.add_argument("--soak", type=int, default=0, help="also run a memory soak of this many seconds (600 = 10 min)")
    parser.add_argument("--tls-requests", type=int,
                        help="HTTPS calls per run of the tls section (default 3000, quick 500)")
    parser.add_argument("--tls-repeats", type=int,
                        help="runs per mode of the tls section, interleaved (default 9, quick 3)")
    parser.add_argument("--pipeline-cost", type=Path,
                        help="the pipeline_cost example binary (cargo xtask bench builds it): the pipeline section")
    parser.add_argument("--syscall-floor", type=Path,
                        help="the syscall_floor example binary (cargo xtask bench builds it): the floor rows of the "
                             "tax and traced-tax sections")
    parser.add_argument("--only", help=f"comma list of sections to run: {','.join(SECTIONS)} (default all)")
    parser.add_argument("--gym-scale-steps", help="comma list of rollouts in flight for the gym-scale section "
                        "(default 256,1024,4096; quick 256), e.g. 16384")
    args = parser.parse_args(argv)
    quick = args.quick
    args.duration = args.duration or (3 if quick else 8)
    args.repeats = args.repeats or (1 if quick else 3)
    args.warmup = 1 if quick else 2
    args.step_duration = 3 if quick else 5
    args.saturation_connections = [1, 16, 64] if quick else [1, 4, 16, 64, 256]
    args.scale_connections = [500] if quick else [1000, 5000, 16384]
    args.tax_repeats = 3 if quick else 5
    args.tax_iterations = 50_000 if quick else 200_000
    args.ctx_requests = 5_000 if quick else 40_000
    args.ctx_repeats = 3 if quick else 9
    args.lineage_tasks = 5_000 if quick else 20_000
    args.tls_requests = args.tls_requests or (500 if quick else 3000)
    args.tls_repeats = args.tls_repeats or args.ctx_repeats
    args.sections = SECTIONS if not args.only else tuple(s.strip() for s in args.only.split(","))
    unknown = set(args.sections) - set(SECTIONS)
    if unknown:
        parser.error(f"--only: unknown section(s) {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    return args


def preflight(args):
    if os.geteuid() != 0:
        raise BenchError("the bench loads eBPF programs: run it as root (sudo -E cargo xtask bench)")
    if len(os.sched_getaffinity(0)) < 2 or not {SERVER_CPU, LOAD_CPU} <= os.sched_getaffinity(0):
        raise BenchError(f"the bench pins servers to CPU {SERVER_CPU} and load to CPU {LOAD_CPU}: it needs both")
    for tool, package in (("wrk", "wrk"), ("taskset", "util-linux")):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode != 0:
            raise BenchError(f"{tool} is not on PATH: install it (`apt-get install -y {package}`; "
                             "`cargo xtask bench` does this) and retry")
    if "tls" in args.sections and subprocess.run(["sh", "-c", "command -v openssl"],
                                                  capture_output=True).returncode != 0:
        raise BenchError("openssl is not on PATH (the tls section makes its certificate with it): install it "
                         "(`apt-get install -y openssl`) and retry")
    if "pipeline" in args.sections and not (args.pipeline_cost and args.pipeline_cost.exists()):
        if args.only:
            raise BenchError("the pipeline section runs the pipeline_cost example: build it with `cargo build --release "
                             "-p tracer-userspace --example pipeline_cost` and pass --pipeline-cost "
                             "target/release/examples/pipeline_cost (`cargo xtask bench` does both)")
        print("bench: the pipeline section is skipped: no --pipeline-cost binary (`cargo xtask bench` passes one)",
              file=sys.stderr)
        args.sections = tuple(s for s in args.sections if s != "pipeline")
    if {"tax", "traced-tax"} & set(args.sections) and not (args.syscall_floor and args.syscall_floor.exists()):
        print("bench: the floor rows of the tax sections are left out: no --syscall-floor binary (`cargo xtask "
              "bench` passes one; `cargo build --release -p tracer-userspace --example syscall_floor` builds it)",
              file=sys.stderr)
        args.syscall_floor = None
    if not args.agent.exists():
        raise BenchError(f"{args.agent} does not exist: build it with `cargo xtask build --release`")
    os.environ["GYM_TRACER_BIN"] = str(args.agent.resolve())


def main(argv=None):
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    started = time.monotonic()
    report = {"started": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"), "commit": git_commit(),
              "machine": machine(), "parameters": {k: v for k, v in vars(args).items() if k not in ("agent", "out_dir", "pipeline_cost", "syscall_floor")},
              "runs": [], "table": {}, "headline": {}}
    report["parameters"]["sections"] = list(args.sections)
    try:
        preflight(args)
        args.out_dir.mkdir(parents=True, exist_ok=True)
        os.sched_setaffinity(0, {LOAD_CPU})  # this driver keeps off the servers' CPU
        receiver = Receiver()
        workdir = Path(tempfile.mkdtemp(prefix="gym-bench-"))
        scripts = {}
        for workload in WORKLOADS:
            scripts[workload] = workdir / f"{workload}.lua"
            scripts[workload].write_text(wrk_script(workload))
        # `lineage` alone runs both workloads with LINEAGE_VARIANTS only.
        workloads = [w for w in WORKLOADS if w in args.sections or "lineage" in args.sections]
        for repeat in range(args.repeats):
            for workload in workloads:
                for variant in VARIANTS:
                    if ONLY_ON.get(variant, workload) != workload:
                        continue
                    if workload not in args.sections and variant not in LINEAGE_VARIANTS:
                        continue
                    result = measure(workload, variant, args, receiver, scripts)
                    result["repeat"] = repeat
                    report["runs"].append(result)
                    print(f"  {workload}/{variant} repeat {repeat + 1}/{args.repeats}: {result['rps']:.0f} req/s, "
                          f"server {result['server_cpu_us_per_req']:.0f} µs/req, agent "
                          f"{fmt(result.get('agent_cpu_us_per_req'), '.1f')} µs/req, spans/req "
                          f"{fmt(result.get('spans_per_req'), '.3f')}"
                          + (f", lineage probe hits/req {result['lineage_tasks_per_req']:.2f}"
                             if result.get("lineage_tasks_per_req") else ""), flush=True)
        table = medians(report["runs"])
        report["table"] = {f"{w}/{v}": row for (w, v), row in table.items()}
        report["headline"] = {w: headline(table, w) for w in workloads}
        report["context_cost"] = {w: context_cost(table, w) for w in workloads}
        report["lineage"] = {w: lineage_cost(table, report["runs"], w) for w in workloads}
        report["injection"] = injection_cost(table, report["runs"])
        if "saturation" in args.sections:
            report["saturation"] = saturation(args, receiver, scripts)
        if "connections" in args.sections:
            report["connections"] = connection_scale(args, receiver)
        if "tax" in args.sections:
            report["host_tax"] = host_tax(args, build_tax_program(args.out_dir), receiver)
        if "traced-tax" in args.sections:
            report["traced_tax"] = traced_tax(args, build_tax_program(args.out_dir), receiver)
        if "ctx" in args.sections:
            report["context_reads"] = context_reads(args, receiver)
        if "pipeline" in args.sections:
            report["pipeline_cost"] = pipeline_cost(args.pipeline_cost, args.quick)
        if "lineage" in args.sections:
            report["lineage_alone"] = alone = task_lineage_alone(args, receiver)
            for c in report["lineage"].values():
                if c:
                    # A hit: the trap and its program, seen in the loop's CPU. The reads at a
                    # write: more work in a program that runs anyway (no trap), below the
                    # noise of the CPU figure: its eBPF run time.
                    c["expected_us"] = (c["probe_hits_per_req"] * alone["us_per_hit"]
                                        + c["writes_per_req"] * alone["kernel_ns_per_write"] / 1000)
        if "tls" in args.sections:
            report["tls_calls"] = tls_calls(args, receiver)
        if "gym-scale" in args.sections:
            steps = tuple(int(n) for n in args.gym_scale_steps.split(",")) if args.gym_scale_steps else None
            report["gym_scale"] = gym_scale.gym_scale(args.quick, steps)
        if "gym-instructions" in args.sections:
            report["gym_instructions"] = gym_instructions.gym_instructions()
        if args.soak:
            report["soak"] = soak(args, receiver, scripts)
    except (BenchError, RuntimeError, AssertionError, OSError, subprocess.SubprocessError) as error:
        # RuntimeError/AssertionError: a server or the agent did not start (tests/support/harness.py).
        print(f"bench: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("bench: interrupted; stopping everything it started", file=sys.stderr)
        return 130
    finally:
        CHILDREN.kill_all()
    report["elapsed_seconds"] = round(time.monotonic() - started, 1)
    report["goals"] = goals(report)
    text = render(report)
    print("\n" + text + f"\n\n(whole run: {report['elapsed_seconds']:.0f} s)")
    stamp = report["started"].replace(":", "").replace("-", "")
    report["text"] = text
    for path in (args.out_dir / f"bench-{stamp}.json", args.out_dir / "latest.json"):
        path.write_text(json.dumps(report, indent=1))
    print(f"written: {args.out_dir / f'bench-{stamp}.json'} and latest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
