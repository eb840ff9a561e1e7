"""`cargo xtask bench` smoke check: the driver runs its shortest form end to end (real servers,
real agent, real wrk) and writes a report with every column; no figure is judged, only that
each request was traced and nothing was lost. One run of the driver with every section the
tests check (`quick_bench`); each test reads its part of the report."""

import json
import shutil
import subprocess
import sys

import pytest

from harness import ROOT, agent_binary, example_binary


def run_bench(tmp_path, *args, timeout=300):
    """bench/bench.py in its shortest form with `args`, writing its report under `tmp_path`."""
    return subprocess.run(
        [sys.executable, str(ROOT / "bench" / "bench.py"), "--agent", str(agent_binary()), "--out-dir", str(tmp_path),
         "--quick", *args],
        capture_output=True, text=True, timeout=timeout,
    )


# Every section the tests below check, in one run of the driver: the verify section's runs
# are also the lineage section's verify rows, so they are measured once, not twice.
SECTIONS = "verify,lineage,tls,pipeline,gym-scale,tax,traced-tax"
TLS_REQUESTS = 200


@pytest.fixture(scope="module")
def quick_bench(tmp_path_factory):
    """One shortest-form run of the bench with every section checked here: (stdout, report);
    a failed run fails every test of the module, with its output."""
    assert shutil.which("wrk"), "wrk is not installed: `cargo xtask setup` (as root) installs it"
    out_dir = tmp_path_factory.mktemp("bench")
    out = run_bench(out_dir, "--only", SECTIONS, "--duration", "2", "--tls-requests", str(TLS_REQUESTS),
                    "--tls-repeats", "1", "--pipeline-cost", str(example_binary("pipeline_cost")),
                    "--syscall-floor", str(example_binary("syscall_floor")), timeout=1200)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout, json.loads((out_dir / "latest.json").read_text())


# A smoke test, but one that fails when the tracer is an order of magnitude off what it
# measures (the full bench's figures, docs/performance.md: ~20 µs of agent CPU per span,
# traced throughput within a few % of untraced), not only when a column is missing.
MAX_AGENT_US_PER_SPAN = 200
MIN_TRACED_THROUGHPUT = 0.3


def test_quick_bench_writes_a_complete_report(quick_bench):
    stdout, report = quick_bench
    assert "verify   gym-tracer" in stdout, stdout

    for key in ("machine", "commit", "parameters", "runs", "table", "headline", "text"):
        assert key in report, key
    table = report["table"]
    # The verify section's variants, and the lineage section's on the run workload.
    assert set(table) == {"verify/untraced", "verify/gym-tracer", "verify/tracer-lineage", "verify/tracer-no-ctx",
                          "verify/otel", "run/untraced", "run/gym-tracer", "run/tracer-lineage", "run/tracer-inject",
                          "run/otel"}
    for row in table.values():
        for column in ("rps", "p50_ms", "p99_ms", "server_cpu_us_per_req", "rps_vs_untraced"):
            assert row[column] > 0, (column, row)
    traced = table["verify/gym-tracer"]
    for column in ("agent_cpu_us_per_req", "agent_peak_rss_kib"):
        assert traced[column] > 0, (column, traced)
    # Every answered request has its SERVER span and none is made up (requests in flight
    # when wrk stops are sent, served and traced, but not answered), and the agent lost and
    # dropped nothing.
    [run] = [r for r in report["runs"] if (r["workload"], r["variant"]) == ("verify", "gym-tracer")]
    assert run["requests"] <= run["entry_server_spans"] <= run["sent"], run
    assert run["one_span_per_request"]
    assert traced["events_lost"] == 0 and traced["agent_drops"] == 0, traced
    assert report["headline"]["verify"]["otel_throughput_cost"] is not None
    goals = {g["goal"]: g for g in report["goals"]}
    for name in ("agent CPU per exported span", "traced server throughput and CPU per request"):
        assert goals[name]["status"] in ("met", "not met"), goals[name]  # judged on this run's figures
    per_span = traced["agent_cpu_us_per_req"] / traced["spans_per_req"]
    assert per_span <= MAX_AGENT_US_PER_SPAN, f"{per_span:.1f} µs of agent CPU per span"
    assert traced["rps_vs_untraced"] >= MIN_TRACED_THROUGHPUT, traced
    # The task-context reads priced on their own: one chain per /verify response with them
    # (per request wrk sent: the last ones sent are not all answered), none without.
    cost = report["context_cost"]["verify"]
    assert 0.9 <= cost["context_chains_per_req"] <= 1.05, cost  # + the route harvest's response
    assert table["verify/tracer-no-ctx"]["context_chains_per_req"] == 0, table["verify/tracer-no-ctx"]
    # The task-lineage uprobe priced on its own (gym-tracer --task-lineage on against
    # gym-tracer): its runs traced every request and lost nothing, and it counted probe hits
    # over the measured window (at least the task uvicorn runs each request in); gym-tracer's
    # default (auto) probes none of these servers.
    check_lineage_runs(report, "verify")
    assert "verify: task lineage:" in stdout, stdout


HITS_PER_REQUEST = {"verify": 3, "run": 3 * 3 + 2}
# Under the default --task-lineage auto (the gym-tracer rows): the model server is probed (a
# model server's upstream calls carry no evidence of their own), its three tasks per request;
# the resources server of /verify names no model server and is not.
AUTO_HITS_PER_REQUEST = {"verify": 0, "run": 3}
AUTO_LINEAGE_PROCESSES = {"verify": 0, "run": 1}


def check_lineage_runs(report, workload):
    """The tracer-lineage runs of `workload` traced every request and lost nothing, the probe
    fired in every server, and the lineage figures are in the report."""
    table = report["table"]
    row = table[f"{workload}/tracer-lineage"]
    assert row["events_lost"] == 0 and row["agent_drops"] == 0, row
    for run in (r for r in report["runs"] if r["workload"] == workload and r["variant"] == "tracer-lineage"):
        assert run["one_span_per_request"], run
        assert run["lineage_processes_off"] == 0, run
    lineage = report["lineage"][workload]
    # Exactly the tasks the servers' code creates per request: uvicorn's run_asgi, the task
    # `@app.middleware("http")`'s call_next runs the app in, and the one Starlette's
    # receive_or_disconnect starts to read the body, in each server; on /run also one eager
    # write_bytes task per aiohttp call with a body (the model call and the verify call).
    assert abs(lineage["probe_hits_per_req"] - HITS_PER_REQUEST[workload]) < 0.02, lineage
    assert lineage["lineage_processes"] == (1 if workload == "verify" else 3), lineage
    assert abs(lineage["gym_tracer_probe_hits_per_req"] - AUTO_HITS_PER_REQUEST[workload]) < 0.02, lineage
    assert table[f"{workload}/gym-tracer"]["lineage_processes"] == AUTO_LINEAGE_PROCESSES[workload], \
        table[f"{workload}/gym-tracer"]
    # A difference of noisy figures: present and finite, not necessarily positive.
    for key in ("delta_us", "us_per_hit", "otel_us"):
        assert isinstance(lineage[key], float) and abs(lineage[key]) < float("inf"), (key, lineage)
    assert len(lineage["by_repeat"]) == report["parameters"]["repeats"], lineage


def test_quick_bench_prices_task_lineage(quick_bench):
    """The lineage section, shortest form: both workloads (the run workload with untraced,
    gym-tracer, tracer-lineage and otel only), the lineage lines of each (probe hits per request
    over the measured window, the CPU they cost, OpenTelemetry's beside), and the two loops that
    price lineage's costs alone: a probe hit per task created, and the reads at a message-start
    write."""
    stdout, report = quick_bench
    for text in ("verify: task lineage:", "run: task lineage:"):
        assert text in stdout, (text, stdout)
    assert {key for key in report["table"] if key.startswith("run/")} == {
        f"run/{v}" for v in ("untraced", "gym-tracer", "tracer-lineage", "tracer-inject", "otel")}
    for workload in ("verify", "run"):
        check_lineage_runs(report, workload)
    lineage = report["lineage"]
    # /run's three servers each create the tasks /verify's one does, and the agent server's
    # aiohttp client adds its own; its two calls are placed (by lineage among other evidence).
    assert lineage["verify"]["parents_by_lineage_per_req"] == 0, lineage["verify"]
    assert abs(lineage["run"]["parents_by_lineage_per_req"] - 2) < 0.02, lineage["run"]

    # The two costs alone: a probe hit per task created (the loop's own task, asyncio.run's,
    # too), in the one process; the reads at each message-start write.
    alone = report["lineage_alone"]
    assert all(1 <= hits < 1.01 for hits in alone["hits_per_task"]), alone["hits_per_task"]
    assert alone["lineage_processes"] == [1, 1, 1], alone
    for loop, modes in (("task_loop", {"untraced", "traced, --task-lineage off", "traced, --task-lineage on"}),
                        ("write_loop", {"traced, --task-lineage off", "traced, --task-lineage on"})):
        figures = alone[loop]
        assert set(figures["median_us"]) == modes, (loop, figures)
        assert all(len(runs) == 3 for runs in figures["runs"].values()), (loop, figures["runs"])
        assert all(value > 0 for value in figures["median_us"].values()), (loop, figures)
    assert alone["kernel_ns_per_hit"] > 0, alone
    for key in ("us_per_hit", "least_us_per_hit", "us_per_write", "least_us_per_write", "kernel_ns_per_write"):
        assert isinstance(alone[key], float) and abs(alone[key]) < float("inf"), (key, alone)
    for workload in ("verify", "run"):
        assert isinstance(lineage[workload]["expected_us"], float), lineage[workload]
    assert "task lineage alone" in stdout, stdout


def test_quick_bench_prices_injection_per_rollout(quick_bench):
    """The run workload with --inject-traceparent (one /run is one rollout; the lineage
    section runs it): a header in each of its two calls but the few whose handler's trace the
    kernel did not know yet (counted: a request root the lineage probe saw without a request),
    the task-lineage probe in every server (its hits per rollout those of tracer-lineage), the
    agent's eBPF time and the servers' CPU with it and without, and OpenTelemetry's beside."""
    stdout, report = quick_bench
    injection = report["injection"]
    assert "run with --inject-traceparent" in stdout, stdout
    [run] = [r for r in report["runs"] if (r["workload"], r["variant"]) == ("run", "tracer-inject")]
    assert run["one_span_per_request"] and run["agent_drops"] == 0, run
    assert run["lineage_processes"] == 3 and run["lineage_processes_off"] == 0, run
    # Per request sent (the warm-up's too): calls of the last ones sent may still be unwritten.
    written = injection["headers_per_rollout"] + injection["not_known_per_rollout"]
    assert abs(written - 2) < 0.02, injection
    assert injection["not_known_per_rollout"] < 0.1 and injection["failed"] == 0, injection
    assert abs(injection["probe_hits_per_rollout"] - HITS_PER_REQUEST["run"]) < 0.02, injection
    assert abs(injection["probe_hits_per_rollout_without"] - AUTO_HITS_PER_REQUEST["run"]) < 0.02, injection
    # Every traced run's eBPF time is taken: more programs run with the header's two.
    assert 0 < injection["bpf_us_per_rollout_without"] and 0 < injection["bpf_us_per_rollout"], injection
    assert injection["bpf_runs_per_rollout"] > injection["bpf_runs_per_rollout_without"], injection
    for key in ("delta_us", "otel_us", "total_us"):
        assert isinstance(injection[key], float) and abs(injection[key]) < float("inf"), (key, injection)


def test_quick_bench_prices_the_tls_uprobes(quick_bench):
    """The tls section, shortest form: an HTTPS client's CPU per call in every mode, the
    uprobes' cost as differences and ratios, the agent's eBPF time per call; the uprobes fired
    for the traced client (two plaintext records and one CLIENT span a call) and for no one
    else."""
    requests = TLS_REQUESTS
    stdout, report = quick_bench
    assert "the uprobes on the traced client" in stdout, stdout

    assert "HTTPS client calls" in report["text"]
    tls = report["tls_calls"]
    modes = {"untraced", "untraced, agent --no-tls", "untraced, uprobes per library", "untraced, uprobes per process",
             "traced, --no-tls", "traced, uprobes"}
    assert tls["requests"] == requests and tls["calls"] > requests, tls
    for figure in ("median_us_per_req", "least_us_per_req", "median_vs_untraced", "least_vs_untraced"):
        assert set(tls[figure]) == modes, (figure, tls[figure])
        assert all(value > 0 for value in tls[figure].values()), (figure, tls[figure])
    assert all(len(runs) == 1 for runs in tls["runs"].values()), tls["runs"]
    agent_modes = modes - {"untraced"}
    for figure in ("kernel_ns_per_req", "program_runs_per_req"):
        assert set(tls[figure]) == agent_modes, (figure, tls[figure])
        assert all(value > 0 for value in tls[figure].values()), (figure, tls[figure])
    # The uprobes run programs on every call of the client, traced or not: more runs per call
    # than the same agent without them.
    runs = tls["program_runs_per_req"]
    assert runs["traced, uprobes"] > runs["traced, --no-tls"], runs
    assert runs["untraced, uprobes per library"] > runs["untraced, agent --no-tls"], runs
    # Per process (the default), an untraced client never reaches them: what it runs of the
    # agent's programs is what an agent without uprobes runs (the syscall tracepoints). The
    # runs are counted host-wide (the agent's own reads of /proc and ELF files included), so
    # the bound is a fraction of what the uprobes add per library file, not zero.
    by_library = runs["untraced, uprobes per library"] - runs["untraced, agent --no-tls"]
    assert abs(runs["untraced, uprobes per process"] - runs["untraced, agent --no-tls"]) < by_library / 4, runs
    # Costs are differences of noisy figures: present and finite, not necessarily positive.
    for cost in ("uprobes_cost", "attached_cost", "attached_uprobes_cost", "process_scope_cost", "traced_cost"):
        for key in ("us", "least_us", "ratio", "least_ratio", "kernel_ns", "program_runs"):
            value = tls[cost][key]
            assert isinstance(value, float) and abs(value) < float("inf"), (cost, key, tls[cost])
    for cost in ("uprobes_cost", "attached_uprobes_cost"):
        assert tls[cost]["program_runs"] > 0 and "us_per_program_run" in tls[cost], tls[cost]
    counters = tls["agent_counters"]
    [traced] = counters["traced, uprobes"]
    assert traced["tls_records"] >= 2 * requests and traced["tls_libraries_probed"] >= 1, traced
    assert all(records >= 2 for records in tls["tls_records_per_call"]), tls["tls_records_per_call"]
    assert requests <= tls["client_spans"][0] <= tls["calls"], tls["client_spans"]
    for mode in ("untraced, uprobes per library", "untraced, uprobes per process"):
        [attached] = counters[mode]
        assert attached["tls_libraries_probed"] >= 1 and attached["tls_records"] == 0, (mode, attached)
    for mode in ("traced, --no-tls", "untraced, agent --no-tls"):
        [off] = counters[mode]
        assert off["tls_libraries_probed"] == 0 and off["tls_records"] == 0, (mode, off)


def test_quick_bench_prices_the_agent_user_space_alone(quick_bench):
    """The pipeline section, shortest form: the pipeline_cost example's Gym-shaped records
    through the real pipeline core, every request yielding its spans (SERVER + gym.verify per
    /verify; CLIENT, SERVER and gym.model per model call, each SERVER span stitched under its
    CLIENT span; the recorded real-Gym rollouts' 20 spans each) and a cost per request and per
    span."""
    stdout, report = quick_bench
    assert "agent user space alone" in stdout, stdout
    cost = report["pipeline_cost"]
    workloads = cost["workloads"]
    assert set(workloads) == {"verify", "cross-process", "real-gym"}, workloads
    assert workloads["verify"]["spans_per_request"] == 2 and workloads["verify"]["stitched_per_request"] == 0
    assert workloads["cross-process"]["spans_per_request"] == 3
    assert workloads["cross-process"]["stitched_per_request"] == 1
    # The recorded real-Gym run: 4 rollouts of 15 requests (7 served, 8 sent: seed_session,
    # the agent's /v1/responses, two model calls and their two upstream calls, get_weather,
    # verify) and the agent's 3 route harvests (not exported); 20 spans per rollout; the 6
    # calls from one traced server to another placed across processes in each.
    real = workloads["real-gym"]
    assert real["spans_per_request"] == 4 * 20 / (4 * 15 + 3), real
    assert real["stitched_per_request"] == 4 * 6 / (4 * 15 + 3), real
    for figures in workloads.values():
        for key in ("pipeline_ns_per_request", "encode_ns_per_span", "ns_per_span"):
            assert figures[key] > 0, (key, figures)
    by_in_flight = cost["stitch_ns_per_call_by_in_flight"]
    assert sorted(int(n) for n in by_in_flight) == [64, 1024, 4096, 16384], by_in_flight
    assert all(ns > 0 for ns in by_in_flight.values()), by_in_flight
    assert "the stitcher with N rollouts in flight" in stdout, stdout


def test_quick_bench_drives_gym_at_scale(quick_bench):
    """The gym-scale section, shortest form (256 rollouts in flight through the real nemo-gym
    servers, untraced then traced): every rollout answered, every one whole (one trace, the
    tree of a lone rollout), the traced run's spans exactly 20 per rollout, nothing lost in
    the kernel, and each figure of the table present."""
    stdout, report = quick_bench
    [step] = report["gym_scale"]
    untraced, traced = step["untraced"], step["traced"]
    assert step["rollouts"] == 256
    assert (untraced["failed"], traced["failed"]) == (0, 0), step
    assert (traced["whole"], traced["spans"], traced["kernel_lost"]) == (256, 256 * 20, 0), step
    for run in (untraced, traced):
        for key in ("rollouts_per_s", "p50_s", "p99_s", "servers_cpu_s"):
            assert run[key] > 0, (key, run)
    for key in ("agent_us_per_span", "agent_us_per_rollout", "agent_share_of_servers", "agent_peak_rss_mib"):
        assert traced[key] > 0, (key, traced)
    assert "gym-scale: real nemo-gym" in stdout and "256/256" in stdout, stdout


def test_quick_bench_measures_the_syscall_floors(quick_bench):
    """The tax sections, shortest form, with the floor programs: every figure present for
    each mode; the floor's capture delivered one record per read and write of the traced
    loop (and its stdin read), none lost; the agent lost nothing either. No figure is judged
    against another: on a noisy machine a floor can measure above the agent."""
    iterations = 50_000
    stdout, report = quick_bench
    assert "floors on this kernel" in stdout, stdout
    for mode, figures in report["host_tax"].items():
        assert len(figures["runs"]["empty programs"]) == 3, (mode, figures)
        assert figures["empty_programs_ns"] > 0, (mode, figures)
    traced = report["traced_tax"]
    assert set(traced["median_ns"]) == {"untraced", "agent, not traced", "traced", "empty programs",
                                        "capture floor"}, traced
    assert all(ns > 0 for ns in traced["median_ns"].values()), traced
    assert traced["events_lost"] == [0, 0, 0], traced
    for counts in traced["floor_counts"]:
        assert counts["lost"] == 0, counts
        assert counts["records"] == 4 * iterations + 1, counts  # + the "go" line read from stdin
    assert traced["capture_floor_kernel_ns_per_syscall"] > 0, traced
    for key in ("empty_programs_delta_ns", "capture_floor_delta_ns", "above_floor_ns"):
        assert isinstance(traced[key], float), (key, traced)
    # The goals block judges what these sections measured, each beside its floor, and says
    # which goals this run could not judge.
    goals = {g["goal"]: g for g in report["goals"]}
    for name in ("traced read/write of a small HTTP message", "untraced process, per syscall of an instrumented kind"):
        assert goals[name]["status"].startswith(("met", "not met")), goals[name]
        assert goals[name]["floor"], goals[name]
    # And says which it could not judge: the connections section is not in the quick run.
    assert goals["16,384 keep-alive connections tracked"]["status"] == "not measured in this run", goals
    assert "goals (issue #18) in this run" in stdout, stdout
