"""Start the real nemo-gym 0.7.0 servers the way `ng_run` / `gym env start` does.

By default, example_single_tool_call: three servers from the installed package, plus a canned
OpenAI-compatible upstream:

| server name (NEMO_GYM_CONFIG_PATH) | type                 | impl                      |
| ---------------------------------- | -------------------- | ------------------------- |
| `example_single_tool_call_simple_agent` | responses_api_agents | simple_agent         |
| `policy_model`                      | responses_api_models | openai_model              |
| `example_single_tool_call`          | resources_servers    | example_single_tool_call  |

How Gym launches a server (nemo_gym/cli/env.py `RunHelper._start`, `_server_launch_command`;
nemo_gym/cli/setup_command.py `run_command`), and what this module does the same way:
- the run config is resolved by nemo_gym's GlobalConfigDictParser (make_config.py) and
  passed whole, as YAML, in NEMO_GYM_CONFIG_DICT; NEMO_GYM_CONFIG_PATH = the server's name;
- `/bin/bash -c "cd <server dir> && source <venv>/bin/activate && <venv>/bin/python app.py"`
  (Gym's command with `skip_venv_if_present` and a ready venv; Gym's per-server uv venv is
  replaced by the one shared gym venv). bash execs the last command of the list, so the
  Popen pid is the server's Python;
- env = our environment + the two variables above, PYTHONPATH = <server dir>[:old],
  UV_CACHE_DIR, UV_LOCK_TIMEOUT. Unlike Gym, OTEL_* and NEMO_GYM_* variables of the caller
  are not passed on, so Gym's in-process telemetry stays off and `service.name` is `nemo/...`.
- Gym's head server (a thread inside the `ng_run` process, port 11000) is NOT started:
  a server launched with NEMO_GYM_CONFIG_DICT never contacts it (ServerClient reads the
  config from the environment), and nothing on the rollout path calls it.
- ng_run 0.7.0 would also start a generated `legacy_agent` relay (environment_servers) in
  front of the agent; rollouts are driven at the agent's /run directly instead.

Readiness is Gym's: any HTTP answer on `GET /` of every server (at its configured host).

Across hosts: `hosts` (server name -> address) sets each server's `host` in the config, so it
binds that address and every peer calls it there (Gym's ServerClient builds a server's URL
from the global config); `netns` (server name -> command prefix, e.g. `["ip", "netns",
"exec", NAME]`, see tests/support/netns.py) runs that server's bash command under the prefix.
`ip netns exec` and bash both exec, so the Popen pid is still the server's Python. The canned
upstream is on 127.0.0.1 in this process's namespace, where the model server calls it, unless
`upstream_netns` (a command prefix like `netns`'s) runs it in another network namespace: then
it is on that namespace's 127.0.0.1, and the model server must run there too. Its readiness is
its ready file (written once it listens, seen through the shared filesystem), and
`upstream_requests()` asks it from inside that namespace.

With `upstream_tls=True` the canned upstream serves HTTPS with a self-signed certificate for
127.0.0.1 and localhost (made here with the `openssl` command), `openai_base_url` is
`https://127.0.0.1:<port>/v1`, and the servers trust the certificate through `SSL_CERT_FILE`
(aiohttp's default context is `ssl.create_default_context()`, which loads it).

Another environment of the package: `RealGymRun(venv, environment="equivalence_llm_judge")`
is given to Gym's parser as `ng_run` is given one (make_config.py): `config_paths` =
resources_servers/<env>/configs/<env>.yaml (its servers, their settings, its agent's datasets)
and responses_api_models/openai_model/configs/openai_model.yaml (`policy_model`, which the
environments' agents and some judges name), with `policy_base_url` / `policy_api_key` /
`policy_model_name` pointing at the canned upstream; every model server's `openai_base_url`,
`openai_api_key` and `openai_model` are set to the upstream's too (arena_judge's
`arena_judge_judge_model` would read ARENA_JUDGE_* environment variables). Every server the
resolved config names is started (the environment's `<env>_environment_server`, a
`legacy_agent` relay, is not: rollouts go to the agent's /run). Which is which is read from
the config: the agent (`<env>_simple_agent`, else the only or first agent), its
`resources_server` and `model_server` (the policy model), and the resources server's
`judge_model_server`, if any (`run.roles`). Rollout rows come from the agent's `example`
dataset (`datasets[].jsonl_fpath`). The default environment keeps its hand-written config
(the package's example_single_tool_call.yaml less `datasets` and its environment server), so
NEMO_GYM_CONFIG_DICT stays what the tests have always been given.

Of the judge environments, two are known to the canned upstream (canned_upstream.py has the
rule): equivalence_llm_judge (one judge call per rollout, `POST /v1/responses` to
`policy_model`) and arena_judge (two at once per rollout, `POST /v1/chat/completions` to
`arena_judge_judge_model`). arena_judge's app.py imports scikit-learn, which needs joblib,
threadpoolctl, narwhals and cloudpickle: requirements.txt pins them; a gym venv made before
they were added can be given them from a directory of their own (`pip install --target DIR`)
with `extra_pythonpath=[DIR]` or GYM_REAL_EXTRA_PYTHONPATH=DIR.

`upstream_delay_s` makes the upstream wait that long before every answer (a slow model);
`drive_rollouts(n, concurrency)` (drive.py) keeps many rollouts in flight at once.

Use with the gym venv (`cargo xtask setup` makes target/gym-venv):

    run = RealGymRun(venv).start()
    result = run.drive_rollout(task_index=0, rollout_index=0)
    run.stop()

Or by hand: `python tests/support/real_gym/launch.py --venv target/gym-venv [--observability] [--upstream-tls]`,
and the many-rollouts self-check: `python tests/support/real_gym/launch.py --environment
equivalence_llm_judge --rollouts 256 --upstream-delay-s 1` (prints a summary; exit 1 if a check
failed).
"""

import argparse
import collections
import json
import os
import re
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

# tests/support, for the ports helper (also when this file is run as a script).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from harness import free_ports  # noqa: E402
from real_gym import drive  # noqa: E402
from real_gym.canned_upstream import FAIL_JUDGE, FAIL_POLICY, JUDGE_LABELS, LOSE  # noqa: E402

HERE = Path(__file__).resolve().parent

AGENT = "example_single_tool_call_simple_agent"
MODEL = "policy_model"
RESOURCES = "example_single_tool_call"
SERVER_TYPES = {
    AGENT: "responses_api_agents",
    MODEL: "responses_api_models",
    RESOURCES: "resources_servers",
}
# The canned upstream's key; it is in the YAML (NEMO_GYM_CONFIG_DICT) and must never be exported.
API_KEY = "sk-canned-upstream-5ecret-0f-the-yaml-7f3a9c"
EXAMPLE_DATA = "resources_servers/example_single_tool_call/data/example.jsonl"
DEFAULT_ENVIRONMENT = RESOURCES
UPSTREAM_MODEL = "canned-model"
# The api-version azure_openai_model's config asks for (`default_query`, `???` in its YAML).
AZURE_API_VERSION = "2024-10-21"


def policy_model_config(impl):
    """The policy model's config file as `ng_run` is given it (relative to Gym's root)."""
    return f"responses_api_models/{impl}/configs/{impl}.yaml"


def model_upstream_settings(base_url, api_key=API_KEY, model=UPSTREAM_MODEL):
    """How each model server implementation is pointed at the canned upstream: the settings its
    configs/<impl>.yaml fills from ${policy_base_url}, ${policy_api_key}, ${policy_model_name},
    by implementation (make_config.py sets them on every model server of that implementation).
    `base_url` ends in /v1; Azure's client adds its own /openai/deployments/<model> path."""
    return {
        "openai_model": {"openai_base_url": base_url, "openai_api_key": api_key, "openai_model": model},
        "vllm_model": {"base_url": base_url, "api_key": api_key, "model": model,
                       "return_token_id_information": False},
        "azure_openai_model": {"openai_base_url": base_url.removesuffix("/v1"), "openai_api_key": api_key,
                               "openai_model": model, "default_query": {"api-version": AZURE_API_VERSION}},
    }
# Ports handed to make_config.py for an environment's servers (it uses as many as there are).
MAX_SERVERS = 12
# The judge calls of the environments canned_upstream.py judges: (upstream path, per rollout).
JUDGE_CALLS = {
    "equivalence_llm_judge": ("/v1/responses", 1),
    "arena_judge": ("/v1/chat/completions", 2),
}
# Filler for `rollout_body(pad_to=...)`: plain ASCII (no JSON escapes), a prompt-like sentence.
PADDING = " Prefer concise answers; the padded-prompt-filler says weather questions need the get_weather tool."


def default_venv():
    return Path(os.environ.get("GYM_REAL_VENV") or HERE.parents[2] / "target" / "gym-venv")


# The self-signed certificate of the HTTPS upstream: written as the config of `openssl req`,
# so the system's openssl.cnf changes nothing. Python 3.13's default context verifies
# strictly (VERIFY_X509_STRICT): the key identifiers and key usage are needed.
CERT_CONFIG = """\
[req]
distinguished_name = dn
x509_extensions = v3
prompt = no
[dn]
CN = localhost
[v3]
subjectAltName = IP:127.0.0.1, DNS:localhost
basicConstraints = critical, CA:TRUE
keyUsage = critical, digitalSignature, keyCertSign
extendedKeyUsage = serverAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always
"""


def make_self_signed_cert(directory):
    """A self-signed certificate for IP 127.0.0.1 and DNS localhost (subjectAltName) and its
    key, PEM files in `directory`: (cert path, key path). Needs the `openssl` command."""
    openssl = shutil.which("openssl")
    if openssl is None:
        raise RuntimeError("upstream_tls needs the `openssl` command line tool to make a self-signed "
                           "certificate: install openssl (e.g. `apt-get install openssl`)")
    directory = Path(directory)
    config, cert, key = directory / "upstream-cert.cnf", directory / "upstream-cert.pem", directory / "upstream-key.pem"
    config.write_text(CERT_CONFIG)
    out = subprocess.run(
        [openssl, "req", "-x509", "-config", str(config), "-newkey", "ec", "-pkeyopt",
         "ec_paramgen_curve:prime256v1", "-nodes", "-days", "7", "-keyout", str(key), "-out", str(cert)],
        capture_output=True, text=True, timeout=60,
    )
    if out.returncode != 0:
        raise RuntimeError(f"openssl req failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return cert, key


def run_config(ports, upstream_port, observability, capture_dir, access_log, upstream_scheme="http", hosts=None):
    """The run config before Gym's parser fills the global keys (what a user's YAML holds).
    `hosts`: server name -> the address it binds and is called at (default 127.0.0.1)."""
    hosts = {**{name: "127.0.0.1" for name in SERVER_TYPES}, **(hosts or {})}
    upstream = model_upstream_settings(f"{upstream_scheme}://127.0.0.1:{upstream_port}/v1")
    config = {
        MODEL: {"responses_api_models": {"openai_model": {
            "entrypoint": "app.py",
            "host": hosts[MODEL],
            "port": ports[MODEL],
            **upstream["openai_model"],
        }}},
        RESOURCES: {"resources_servers": {"example_single_tool_call": {
            "entrypoint": "app.py",
            "host": hosts[RESOURCES],
            "port": ports[RESOURCES],
            "domain": "agent",
            "verified": False,
            "description": "Basic single-step tool calling",
        }}},
        AGENT: {"responses_api_agents": {"simple_agent": {
            "entrypoint": "app.py",
            "host": hosts[AGENT],
            "port": ports[AGENT],
            "resources_server": {"type": "resources_servers", "name": RESOURCES},
            "model_server": {"type": "responses_api_models", "name": MODEL},
        }}},
    }
    if observability:
        # Evaluation model-call capture: the agent then prefixes downstream model and
        # resources calls with /ng-rollout/<rollout id>/ (base_responses_api_agent.py
        # `_model_call_capture_enabled`, server_utils.ServerClient.request).
        config["observability_enabled"] = True
        config["model_call_capture_dir"] = str(capture_dir)
    if access_log:
        config["uvicorn_logging_show_200_ok"] = True
    return config


def _clean_env():
    """Our environment without telemetry or Gym variables that would change the servers."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "NEMO_GYM_"))}


# GET argv[1] (trusting the PEM certificate argv[2], if any), its body to stdout: the canned
# upstream's log, asked from inside the network namespace it runs in.
_FETCH = """\
import ssl, sys, urllib.request
context = ssl.create_default_context(cafile=sys.argv[2]) if sys.argv[2] else None
with urllib.request.urlopen(sys.argv[1], timeout=5, context=context) as r:
    sys.stdout.write(r.read().decode())
"""


class CannedUpstream:
    """canned_upstream.py in a process of its own on 127.0.0.1:`port`, expecting `api_key`;
    with `tls`, over HTTPS with a self-signed certificate made in `workdir` (`cert`, `key`).
    Its output goes to `workdir`/canned_upstream.log.
    netns: a command prefix (e.g. `ip netns exec NAME`, which must exec the command) that runs
    it in another network namespace, on that namespace's 127.0.0.1; `requests()` then runs its
    query under the same prefix. Readiness (the ready file) needs no network either way."""

    def __init__(self, workdir, port=None, tls=False, api_key=API_KEY, netns=None, delay_s=0.0, judge_labels=None):
        self.workdir = Path(workdir)
        self.port = port or free_ports(1)[0]
        self.tls, self.api_key = tls, api_key
        self.netns = list(netns or [])
        self.delay_s = delay_s
        # Every `slow_every`th request waits `slow_extra_s` more (0: none); set before start().
        self.slow_every, self.slow_extra_s = 0, 0.0
        self.judge_labels = tuple(judge_labels or JUDGE_LABELS)
        self.cert = self.key = None
        self.process = None

    @property
    def base_url(self):
        return f"{'https' if self.tls else 'http'}://127.0.0.1:{self.port}"

    def start(self, timeout=20):
        ready = self.workdir / "upstream.ready"
        tls = []
        if self.tls:
            self.cert, self.key = make_self_signed_cert(self.workdir)
            tls = ["--tls-cert", str(self.cert), "--tls-key", str(self.key)]
        options = []
        if self.delay_s:
            options += ["--delay-s", repr(float(self.delay_s))]
        if self.slow_every:
            options += ["--slow-every", str(self.slow_every), "--slow-extra-s", repr(float(self.slow_extra_s))]
        if self.judge_labels != tuple(JUDGE_LABELS):
            options += ["--judge-labels", *self.judge_labels]
        log = open(self.workdir / "canned_upstream.log", "wb")
        self.process = subprocess.Popen(
            [*self.netns, sys.executable, str(HERE / "canned_upstream.py"), "--port", str(self.port),
             "--api-key", self.api_key, "--ready-file", str(ready), *tls, *options],
            env=_clean_env(), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir,
        )
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"canned upstream exited: {self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"canned upstream did not start within {timeout} s")
            time.sleep(0.05)
        return self

    def requests(self):
        """What it saw, in order: [{method, path, auth_ok, stream, model, model_offset,
        body_bytes, usage: {input, output} or None, kind, verdict, t_ns, n, slow}] (canned_upstream.py;
        the last 20,000)."""
        return self._get("/_canned/requests")

    def summary(self):
        """Counts over every request: {requests, logged, counts: {"METHOD PATH KIND": n},
        verdicts: {label: n}, peak_in_flight: {"METHOD PATH KIND": n}, auth_failed: n}
        (canned_upstream.py)."""
        return self._get("/_canned/summary")

    def _get(self, path):
        url = f"{self.base_url}{path}"
        if self.netns:  # its 127.0.0.1 is another namespace's: ask from in there
            out = subprocess.run([*self.netns, sys.executable, "-c", _FETCH, url, str(self.cert or "")],
                                 capture_output=True, text=True, timeout=30, env=_clean_env())
            if out.returncode != 0:
                raise RuntimeError(f"querying {url} under {self.netns} failed ({out.returncode}):\n{out.stderr[-2000:]}")
            return json.loads(out.stdout)
        context = ssl.create_default_context(cafile=str(self.cert)) if self.tls else None
        with urllib.request.urlopen(url, timeout=5, context=context) as r:
            return json.loads(r.read())

    def stop(self, timeout=10):
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def log_tail(self, lines=40):
        try:
            return "\n".join((self.workdir / "canned_upstream.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"<{e}>"


class RealGymRun:
    """One run of the three real servers and the canned upstream.

    observability: enable Gym's model-call capture (adds the /ng-rollout/<id>/ prefixes).
    access_log: let uvicorn log every request (`uvicorn_logging_show_200_ok`); see
    `access_log_paths()`.
    upstream_tls: the canned upstream serves HTTPS with a self-signed certificate
    (`upstream_cert`), which the servers trust through SSL_CERT_FILE.
    hosts: server name -> the address it binds and its peers call (default 127.0.0.1).
    netns: server name -> a command prefix its launch command runs under (e.g. `ip netns
    exec NAME`, which must exec the command so the pid stays the server's).
    upstream_netns: a command prefix the canned upstream runs under (default: none, this
    process's namespace); the model server calls it at 127.0.0.1, so with a prefix the model
    server must be in that namespace too (`netns[MODEL]`).
    environment: a resources server of the package whose configs/<environment>.yaml to run
    (default: example_single_tool_call, with its hand-written config); config_path: another
    config file instead (relative to Gym's root, or absolute), e.g. one of an environment's
    other configs. The server names (for hosts, netns, pids, urls) are then the config's:
    see `roles` once started.
    upstream_delay_s: the canned upstream waits this long before every answer.
    model_impl: the policy model server's implementation (`openai_model`, `vllm_model`,
    `azure_openai_model`: model_upstream_settings()), run from its package config
    (responses_api_models/<impl>/configs/<impl>.yaml) with the environment's.
    extra_path: directories put first on every server's PATH (codex_agent finds the `codex`
    CLI there).
    extra_pythonpath: directories put on every server's PYTHONPATH after its own folder
    (default: GYM_REAL_EXTRA_PYTHONPATH, colon-separated), e.g. packages a server imports that
    the gym venv lacks.
    """

    def __init__(self, venv=None, observability=False, access_log=False, workdir=None, upstream_tls=False,
                 hosts=None, netns=None, upstream_netns=None, environment=None, config_path=None,
                 upstream_delay_s=0.0, extra_pythonpath=None, model_impl="openai_model", extra_path=None):
        self.venv = Path(venv or default_venv()).absolute()
        self.python = self.venv / "bin" / "python"
        if not self.python.exists():
            raise RuntimeError(f"{self.python} does not exist: run `cargo xtask setup` to create the gym venv")
        self.observability = observability
        self.access_log = access_log
        self.model_impl = model_impl
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="real-gym-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.environment = environment or DEFAULT_ENVIRONMENT
        # The default keeps its hand-written config; any other environment (or file), or another
        # policy model server, is read from the package (the server names stay the same).
        if model_impl not in model_upstream_settings(""):
            raise ValueError(f"model server {model_impl!r}: the canned upstream serves "
                             f"{sorted(model_upstream_settings(''))}")
        self.config_path = config_path
        self.from_package = (config_path is not None or self.environment != DEFAULT_ENVIRONMENT
                             or model_impl != "openai_model")
        if self.from_package:
            self.upstream_port, *self.port_pool = free_ports(1 + MAX_SERVERS)
            self.ports = {}  # known once the config is resolved
        else:
            self.upstream_port, *ports = free_ports(1 + len(SERVER_TYPES))
            self.ports = dict(zip(SERVER_TYPES, ports))
        self.upstream_tls = upstream_tls
        if not self.from_package:
            unknown = sorted(set(hosts or {}).union(netns or {}) - set(SERVER_TYPES))
            if unknown:
                raise ValueError(f"hosts/netns name servers this run does not have: {unknown}")
        self.hosts = dict(hosts or {})
        self.netns = {name: list(prefix) for name, prefix in (netns or {}).items()}
        self.upstream_netns = list(upstream_netns or [])
        self.upstream_delay_s = float(upstream_delay_s or 0.0)
        if extra_pythonpath is None:
            extra_pythonpath = [p for p in os.environ.get("GYM_REAL_EXTRA_PYTHONPATH", "").split(":") if p]
        self.extra_pythonpath = [str(Path(p).absolute()) for p in extra_pythonpath]
        self.extra_path = [str(Path(p).absolute()) for p in extra_path or []]
        self.canned = CannedUpstream(self.workdir, self.upstream_port, tls=upstream_tls, netns=self.upstream_netns,
                                     delay_s=self.upstream_delay_s)
        self.upstream_cert = self.upstream_key = None
        self.upstream = None
        self.processes = {}
        self.servers = {}
        self.config_yaml = ""
        # Which server is which: the default's are known; an environment's once resolved.
        self.roles = {} if self.from_package else {"agent": AGENT, "resources": RESOURCES, "policy_model": MODEL,
                                                   "judge_model": None}
        self._rows = None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, timeout=120):
        try:
            # The config first: it says which judge labels the upstream answers with.
            self._resolve_config()
            self._start_upstream()
            for name, server in self.servers.items():
                self._start_server(name, server)
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_upstream(self):
        labels = self.servers.get(self.roles.get("resources"), {}).get("labels", {})
        if "judge_equal_label" in labels and "judge_not_equal_label" in labels:
            self.canned.judge_labels = (labels["judge_equal_label"], labels["judge_not_equal_label"])
        self.canned.start()
        self.upstream = self.canned.process
        self.upstream_cert, self.upstream_key = self.canned.cert, self.canned.key

    def _resolve_config(self):
        if self.from_package:
            initial = self._package_run_config()
        else:
            initial = run_config(self.ports, self.upstream_port, self.observability,
                                 self.workdir / "model-calls", self.access_log, self.upstream_scheme, self.hosts)
        initial_path = self.workdir / "run_config.yaml"
        initial_path.write_text(json.dumps(initial, indent=2))  # JSON is YAML
        resolved_path = self.workdir / "resolved_config.yaml"
        out = subprocess.run(
            [str(self.python), str(HERE / "make_config.py"), str(initial_path), "--out", str(resolved_path)],
            env=_clean_env(), cwd=self.workdir, capture_output=True, text=True, timeout=120,
        )
        if out.returncode != 0:
            raise RuntimeError(f"make_config.py failed ({out.returncode}):\n{out.stderr[-4000:]}")
        self.config_yaml = resolved_path.read_text()
        self.servers = {s["name"]: s for s in map(json.loads, out.stdout.splitlines())}
        if not self.from_package:
            if set(self.servers) != set(SERVER_TYPES):
                raise RuntimeError(f"make_config.py found servers {sorted(self.servers)}, want {sorted(SERVER_TYPES)}")
            return
        self.ports = {name: s["port"] for name, s in self.servers.items()}
        unknown = sorted(set(self.netns) - set(self.servers))
        if unknown:
            raise ValueError(f"netns names servers this run does not have: {unknown}; it has {sorted(self.servers)}")
        self.roles = self._find_roles()

    def _package_config_file(self):
        """The environment's config file, relative to Gym's root as `ng_run` is given it."""
        if self.config_path is not None:
            return str(self.config_path)
        relative = f"resources_servers/{self.environment}/configs/{self.environment}.yaml"
        if not (self.gym_root / relative).exists():
            known = sorted(p.parent.parent.name for p in self.gym_root.glob("resources_servers/*/configs/*.yaml")
                           if p.stem == p.parent.parent.name)
            raise ValueError(f"{self.gym_root / relative} does not exist; environments with a config of their "
                             f"own name: {', '.join(known)}")
        return relative

    def _package_run_config(self):
        """A run of an environment as `ng_run "+config_paths=[ENV.yaml,openai_model.yaml]"
        +policy_base_url=... +policy_api_key=... +policy_model_name=...` is asked for, and what
        make_config.py sets on each server once merged (`_real_gym`, see there)."""
        base_url = f"{self.upstream_scheme}://127.0.0.1:{self.upstream_port}/v1"
        config = {
            "config_paths": [self._package_config_file(), policy_model_config(self.model_impl)],
            "policy_base_url": base_url,
            "policy_api_key": API_KEY,
            "policy_model_name": UPSTREAM_MODEL,
            "_real_gym": {"ports": self.port_pool, "hosts": self.hosts,
                          "model_upstream": model_upstream_settings(base_url)},
            # The policy model's settings, as a user's `++policy_model....=` overrides (azure's
            # config leaves its api-version `???`, which the parser refuses before any merge).
            MODEL: {"responses_api_models": {self.model_impl: model_upstream_settings(base_url)[self.model_impl]}},
        }
        if self.observability:  # as run_config: Gym's evaluation model-call capture
            config["observability_enabled"] = True
            config["model_call_capture_dir"] = str(self.workdir / "model-calls")
        if self.access_log:
            config["uvicorn_logging_show_200_ok"] = True
        return config

    def _find_roles(self):
        """Which server is which, from the resolved config's references."""
        agents = [n for n, s in self.servers.items() if s["type"] == "responses_api_agents"]
        if not agents:
            raise RuntimeError(f"the config has no agent: {sorted(self.servers)}")
        preferred = f"{self.environment}_simple_agent"
        agent = preferred if preferred in agents else agents[0]
        refs = self.servers[agent].get("refs", {})
        resources = refs.get("resources_server", {}).get("name")
        policy = refs.get("model_server", {}).get("name")
        judge = self.servers.get(resources, {}).get("refs", {}).get("judge_model_server", {}).get("name")
        return {"agent": agent, "resources": resources, "policy_model": policy, "judge_model": judge}

    def launch_command(self, server):
        """Gym's `_server_launch_command` with skip_venv_if_present and a ready venv."""
        venv = shlex.quote(str(self.venv))
        return (f"cd {shlex.quote(server['dir'])} && source {venv}/bin/activate "
                f"&& {shlex.quote(str(self.python))} {shlex.quote(server['entrypoint'])}")

    def _start_server(self, name, server):
        env = _clean_env()
        env["NEMO_GYM_CONFIG_DICT"] = self.config_yaml
        env["NEMO_GYM_CONFIG_PATH"] = name
        env["PYTHONPATH"] = ":".join(p for p in (server["dir"], *self.extra_pythonpath, env.get("PYTHONPATH")) if p)
        env["PATH"] = ":".join(p for p in (*self.extra_path, env.get("PATH")) if p)
        env["UV_CACHE_DIR"] = str(self.workdir / "cache" / "uv")
        env["UV_LOCK_TIMEOUT"] = "1800"
        # haystack_agent's haystack-ai sends usage telemetry (posthog) by default: no network here.
        env["HAYSTACK_TELEMETRY_ENABLED"] = "False"
        if self.upstream_cert:
            env["SSL_CERT_FILE"] = str(self.upstream_cert)  # how the servers trust the upstream
        log = open(self.workdir / f"{name}.log", "wb")
        prefix = self.netns.get(name)
        if prefix:  # e.g. `ip netns exec NAME /bin/bash -c CMD`: ip execs bash, bash execs python
            command = dict(args=[*prefix, "/bin/bash", "-c", self.launch_command(server)])
        else:
            command = dict(args=self.launch_command(server), shell=True, executable="/bin/bash")
        self.processes[name] = subprocess.Popen(**command, env=env, stdout=log, stderr=subprocess.STDOUT)

    def _wait_ready(self, timeout):
        pending = set(self.servers)
        deadline = time.monotonic() + timeout
        while pending:
            for name in sorted(pending):
                process = self.processes[name]
                if process.poll() is not None:
                    tail = self._tail(name + ".log")
                    hint = ""
                    if "ModuleNotFoundError" in tail:
                        hint = ("\n(a package this server imports is not in the gym venv: rerun `cargo xtask setup` "
                                "after adding it to tests/support/real_gym/requirements.txt, or give it with "
                                "extra_pythonpath / GYM_REAL_EXTRA_PYTHONPATH)")
                    raise RuntimeError(f"server {name} exited with {process.returncode}:\n{tail}{hint}")
                try:
                    urllib.request.urlopen(self.urls[name] + "/", timeout=2).read()
                except urllib.error.HTTPError:
                    pass  # any answer counts, like Gym's poll_for_status
                except OSError:
                    continue
                pending.discard(name)
            if pending and time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}:\n{self._tail(n + '.log')}" for n in sorted(pending))
                raise RuntimeError(f"servers not ready within {timeout} s: {sorted(pending)}\n{logs}")
            if pending:
                time.sleep(0.2)

    def stop(self, timeout=15):
        """SIGINT every server (uvicorn shuts down), then the upstream; SIGKILL stragglers."""
        procs = list(self.processes.values()) + ([self.upstream] if self.upstream else [])
        for process in procs:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
        deadline = time.monotonic() + timeout
        for process in procs:
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- facts ----------------------------------------------------------------------------

    @property
    def pids(self):
        """Server name -> pid (bash, and a netns prefix, exec the server: the Python process)."""
        return {name: p.pid for name, p in self.processes.items()}

    @property
    def urls(self):
        return {name: f"http://{s['host']}:{s['port']}" for name, s in self.servers.items()}

    @property
    def upstream_scheme(self):
        return "https" if self.upstream_tls else "http"

    @property
    def upstream_base_url(self):
        """The canned upstream's root, e.g. https://127.0.0.1:PORT (the model calls {this}/v1/...)."""
        return self.canned.base_url

    def server_type(self, name):
        return self.servers[name]["type"]

    @property
    def agent(self):
        """The agent's server name (rollouts go to its /run)."""
        return self.roles["agent"]

    @property
    def resources(self):
        return self.roles["resources"]

    @property
    def policy_model(self):
        """The model server the agent calls."""
        return self.roles["policy_model"]

    @property
    def judge_model(self):
        """The model server the resources server's /verify calls (`judge_model_server`), or
        None; equivalence_llm_judge's is `policy_model` itself."""
        return self.roles.get("judge_model")

    @property
    def model_servers(self):
        """Every responses_api_models server, by name."""
        return [name for name, s in self.servers.items() if s["type"] == "responses_api_models"]

    @property
    def gym_root(self):
        """The folder the package's resources_servers/, responses_api_models/, ... are in."""
        if self.servers:
            return Path(next(iter(self.servers.values()))["dir"]).parent.parent
        found = list((self.venv / "lib").glob("python3*/site-packages/nemo_gym"))
        if not found:
            raise RuntimeError(f"nemo_gym is not installed in {self.venv}")
        return found[0].parent

    def example_data(self):
        """The rows' file: the agent's `example` dataset (the default: EXAMPLE_DATA)."""
        datasets = self.servers.get(self.agent, {}).get("datasets") or []
        examples = [d for d in datasets if d.get("type") == "example" and d.get("jsonl_fpath")]
        named = [d for d in examples if d.get("name") == "example"]
        relative = (named or examples)[0]["jsonl_fpath"] if examples else EXAMPLE_DATA
        return self.gym_root / relative

    def example_rows(self):
        """How many rows the example data has."""
        return len(self._row_lines())

    def _row_lines(self):
        if self._rows is None:
            with open(self.example_data()) as f:
                self._rows = [line for line in f if line.strip()]
        return self._rows

    def example_row(self, index=0):
        lines = self._row_lines()
        if not 0 <= index < len(lines):
            raise IndexError(index)
        return json.loads(lines[index])

    def rollout_body(self, task_index=0, rollout_index=0, attempt_index=None, *, row_index=None, pad_to=None,
                     prompt_suffix=None, lose=False, fail=None):
        """A flat row as rollout collection posts it to /run.

        row_index: the example row (default: task_index; example_single_tool_call's file has 5
        rows, equivalence_llm_judge's 5, arena_judge's 5).
        prompt_suffix: appended to the row's last input message (the user's prompt), which the
        model server sends on to its upstream (e.g. a canary the tracer must never export).
        lose: append " " + LOSE to that message too, so the canned upstream's judge decides
        against this rollout (reward 0.0 in equivalence_llm_judge and arena_judge).
        fail: "judge" or "policy": append FAIL_JUDGE or FAIL_POLICY to that message, so the
        canned upstream answers its judge call (Gym's judge_failsafe: /verify answers 200,
        reward 0.0, failure_kind judge_failed) or its policy call (the /run fails) 500.
        pad_to: lengthen the row's first input message (its developer prompt, as the long
        system prompts of example_multi_step's ~11 KB rows) until the JSON body is `pad_to`
        bytes; the `_ng_*` fields stay last, so they are only in the body's tail."""
        body = self.example_row(task_index if row_index is None else row_index)
        body["agent_ref"] = {"type": "responses_api_agents", "name": self.agent}
        body["_ng_task_index"] = task_index
        body["_ng_rollout_index"] = rollout_index
        if attempt_index is not None:
            body["_ng_attempt_index"] = attempt_index
        if prompt_suffix:
            last = body["responses_create_params"]["input"][-1]
            last["content"] = last["content"] + prompt_suffix
        if lose:
            last = body["responses_create_params"]["input"][-1]
            last["content"] = last["content"] + " " + LOSE
        if fail:
            last = body["responses_create_params"]["input"][-1]
            last["content"] = last["content"] + " " + {"judge": FAIL_JUDGE, "policy": FAIL_POLICY}[fail]
        if pad_to:
            first = body["responses_create_params"]["input"][0]
            missing = pad_to - len(json.dumps(body).encode())
            if missing > 0:
                first["content"] = first["content"] + (PADDING * (missing // len(PADDING) + 1))[:missing]
        return body

    def drive_rollout(self, task_index=0, rollout_index=0, attempt_index=None, timeout=60, **body_options):
        """POST one rollout to the agent's /run; returns the verify response (has `reward`).
        `body_options` go to `rollout_body` (row_index, pad_to, prompt_suffix)."""
        body = json.dumps(self.rollout_body(task_index, rollout_index, attempt_index, **body_options)).encode()
        request = urllib.request.Request(self.urls[self.agent] + "/run", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"/run answered {e.code}: {e.read()[:2000]!r}\n{self.logs()}") from e

    def drive_rollouts(self, n, concurrency=None, *, lose=None, fail=None, timeout=600, rollout_offset=0,
                       **body_options):
        """`n` rollouts at the agent's /run, `concurrency` in flight at once (default: all n),
        from aiohttp (drive.py). Rollout i is row i % rows of the example data, task index
        i % rows, rollout index rollout_offset + i // rows.
        lose: which rollouts the upstream's judge decides against (`rollout_body(lose=True)`):
        None (none), an int k (every k-th: i % k == k - 1) or a function (task index, rollout
        index) -> bool. fail: a function (task index, rollout index) -> None, "judge" or
        "policy": the call of the rollout the upstream fails (`rollout_body(fail=...)`).
        `body_options` go to `rollout_body` (pad_to, prompt_suffix).
        Returns one dict per rollout, in order (drive.py `result`), plus `lose` (bool),
        `decided` ("win"/"lose" for a judge environment, else None) and `expected_reward`
        (what the canned upstream's rule makes of it, where this module knows: 1.0/0.0 for
        equivalence_llm_judge and arena_judge, 1.0 for example_single_tool_call, else None)."""
        rows = self.example_rows()
        judged = self.environment in JUDGE_CALLS and self.judge_model is not None

        def item(i):
            task, rollout = i % rows, rollout_offset + i // rows
            if callable(lose):
                lost = bool(lose(task, rollout))
            else:
                lost = bool(lose) and i % int(lose) == int(lose) - 1
            failing = fail(task, rollout) if fail else None
            body = self.rollout_body(task, rollout, row_index=task, lose=lost, fail=failing, **body_options)
            decided = ("lose" if lost else "win") if judged else None
            expected = (0.0 if lost else 1.0) if judged else (1.0 if not self.from_package else None)
            meta = {"task_index": task, "rollout_index": rollout, "lose": lost, "decided": decided,
                    "expected_reward": 0.0 if failing == "judge" else None if failing else expected,
                    "fail": failing}
            return meta, json.dumps(body).encode()

        return drive.drive_rollouts(self.urls[self.agent] + "/run", item, n, concurrency or n, timeout=timeout,
                                    gym_python=self.python)

    def upstream_requests(self):
        """What the canned upstream saw, in order (CannedUpstream.requests)."""
        return self.canned.requests()

    def upstream_summary(self):
        """Counts over every upstream request (CannedUpstream.summary)."""
        return self.canned.summary()

    def access_log_paths(self):
        """Server name -> [(method, path, status)] from uvicorn's access log (access_log=True)."""
        # `(name) INFO:     127.0.0.1:PORT - "POST /run HTTP/1.1" 200 OK`
        pattern = re.compile(r'"([A-Z]+) (\S+) HTTP/[0-9.]+" (\d{3})')
        out = {}
        for name in self.servers:
            text = (self.workdir / f"{name}.log").read_text(errors="replace")
            out[name] = [m.groups() for m in pattern.finditer(text)]
        return out

    def _tail(self, filename, lines=40):
        try:
            return "\n".join((self.workdir / filename).read_text(errors="replace").splitlines()[-lines:])
        except OSError as e:
            return f"<{e}>"

    def logs(self):
        return "\n".join(f"--- {name}.log:\n{self._tail(name + '.log')}" for name in self.servers)


def upstream_verdict(environment, decided, labels=JUDGE_LABELS):
    """The label Gym parses from the canned judge's answer for a rollout the upstream decided
    `decided` ("win"/"lose") on (canned_upstream.py), as the /run answer carries it:
    equivalence_llm_judge's `judge_evaluations[-1].verdict_label`, arena_judge's
    `verdict_gen_base` (the call with the candidate as A)."""
    if environment == "equivalence_llm_judge":
        return labels[0] if decided == "win" else labels[1]
    if environment == "arena_judge":
        return "A>B" if decided == "win" else "B>A"
    return None


def self_check(run, rollouts, concurrency, lose_every, timeout):
    """Drives `rollouts` at once (or `concurrency` at a time) and checks what came back
    against the canned upstream's rule and its log; prints a summary, returns the failures."""
    judged = JUDGE_CALLS.get(run.environment) if run.judge_model else None
    before = run.upstream_summary()
    results = run.drive_rollouts(rollouts, concurrency, lose=lose_every if judged else None, timeout=timeout)
    after = run.upstream_summary()
    summary = drive.summarize(results)
    counts = collections.Counter({k: v - before["counts"].get(k, 0) for k, v in after["counts"].items()})
    verdicts = {k: v - before["verdicts"].get(k, 0) for k, v in after["verdicts"].items()}

    failures = []
    bad_status = [r for r in results if r["status"] != 200]
    if bad_status:
        failures.append(f"{len(bad_status)} rollouts did not answer 200, e.g. {bad_status[0]}")
    judge_failed = [r for r in results if r["failure_kind"]]
    if judge_failed:
        failures.append(f"{len(judge_failed)} rollouts have a failure_kind, e.g. {judge_failed[0]}")
    wrong = [r for r in results if r["status"] == 200 and r["expected_reward"] is not None
             and r["reward"] != r["expected_reward"]]
    if wrong:
        failures.append(f"{len(wrong)} rewards differ from the upstream's rule, e.g. {wrong[0]}")
    expected = {"POST /v1/responses policy": rollouts}
    if judged:
        path, per_rollout = judged
        expected[f"POST {path} judge"] = per_rollout * rollouts
        misjudged = [r for r in results if r["status"] == 200
                     and r["verdict"] != upstream_verdict(run.environment, r["decided"], run.canned.judge_labels)]
        if misjudged:
            failures.append(f"{len(misjudged)} verdicts are not the upstream's, e.g. {misjudged[0]}")
    elif run.environment == DEFAULT_ENVIRONMENT:
        expected["POST /v1/responses tool_call"] = rollouts
    auth_failed = after.get("auth_failed", 0) - before.get("auth_failed", 0)
    if auth_failed:
        failures.append(f"{auth_failed} upstream requests lacked the expected API key")
    for key, want in expected.items():
        if counts[key] != want:
            failures.append(f"upstream saw {counts[key]} {key!r}, want {want}")
    # Only model calls count: a stray GET of another program that once had this port is no
    # call of these servers.
    unexpected = {k: v for k, v in counts.items() if v and k not in expected and k.startswith("POST /v1/")}
    if unexpected:
        failures.append(f"upstream saw other calls: {unexpected}")

    print(f"environment: {run.environment}  roles: {run.roles}")
    print("servers: " + ", ".join(f"{name} ({run.server_type(name)}, pid {pid})" for name, pid in run.pids.items()))
    print(f"rollouts: {rollouts}, in flight at once: {concurrency or rollouts}, upstream delay: "
          f"{run.upstream_delay_s} s, decided lose: {sum(r['lose'] for r in results)}"
          + (f" (every {lose_every}th)" if judged and lose_every else ""))
    print(f"statuses: {summary['statuses']}  rewards: {summary['rewards']}  "
          f"verdicts (as Gym parsed them): {dict(collections.Counter(str(r['verdict']) for r in results))}")
    model_calls = lambda d: dict(sorted((k, v) for k, v in d.items() if v and k.startswith("POST /v1/")))
    print(f"upstream calls: {model_calls(counts)}")
    print(f"upstream verdicts: {dict(sorted((k, v) for k, v in verdicts.items() if v))}")
    print(f"upstream peak in flight (whole run): {model_calls(after.get('peak_in_flight', {}))}")
    d = summary["duration_s"]
    print(f"rollout duration (s): min {d['min']:.3f}  p50 {d['p50']:.3f}  p90 {d['p90']:.3f}  max {d['max']:.3f}; "
          f"wall {summary['wall_s']:.3f} s; starts spread over {summary['start_spread_s']:.3f} s")
    print("OK" if not failures else "FAILED:\n  " + "\n  ".join(failures))
    return failures


def main():
    parser = argparse.ArgumentParser(description="Start the real Gym servers, drive one rollout, print paths; "
                                                 "or, with --rollouts, drive many at once and check them.")
    parser.add_argument("--venv", default=None)
    parser.add_argument("--observability", action="store_true")
    parser.add_argument("--upstream-tls", action="store_true", help="the canned upstream serves HTTPS")
    parser.add_argument("--keep", action="store_true", help="keep the servers running until Ctrl-C")
    parser.add_argument("--environment", default=None, help=f"a resources server of the package (default: "
                                                            f"{DEFAULT_ENVIRONMENT})")
    parser.add_argument("--rollouts", type=int, default=None, help="drive this many rollouts and check them")
    parser.add_argument("--concurrency", type=int, default=None, help="in flight at once (default: all)")
    parser.add_argument("--upstream-delay-s", type=float, default=0.0)
    parser.add_argument("--lose-every", type=int, default=4,
                        help="the upstream's judge decides against every k-th rollout (0: none)")
    parser.add_argument("--timeout", type=float, default=600, help="per rollout, seconds")
    parser.add_argument("--extra-pythonpath", action="append", default=None,
                        help="a directory for every server's PYTHONPATH (repeatable)")
    args = parser.parse_args()
    if args.rollouts is not None:
        run = RealGymRun(args.venv, observability=args.observability, upstream_tls=args.upstream_tls,
                         environment=args.environment, upstream_delay_s=args.upstream_delay_s,
                         extra_pythonpath=args.extra_pythonpath)
        with run:
            print("workdir:", run.workdir)
            failures = self_check(run, args.rollouts, args.concurrency, args.lose_every, args.timeout)
        sys.exit(1 if failures else 0)
    run = RealGymRun(args.venv, observability=args.observability, access_log=True, upstream_tls=args.upstream_tls,
                     environment=args.environment, upstream_delay_s=args.upstream_delay_s,
                     extra_pythonpath=args.extra_pythonpath)
    with run:
        print("workdir:", run.workdir)
        print("pids:", run.pids)
        print("urls:", run.urls)
        result = run.drive_rollout(task_index=0, rollout_index=0)
        print("reward:", result.get("reward"))
        time.sleep(0.5)  # let the access logs flush
        for name, entries in run.access_log_paths().items():
            for method, path, status in entries:
                print(f"{name}: {method} {path} {status}")
        for entry in run.upstream_requests():
            print(f"upstream ({run.upstream_base_url}): {entry['method']} {entry['path']} auth_ok={entry['auth_ok']} "
                  f"model={entry.get('model')!r} at byte {entry.get('model_offset')} of {entry.get('body_bytes')} "
                  f"usage={entry.get('usage')}")
        if args.keep:
            print("running; Ctrl-C to stop")
            try:
                signal.pause()
            except KeyboardInterrupt:
                pass


if __name__ == "__main__":
    main()
