"""`cargo xtask demo`: start three Gym-shaped servers (agent, model, resources) the way Gym
launches them, let gym-tracer find them with `--discover gym`, drive a few rollouts through
the agent's /run, and show what the tracer printed with `--output tree`: one tree per
rollout across the three processes, then the gym.* metrics at shutdown."""

import argparse
import json
import os
import sys

from gym_launch import GymRun, drive_rollouts, run_body
from harness import Agent


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agent", required=True, help="path of the gym-tracer binary")
    args = parser.parse_args()
    os.environ["GYM_TRACER_BIN"] = args.agent

    run = GymRun()
    agent = None
    try:
        run.start()
        for server in run.servers.values():
            print(f"demo: {server.type} server {server.name!r} on {server.base_url}, pid {server.pid}")
        agent = Agent(discover=True, extra_args=["--output", "tree"]).start()
        print(f"demo: gym-tracer started: {' '.join(agent.args)}")
        for server in run.servers.values():
            agent.wait_for_routes(server.pid)
        bodies = [
            run_body(0, 0),                                   # id "0-0" from the body
            run_body(0, 1, attempt=2),                        # "0-1-a2"
            run_body(rollout_id="demo-rollout", reward=0.0),  # explicit id; reward 0 still succeeds
            run_body(1, 0, fail=True),                        # the verifier raises: a 500
        ]
        for sent in drive_rollouts(run, bodies):
            print(f"demo: POST /run {json.dumps({k: v for k, v in sent.body.items() if k.startswith('_ng')})}"
                  f" -> {sent.status}")
    finally:
        if agent is not None:
            agent.stop()
        run.stop()

    output = agent.stdout_text()
    print("\ndemo: what gym-tracer printed (--output tree):\n")
    print(output)
    print("demo: agent's closing line:")
    print("  " + agent.log_messages()[-1])
    wanted = ["POST /run", "gym.rollout", "HTTP POST", "POST /v1/responses", "gym.model.responses",
              "POST /verify", "gym.verify", "metric gym.verify.calls"]
    return 0 if all(text in output for text in wanted) else 1


if __name__ == "__main__":
    sys.exit(main())
