"""Processes the integration tests and the demo drive: Gym-shaped uvicorn servers and the
real gym-tracer agent."""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TESTS_DIR = Path(__file__).resolve().parent
ROOT = TESTS_DIR.parent


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def agent_binary():
    path = Path(os.environ.get("GYM_TRACER_BIN", ROOT / "target" / "release" / "gym-tracer"))
    if not path.exists():
        raise RuntimeError(f"{path} does not exist: build it with `cargo xtask build --release`")
    return path


class UvicornServer:
    """One uvicorn process serving `app` (module:attr under tests/servers)."""

    def __init__(self, app="servers.gym_shaped:app", loop="uvloop", http="httptools", env=None):
        self.port = free_port()
        self.app, self.loop, self.http = app, loop, http
        self.env = dict(os.environ, PYTHONPATH=str(TESTS_DIR), **(env or {}))
        self.process = None

    def start(self):
        self.process = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", self.app, "--host", "127.0.0.1", "--port", str(self.port),
             "--loop", self.loop, "--http", self.http, "--no-access-log", "--log-level", "warning"],
            env=self.env, cwd=TESTS_DIR,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"uvicorn exited with {self.process.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.1)
        raise RuntimeError("uvicorn did not start listening within 20 s")

    @property
    def pid(self):
        return self.process.pid

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}"

    def stop(self):
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()


class Agent:
    """The real gym-tracer, attached by PID (or, with discover=True, finding Gym servers itself
    with `--discover gym`); JSON lines are read from its stdout."""

    def __init__(self, pids=(), extra_args=(), env=None, discover=False, metric_interval=3600):
        self.workdir = tempfile.mkdtemp(prefix="gym-tracer-test-")
        self.ready_file = Path(self.workdir) / "ready"
        self.stdout_path = Path(self.workdir) / "stdout.jsonl"
        self.stderr_path = Path(self.workdir) / "stderr.log"
        self.summary_path = Path(self.workdir) / "summary.json"
        args = [str(agent_binary()), "run", "--ready-file", str(self.ready_file),
                "--summary-file", str(self.summary_path),
                "--metric-interval", str(metric_interval)]
        for pid in pids:
            args += ["--pid", str(pid)]
        if discover:
            args += ["--discover", "gym"]
        args += list(extra_args)
        self.args = args
        clean_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM_"))}
        self.env = dict(clean_env, **(env or {}))
        self.process = None
        self.returncode = None

    def start(self, timeout=60):
        self.process = subprocess.Popen(
            self.args, env=self.env, stdout=open(self.stdout_path, "wb"), stderr=open(self.stderr_path, "wb")
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                return self
            if self.process.poll() is not None:
                raise RuntimeError(f"gym-tracer exited with {self.process.returncode}: {self.stderr()}")
            time.sleep(0.05)
        raise RuntimeError(f"gym-tracer not ready within {timeout} s: {self.stderr()}")

    def stop(self, timeout=30):
        """SIGINT, like Ctrl-C: the agent flushes and exits 0."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise RuntimeError(f"gym-tracer did not exit within {timeout} s of SIGINT")
        self.returncode = self.process.returncode
        return self

    def stderr(self):
        return self.stderr_path.read_text(errors="replace")

    def log(self):
        """The agent's log records: stderr is JSON lines (not a TTY), one object per record."""
        records = []
        for line in self.stderr().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                records.append({"level": "RAW", "message": line})  # e.g. a panic message
        return records

    def log_messages(self):
        return [record.get("message", "") for record in self.log()]

    def wait_for_routes(self, pid, timeout=15):
        """Waits until the agent has harvested `pid`'s route table: requests served before
        that are named from Gym's known routes only."""
        return self.wait_for_stderr(f"pid {pid}: ", timeout)

    def wait_for_stderr(self, text, timeout=15):
        """Waits until `text` appears in a message of the agent's log; returns that message."""
        deadline = time.monotonic() + timeout
        while True:
            for message in self.log_messages():
                if text in message:
                    return message
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise AssertionError(f"{text!r} not in gym-tracer's stderr within {timeout} s:\n{self.stderr()}")
            time.sleep(0.05)

    def stdout_text(self):
        return self.stdout_path.read_text(errors="replace")

    def lines(self):
        return [json.loads(line) for line in self.stdout_text().splitlines() if line.strip()]

    def spans(self):
        return [line for line in self.lines() if "span_id" in line]

    def metric_points(self, name):
        return [line for line in self.lines() if line.get("metric") == name]

    def summary(self):
        """Every counter the agent wrote to its --summary-file at exit, by name (plus
        `events_lost_by_cpu`, a list). Fails if the agent has not exited or wrote none."""
        if not self.summary_path.exists():
            raise AssertionError(f"gym-tracer wrote no summary file (has it stopped?):\n{self.stderr()}")
        summary = json.loads(self.summary_path.read_text())
        return dict(summary["counters"], events_lost_by_cpu=summary["events_lost_by_cpu"])


def post_verify(port, count, pause_s=0.0):
    """Sends `count` POST /verify requests over one keep-alive connection; each must be a 200."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for i in range(count):
        connection.request("POST", "/verify", body=json.dumps({"answer": str(i)}),
                           headers={"content-type": "application/json"})
        response = connection.getresponse()
        response.read()
        assert response.status == 200
        time.sleep(pause_s)
    connection.close()


def wait_for_health(port, timeout=30):
    """Polls GET /health on 127.0.0.1:`port` until it answers; returns the answer."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return http_get(f"http://127.0.0.1:{port}/health", timeout=1)
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"nothing answered GET /health on port {port} within {timeout} s")


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read()
