"""`cargo xtask demo`: start three Gym-shaped servers (agent, model, resources) the way Gym
launches them, let gym-tracer find them with `--discover gym`, drive a few rollouts through
the agent's /run, and show the spans and gym.* metrics the tracer printed."""

import argparse
import json
import os
import sys

from gym_launch import GymRun, drive_rollouts, run_body
from harness import Agent


def show_spans(spans):
    print(f"\ndemo: gym-tracer exported {len(spans)} spans, by rollout (no CLIENT spans or cross-process"
          " parents yet: each server's spans are their own trace):\n")
    print(f"  {'service.name':<26} {'kind':<8} {'span':<28} {'status':>6} {'rollout id':<12} {'ms':>7}")
    for span in spans:
        attributes = span["attributes"]
        duration_ms = (span["end_time_unix_nano"] - span["start_time_unix_nano"]) / 1e6
        print(f"  {span['resource']['service.name']:<26} {span['kind']:<8} {span['name']:<28} "
              f"{attributes.get('http.response.status_code', ''):>6} "
              f"{attributes.get('nemo.gym.rollout.id', '-'):<12} {duration_ms:>7.1f}")


def show_metrics(agent):
    print("\ndemo: gym.* metrics at shutdown:\n")
    for name in ("gym.rollout.duration_ms", "gym.verify.duration_ms", "gym.verify.calls",
                 "gym.verify.success_rate"):
        for point in agent.metric_points(name):
            value = point.get("count", point.get("value"))
            labels = ", ".join(f"{k}={v}" for k, v in point["attributes"].items())
            kind = "count" if "count" in point else "value"
            print(f"  {name:<26} {kind}={value:<8} {{{labels}}}")


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
        agent = Agent(discover=True).start()
        print(f"demo: gym-tracer started: {' '.join(agent.args)}")
        for server in run.servers.values():
            agent.wait_for_stderr(f"attached pid {server.pid}")
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

    pids = {server.pid for server in run.servers.values()}
    spans = [s for s in agent.spans() if s["resource"]["process.pid"] in pids]
    show_spans(sorted(spans, key=lambda s: (s["attributes"].get("nemo.gym.rollout.id", ""),
                                            s["start_time_unix_nano"], s["kind"] != "SERVER")))
    verify = next((s for s in spans if s["name"] == "gym.verify"), None)
    if verify:
        print("\ndemo: one gym.verify span as the JSON line it was printed as:\n")
        print(json.dumps(verify, indent=2))
    show_metrics(agent)
    print("\ndemo: agent's closing line:")
    print("  " + agent.stderr().strip().splitlines()[-1])
    names = {s["name"] for s in spans}
    wanted = {"POST /run", "gym.rollout", "POST /v1/responses", "gym.model.responses", "POST /verify", "gym.verify"}
    return 0 if wanted <= names else 1


if __name__ == "__main__":
    sys.exit(main())
