"""`cargo xtask demo`: start a Gym-shaped uvicorn server, attach gym-tracer to it by PID,
send it a little traffic, and show the spans the tracer printed."""

import argparse
import http.client
import json
import os
import sys
import time

from harness import Agent, UvicornServer


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--agent", required=True, help="path of the gym-tracer binary")
    args = parser.parse_args()
    os.environ["GYM_TRACER_BIN"] = args.agent

    server = UvicornServer().start()
    print(f"demo: Gym-shaped server (uvicorn, uvloop + httptools) on {server.base_url}, pid {server.pid}")
    agent = None
    try:
        agent = Agent([server.pid]).start()
        print(f"demo: gym-tracer attached: {' '.join(agent.args)}")
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        requests = [
            ("GET", "/health", None),
            ("POST", "/verify?api_key=never-exported", {"answer": "42"}),
            ("POST", "/verify", {"answer": "7"}),
            ("POST", "/fail", {}),
            ("GET", "/slow", None),
            ("GET", "/stream", None),
        ]
        for method, path, payload in requests:
            body = json.dumps(payload) if payload is not None else None
            connection.request(method, path, body=body, headers={"content-type": "application/json"})
            response = connection.getresponse()
            response.read()
            print(f"demo: {method} {path} -> {response.status}")
        connection.close()
        time.sleep(1.0)
    finally:
        if agent is not None:
            agent.stop()
        server.stop()

    spans = agent.spans()
    print(f"\ndemo: gym-tracer exported {len(spans)} spans:\n")
    print(f"  {'span':<16} {'status':>6} {'duration':>10}  trace_id")
    for span in spans:
        duration_ms = (span["end_time_unix_nano"] - span["start_time_unix_nano"]) / 1e6
        code = span["attributes"].get("http.response.status_code", "-")
        print(f"  {span['name']:<16} {code:>6} {duration_ms:>8.1f}ms  {span['trace_id']}  {span['status']}")
    if spans:
        print("\ndemo: one span as the JSON line it was printed as:\n")
        print(json.dumps(spans[0], indent=2))
    print("\ndemo: agent's closing line:")
    print("  " + agent.stderr().strip().splitlines()[-1])
    return 0 if len(spans) == 6 else 1


if __name__ == "__main__":
    sys.exit(main())
