"""Fork following: the worker processes a traced server starts later (uvicorn --workers) are
traced from their first request, under the parent's identity."""

import collections
import subprocess
import sys
import time
from pathlib import Path

from harness import SUPPORT_DIR, free_port, http_get, server_env, wait_for_health

WORKERS = 2
REQUESTS = 40


def start_gated_uvicorn(port, gate):
    """A process that waits for `gate` to exist and then execs `uvicorn --workers`: the agent
    can attach to its pid before any worker exists, so only fork following can find them."""
    command = [sys.executable, "-m", "uvicorn", "servers.gym_shaped:app", "--host", "127.0.0.1", "--port", str(port),
               "--workers", str(WORKERS), "--no-access-log", "--log-level", "warning"]
    waiter = (f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.02)\n"
              f"os.execv({sys.executable!r}, {command!r})")
    env = {k: v for k, v in server_env().items() if not k.startswith(("OTEL_", "NEMO_GYM_"))}
    return subprocess.Popen([sys.executable, "-c", waiter], cwd=SUPPORT_DIR, env=env)



def test_workers_forked_after_attach_are_traced_with_the_parent_identity(tmp_path, agents):
    port, gate = free_port(), Path(tmp_path) / "go"
    launcher = start_gated_uvicorn(port, gate)
    try:
        agent = agents([launcher.pid], extra_args=["--server-name", "forked_server", "--server-type", "resources"])
        gate.touch()
        wait_for_health(port)  # one /health, served by some worker
        for i in range(REQUESTS):
            status, _ = http_get(f"http://127.0.0.1:{port}/health")
            assert status == 200
        time.sleep(1.0)
        agent.stop()
    finally:
        launcher.terminate()
        launcher.wait(15)

    adopted = [line for line in agent.stderr().splitlines() if f"(child of pid {launcher.pid})" in line]
    assert adopted, agent.stderr()
    assert all("as forked_server (resources_servers)" in line for line in adopted), adopted
    spans = [s for s in agent.spans() if s["name"] == "GET /health" and s["kind"] == "SERVER"]
    # Every request was served by a worker the agent only knew of through fork events.
    assert len(spans) == REQUESTS + 1, agent.stderr()
    by_pid = collections.Counter(span["resource"]["process.pid"] for span in spans)
    assert launcher.pid not in by_pid
    for span in spans:
        resource = span["resource"]
        assert resource["process.parent_pid"] == launcher.pid
        assert resource["service.name"] == "nemo/forked_server"
        assert resource["nemo.gym.server.name"] == "forked_server"
        assert resource["nemo.gym.server.type"] == "resources_servers"
        assert span["attributes"]["nemo.gym.server.name"] == "forked_server"
    assert agent.summary()["forks_followed"] >= WORKERS
