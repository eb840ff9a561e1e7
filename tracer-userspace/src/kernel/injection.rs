//! `--inject-traceparent`: the cgroup `sock_ops` program that puts traced processes' client
//! sockets in a sockhash, the `sk_msg` program on that sockhash that inserts the armed
//! `traceparent` line, and the checks `doctor` makes of them.
//!
//! Off by default: a socket in a sockhash is handled by the kernel's sockmap code, and on
//! some kernels that changes what `FIONREAD` reports for it ([`fionread_hazard`]).

use std::fs::File;
use std::io::{Read as _, Write as _};
use std::net::{TcpListener, TcpStream};
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf,
    maps::SockHash,
    programs::{CgroupAttachMode, SkMsg, SockOps},
};
use tracer_abi::{
    INJECT_CARRIED, INJECT_FAILED, INJECT_HANDED_OVER, INJECT_HEAD_UNSCANNED, INJECT_NO_TRACE,
    INJECT_NOT_DELIVERED, INJECT_OWNER_DONE, INJECT_SOCKETS_FULL, INJECT_WRITTEN,
};

/// Which outbound requests the kernel writes a `traceparent` into (`--inject-traceparent`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InjectScope {
    /// Those to a peer off this host ([`tracer_abi::peer_on_host`]).
    Remote,
    /// Every one.
    All,
}

impl InjectScope {
    /// The eBPF side's `INJECT_TRACEPARENT`.
    pub fn kernel_value(self) -> u32 {
        match self {
            InjectScope::Remote => tracer_abi::INJECT_REMOTE,
            InjectScope::All => tracer_abi::INJECT_ALL,
        }
    }
}

/// The injection programs: loaded and attached only with `--inject-traceparent`.
pub const INJECTION_PROGRAMS: [&str; 2] = ["inject_sockets", "inject_traceparent"];

const SOCKETS_MAP: &str = "INJECT_SOCKETS";

/// The maps of the tracing object that only injection writes (sized down to one entry
/// without it; the sockhash and `CONNECTING` are in the injection object alone).
pub const INJECTION_MAPS: [&str; 5] = [
    "INJECT_TRACES",
    "INJECT_ARMED",
    "INBOUND_TRACES",
    "LOCAL_CALL_TRACES",
    "TRACE_KNOWN_AT_WRITE",
];

/// What the kernel did with traced processes' request writes (`tracer_abi::INJECT_*`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InjectionCounters {
    pub written: u64,
    pub no_trace: u64,
    pub carried: u64,
    pub head_unscanned: u64,
    pub owner_answered: u64,
    pub not_delivered: u64,
    pub failed: u64,
    pub sockets_map_full: u64,
    pub handed_over: u64,
}

impl InjectionCounters {
    pub fn from_slots(slots: &[u64]) -> Self {
        let slot = |index: u32| slots.get(index as usize).copied().unwrap_or(0);
        Self {
            written: slot(INJECT_WRITTEN),
            no_trace: slot(INJECT_NO_TRACE),
            carried: slot(INJECT_CARRIED),
            head_unscanned: slot(INJECT_HEAD_UNSCANNED),
            owner_answered: slot(INJECT_OWNER_DONE),
            not_delivered: slot(INJECT_NOT_DELIVERED),
            failed: slot(INJECT_FAILED),
            sockets_map_full: slot(INJECT_SOCKETS_FULL),
            handed_over: slot(INJECT_HANDED_OVER),
        }
    }
}

/// Loads both programs (the verifier's verdict) without attaching either.
pub fn load(ebpf: &mut Ebpf) -> Result<()> {
    sk_msg(ebpf)?
        .load()
        .context("the kernel verifier rejected inject_traceparent (sk_msg)")?;
    sock_ops(ebpf)?
        .load()
        .context("the kernel verifier rejected inject_sockets (sock_ops)")?;
    Ok(())
}

/// Loads and attaches: `sk_msg` to the sockhash, `sock_ops` to the root of the cgroup v2
/// hierarchy (every process below it; only traced ones' sockets enter the sockhash).
pub fn attach(ebpf: &mut Ebpf) -> Result<()> {
    load(ebpf)?;
    attach_sk_msg(ebpf)?;
    match fionread_hazard(ebpf) {
        Ok(None) => {}
        Ok(Some(reported)) => tracing::warn!(
            "on this kernel a socket in the injection sockhash reports {reported} for FIONREAD \
             with bytes waiting: a runtime that sizes its reads by FIONREAD may stall on \
             traced processes' outbound connections (aiohttp, uvloop and asyncio do not use it)"
        ),
        Err(why) => tracing::warn!("could not check FIONREAD on an injected socket: {why:#}"),
    }
    let root = cgroup2_root()?;
    let cgroup = File::open(&root).with_context(|| format!("opening {}", root.display()))?;
    // Through a bpf_link (kernel 5.7+), which takes no flags and coexists with the
    // programs other tools attached there, as BPF_F_ALLOW_MULTI would.
    sock_ops(ebpf)?
        .attach(cgroup, CgroupAttachMode::Single)
        .with_context(|| {
            format!(
                "attaching inject_sockets (sock_ops) to the cgroup {}",
                root.display()
            )
        })?;
    tracing::info!(
        "--inject-traceparent: sockets of traced processes below the cgroup {} enter the sockhash",
        root.display()
    );
    Ok(())
}

pub fn attach_sk_msg(ebpf: &mut Ebpf) -> Result<()> {
    let map_fd = {
        let map = ebpf
            .map(SOCKETS_MAP)
            .context("map INJECT_SOCKETS missing from the eBPF object")?;
        let sockets: SockHash<_, u64> = SockHash::try_from(map)?;
        sockets.fd().try_clone()?
    };
    sk_msg(ebpf)?
        .attach(&map_fd)
        .context("attaching inject_traceparent (sk_msg) to its sockhash")?;
    Ok(())
}

fn sk_msg(ebpf: &mut Ebpf) -> Result<&mut SkMsg> {
    let program = ebpf
        .program_mut("inject_traceparent")
        .context("program inject_traceparent missing from the eBPF object")?;
    Ok(program.try_into()?)
}

fn sock_ops(ebpf: &mut Ebpf) -> Result<&mut SockOps> {
    let program = ebpf
        .program_mut("inject_sockets")
        .context("program inject_sockets missing from the eBPF object")?;
    Ok(program.try_into()?)
}

/// The root of the cgroup v2 hierarchy `sock_ops` attaches to: the host's. In a container
/// that shares the host's PID namespace (the DaemonSet's), the container's own
/// `/sys/fs/cgroup` is only its pod's cgroup, and servers in other pods would never reach the
/// sockhash; the host's init sees the node's root, which `/proc/1/root` reaches (with
/// CAP_SYS_PTRACE). Where that is not readable, or is the same directory, the hierarchy of
/// this process's own mount table (`/sys/fs/cgroup` on a unified host,
/// `/sys/fs/cgroup/unified` on a hybrid one).
pub fn cgroup2_root() -> Result<PathBuf> {
    cgroup2_root_in(Path::new("/proc"))
}

fn cgroup2_root_in(proc: &Path) -> Result<PathBuf> {
    let own = std::fs::read_to_string(proc.join("self/mountinfo"))
        .ok()
        .as_deref()
        .and_then(cgroup2_mount_point);
    let hosts = std::fs::read_to_string(proc.join("1/mountinfo"))
        .ok()
        .as_deref()
        .and_then(cgroup2_mount_point)
        .map(|mount| {
            proc.join("1/root")
                .join(mount.strip_prefix("/").unwrap_or(&mount))
        })
        .filter(|through_init| File::open(through_init).is_ok());
    match (own, hosts) {
        (Some(own), Some(hosts)) if !same_directory(&own, &hosts) => Ok(hosts),
        (Some(own), _) => Ok(own),
        (None, Some(hosts)) => Ok(hosts),
        (None, None) => bail!(
            "no cgroup v2 hierarchy is mounted, and --inject-traceparent attaches to one: \
             mount it (`mount -t cgroup2 none /sys/fs/cgroup/unified`) or run without \
             --inject-traceparent"
        ),
    }
}

fn same_directory(a: &Path, b: &Path) -> bool {
    use std::os::unix::fs::MetadataExt as _;
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(a), Ok(b)) => (a.dev(), a.ino()) == (b.dev(), b.ino()),
        _ => false,
    }
}

/// The mount point of the first `cgroup2` mount of a `mountinfo` table: the root of the
/// hierarchy as this process sees it (its cgroup namespace's root).
fn cgroup2_mount_point(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (fields, after) = line.split_once(" - ")?;
        let fstype = after.split_whitespace().next()?;
        let mount_point = fields.split_whitespace().nth(4)?;
        (fstype == "cgroup2").then(|| PathBuf::from(mount_point.replace("\\040", " ")))
    })
}

/// Whether a socket in the sockhash still reports its unread bytes through `FIONREAD`:
/// `Ok(None)` when it does, `Ok(Some(reported))` when it reports `reported` instead of what
/// is waiting (runtimes that size their reads by it stall on such a socket). A loopback
/// connection of this process goes in the sockhash for the check and is closed after it.
pub fn fionread_hazard(ebpf: &mut Ebpf) -> Result<Option<i32>> {
    let listener = TcpListener::bind("127.0.0.1:0").context("a loopback listener")?;
    let client = TcpStream::connect(listener.local_addr()?).context("a loopback connection")?;
    let (mut server, _) = listener.accept()?;
    {
        let map = ebpf
            .map_mut(SOCKETS_MAP)
            .context("map INJECT_SOCKETS missing from the eBPF object")?;
        let mut sockets: SockHash<_, u64> = SockHash::try_from(map)?;
        sockets
            .insert(u64::MAX, client.as_raw_fd(), 0)
            .context("putting a test socket in the sockhash")?;
    }
    const SENT: &[u8] = b"fionread";
    server.write_all(SENT)?;
    let mut waiting: libc::c_int = 0;
    for _ in 0..50 {
        // SAFETY: FIONREAD writes one int through a valid pointer.
        if unsafe { libc::ioctl(client.as_raw_fd(), libc::FIONREAD, &mut waiting) } != 0 {
            bail!("FIONREAD failed: {}", std::io::Error::last_os_error());
        }
        if waiting as usize == SENT.len() {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // The bytes are there whatever FIONREAD said: a read proves the socket still works.
    let mut client = client;
    client.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut received = [0u8; SENT.len()];
    client
        .read_exact(&mut received)
        .context("reading from a socket in the sockhash")?;
    Ok((waiting as usize != SENT.len()).then_some(waiting))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cgroup2_mount_is_found_on_hybrid_and_unified_hosts() {
        let hybrid = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - tmpfs tmpfs ro,mode=755\n\
                      35 30 0:30 / /sys/fs/cgroup/unified rw,nosuid - cgroup2 cgroup2 rw\n\
                      36 30 0:31 / /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n";
        assert_eq!(
            cgroup2_mount_point(hybrid),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        let unified = "29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw\n";
        assert_eq!(
            cgroup2_mount_point(unified),
            Some(PathBuf::from("/sys/fs/cgroup"))
        );
        assert_eq!(
            cgroup2_mount_point("36 30 0:31 / /x rw - cgroup cgroup rw\n"),
            None
        );
    }

    #[test]
    fn the_hosts_cgroup_root_is_reached_through_init_when_it_is_not_this_processs() {
        let proc = std::env::temp_dir().join(format!("gym-tracer-cgroup-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&proc);
        let mount =
            |mount_point: &str| format!("29 23 0:26 / {mount_point} rw - cgroup2 cgroup2 rw\n");
        std::fs::create_dir_all(proc.join("self")).unwrap();
        std::fs::create_dir_all(proc.join("1/root/sys/fs/cgroup/unified")).unwrap();
        std::fs::write(proc.join("1/mountinfo"), mount("/sys/fs/cgroup/unified")).unwrap();
        // A container: its own hierarchy is a directory of its own (its pod's cgroup).
        let own = proc.join("pod-cgroup");
        std::fs::create_dir_all(&own).unwrap();
        std::fs::write(proc.join("self/mountinfo"), mount(own.to_str().unwrap())).unwrap();
        let through_init = proc.join("1/root/sys/fs/cgroup/unified");
        assert_eq!(cgroup2_root_in(&proc).unwrap(), through_init);
        // On the host itself both name one directory: this process's path is kept.
        let host_path = proc.join("host-cgroup");
        std::os::unix::fs::symlink(&through_init, &host_path).unwrap();
        std::fs::write(
            proc.join("self/mountinfo"),
            mount(host_path.to_str().unwrap()),
        )
        .unwrap();
        assert_eq!(cgroup2_root_in(&proc).unwrap(), host_path);
        // Init's root out of reach (no CAP_SYS_PTRACE, or a sandbox): this process's own.
        std::fs::write(proc.join("self/mountinfo"), mount(own.to_str().unwrap())).unwrap();
        std::fs::remove_dir_all(proc.join("1/root")).unwrap();
        assert_eq!(cgroup2_root_in(&proc).unwrap(), own);
        std::fs::write(proc.join("self/mountinfo"), "").unwrap();
        assert!(cgroup2_root_in(&proc).is_err());
        std::fs::remove_dir_all(&proc).unwrap();
    }

    #[test]
    fn kernel_slots_name_their_outcomes() {
        let mut slots = vec![0; tracer_abi::INJECT_OUTCOMES as usize];
        slots[INJECT_WRITTEN as usize] = 3;
        slots[INJECT_OWNER_DONE as usize] = 2;
        let counters = InjectionCounters::from_slots(&slots);
        assert_eq!((counters.written, counters.owner_answered), (3, 2));
        assert_eq!(counters.no_trace + counters.failed, 0);
    }
}
