"""Start the real nemo-gym 0.7.0 servers the way `ng_run` / `gym env start` does.

Three servers from the installed package, plus a canned OpenAI-compatible upstream:

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

Use with the gym venv (`cargo xtask setup` makes target/gym-venv):

    run = RealGymRun(venv).start()
    result = run.drive_rollout(task_index=0, rollout_index=0)
    run.stop()

Or by hand: `python tests/support/real_gym/launch.py --venv target/gym-venv [--observability] [--upstream-tls]`.
"""

import argparse
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
    config = {
        MODEL: {"responses_api_models": {"openai_model": {
            "entrypoint": "app.py",
            "host": hosts[MODEL],
            "port": ports[MODEL],
            "openai_base_url": f"{upstream_scheme}://127.0.0.1:{upstream_port}/v1",
            "openai_api_key": API_KEY,
            "openai_model": "canned-model",
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

    def __init__(self, workdir, port=None, tls=False, api_key=API_KEY, netns=None):
        self.workdir = Path(workdir)
        self.port = port or free_ports(1)[0]
        self.tls, self.api_key = tls, api_key
        self.netns = list(netns or [])
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
        log = open(self.workdir / "canned_upstream.log", "wb")
        self.process = subprocess.Popen(
            [*self.netns, sys.executable, str(HERE / "canned_upstream.py"), "--port", str(self.port),
             "--api-key", self.api_key, "--ready-file", str(ready), *tls],
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
        body_bytes, usage: {input, output} or None}] (canned_upstream.py)."""
        url = f"{self.base_url}/_canned/requests"
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
    """

    def __init__(self, venv=None, observability=False, access_log=False, workdir=None, upstream_tls=False,
                 hosts=None, netns=None, upstream_netns=None):
        self.venv = Path(venv or default_venv()).absolute()
        self.python = self.venv / "bin" / "python"
        if not self.python.exists():
            raise RuntimeError(f"{self.python} does not exist: run `cargo xtask setup` to create the gym venv")
        self.observability = observability
        self.access_log = access_log
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="real-gym-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.upstream_port, *ports = free_ports(1 + len(SERVER_TYPES))
        self.ports = dict(zip(SERVER_TYPES, ports))
        self.upstream_tls = upstream_tls
        unknown = sorted(set(hosts or {}).union(netns or {}) - set(SERVER_TYPES))
        if unknown:
            raise ValueError(f"hosts/netns name servers this run does not have: {unknown}")
        self.hosts = dict(hosts or {})
        self.netns = {name: list(prefix) for name, prefix in (netns or {}).items()}
        self.upstream_netns = list(upstream_netns or [])
        self.canned = CannedUpstream(self.workdir, self.upstream_port, tls=upstream_tls, netns=self.upstream_netns)
        self.upstream_cert = self.upstream_key = None
        self.upstream = None
        self.processes = {}
        self.servers = {}
        self.config_yaml = ""

    # -- lifecycle ----------------------------------------------------------------------

    def start(self, timeout=120):
        try:
            self._start_upstream()
            self._resolve_config()
            for name, server in self.servers.items():
                self._start_server(name, server)
            self._wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_upstream(self):
        self.canned.start()
        self.upstream = self.canned.process
        self.upstream_cert, self.upstream_key = self.canned.cert, self.canned.key

    def _resolve_config(self):
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
        if set(self.servers) != set(SERVER_TYPES):
            raise RuntimeError(f"make_config.py found servers {sorted(self.servers)}, want {sorted(SERVER_TYPES)}")

    def launch_command(self, server):
        """Gym's `_server_launch_command` with skip_venv_if_present and a ready venv."""
        venv = shlex.quote(str(self.venv))
        return (f"cd {shlex.quote(server['dir'])} && source {venv}/bin/activate "
                f"&& {shlex.quote(str(self.python))} {shlex.quote(server['entrypoint'])}")

    def _start_server(self, name, server):
        env = _clean_env()
        env["NEMO_GYM_CONFIG_DICT"] = self.config_yaml
        env["NEMO_GYM_CONFIG_PATH"] = name
        env["PYTHONPATH"] = ":".join(p for p in (server["dir"], env.get("PYTHONPATH")) if p)
        env["UV_CACHE_DIR"] = str(self.workdir / "cache" / "uv")
        env["UV_LOCK_TIMEOUT"] = "1800"
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
                    raise RuntimeError(f"server {name} exited with {process.returncode}:\n{self._tail(name + '.log')}")
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

    def example_row(self, index=0):
        path = Path(self.servers[RESOURCES]["dir"]).parent.parent / EXAMPLE_DATA
        with open(path) as f:
            for i, line in enumerate(f):
                if i == index:
                    return json.loads(line)
        raise IndexError(index)

    def rollout_body(self, task_index=0, rollout_index=0, attempt_index=None, *, row_index=None, pad_to=None,
                     prompt_suffix=None):
        """A flat row as rollout collection posts it to /run.

        row_index: the example row (default: task_index; the example file has 5 rows).
        prompt_suffix: appended to the row's last input message (the user's prompt), which the
        model server sends on to its upstream (e.g. a canary the tracer must never export).
        pad_to: lengthen the row's first input message (its developer prompt, as the long
        system prompts of example_multi_step's ~11 KB rows) until the JSON body is `pad_to`
        bytes; the `_ng_*` fields stay last, so they are only in the body's tail."""
        body = self.example_row(task_index if row_index is None else row_index)
        body["agent_ref"] = {"type": "responses_api_agents", "name": AGENT}
        body["_ng_task_index"] = task_index
        body["_ng_rollout_index"] = rollout_index
        if attempt_index is not None:
            body["_ng_attempt_index"] = attempt_index
        if prompt_suffix:
            last = body["responses_create_params"]["input"][-1]
            last["content"] = last["content"] + prompt_suffix
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
        request = urllib.request.Request(self.urls[AGENT] + "/run", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"/run answered {e.code}: {e.read()[:2000]!r}\n{self.logs()}") from e

    def upstream_requests(self):
        """What the canned upstream saw, in order (CannedUpstream.requests)."""
        return self.canned.requests()

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


def main():
    parser = argparse.ArgumentParser(description="Start the real Gym servers, drive one rollout, print paths.")
    parser.add_argument("--venv", default=None)
    parser.add_argument("--observability", action="store_true")
    parser.add_argument("--upstream-tls", action="store_true", help="the canned upstream serves HTTPS")
    parser.add_argument("--keep", action="store_true", help="keep the servers running until Ctrl-C")
    args = parser.parse_args()
    run = RealGymRun(args.venv, observability=args.observability, access_log=True, upstream_tls=args.upstream_tls)
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
