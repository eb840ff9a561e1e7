"""Arize Phoenix, a real OTLP trace backend with a web UI built for LLM and agent traces, run
offline on loopback (`cargo xtask demo --ui`, tests/test_backend.py), and headless Chromium to
look at its pages.

Phoenix takes OTLP/HTTP at /v1/traces on its UI port and OTLP/gRPC on its own port, stores the
spans in SQLite under its working directory, and answers metrics with 405 (it takes traces
only). Spans land in the project their resource's `openinference.project.name` names, else
`default`; /redirects/traces/<trace id> opens a trace's page whatever its project.

Offline: with telemetry off alone, Phoenix still tries to download a WASM sandbox, to reach a
documentation server and to link web fonts at startup; OFFLINE turns each of those off (with
them, strace showed no outbound connection).
"""

import json
import os
import subprocess
import tempfile
import urllib.parse
import urllib.request
from pathlib import Path

from harness import ROOT, free_port, interrupt, wait_until

OFFLINE = {
    "PHOENIX_TELEMETRY_ENABLED": "false",
    "PHOENIX_ALLOW_EXTERNAL_RESOURCES": "false",
    "PHOENIX_DISABLE_AGENT_ASSISTANT": "true",
    "PHOENIX_ALLOWED_SANDBOX_PROVIDERS": "NONE",
    "PHOENIX_LOG_MIGRATIONS": "false",
}
PROJECT = "default"


def phoenix_venv():
    """target/phoenix-venv (`cargo xtask setup`), or where GYM_PHOENIX_VENV says."""
    return Path(os.environ.get("GYM_PHOENIX_VENV") or ROOT / "target" / "phoenix-venv")


class Phoenix:
    """One Phoenix server on 127.0.0.1 with a fresh database. Its gRPC port listens on every
    interface whatever PHOENIX_HOST says (Phoenix has no setting for it); nothing is sent to
    it here."""

    def __init__(self, venv=None, port=None, workdir=None):
        self.venv = Path(venv or phoenix_venv())
        self.port = port or free_port()
        self.grpc_port = free_port()
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="gym-tracer-phoenix-"))
        self.log_path = self.workdir / "phoenix.log"
        self.process = None

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.port}"

    @property
    def traces_url(self):
        """The OTLP/HTTP traces endpoint (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT: used as it is)."""
        return f"{self.base_url}/v1/traces"

    def trace_url(self, trace_id):
        return f"{self.base_url}/redirects/traces/{trace_id}"

    def start(self, timeout=180):
        """Starts it and waits until its UI answers (15-25 s on a fresh database, more on a
        busy machine: it migrates the schema first)."""
        executable = self.venv / "bin" / "phoenix"
        if not executable.exists():
            raise FileNotFoundError(f"no Phoenix at {executable}: run `cargo xtask setup`")
        env = dict(os.environ, **OFFLINE,
                   PHOENIX_HOST="127.0.0.1", PHOENIX_PORT=str(self.port), PHOENIX_GRPC_PORT=str(self.grpc_port),
                   PHOENIX_WORKING_DIR=str(self.workdir),
                   PHOENIX_SQL_DATABASE_URL=f"sqlite:///{self.workdir / 'phoenix.db'}")
        env = {k: v for k, v in env.items() if not k.startswith("OTEL_")}
        self.process = subprocess.Popen([str(executable), "serve"], env=env, cwd=self.workdir,
                                        stdout=open(self.log_path, "wb"), stderr=subprocess.STDOUT)

        def up():
            if self.process.poll() is not None:
                raise RuntimeError(f"Phoenix exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/healthz", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        wait_until(up, timeout, lambda: f"Phoenix answering on {self.base_url}:\n{self.log_tail()}", interval=0.5)
        return self

    def get(self, path, **query):
        url = f"{self.base_url}{path}"
        if query:
            url += "?" + urllib.parse.urlencode({k: v for k, v in query.items() if v is not None})
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.load(response)

    def spans(self, trace_id, project=PROJECT):
        """Every span Phoenix stored for `trace_id`, through its REST API (paged)."""
        spans, cursor = [], None
        while True:
            page = self.get(f"/v1/projects/{project}/spans", trace_id=trace_id, limit=1000, cursor=cursor)
            spans += page["data"]
            cursor = page.get("next_cursor")
            if not cursor:
                return spans

    def log_tail(self, lines=40):
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self, timeout=30):
        """SIGINT: Phoenix shuts down cleanly (SIGTERM works too, exiting with 143)."""
        if self.process is not None:
            interrupt(self.process, timeout)
