"""`--only gym-instructions`: the agent's user-space instructions per rollout on Gym's own
workload, counted by callgrind, which the machine's noise does not move (issue #48). The real
nemo-gym servers as in gym-scale (simple_agent, example_single_tool_call, openai_model, the
upstream answering after 1 s, ~11 KB bodies), N rollouts in flight; the agent (`--discover gym`,
its defaults, JSON lines out) runs under `valgrind --tool=callgrind`, its counters zeroed once
it has attached to the three servers and dumped once every span is out, so start-up and
shutdown are left out. Reported: the total and each stage's inclusive count, per rollout.

Under callgrind the agent runs ~50x slower; at the default 256 rollouts it keeps up (the
records wait in the ring buffer, `events_lost_in_kernel` is reported and must be 0 for the
figure to stand)."""

import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import gym_scale

ROLLOUTS = 256

# Each stage: the functions whose inclusive counts make it up (as callgrind names them).
STAGES = (
    ("pipeline: records in, spans out", ("gym_tracer::pipeline::Pipeline<M>::handle_record",)),
    ("  HTTP heads and bodies", ("gym_tracer::reassembly::http::MessageStream::feed",)),
    ("  rollout ids from bodies", ("gym_tracer::gym::rollout_id::rollout_id_from_body_tail",
                                   "gym_tracer::gym::rollout_id::rollout_id_from_run_body")),
    ("  GenAI model and usage from bodies", ("gym_tracer::model::genai::top_level_model",
                                             "gym_tracer::model::genai::usage")),
    ("  spans, stitching, metrics", ("gym_tracer::pipeline::Pipeline<M>::after_table",)),
    ("insight: whole rollouts", ("gym_tracer::pipeline::Pipeline<M>::deliver",)),
    ("export: JSON lines", ("gym_tracer::export::run_span_export::{{closure}}",)),
)

LINE = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+(?:\S+?):(.+?) \[(.+)\]\s*$")


def inclusive_counts(dump):
    """Function -> its inclusive instruction count in the dump (the agent's own symbols)."""
    listing = subprocess.run(["callgrind_annotate", "--inclusive=yes", "--threshold=100", "--auto=no", str(dump)],
                             capture_output=True, text=True, check=True).stdout
    counts = {"PROGRAM TOTALS": 0}
    for line in listing.splitlines():
        if line.rstrip().endswith("PROGRAM TOTALS"):
            counts["PROGRAM TOTALS"] = int(line.split()[0].replace(",", ""))
            continue
        match = LINE.match(line)
        if match and ".so" not in match.group(3):  # the agent binary, not a library
            name = match.group(2)
            counts[name] = max(counts.get(name, 0), int(match.group(1).replace(",", "")))
    return counts


def gym_instructions(rollouts=ROLLOUTS):
    """One traced run under callgrind; the figures per rollout, or why there are none."""
    if not (shutil.which("valgrind") and shutil.which("callgrind_control")):
        return {"skipped": "valgrind is not installed (apt-get install valgrind)"}
    from harness import Agent
    from real_gym.launch import RealGymRun
    from test_real_gym import gym_venv

    run = RealGymRun(gym_venv(), upstream_delay_s=gym_scale.UPSTREAM_DELAY_S)
    agent = None
    try:
        run.start()
        pids = dict(run.pids)
        dumps_dir = Path(tempfile.mkdtemp(prefix="gym-instructions-"))
        agent = Agent(discover=True, wrapper=("valgrind", "--tool=callgrind",
                                              f"--callgrind-out-file={dumps_dir}/callgrind.%p"))
        agent.start(timeout=300)
        for name, pid in pids.items():
            agent.wait_for_stderr(f"attached pid {pid} as {name}", timeout=300)
            agent.wait_for_routes(pid, timeout=300)
        pid = agent.process.pid
        subprocess.run(["callgrind_control", "-z", str(pid)], check=True, capture_output=True)
        results = run.drive_rollouts(rollouts, pad_to=gym_scale.BODY_BYTES, timeout=1800)
        expected = rollouts * 20
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and gym_scale.lines_in(agent.stdout_path) < expected:
            time.sleep(1.0)
        time.sleep(1.0)
        subprocess.run(["callgrind_control", "-d", str(pid)], check=True, capture_output=True)
        agent.stop(timeout=300)
        summary = agent.summary()
        dumps = sorted(dumps_dir.glob(f"callgrind.{pid}.*"))
        counts = inclusive_counts(dumps[0])
        spans = gym_scale.lines_in(agent.stdout_path)
        failed = sum((r["status"], r["reward"]) != (200, 1.0) for r in results)
        return {
            "rollouts": rollouts, "spans": spans, "failed": failed,
            "kernel_lost": summary.get("events_lost_in_kernel"),
            "total_per_rollout": counts["PROGRAM TOTALS"] / rollouts,
            "stages_per_rollout": [
                (label, sum(counts.get(name, 0) for name in names) / rollouts) for label, names in STAGES],
        }
    finally:
        if agent is not None and agent.process is not None and agent.process.poll() is None:
            agent.stop(timeout=300)
        run.stop()


def render(figures):
    """The instructions table."""
    if "skipped" in figures:
        return f"gym-instructions: skipped: {figures['skipped']}"
    lines = [
        f"gym-instructions: the agent's instructions per rollout on real nemo-gym (callgrind; "
        f"{figures['rollouts']} rollouts in flight, {figures['spans']} spans, "
        f"{figures['kernel_lost']} records lost in the kernel, {figures['failed']} rollouts failed)",
        f"  {'whole agent (measured window)':<40} {figures['total_per_rollout'] / 1000:>9.0f} k",
    ]
    for label, count in figures["stages_per_rollout"]:
        lines.append(f"  {label:<40} {count / 1000:>9.0f} k")
    return "\n".join(lines)
