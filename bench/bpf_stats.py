"""Run time of one process's eBPF programs, as the kernel accounts it while
`kernel.bpf_stats_enabled` is 1: the sum of `run_time_ns` and `run_cnt` over the programs
whose file descriptors the process holds (`bpf_prog_info`, read with the bpf syscall)."""

import ctypes
import os
import struct
from contextlib import contextmanager

SYS_BPF = 321  # x86_64
BPF_PROG_GET_FD_BY_ID = 13
BPF_OBJ_GET_INFO_BY_FD = 15
INFO_SIZE = 256
RUN_TIME_OFFSET = 192  # bpf_prog_info.run_time_ns, then run_cnt
STATS_SWITCH = "/proc/sys/kernel/bpf_stats_enabled"

_libc = ctypes.CDLL(None, use_errno=True)


def _bpf(command, attr):
    buffer = ctypes.create_string_buffer(attr, 128)
    return _libc.syscall(SYS_BPF, command, buffer, 128)


def _program_ids(pid):
    ids = set()
    fdinfo = f"/proc/{pid}/fdinfo"
    for name in os.listdir(fdinfo):
        try:
            with open(f"{fdinfo}/{name}") as f:
                ids.update(int(line.split()[1]) for line in f if line.startswith("prog_id:"))
        except OSError:
            pass  # a descriptor closed meanwhile
    return ids


def run_time(pid):
    """(ns, runs) summed over the programs `pid` holds."""
    total_ns = total_runs = 0
    for prog_id in _program_ids(pid):
        fd = _bpf(BPF_PROG_GET_FD_BY_ID, struct.pack("III", prog_id, 0, 0))
        if fd < 0:
            continue
        info = ctypes.create_string_buffer(INFO_SIZE)
        try:
            if _bpf(BPF_OBJ_GET_INFO_BY_FD, struct.pack("IIQ", fd, INFO_SIZE, ctypes.addressof(info))) < 0:
                continue
        finally:
            os.close(fd)
        ns, runs = struct.unpack_from("QQ", info.raw, RUN_TIME_OFFSET)
        total_ns += ns
        total_runs += runs
    return total_ns, total_runs


@contextmanager
def stats_enabled():
    """Turns the kernel's per-program accounting on, and back to what it was."""
    with open(STATS_SWITCH) as f:
        before = f.read().strip()
    with open(STATS_SWITCH, "w") as f:
        f.write("1")
    try:
        yield
    finally:
        with open(STATS_SWITCH, "w") as f:
            f.write(before)
