"""Records the agent on the real nemo-gym servers (`gym-tracer run --record`) for the core's
replay test and `pipeline_cost` (tracer-userspace/src/pipeline/recording.rs): Gym's default
shape (simple_agent, example_single_tool_call, openai_model), ROLLOUTS rollouts at once, each
body ~11 KB with its `_ng_*` ids in its tail only (as example_multi_step's rows), the agent
`--discover gym` with its defaults. Written to OUT once every span is out.

    GYM_TRACER_BIN=target/release/gym-tracer target/venv/bin/python \\
        tests/support/real_gym/record.py tracer-userspace/testdata/real_gym_rollouts.rec

Run it again whenever the kernel records' layout changes (the replay test says so)."""

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parent.parent)]

from harness import Agent  # noqa: E402
from real_gym.launch import RealGymRun  # noqa: E402
from test_real_gym import gym_venv  # noqa: E402

ROLLOUTS = 4
SPANS_PER_ROLLOUT = 20
BODY_BYTES = 11_000
UPSTREAM_DELAY_S = 0.5


def main(out):
    out = Path(out).absolute()
    run = RealGymRun(gym_venv(), upstream_delay_s=UPSTREAM_DELAY_S)
    agent = None
    try:
        run.start()
        agent = Agent(discover=True, extra_args=["--record", str(out)])
        agent.start(timeout=120)
        for name, pid in run.pids.items():
            agent.wait_for_stderr(f"attached pid {pid} as {name}", timeout=60)
            agent.wait_for_routes(pid, timeout=60)
        results = run.drive_rollouts(ROLLOUTS, pad_to=BODY_BYTES, timeout=300)
        failed = [r for r in results if r.get("status") != 200]
        if failed:
            raise SystemExit(f"{len(failed)} rollouts failed: {failed[:2]}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(agent.spans()) < ROLLOUTS * SPANS_PER_ROLLOUT:
            time.sleep(0.2)
        agent.stop()
        print(f"{out}: {out.stat().st_size} bytes, {len(agent.spans())} spans exported")
    finally:
        if agent and agent.process and agent.process.poll() is None:
            agent.stop()
        run.stop()


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    main(sys.argv[1])
