"""Two "hosts" on one machine: the root network namespace (host A) and one new network
namespace (host B), joined by a veth pair on a /24 of their own.

    with TwoHosts() as hosts:
        hosts.a_address   # 10.231.N.1, the veth end in the root namespace
        hosts.b_address   # 10.231.N.2, the veth end inside namespace `hosts.b_name`
        hosts.b_exec      # ["ip", "netns", "exec", name]: prefix a command to run it on B
        hosts.b_enter     # ["nsenter", "--net=/run/netns/<name>", "--"]: the same, mounts kept

Traffic between A and B crosses the veth, so each side sees the other's address, not
127.0.0.1: a request from A to B is a real cross-host TCP connection for whatever traces it.
Only the pid namespace is shared (one machine), which is what lets one gym-tracer per host
attach by pid.

`b_exec` vs `b_enter`: `ip netns exec` also unshares the mount namespace and mounts a fresh
sysfs on /sys, so what was mounted under /sys in the root namespace (tracefs at
/sys/kernel/tracing, where gym-tracer finds its syscall tracepoints) is not there. A program
that needs those mounts (gym-tracer) is run with `b_enter` (setns into the network namespace
only); both exec the command, so its pid is the one Popen returns.

Needs root and the `ip` command (iproute2); `b_enter` also needs `nsenter` (util-linux).
N is random in 1..250, avoiding any 10.231.N. address this machine already has (a concurrent
run). The namespace is deleted on exit, also after a failure, which removes the veth pair.
"""

import os
import random
import re
import secrets
import shutil
import subprocess

import pytest

NETNS_DIR = "/run/netns"  # where `ip netns add` binds the namespace (iproute2's NETNS_RUN_DIR)


def _ip(*args, check=True):
    """`ip ARGS...`; a failure raises with ip's stderr."""
    out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and out.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed ({out.returncode}): {out.stderr.strip()}")
    return out


def _subnets_in_use():
    """The N of every 10.231.N.x address this machine (its root namespace) has."""
    text = _ip("-o", "addr").stdout
    return {int(n) for n in re.findall(r"\binet 10\.231\.(\d+)\.", text)}


class TwoHosts:
    """Host A = the root network namespace (10.231.N.1), host B = a new one (10.231.N.2)."""

    def __init__(self):
        suffix = secrets.token_hex(3)
        self.b_name = f"gtb-{suffix}"
        self.a_link = f"gta{suffix}"  # in the root namespace
        self.b_link = f"gtb{suffix}"  # moved into the namespace
        self.subnet = None
        self._created = False

    @property
    def a_address(self):
        return f"10.231.{self.subnet}.1"

    @property
    def b_address(self):
        return f"10.231.{self.subnet}.2"

    @property
    def b_exec(self):
        """Prefix that runs a command on host B: `ip netns exec NAME` (fresh /sys, see above)."""
        return ["ip", "netns", "exec", self.b_name]

    @property
    def b_enter(self):
        """Prefix that runs a command on host B with this machine's mounts (tracefs) kept."""
        return ["nsenter", f"--net={NETNS_DIR}/{self.b_name}", "--"]

    def __enter__(self):
        if os.geteuid() != 0:
            pytest.fail("TwoHosts makes a network namespace and a veth pair: run the tests as root",
                        pytrace=False)
        missing = [tool for tool in ("ip", "nsenter") if shutil.which(tool) is None]
        if missing:
            pytest.fail(f"TwoHosts needs {' and '.join(missing)}: `apt-get install iproute2 util-linux`",
                        pytrace=False)
        used = _subnets_in_use()
        free = [n for n in range(1, 251) if n not in used]
        if not free:
            raise RuntimeError("every 10.231.N.0/24 (N in 1..250) is in use on this machine")
        self.subnet = random.choice(free)
        try:
            self._create()
        except BaseException:
            self._delete_quietly()
            raise
        return self

    def _create(self):
        _ip("netns", "add", self.b_name)
        self._created = True
        _ip("link", "add", self.a_link, "type", "veth", "peer", "name", self.b_link)
        _ip("link", "set", self.b_link, "netns", self.b_name)
        _ip("addr", "add", f"{self.a_address}/24", "dev", self.a_link)
        _ip("link", "set", self.a_link, "up")
        _ip("-n", self.b_name, "addr", "add", f"{self.b_address}/24", "dev", self.b_link)
        _ip("-n", self.b_name, "link", "set", self.b_link, "up")
        _ip("-n", self.b_name, "link", "set", "lo", "up")

    def _delete(self):
        """Deleting the namespace destroys the veth end inside it, and with it its peer; the
        peer is deleted by hand if setup failed before it was moved in."""
        errors = []
        if self._created:
            out = _ip("netns", "del", self.b_name, check=False)
            if out.returncode != 0:
                errors.append(f"`ip netns del {self.b_name}`: {out.stderr.strip()}")
            self._created = False
        if _ip("link", "show", self.a_link, check=False).returncode == 0:
            out = _ip("link", "del", self.a_link, check=False)
            # The kernel destroys the pair asynchronously after `netns del`: gone meanwhile is done.
            if out.returncode != 0 and "Cannot find device" not in out.stderr:
                errors.append(f"`ip link del {self.a_link}`: {out.stderr.strip()}")
        if errors:
            raise RuntimeError("could not clean up the second host: " + "; ".join(errors))

    def _delete_quietly(self):
        """Cleanup after a failure: a cleanup error is printed, not raised over the failure."""
        try:
            self._delete()
        except RuntimeError as error:
            print(error)

    def __exit__(self, exc_type, exc, traceback):
        if exc_type is None:
            self._delete()
        else:
            self._delete_quietly()

    def __repr__(self):
        return f"TwoHosts(A={self.a_address} (root namespace), B={self.b_address} (netns {self.b_name}))"
