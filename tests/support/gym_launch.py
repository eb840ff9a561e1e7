"""Launches Gym-shaped servers the way `ng_run` does and drives rollouts through them.

Each server is its own `python <server>.py` process (uvicorn, uvloop + httptools) with
NEMO_GYM_CONFIG_PATH = its name and NEMO_GYM_CONFIG_DICT = the YAML of the whole run, from
which it reads its host, port and peers. The YAML holds a fake API key (SECRET) that must
never reach the tracer's output.
"""

import http.client
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import yaml

from harness import SUPPORT_DIR, free_port, wait_listening, wait_until

AGENT, MODEL, RESOURCES = "responses_api_agents", "responses_api_models", "resources_servers"
SECRET = "sk-SECRET-0123456789abcdef-never-export"
PROMPT = "PROMPT-TEXT-never-export: what is six times seven?"
USER_AGENT = "gym-tests"

# server type -> (impl name, script under support/servers, the FastAPI routes it serves)
KINDS = {
    AGENT: ("simple_agent", "gym_agent.py", {"/run", "/v1/responses", "/aggregate_metrics", "/health"}),
    MODEL: ("canned_model", "gym_model.py", {"/v1/chat/completions", "/v1/responses", "/v1/messages", "/health"}),
    RESOURCES: ("canned_verifier", "gym_resources.py",
                {"/seed_session", "/verify", "/close_session", "/aggregate_metrics", "/reverify_mode", "/health",
                 "/get_weather", "/items/{item_id}"}),
}
DEFAULT_SERVERS = {"simple_agent": AGENT, "policy_model": MODEL, "example_verifier": RESOURCES}


@dataclass
class Sent:
    """One request the test sent, and what came back."""
    server: str
    method: str
    path: str
    body: dict | None
    data: bytes
    status: int
    response: bytes

    def json(self):
        return json.loads(self.response)


class GymServer:
    def __init__(self, name, server_type, env):
        self.name, self.type, self.env = name, server_type, env
        self.impl, self.script, self.routes = KINDS[server_type]
        self.port = free_port()
        self.process = None

    @property
    def pid(self):
        return self.process.pid

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}"

    def config_entry(self, peers):
        entry = {"entrypoint": self.script, "host": "127.0.0.1", "port": self.port}
        if self.type == AGENT:
            entry |= {f"{kind}_server": {"type": t, "name": n} for kind, (t, n) in peers.items()}
        if self.type == MODEL:
            entry |= {"openai_base_url": "http://127.0.0.1:1/v1", "openai_model": "canned", "api_key": SECRET}
        return {self.type: {self.impl: entry}}

    def send(self, method, path, body=None, headers=None):
        data = json.dumps(body).encode() if body is not None else b""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request(method, path, body=data or None, headers={
                "User-Agent": USER_AGENT, **({"Content-Type": "application/json"} if body is not None else {}),
                **(headers or {})})
            response = connection.getresponse()
            return Sent(self.name, method, path, body, data, response.status, response.read())
        finally:
            connection.close()


class GymRun:
    """The servers of one run; `env` adds per-server environment: {name: {VAR: value}}."""

    def __init__(self, servers=None, env=None):
        env = env or {}
        self.servers = {name: GymServer(name, t, env.get(name, {})) for name, t in (servers or DEFAULT_SERVERS).items()}
        first = {t: next((n for n, s in self.servers.items() if s.type == t), None) for t in (MODEL, RESOURCES)}
        peers = {"model": (MODEL, first[MODEL]), "resources": (RESOURCES, first[RESOURCES])}
        config = {
            "head_server": {"host": "127.0.0.1", "port": free_port()},
            "policy_base_url": "http://127.0.0.1:1/v1", "policy_api_key": SECRET, "policy_model_name": "canned",
            **{name: server.config_entry(peers) for name, server in self.servers.items()},
        }
        self.config_yaml = yaml.safe_dump(config, sort_keys=False)
        self.logdir = Path(tempfile.mkdtemp(prefix="gym-run-"))

    def __getitem__(self, name):
        return self.servers[name]

    def first(self, server_type):
        return next(s for s in self.servers.values() if s.type == server_type)

    @property
    def agent(self):
        return self.first(AGENT)

    @property
    def model(self):
        return self.first(MODEL)

    @property
    def resources(self):
        return self.first(RESOURCES)

    def by_pid(self):
        """pid -> server, for every server ever started (exited ones too)."""
        return {s.pid: s for s in self.servers.values() if s.process}

    def start(self, *names):
        """Starts the named servers (default: all not yet started) and waits until each listens."""
        started = [self.servers[n] for n in names] if names else [s for s in self.servers.values() if not s.process]
        base_env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM_"))}
        for server in started:
            env = dict(base_env, PYTHONPATH=str(SUPPORT_DIR), NEMO_GYM_CONFIG_PATH=server.name,
                       NEMO_GYM_CONFIG_DICT=self.config_yaml, **server.env)
            log = open(self.logdir / f"{server.name}.log", "wb")
            server.process = subprocess.Popen([sys.executable, server.script], cwd=SUPPORT_DIR / "servers", env=env,
                                              stdout=log, stderr=subprocess.STDOUT)
        for server in started:
            log_path = self.logdir / f"{server.name}.log"
            wait_listening(server.process, server.port, server.name,
                           describe_exit=lambda log_path=log_path: f": {log_path.read_text()}")
        return self

    def stop(self, *names):
        for server in [self.servers[n] for n in names] if names else self.servers.values():
            if server.process and server.process.poll() is None:
                server.process.terminate()
                try:
                    server.process.wait(10)
                except subprocess.TimeoutExpired:
                    server.process.kill()
                    server.process.wait()

    def log(self, name):
        return (self.logdir / f"{name}.log").read_text(errors="replace")


# Gym's rollout id pattern, and the prefix as the tracer strips it (any non-slash segment,
# then an optional /training-token-capture).
ROLLOUT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
PREFIX = re.compile(r"^/ng-rollout/(?P<id>[^/]+)(?:/training-token-capture)?(?P<rest>/.*)$")


def split_prefix(path):
    """-> (path without the query and the /ng-rollout/<id>[/training-token-capture] prefix, valid id or None)."""
    path = path.split("?", 1)[0]
    match = PREFIX.match(path)
    if not match:
        return path, None
    return match["rest"], match["id"] if ROLLOUT_ID.match(match["id"]) else None


def run_body(task=None, rollout=None, *, rollout_id=None, attempt=None, reward=1.0, fail=False, padding=0,
             ids_first=True, metadata=None, prompt=PROMPT):
    """A /run request body like Gym's rollout collection sends. Fields left None are absent;
    `padding` bytes are added to the prompt; `ids_first` puts the `_ng_*` fields before
    `responses_create_params` (Gym itself appends them after it)."""
    ids = {key: value for key, value in (("_ng_rollout_id", rollout_id), ("_ng_task_index", task),
                                         ("_ng_rollout_index", rollout), ("_ng_attempt_index", attempt))
           if value is not None}
    params = {"responses_create_params": {"model": "canned", "input": prompt + "x" * padding,
                                          **({"metadata": metadata} if metadata else {})}}
    rest = {"reward": reward, **({"raise": True} if fail else {})}
    return {**ids, **params, **rest} if ids_first else {**params, **ids, **rest}


def rollout_mix(n, start=0):
    """n /run bodies cycling through the id variants: task/rollout indices, attempt 0 and n > 0,
    explicit ids (with and without attempt), malformed explicit ids (Gym rejects them: 500), no
    usable fields, reward 0 (still a successful verify), a verifier that raises, and decoys (an
    `_ng_rollout_id` nested in the params and one quoted inside the prompt) before the real fields."""
    decoy = 'quote: "_ng_rollout_id": "decoy-in-text"'
    variants = [
        lambda i: run_body(i, 0),
        lambda i: run_body(i, 1, attempt=0),
        lambda i: run_body(i, 2, attempt=2),
        lambda i: run_body(rollout_id=f"run.{i}_ex-id"),
        lambda i: run_body(rollout_id=f"R{i}", attempt=1),
        lambda i: run_body(rollout_id=f"-bad{i}"),
        lambda i: run_body(rollout_id=i),
        lambda i: run_body(task=i),
        lambda i: run_body(i, 3, reward=0.0),
        lambda i: run_body(i, 4, fail=True),
        lambda i: run_body(i, 5, ids_first=False, metadata={"_ng_rollout_id": "decoy-nested"}, prompt=decoy),
    ]
    return [variants[k % len(variants)](start + k) for k in range(n)]


def drive_rollouts(run, bodies, concurrency=4, agent=None):
    """POSTs each body to the agent's /run, `concurrency` at a time; returns the Sent list in order."""
    agent = agent or run.agent
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda body: agent.send("POST", "/run", body), bodies))
