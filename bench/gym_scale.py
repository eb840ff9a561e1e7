"""`--only gym-scale`: Gym's own workload, not a stand-in. The real nemo-gym servers
(simple_agent, example_single_tool_call, openai_model in front of the canned upstream answering
each model call after UPSTREAM_DELAY_S), Gym's telemetry off, driven with N rollouts in flight
at once (tests/support/real_gym/drive.py: one aiohttp session, one connection per rollout in
flight, ~11 KB bodies), untraced and traced by gym-tracer (`--discover gym`, its defaults) side
by side, each on servers of its own. Per step:
- rollouts whole: rollouts whose trace is exactly the tree of a rollout run alone
  (test_real_gym.EXPECTED_TREE), no span of another rollout in it;
- Gym's rollouts/s (N over the batch's wall time, first POST to last answer) and p50/p99 rollout
  latency, traced vs untraced;
- the agent's CPU (user + system, from its start to its exit, so its whole export) per span and
  per rollout, and as a fraction of the Gym servers' CPU over the batch;
- the agent's peak RSS (VmHWM) and the records the kernel lost (events_lost_in_kernel).
"""

import os
import statistics
import sys
import time
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent.parent / "tests"
sys.path.insert(0, str(TESTS_DIR))

STEPS = (256, 1024, 4096)
QUICK_STEPS = (256,)
UPSTREAM_DELAY_S = 1.0
BODY_BYTES = 11_000
CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid):
    """utime + stime of a live process, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def vm_hwm_kib(pid):
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return None


def lines_in(path):
    """JSON lines written so far (one span each)."""
    with open(path, "rb") as file:
        return sum(chunk.count(b"\n") for chunk in iter(lambda: file.read(1 << 20), b""))


def percentile(values, q):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def whole_rollouts(spans, ids, by_pid):
    """How many of the rollouts `ids` are one trace holding exactly a lone rollout's tree."""
    from gym_expect import rollout_trace_id
    from test_real_gym import EXPECTED_TREE, canonical, tree_shape

    by_trace = {}
    for span in spans:
        by_trace.setdefault(span["trace_id"], []).append(span)
    want = [canonical(EXPECTED_TREE)]
    whole = 0
    for rollout_id in ids:
        members = by_trace.get(rollout_trace_id(rollout_id), [])
        foreign = any(s["attributes"].get("nemo.gym.rollout.id") not in (None, rollout_id) for s in members)
        whole += not foreign and tree_shape(members, by_pid) == want
    return whole


def one_run(n, traced, binary_env):
    """N rollouts at once on fresh servers, traced or not; the figures of the run."""
    from harness import Agent
    from real_gym.launch import RealGymRun
    from test_real_gym import gym_venv

    run = RealGymRun(gym_venv(), upstream_delay_s=UPSTREAM_DELAY_S)
    agent = None
    try:
        run.start()
        pids = dict(run.pids)
        if traced:
            agent = Agent(discover=True, env=binary_env)
            agent.start()
            for name, pid in pids.items():
                agent.wait_for_stderr(f"attached pid {pid} as {name}", timeout=30)
                agent.wait_for_routes(pid, timeout=30)
            agent_cpu_before = cpu_seconds(agent.process.pid)
        servers_before = sum(cpu_seconds(pid) for pid in pids.values())
        results = run.drive_rollouts(n, pad_to=BODY_BYTES, timeout=1800)
        servers_cpu = sum(cpu_seconds(pid) for pid in pids.values()) - servers_before
        figures = {"rollouts": n, "traced": traced, "servers_cpu_s": servers_cpu}
        failed = [r for r in results if (r["status"], r["reward"]) != (200, 1.0)]
        figures["failed"] = len(failed)
        wall = (max(r["end_ns"] for r in results) - min(r["start_ns"] for r in results)) / 1e9
        latencies = [(r["end_ns"] - r["start_ns"]) / 1e9 for r in results]
        figures.update(rollouts_per_s=n / wall, p50_s=statistics.median(latencies), p99_s=percentile(latencies, 0.99),
                       wall_s=wall)
        if traced:
            expected = n * 20
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and lines_in(agent.stdout_path) < expected:
                time.sleep(1.0)
            time.sleep(1.0)
            pid = agent.process.pid
            figures["agent_cpu_s"] = cpu_seconds(pid) - agent_cpu_before
            figures["agent_peak_rss_mib"] = (vm_hwm_kib(pid) or 0) / 1024
            agent.stop()
            summary = agent.summary()
            spans = [s for s in agent.spans() if s["resource"].get("process.pid") in set(pids.values())]
            by_pid = {pid: name for name, pid in pids.items()}
            ids = [f"{r['task_index']}-{r['rollout_index']}" for r in results]
            figures.update(
                spans=len(spans), whole=whole_rollouts(spans, ids, by_pid),
                kernel_lost=summary.get("events_lost_in_kernel"),
                agent_us_per_span=figures["agent_cpu_s"] * 1e6 / max(1, len(spans)),
                agent_us_per_rollout=figures["agent_cpu_s"] * 1e6 / n,
                agent_share_of_servers=figures["agent_cpu_s"] / servers_cpu if servers_cpu else None,
            )
        return figures
    finally:
        if agent is not None and agent.process is not None and agent.process.poll() is None:
            agent.stop()
        run.stop()


def gym_scale(quick, steps=None):
    """Every step (`steps`, else STEPS, or QUICK_STEPS when quick), untraced then traced; the
    figures by step."""
    all_cpus = set(range(os.cpu_count() or 1))
    mine = os.sched_getaffinity(0)
    os.sched_setaffinity(0, all_cpus)  # Gym's servers use every CPU, as in production
    env = {"GYM_TRACER_BIN": os.environ.get("GYM_TRACER_BIN", "")}
    ns = steps or (QUICK_STEPS if quick else STEPS)
    steps = []
    try:
        for n in ns:
            started = time.monotonic()
            untraced = one_run(n, False, env)
            traced = one_run(n, True, env)
            steps.append({"rollouts": n, "untraced": untraced, "traced": traced,
                          "seconds": round(time.monotonic() - started, 1)})
            print(f"  gym-scale {n}: whole {traced['whole']}/{n}, {untraced['rollouts_per_s']:.1f} vs "
                  f"{traced['rollouts_per_s']:.1f} rollouts/s, agent {traced['agent_us_per_span']:.1f} µs/span, "
                  f"peak RSS {traced['agent_peak_rss_mib']:.0f} MiB ({steps[-1]['seconds']:.0f} s)", flush=True)
    finally:
        os.sched_setaffinity(0, mine)
    return steps


def render(steps, pipeline_cost=None):
    """The gym-scale table; with the pipeline section's figure for the recorded real-Gym
    rollouts (`pipeline_cost` real-gym: the same traffic fed to the core alone), how far the
    whole agent is above it."""
    lines = [
        f"gym-scale: real nemo-gym (simple_agent, example_single_tool_call, openai_model; upstream answering after "
        f"{UPSTREAM_DELAY_S:.0f} s), N rollouts in flight at once, untraced vs traced (gym-tracer --discover gym)",
        f"{'in flight':>9} {'whole':>11} {'rollouts/s':>17} {'p50 s':>13} {'p99 s':>13} {'agent µs':>9} "
        f"{'agent ms':>9} {'agent/Gym':>9} {'peak RSS':>9} {'lost':>5}",
        f"{'':>9} {'':>11} {'untraced traced':>17} {'untr. traced':>13} {'untr. traced':>13} {'/span':>9} "
        f"{'/rollout':>9} {'CPU':>9} {'MiB':>9} {'':>5}",
    ]
    for step in steps:
        u, t = step["untraced"], step["traced"]
        lines.append(
            f"{step['rollouts']:>9} {str(t['whole']) + '/' + str(step['rollouts']):>11} "
            f"{u['rollouts_per_s']:>8.1f} {t['rollouts_per_s']:>8.1f} {u['p50_s']:>6.1f} {t['p50_s']:>6.1f} "
            f"{u['p99_s']:>6.1f} {t['p99_s']:>6.1f} {t['agent_us_per_span']:>9.1f} "
            f"{t['agent_us_per_rollout'] / 1000:>9.2f} {100 * (t['agent_share_of_servers'] or 0):>8.1f}% "
            f"{t['agent_peak_rss_mib']:>9.0f} {t['kernel_lost']:>5}")
        failed = u["failed"] + t["failed"]
        if failed:
            lines.append(f"{'':>9} ({u['failed']} untraced and {t['failed']} traced rollouts did not answer 200/1.0)")
    alone = ((pipeline_cost or {}).get("workloads") or {}).get("real-gym")
    if alone:
        floor_us = alone["ns_per_span"] / 1000
        ratios = ", ".join(f"{step['rollouts']}: {step['traced']['agent_us_per_span'] / floor_us:.1f}x"
                           for step in steps if step["traced"].get("agent_us_per_span"))
        lines.append(f"the same traffic recorded and fed to the pipeline core alone (pipeline_cost real-gym: no "
                     f"kernel, no metrics, OTLP encoding): {floor_us:.2f} µs per span; the agent above it by "
                     f"in flight: {ratios}")
    return "\n".join(lines)
