"""`cargo xtask demo`: start three Gym-shaped servers (agent, model, resources) the way Gym
launches them, let gym-tracer find them with `--discover gym`, drive a few rollouts through
the agent's /run, and show what the tracer printed with `--output tree`: one tree per
rollout across the three processes, then the gym.* metrics at shutdown.

With `--ui` (`cargo xtask demo --ui`), Arize Phoenix runs on 127.0.0.1:6006 (another free
port if that one is taken) and the agent also sends it the spans, configured as a user
would: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT and OTEL_TRACES_EXPORTER=otlp,console (Phoenix
takes no metrics; they stay in the terminal). Each rollout's trace URL is printed once
Phoenix has it, and Phoenix stays up until Enter or Ctrl-C."""

import argparse
import json
import os
import socket
import sys

from gym_expect import gym_rollout_id, rollout_trace_id
from gym_launch import GymRun, drive_rollouts, run_body
from harness import Agent, wait_until


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agent", required=True, help="path of the gym-tracer binary")
    parser.add_argument("--ui", action="store_true", help="also show the rollouts in Arize Phoenix")
    args = parser.parse_args()
    os.environ["GYM_TRACER_BIN"] = args.agent

    run = GymRun()
    agent = phoenix = None
    env = {}
    try:
        if args.ui:
            phoenix = start_phoenix()
            env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": phoenix.traces_url, "OTEL_TRACES_EXPORTER": "otlp,console"}
        run.start()
        for server in run.servers.values():
            print(f"demo: {server.type} server {server.name!r} on {server.base_url}, pid {server.pid}")
        agent = Agent(discover=True, extra_args=["--output", "tree", "--log-format", "text"], env=env).start()
        if env:
            print(f"demo: with {' '.join(f'{k}={v}' for k, v in env.items())}")
        print(f"demo: gym-tracer started: {' '.join(agent.args)}")
        for server in run.servers.values():
            agent.wait_for_routes(server.pid)
        bodies = [
            run_body(0, 0),                                   # id "0-0" from the body
            run_body(0, 1, attempt=2),                        # "0-1-a2"
            run_body(rollout_id="demo-rollout", reward=0.0),  # explicit id; reward 0 still succeeds
            run_body(1, 0, fail=True),                        # the verifier raises: a 500
        ]
        sent_rollouts = drive_rollouts(run, bodies)
        for sent in sent_rollouts:
            print(f"demo: POST /run {json.dumps({k: v for k, v in sent.body.items() if k.startswith('_ng')})}"
                  f" -> {sent.status}")
    finally:
        if agent is not None:
            agent.stop()
        run.stop()
        if phoenix is not None and sys.exc_info()[0] is not None:
            phoenix.stop()

    output = agent.stdout_text()
    print("\ndemo: what gym-tracer printed (--output tree):\n")
    print(output)
    print("demo: what gym-tracer said when it stopped (stderr):\n")
    stderr = agent.stderr()
    print(stderr[stderr.rfind("gym-tracer stopped after"):])
    wanted = ["POST /run", "gym.rollout", "HTTP POST", "POST /v1/responses", "gym.model.responses",
              "POST /verify", "gym.verify", "metric gym.verify.calls"]
    printed = all(text in output for text in wanted)
    if phoenix is None:
        return 0 if printed else 1
    try:
        shown = show_in_phoenix(phoenix, [gym_rollout_id(sent.body) for sent in sent_rollouts])
    finally:
        phoenix.stop()
    return 0 if printed and shown else 1


def start_phoenix():
    from trace_ui import Phoenix

    with socket.socket() as probe:
        port = 6006 if probe.connect_ex(("127.0.0.1", 6006)) != 0 else None
    phoenix = Phoenix(port=port)
    print(f"demo: starting Arize Phoenix on {phoenix.base_url} (its data in {phoenix.workdir}; "
          "20-30 s on a fresh database)")
    return phoenix.start()


def show_in_phoenix(phoenix, rollout_ids):
    """Prints where each rollout's trace opens once Phoenix has it (its trace id is derived from
    the rollout id: docs/how-it-works.md, "Across hosts"), then holds Phoenix up for the person reading."""
    print(f"\ndemo: the rollouts in Arize Phoenix ({phoenix.base_url}, project `default`):")
    ok = True
    for rollout in rollout_ids:
        trace_id = rollout_trace_id(rollout)
        try:
            spans = wait_until(lambda: phoenix.spans(trace_id), 15, f"rollout {rollout}'s trace in Phoenix")
        except AssertionError as error:
            print(f"  rollout {rollout}: {error}")
            ok = False
            continue
        kinds = sorted({s["span_kind"] for s in spans} - {"UNKNOWN"})
        print(f"  rollout {rollout:>14}: {len(spans):2} spans ({', '.join(kinds)})  {phoenix.trace_url(trace_id)}")
    if sys.stdin.isatty():
        try:
            input("\ndemo: Phoenix is up; open the links above. Press Enter (or Ctrl-C) to stop it. ")
        except (EOFError, KeyboardInterrupt):
            pass
    return ok


if __name__ == "__main__":
    sys.exit(main())
