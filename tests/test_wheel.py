"""`pip install gym-tracer`: the wheel `cargo xtask wheel` builds (GYM_TRACER_WHEEL; `cargo xtask
test` builds it before pytest), installed into a fresh venv by pip with a PATH that holds no
Rust toolchain, is one binary that runs as the source build does: the same `--version`, the
same `doctor` report, and a traced rollout of Gym-shaped servers found with `--discover gym`
that is one trace of exactly the contract's tree. Its manylinux tag claims no older glibc than
the binary's symbols need, and its metadata is what the package page shows."""

import email.parser
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from gym_expect import assert_attached, containment_problems, rollout_trace_id
from gym_launch import drive_rollouts, run_body
from harness import agent_binary
from test_stitching import SPANS_PER_RUN, build_traces, expected_run_tree, render_shape, shape, \
    tracer_spans_so_far, wait_for

# What pip and the installed binary see: the system's directories only. No ~/.cargo/bin, no
# rustup: the wheel must need neither.
CLEAN_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def wheel_path():
    path = os.environ.get("GYM_TRACER_WHEEL")
    if not path or not Path(path).exists():
        pytest.fail(f"GYM_TRACER_WHEEL={path!r} is not a wheel: build it with `cargo xtask wheel` and "
                    "set GYM_TRACER_WHEEL to the file in target/wheels/ (`cargo xtask test` does both)")
    return Path(path)


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CARGO", "RUSTUP", "RUST", "VIRTUAL_ENV", "PYTHON", "GYM_TRACER"))}
    env["PATH"] = CLEAN_PATH
    return env


class Installed:
    def __init__(self, venv):
        self.venv = venv
        self.binary = venv / "bin" / "gym-tracer"

    def run(self, *args):
        return subprocess.run([str(self.binary), *args], env=clean_env(), capture_output=True, text=True,
                              timeout=120)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The wheel, installed by pip (offline, no dependencies) into a fresh venv."""
    assert shutil.which("cargo", path=CLEAN_PATH) is None and shutil.which("rustc", path=CLEAN_PATH) is None, \
        "a Rust toolchain is on the clean PATH: the test would not show the wheel needs none"
    venv = tmp_path_factory.mktemp("wheel") / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=clean_env())
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", "--no-deps",
                          str(wheel_path())], env=clean_env(), capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, f"pip install failed:\n{pip.stdout}\n{pip.stderr}"
    return Installed(venv)


def source(*args):
    return subprocess.run([str(agent_binary()), *args], capture_output=True, text=True, timeout=120)


def test_the_wheel_is_one_binary_and_its_metadata(installed):
    wheel = wheel_path()
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = email.parser.Parser().parsestr(
            archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode())
    outside_metadata = [n for n in names if ".dist-info/" not in n]
    assert outside_metadata == [f"gym_tracer-{metadata['Version']}.data/scripts/gym-tracer"], names
    assert metadata["Name"] == "gym-tracer"
    assert metadata["License-Expression"] == "Apache-2.0"
    assert "Operating System :: POSIX :: Linux" in metadata.get_all("Classifier")
    assert metadata.get_all("Project-URL"), "project URLs"
    page = metadata.get_payload()
    assert page.startswith("# gym-tracer"), "the package page is packaging/README.md"
    assert 'sudo "$(which gym-tracer)"' in page, "sudo with a venv's binary is documented on the page"
    relative = [link for link in re.findall(r"\]\(([^)]+)\)", page) if not link.startswith(("http://", "https://"))]
    assert not relative, f"links a package page cannot resolve: {relative}"
    print(f"\n{wheel.name}: {wheel.stat().st_size / 1e6:.1f} MB, binary "
          f"{installed.binary.stat().st_size / 1e6:.1f} MB installed")


def glibc_needed(binary):
    """The newest GLIBC_x.y symbol version the binary asks the dynamic linker for."""
    dump = subprocess.run(["objdump", "-T", str(binary)], capture_output=True, text=True, check=True).stdout
    versions = {tuple(int(p) for p in v.split(".")) for v in re.findall(r"\bGLIBC_(\d+\.\d+(?:\.\d+)?)\b", dump)}
    assert versions, dump[:2000]
    return max(versions)


def test_the_tag_claims_no_older_glibc_than_the_binary_needs(installed):
    tag = wheel_path().name.removesuffix(".whl").split("-")[-1]
    legacy = {"manylinux2014_x86_64": (2, 17), "manylinux2010_x86_64": (2, 12), "manylinux1_x86_64": (2, 5)}
    tags = tag.split(".")
    claimed = []
    for t in tags:
        match = re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", t)
        claimed.append((int(match[1]), int(match[2])) if match else legacy[t])
    needed = glibc_needed(installed.binary)
    print(f"\ntag {tag}: claims glibc {min(claimed)}; the binary needs GLIBC_{'.'.join(map(str, needed))}")
    assert needed[:2] <= min(claimed), f"the tag {tag} claims glibc {min(claimed)}, the binary needs {needed}"
    libraries = subprocess.run(["objdump", "-p", str(installed.binary)], capture_output=True, text=True,
                               check=True).stdout
    needed_libs = set(re.findall(r"NEEDED\s+(\S+)", libraries))
    # What manylinux lets a wheel take from the system; anything else would have to be in it.
    assert needed_libs <= {"libc.so.6", "libm.so.6", "libgcc_s.so.1", "libpthread.so.0", "libdl.so.2",
                           "ld-linux-x86-64.so.2", "librt.so.1"}, needed_libs


def test_version_and_doctor_are_the_source_builds(installed):
    version = installed.run("--version")
    assert version.returncode == 0, version.stderr
    assert version.stdout == source("--version").stdout
    doctor = installed.run("doctor")
    reference = source("doctor")
    assert doctor.returncode == reference.returncode == 0, doctor.stdout + doctor.stderr
    assert doctor.stdout == reference.stdout, "the installed doctor reports what the source build does"
    assert doctor.stdout.rstrip().endswith("gym-tracer can trace on this host.")


def test_the_installed_binary_traces_a_rollout(installed, gym, agents):
    run = gym()
    agent = agents(discover=True, binary=installed.binary, env={"PATH": CLEAN_PATH})
    assert_attached(agent, run)
    [sent] = drive_rollouts(run, [run_body(0, 0)])
    assert sent.status == 200, sent.response
    wait_for(lambda: len(tracer_spans_so_far(agent, run)), SPANS_PER_RUN)
    agent.stop()
    assert agent.returncode == 0, agent.stderr()
    spans = tracer_spans_so_far(agent, run)
    assert len(spans) == SPANS_PER_RUN, [s["name"] for s in spans]
    roots = build_traces(spans)[rollout_trace_id("0-0")]
    assert len(roots) == 1, "one trace, one root"
    assert shape(roots[0]) == expected_run_tree(run), render_shape(shape(roots[0]))
    assert not containment_problems(spans)
    summary = agent.summary()
    assert summary["spans_lost_in_export"] == 0 and summary["events_lost_in_kernel"] == 0, summary
