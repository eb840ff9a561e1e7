//! Loads the eBPF programs into the kernel, attaches them to the syscall tracepoints, and owns
//! the maps user space writes (the PID filter) or reads (the loss counter).
//!
//! Everything that can be checked before loading is checked first, so that a missing
//! capability or kernel feature is reported by name with what to do about it, instead of as
//! an errno from deep inside the loader.

use std::path::Path;

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf},
    programs::TracePoint,
};
use tracer_abi::{KernelOffsets, SocketKey, SocketState};

use crate::btf::Btf;

/// The eBPF object built by `build.rs` from `tracer-ebpf`.
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracer-ebpf"));

const TRACEFS: &str = "/sys/kernel/tracing";
const BTF_PATH: &str = "/sys/kernel/btf/vmlinux";

/// (program, syscalls whose tracepoints it serves). Each program is attached to the
/// `sys_enter_*` tracepoint of every syscall listed; `exit_call` to all their `sys_exit_*`.
const ENTER_PROGRAMS: &[(&str, &[&str])] = &[
    ("enter_read_buffer", &["read", "recvfrom"]),
    ("enter_write_buffer", &["write", "sendto"]),
    ("enter_read_iovec", &["readv"]),
    ("enter_write_iovec", &["writev"]),
    ("enter_read_msghdr", &["recvmsg"]),
    ("enter_write_msghdr", &["sendmsg"]),
    ("enter_accept", &["accept", "accept4"]),
    ("enter_connect", &["connect"]),
];

/// Linux capability numbers (linux/capability.h).
const CAP_SYS_ADMIN: u32 = 21;
const CAP_PERFMON: u32 = 38;
const CAP_BPF: u32 = 39;

pub struct LoadOptions {
    pub capture_bytes: u32,
    pub ring_buffer_bytes: u32,
}

/// Optional features and why they are off, for the start-up report.
pub struct FeatureReport {
    pub socket_addresses: Result<(), String>,
}

pub struct LoadedProbes {
    ebpf: Ebpf,
    pub features: FeatureReport,
}

fn effective_capabilities() -> Result<u64> {
    let status =
        std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let line = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .context("no CapEff line in /proc/self/status")?;
    u64::from_str_radix(line.trim(), 16).context("parsing CapEff")
}

/// Fails with a message that names what is missing.
pub fn preflight() -> Result<()> {
    let caps = effective_capabilities()?;
    let has = |cap: u32| caps & (1u64 << cap) != 0;
    let mut missing = Vec::new();
    if !has(CAP_BPF) && !has(CAP_SYS_ADMIN) {
        missing.push("CAP_BPF");
    }
    if !has(CAP_PERFMON) && !has(CAP_SYS_ADMIN) {
        missing.push("CAP_PERFMON");
    }
    if !missing.is_empty() {
        bail!(
            "gym-tracer needs {} to load and attach its eBPF programs. Run it as root \
             (sudo gym-tracer ...) or grant the capabilities, e.g. \
             `setcap cap_bpf,cap_perfmon,cap_sys_ptrace+ep $(which gym-tracer)`",
            missing.join(" and ")
        );
    }
    ensure_tracefs()?;
    let events = Path::new(TRACEFS).join("events");
    let mut required = vec![
        "syscalls/sys_enter_close".to_string(),
        "sched/sched_process_exit".to_string(),
        "sched/sched_process_fork".to_string(),
    ];
    for syscall in ENTER_PROGRAMS
        .iter()
        .flat_map(|(_, syscalls)| syscalls.iter())
    {
        required.push(format!("syscalls/sys_enter_{syscall}"));
        required.push(format!("syscalls/sys_exit_{syscall}"));
    }
    let absent: Vec<String> = required
        .into_iter()
        .filter(|name| !events.join(name).exists())
        .collect();
    if !absent.is_empty() {
        bail!(
            "this kernel lacks tracepoints gym-tracer needs: {}. They come with \
             CONFIG_FTRACE_SYSCALLS=y; use a kernel built with it",
            absent.join(", ")
        );
    }
    Ok(())
}

/// aya finds tracepoint ids under tracefs; mount it if the host has not.
fn ensure_tracefs() -> Result<()> {
    if Path::new(TRACEFS).join("events").exists()
        || Path::new("/sys/kernel/debug/tracing/events").exists()
    {
        return Ok(());
    }
    let source = c"tracefs";
    let target = c"/sys/kernel/tracing";
    // SAFETY: constant NUL-terminated strings; mount(2) does not keep the pointers.
    let rc = unsafe {
        libc::mount(
            source.as_ptr(),
            target.as_ptr(),
            source.as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        bail!(
            "tracefs is not mounted and mounting it at {TRACEFS} failed ({}). Mount it with \
             `mount -t tracefs nodev {TRACEFS}` (in a container: mount the host's {TRACEFS})",
            std::io::Error::last_os_error()
        );
    }
    eprintln!("gym-tracer: mounted tracefs at {TRACEFS}");
    Ok(())
}

fn socket_offsets() -> Result<KernelOffsets, String> {
    let data = std::fs::read(BTF_PATH).map_err(|e| {
        format!("{BTF_PATH} unreadable ({e}): the kernel has no BTF (CONFIG_DEBUG_INFO_BTF)")
    })?;
    Btf::parse(&data)
        .and_then(|btf| btf.kernel_offsets())
        .map_err(|e| format!("{e:#}"))
}

impl LoadedProbes {
    pub fn load(options: &LoadOptions) -> Result<Self> {
        // Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK.
        let unlimited = libc::rlimit {
            rlim_cur: libc::RLIM_INFINITY,
            rlim_max: libc::RLIM_INFINITY,
        };
        // SAFETY: valid rlimit pointer.
        unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) };

        let (offsets, socket_addresses) = match socket_offsets() {
            Ok(offsets) => (offsets, Ok(())),
            Err(why) => (KernelOffsets::default(), Err(why)),
        };
        let ring_bytes = options.ring_buffer_bytes.next_power_of_two().max(4096);
        let mut ebpf = EbpfLoader::new()
            .override_global("CAPTURE_BYTES", &options.capture_bytes, true)
            .override_global("KERNEL_OFFSETS", &offsets, true)
            .map_max_entries("EVENTS", ring_bytes)
            .load(EBPF_OBJECT)
            .context("loading the eBPF programs into the kernel")?;

        for (program, syscalls) in ENTER_PROGRAMS {
            let tracepoint = tracepoint(&mut ebpf, program)?;
            for syscall in *syscalls {
                tracepoint
                    .attach("syscalls", &format!("sys_enter_{syscall}"))
                    .with_context(|| {
                        format!("attaching {program} to syscalls/sys_enter_{syscall}")
                    })?;
            }
        }
        let exit = tracepoint(&mut ebpf, "exit_call")?;
        for (_, syscalls) in ENTER_PROGRAMS {
            for syscall in *syscalls {
                exit.attach("syscalls", &format!("sys_exit_{syscall}"))
                    .with_context(|| {
                        format!("attaching exit_call to syscalls/sys_exit_{syscall}")
                    })?;
            }
        }
        tracepoint(&mut ebpf, "enter_close")?
            .attach("syscalls", "sys_enter_close")
            .context("attaching enter_close")?;
        tracepoint(&mut ebpf, "process_exit")?
            .attach("sched", "sched_process_exit")
            .context("attaching process_exit")?;
        tracepoint(&mut ebpf, "process_fork")?
            .attach("sched", "sched_process_fork")
            .context("attaching process_fork")?;

        Ok(Self {
            ebpf,
            features: FeatureReport { socket_addresses },
        })
    }

    pub fn take_ring_buffer(&mut self) -> Result<RingBuf<MapData>> {
        let map = self
            .ebpf
            .take_map("EVENTS")
            .context("EVENTS map missing from the eBPF object")?;
        RingBuf::try_from(map).context("EVENTS is not a ring buffer")
    }

    fn traced_pids(&mut self) -> Result<BpfHashMap<&mut MapData, u32, u8>> {
        let map = self
            .ebpf
            .map_mut("TRACED_PIDS")
            .context("TRACED_PIDS map missing")?;
        BpfHashMap::try_from(map).context("TRACED_PIDS has the wrong type")
    }

    pub fn trace_pid(&mut self, pid: u32) -> Result<()> {
        self.traced_pids()?
            .insert(pid, tracer_abi::TRACED_BY_USER, 0)
            .with_context(|| format!("adding pid {pid} to the PID filter"))
    }

    pub fn untrace_pid(&mut self, pid: u32) {
        if let Ok(mut map) = self.traced_pids() {
            let _ = map.remove(&pid);
        }
    }

    /// Stops the kernel from reporting a socket, if it still is the connection `conn_id`.
    pub fn untrack_socket(&mut self, pid: u32, fd: i32, conn_id: u64) {
        let Some(map) = self.ebpf.map_mut("SOCKETS") else {
            return;
        };
        let Ok(mut sockets) = BpfHashMap::<_, SocketKey, SocketState>::try_from(map) else {
            return;
        };
        let key = SocketKey { tgid: pid, fd };
        if sockets
            .get(&key, 0)
            .is_ok_and(|state| state.conn_id == conn_id)
        {
            let _ = sockets.remove(&key);
        }
    }

    /// Records the kernel could not put on the ring buffer, summed over CPUs.
    pub fn lost_events(&self) -> u64 {
        let Some(map) = self.ebpf.map("LOST_EVENTS") else {
            return 0;
        };
        let Ok(counter) = PerCpuArray::<_, u64>::try_from(map) else {
            return 0;
        };
        counter
            .get(&0, 0)
            .map(|values| values.iter().sum())
            .unwrap_or(0)
    }
}

fn tracepoint<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut TracePoint> {
    let program: &mut TracePoint = ebpf
        .program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?
        .try_into()
        .with_context(|| format!("program {name} is not a tracepoint"))?;
    program
        .load()
        .with_context(|| format!("the kernel verifier rejected {name}"))?;
    Ok(program)
}
