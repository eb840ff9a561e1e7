"""Processes the integration tests, the demo and the bench drive: Gym-shaped uvicorn servers
and the real gym-tracer agent; and the one way every test waits for something."""

import http.client
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from span_ids import shared_span_ids

# The support programs; the Gym-shaped servers are imported from here as `servers.*`, so
# every process that runs one gets it as PYTHONPATH and cwd.
SUPPORT_DIR = Path(__file__).resolve().parent
TESTS_DIR = SUPPORT_DIR.parent
ROOT = TESTS_DIR.parent


def wait_until(condition, timeout, what, interval=0.1):
    """Polls `condition()` until it returns something truthy, and returns that. Raises an
    AssertionError naming `what` (a string, or a callable giving one, e.g. the last state
    seen) after `timeout` seconds: a test that waits for something says what never came."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout} s: {what() if callable(what) else what}")
        time.sleep(interval)


def wait_listening(process, port, what, timeout=30, describe_exit=lambda: ""):
    """Waits until `process` accepts TCP connections on 127.0.0.1:`port`: a bare connect, no
    HTTP request, so readiness leaves no span behind. Fails at once if the process exits."""

    def listening():
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}{describe_exit()}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False

    wait_until(listening, timeout, f"{what} listening on port {port}", interval=0.05)


def server_env(env=None):
    """The environment a Gym-shaped server runs in: ours, with the support dir importable."""
    return {**os.environ, "PYTHONPATH": str(SUPPORT_DIR), **(env or {})}


def interrupt(process, timeout):
    """SIGINT, as Ctrl-C, then up to `timeout` s for `process` to exit; killed if it does not.
    Returns whether it exited by itself."""
    if process.poll() is not None:
        return True
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout)
        return True
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return False


# Listening ports are chosen from here up to the kernel's ephemeral range.
LISTEN_PORTS_FROM = 10000


def ephemeral_ports_from():
    """The first port of `net.ipv4.ip_local_port_range`."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_ports(n):
    """n distinct ports nothing listens on, below the kernel's ephemeral range. A port the
    kernel hands out for bind(0) is ephemeral: any outgoing connection (wrk, a /run fan-out,
    an exporter) may take it between this check and the server's own bind, which failed runs
    with "address already in use" under load. Below the range, only another listener can."""
    high = ephemeral_ports_from()
    if high - LISTEN_PORTS_FROM < 1000:
        raise RuntimeError(f"ip_local_port_range starts at {high}: no room for listening ports below it")
    chosen, held = [], []
    try:
        while len(chosen) < n:
            port = random.randrange(LISTEN_PORTS_FROM, high)
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            held.append(s)
            chosen.append(port)
        return chosen
    finally:
        for s in held:
            s.close()


def free_port():
    return free_ports(1)[0]


def agent_binary():
    path = Path(os.environ.get("GYM_TRACER_BIN", ROOT / "target" / "release" / "gym-tracer"))
    if not path.exists():
        raise RuntimeError(f"{path} does not exist: build it with `cargo xtask build --release`")
    return path


def example_binary(name):
    """A release example of tracer-userspace the bench runs (`cargo xtask test` builds them and
    names each in GYM_<NAME>_BIN): `pipeline_cost` (the pipeline section), `syscall_floor`
    (the floor rows of the tax sections)."""
    default = ROOT / "target" / "release" / "examples" / name
    path = Path(os.environ.get(f"GYM_{name.upper()}_BIN", default))
    if not path.exists():
        raise RuntimeError(f"{path} does not exist: build it with "
                           f"`cargo build --release -p tracer-userspace --example {name}`")
    return path


class UvicornServer:
    """One uvicorn process serving `app` (module:attr under support/servers); `extra_args` go
    to uvicorn (e.g. a `--backlog` for a flood of connections); `python` runs it (another
    venv's, for another CPython minor)."""

    def __init__(self, app="servers.gym_shaped:app", loop="uvloop", http="httptools", env=None, extra_args=(),
                 python=sys.executable):
        self.port = free_port()
        self.app, self.loop, self.http = app, loop, http
        self.env = server_env(env)
        self.extra_args = list(extra_args)
        self.python = str(python)
        self.process = None

    def command(self):
        return [self.python, "-m", "uvicorn", self.app, "--host", "127.0.0.1", "--port", str(self.port),
                "--loop", self.loop, "--http", self.http, "--no-access-log", "--log-level", "warning",
                *self.extra_args]

    def start(self, spawn=subprocess.Popen):
        """Starts it with `spawn` (a Popen-like callable) and waits until it listens."""
        self.process = spawn(self.command(), env=self.env, cwd=SUPPORT_DIR)
        wait_listening(self.process, self.port, f"uvicorn ({self.app})", timeout=20)
        return self

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
                self.process.wait()


def wait_accepted(port, timeout=20):
    """Waits until the server on `port` has accepted every connection queued on its listening
    socket (a listener's rx_queue in /proc/net/tcp is its accept queue)."""
    local = f":{port:04X}"

    def queue_empty():
        with open("/proc/net/tcp") as table:
            queued = [int(fields[4].split(":")[1], 16) for fields in (line.split() for line in table)
                      if fields[1].endswith(local) and fields[3] == "0A"]
        return bool(queued) and queued[0] == 0

    wait_until(queue_empty, timeout, f"the server on port {port} accepting its queue", interval=0.02)


def rss_kib(pid, field="VmRSS"):
    """A memory figure of /proc/PID/status, in KiB: VmRSS, or e.g. RssAnon (the heap alone,
    without the mapped binary and the ring buffer, whose pages are all resident from the
    start)."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


class Agent:
    """The real gym-tracer, attached by PID (or, with discover=True, finding Gym servers itself
    with `--discover gym`); JSON lines are read from its stdout. `binary`: another build than
    GYM_TRACER_BIN's (the installed wheel's). `wrapper`: a command prefix it
    runs under (e.g. `nsenter --net=... --`, another host's network namespace); the prefix
    must exec gym-tracer, so that the pid is gym-tracer's and `stop()` (SIGINT) reaches it."""

    def __init__(self, pids=(), extra_args=(), env=None, discover=False, metric_interval=3600, wrapper=(),
                 binary=None):
        self.workdir = tempfile.mkdtemp(prefix="gym-tracer-test-")
        self.ready_file = Path(self.workdir) / "ready"
        self.stdout_path = Path(self.workdir) / "stdout.jsonl"
        self.stderr_path = Path(self.workdir) / "stderr.log"
        self.summary_path = Path(self.workdir) / "summary.json"
        args = [*wrapper, str(binary or agent_binary()), "run", "--ready-file", str(self.ready_file),
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

        def ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"gym-tracer exited with {self.process.returncode}: {self.stderr()}")
            return self.ready_file.exists()

        wait_until(ready, timeout, lambda: f"gym-tracer ready: {self.stderr()}", interval=0.05)
        return self

    def stop(self, timeout=30):
        """SIGINT, like Ctrl-C: the agent flushes and exits 0."""
        if not interrupt(self.process, timeout):
            raise RuntimeError(f"gym-tracer did not exit within {timeout} s of SIGINT")
        self.returncode = self.process.returncode
        return self

    def close(self):
        """For fixture teardown: an agent the test left running is stopped (killed if it does
        not exit), so no test leaks one; its stderr is printed, which pytest shows when the
        test failed. Then the run-wide check every test gets: no two spans it exported share a
        span id (the checkers key spans by id, and would merge them)."""
        if self.process is None:
            return
        try:
            if self.process.poll() is None:
                self.stop()
        except RuntimeError as error:
            print(error)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            print(f"gym-tracer {' '.join(self.args)}\nexit status {self.process.returncode}; stderr:\n"
                  f"{self.stderr()[-20000:]}")
        try:
            spans = self.spans()
        except (OSError, ValueError) as error:  # no stdout, or a line that is no JSON: the test's to judge
            print(f"gym-tracer's spans unreadable, span ids not checked: {error}")
            return
        shared = shared_span_ids(spans)
        if shared:
            raise AssertionError(f"gym-tracer exported {len(shared)} span ids on more than one span:\n"
                                 + "\n".join(shared[:20]))

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
        # "pid N: K route templates from its /openapi.json", or "pid N: /openapi.json: <error>";
        # other lines also start with "pid N: " (the Python runtime line comes first).
        return self.wait_for_stderr(f"pid {pid}: ", timeout, also="/openapi.json")

    def wait_for_stderr(self, text, timeout=15, also=""):
        """Waits until `text` (and `also`) appear in a message of the agent's log; returns that
        message."""

        def found():
            message = next((m for m in self.log_messages() if text in m and also in m), None)
            if message is None and self.process.poll() is not None:
                raise AssertionError(f"gym-tracer exited before logging {text!r}:\n{self.stderr()}")
            return message

        return wait_until(found, timeout, lambda: f"{text!r} in gym-tracer's stderr:\n{self.stderr()}",
                          interval=0.05)

    def wait_for_spans(self, count, timeout=15, spans=None):
        """Waits until `spans()` (or the given callable) has at least `count` spans; returns them.
        Exactly how many there must be is the caller's assertion."""
        spans = spans or self.spans

        def enough():
            now = spans()
            return now if len(now) >= count else None

        return wait_until(enough, timeout, lambda: f"{count} spans from gym-tracer (have {len(spans())})")

    def stdout_text(self):
        return self.stdout_path.read_text(errors="replace")

    def lines(self):
        """The complete JSON lines so far (a line still being written is not one yet)."""
        complete = self.stdout_text().split("\n")[:-1]
        return [json.loads(line) for line in complete if line.strip()]

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


def post_verify(port, count, pause_s=0.0, numbered_from=None):
    """Sends `count` POST /verify requests over one keep-alive connection; each must be a 200.
    With `numbered_from` = n, request i says `User-Agent: verify-<n + i>`, so a test can tell
    which requests' spans arrived."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    for i in range(count):
        headers = {"content-type": "application/json"}
        if numbered_from is not None:
            headers["User-Agent"] = f"verify-{numbered_from + i}"
        connection.request("POST", "/verify", body=json.dumps({"answer": str(i)}), headers=headers)
        response = connection.getresponse()
        response.read()
        assert response.status == 200
        time.sleep(pause_s)
    connection.close()


def wait_for_health(port, timeout=30):
    """Polls GET /health on 127.0.0.1:`port` until it answers; returns the answer."""

    def answer():
        try:
            return http_get(f"http://127.0.0.1:{port}/health", timeout=1)
        except OSError:
            return None

    return wait_until(answer, timeout, f"an answer to GET /health on port {port}")


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.status, response.read()
