//! Loads the eBPF programs into the kernel, attaches them to the syscall tracepoints, and owns
//! the maps user space writes (the PID filter) or reads (the loss counter).
//!
//! Everything that can be checked before loading is checked first, so that a missing
//! capability or kernel feature is reported by name with what to do about it, instead of as
//! an errno from deep inside the loader.

use std::io;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use aya::{
    Ebpf, EbpfLoader,
    maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, ProgramArray, RingBuf},
    programs::{
        TracePoint, UProbe,
        uprobe::{UProbeLinkId, UProbeScope},
    },
};
use tracer_abi::{
    AsyncioProcess, CONTEXT_CHAIN_EMPTY, CONTEXT_CHAIN_READ, CONTEXT_LOST, CONTEXT_NOT_A_CONTEXT,
    CONTEXT_OUTCOMES, CONTEXT_READ_FAILED, CONTEXT_THREAD_UNKNOWN, InjectKey, InjectTrace,
    KernelOffsets, PythonThread, SocketKey, SocketState, TaskKey, TaskLineage, ThreadCalls,
    TracepointLayout, UNTRACKED_PENDING_CALLS_FULL, UNTRACKED_SOCKET_MAP_FULL,
    UNTRACKED_UNKNOWN_SOCKET_TRANSFER,
};

use crate::kernel::btf::Btf;
use crate::kernel::injection::{
    self, INJECTION_MAPS, INJECTION_PROGRAMS, InjectScope, InjectionCounters,
};
use crate::kernel::tracepoint_format;
use crate::model::ids::MintKey;
use crate::processes::tls_library::SSL_FUNCTIONS;

/// The uretprobe program every probed SSL function's return is attached to.
const SSL_RETURN_PROGRAM: &str = "ssl_return";

/// The uprobe on `_asyncio`'s `Task.__init__` (`--task-lineage`), attached per probed process.
const TASK_CREATED_PROGRAM: &str = "task_created";

/// Tracepoint programs never attached: the exit program tail-calls them (`TAIL_CALLS`, slot
/// by position here), so that the verifier checks each once, apart from it.
const TAIL_CALLED_PROGRAMS: [&str; 1] = ["scan_inbound_trace"];

/// The uprobe programs: the SSL ones, attached per TLS library when a traced process maps
/// one, and the task-creation probe.
fn uprobe_programs() -> impl Iterator<Item = &'static str> {
    SSL_FUNCTIONS
        .iter()
        .map(|(_, program)| *program)
        .chain([SSL_RETURN_PROGRAM, TASK_CREATED_PROGRAM])
}

/// The eBPF object built by `build.rs` from `tracer-ebpf` (empty in a build made with
/// `AYA_BUILD_SKIP=1`, such as the fuzz target's, which never loads it).
static EBPF_OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracer-ebpf"));

/// The same programs plus the two of `--inject-traceparent` and their sockhash, built from the
/// same source: loaded only with the flag, since creating a sockhash needs `CAP_NET_ADMIN`.
static EBPF_INJECT_OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/tracer-ebpf-inject"));

/// Where the agent mounts tracefs when the host has not; aya also looks under debugfs.
pub const TRACEFS: &str = "/sys/kernel/tracing";
const TRACEFS_PLACES: [&str; 2] = [TRACEFS, "/sys/kernel/debug/tracing"];
pub const BTF_PATH: &str = "/sys/kernel/btf/vmlinux";

/// `PROC_PID_INIT_INO` (include/linux/proc_ns.h): the inode of the initial PID namespace.
const INIT_PID_NAMESPACE_INODE: u64 = 0xEFFF_FFFC;

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

pub struct LoadOptions {
    pub capture_bytes: u32,
    pub ring_buffer_bytes: u32,
    /// `--max-connections`: the entries of the kernel's socket map too.
    pub max_connections: usize,
    /// `--inject-traceparent`, when on: load and attach the injection programs, and arm the
    /// writes it names.
    pub inject_traceparent: Option<InjectScope>,
    /// The secret the kernel mints inbound requests' traces from (see [`MintKey`]).
    pub mint_key: MintKey,
    /// `--max-tasks`: the tasks whose lineage the kernel keeps; 0 when no process will be
    /// probed (`--task-lineage off`), which leaves the map at one entry.
    pub max_tasks: u32,
}

impl LoadOptions {
    /// `--inject-traceparent` is on.
    pub fn injects(&self) -> bool {
        self.inject_traceparent.is_some()
    }

    /// The socket map's size: twice the table's, so that the table, not the kernel, decides
    /// which connections to follow up to `--max-connections` (the kernel also holds the
    /// sockets the table gave up as not HTTP, and opens the table has not read yet). A map
    /// needs one entry at least, and the kernel takes a u32.
    pub fn socket_map_entries(&self) -> u32 {
        u32::try_from(self.max_connections.saturating_mul(2))
            .unwrap_or(u32::MAX)
            .max(1)
    }
}

/// Optional features and why they are off, for the start-up report.
pub struct FeatureReport {
    pub socket_addresses: Result<(), String>,
}

/// What the kernel programs count themselves.
#[derive(Clone, Debug, Default)]
pub struct KernelCounters {
    /// Records the kernel could not put on the ring buffer, per possible CPU.
    pub events_lost_by_cpu: Vec<u64>,
    /// New threads of traced processes that the fork program kept out of the PID filter.
    pub threads_ignored: u64,
    /// New processes of traced processes that the full PID filter could not take.
    pub forks_unfollowed: u64,
    /// Connections opened while the socket map was full (`--max-connections`).
    pub sockets_untracked_map_full: u64,
    /// Transfers that moved bytes on TCP sockets the kernel does not know.
    pub transfers_on_unknown_sockets: u64,
    /// Socket calls not followed because the pending-call map was full.
    pub socket_calls_untracked_map_full: u64,
    /// Message-start writes of traced processes, by what the context read did
    /// (`tracer_abi::CONTEXT_*`).
    pub context_chains_read: u64,
    pub context_chains_empty: u64,
    pub context_thread_unknown: u64,
    pub context_not_a_context: u64,
    pub context_reads_failed: u64,
    pub context_records_lost: u64,
    pub injection: InjectionCounters,
    /// Hits of the task-creation probe, by what it found (`tracer_abi::PROBE_*`).
    pub lineage: LineageProbeCounters,
}

/// What the task-creation probe found at each task created (see `tracer-ebpf/src/lineage.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LineageProbeCounters {
    /// Request roots whose inbound request is known (their thread's last read).
    pub request_roots: u64,
    /// Request roots created where no inbound request was being read.
    pub roots_without_request: u64,
    /// Tasks created outside any task that are no request's root.
    pub other_roots: u64,
    /// Tasks that took their creator's lineage.
    pub inherited: u64,
    /// Tasks whose creator had no recorded lineage (created before the probe, or forgotten).
    pub creator_unseen: u64,
    /// Tasks whose creator could not be read.
    pub creator_unreadable: u64,
}

impl LineageProbeCounters {
    fn from_slots(slots: &[u64]) -> Self {
        let slot = |index: u32| slots.get(index as usize).copied().unwrap_or(0);
        Self {
            request_roots: slot(tracer_abi::PROBE_REQUEST_ROOT),
            roots_without_request: slot(tracer_abi::PROBE_ROOT_WITHOUT_REQUEST),
            other_roots: slot(tracer_abi::PROBE_OTHER_ROOT),
            inherited: slot(tracer_abi::PROBE_INHERITED),
            creator_unseen: slot(tracer_abi::PROBE_CREATOR_UNSEEN),
            creator_unreadable: slot(tracer_abi::PROBE_CREATOR_UNREADABLE),
        }
    }

    /// Probe hits in all.
    pub fn tasks_probed(&self) -> u64 {
        self.request_roots
            + self.roots_without_request
            + self.other_roots
            + self.inherited
            + self.creator_unseen
            + self.creator_unreadable
    }
}

/// One of the loaded programs' maps, as the kernel reports it in `/proc/self/fdinfo`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapFootprint {
    pub name: String,
    pub max_entries: u64,
    /// What the kernel charges for the map (`memlock`), allocated at creation for the
    /// preallocated hashes.
    pub memlock_bytes: u64,
}

pub struct LoadedProbes {
    ebpf: Ebpf,
    pub features: FeatureReport,
}

/// The SSL uprobes attached to one library (for one process, or for all): the functions, and
/// the links to take back.
#[derive(Debug, Default)]
pub struct TlsAttachment {
    pub functions: Vec<&'static str>,
    links: Vec<(&'static str, UProbeLinkId)>,
}

/// One tracepoint and the program attached to it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Attachment {
    pub program: &'static str,
    pub category: &'static str,
    pub name: String,
}

impl Attachment {
    /// `category/name`, the tracepoint's directory under `<tracefs>/events`.
    pub fn tracepoint(&self) -> String {
        format!("{}/{}", self.category, self.name)
    }
}

/// Every tracepoint the agent attaches to, in attach order.
pub fn attachments() -> Vec<Attachment> {
    let syscall = |program, name: String| Attachment {
        program,
        category: "syscalls",
        name,
    };
    let mut all = Vec::new();
    for (program, syscalls) in ENTER_PROGRAMS {
        for name in *syscalls {
            all.push(syscall(program, format!("sys_enter_{name}")));
        }
    }
    for (_, syscalls) in ENTER_PROGRAMS {
        for name in *syscalls {
            all.push(syscall("exit_call", format!("sys_exit_{name}")));
        }
    }
    all.push(syscall("enter_close", "sys_enter_close".into()));
    for (program, category, name) in [
        ("process_exit", "sched", "sched_process_exit"),
        ("new_task", "task", "task_newtask"),
        ("process_exec", "sched", "sched_process_exec"),
    ] {
        all.push(Attachment {
            program,
            category,
            name: name.into(),
        });
    }
    all
}

/// The programs in an eBPF object: its global functions outside `.text` (aya puts each
/// program in a section named for its kind, `tracepoint` here; `.text` holds the helpers
/// they call).
pub fn object_programs(object: &[u8]) -> Result<Vec<String>> {
    use object::{Object as _, ObjectSection as _, ObjectSymbol as _, SymbolKind};
    let file = object::File::parse(object).context("parsing the eBPF object")?;
    let mut programs = Vec::new();
    for symbol in file.symbols() {
        if symbol.kind() != SymbolKind::Text || !symbol.is_global() {
            continue;
        }
        let Some(section) = symbol
            .section_index()
            .and_then(|index| file.section_by_index(index).ok())
        else {
            continue;
        };
        if section.name().is_ok_and(|name| name != ".text") {
            programs.push(
                symbol
                    .name()
                    .context("a symbol name in the eBPF object")?
                    .to_string(),
            );
        }
    }
    programs.sort();
    programs.dedup();
    Ok(programs)
}

/// The programs of the object this build embeds (none in an `AYA_BUILD_SKIP=1` build).
pub fn embedded_programs() -> Result<Vec<String>> {
    object_programs_or_none(EBPF_OBJECT)
}

fn object_programs_or_none(object: &[u8]) -> Result<Vec<String>> {
    if object.is_empty() {
        return Ok(Vec::new());
    }
    object_programs(object)
}

/// The embedded object's programs, each attached ([`attachments`]) and nothing attached
/// that the object lacks; `Err` names the difference. A program that is loaded but never
/// attached, or an attachment to a program that was renamed, would otherwise show up only
/// as a feature that silently does nothing, or as an error deep inside the loader.
pub fn check_attachments_cover(programs: &[String], attachments: &[Attachment]) -> Result<()> {
    let attached: Vec<&str> = attachments
        .iter()
        .map(|a| a.program)
        .chain(uprobe_programs())
        .collect();
    // The injection object's own two are attached by `injection::attach`; the tail-called
    // ones are reached through `TAIL_CALLS`.
    let unattached: Vec<&str> = programs
        .iter()
        .map(String::as_str)
        .filter(|program| {
            !attached.contains(program)
                && !INJECTION_PROGRAMS.contains(program)
                && !TAIL_CALLED_PROGRAMS.contains(program)
        })
        .collect();
    let mut unknown: Vec<&str> = attached
        .iter()
        .copied()
        .filter(|program| !programs.iter().any(|p| p == program))
        .collect();
    unknown.sort();
    unknown.dedup();
    let mut tracepoints: Vec<String> = attachments.iter().map(Attachment::tracepoint).collect();
    tracepoints.sort();
    let twice: Vec<&String> = tracepoints
        .windows(2)
        .filter(|pair| pair[0] == pair[1])
        .map(|pair| &pair[0])
        .collect();
    if unattached.is_empty() && unknown.is_empty() && twice.is_empty() {
        return Ok(());
    }
    bail!(
        "this build's eBPF object and its attachment table disagree (programs never attached: \
         {unattached:?}; attachments to programs the object lacks: {unknown:?}; tracepoints \
         attached twice: {twice:?}): rebuild with `cargo xtask build`, and if that persists, \
         report it"
    )
}

/// The field offsets the fork and exit programs read, from the tracepoints' `format`
/// files, after checking that every attached syscall tracepoint has the argument layout the
/// syscall programs read. An error names the tracepoint and the field.
pub fn tracepoint_layout() -> Result<TracepointLayout> {
    let tracefs = match locate_tracefs() {
        Tracefs::Readable(path) => path,
        Tracefs::Unreadable { path, error } => {
            bail!("tracefs at {} cannot be read ({error})", path.display())
        }
        Tracefs::NotMounted => bail!("tracefs is not mounted: mount it at {TRACEFS}"),
    };
    let events = tracefs.join("events");
    let read = |tracepoint: &str| {
        let path = events.join(tracepoint).join("format");
        std::fs::read_to_string(&path)
            .with_context(|| format!("reading the layout of tracepoint {tracepoint}"))
    };
    let refuse = |error: tracepoint_format::LayoutError| {
        anyhow::anyhow!(
            "this kernel's tracepoint layout cannot be used: {error}. Use a kernel whose layout \
             gym-tracer reads, or report this with the contents of {}",
            events.join(&error.tracepoint).join("format").display()
        )
    };
    for attachment in attachments().iter().filter(|a| a.category == "syscalls") {
        let tracepoint = attachment.tracepoint();
        let format = tracepoint_format::parse_format(&tracepoint, &read(&tracepoint)?);
        format
            .and_then(|format| tracepoint_format::check_syscall_layout(&tracepoint, &format))
            .map_err(refuse)?;
    }
    let new_task = read(tracepoint_format::NEW_TASK)?;
    let exit = read(tracepoint_format::PROCESS_EXIT)?;
    tracepoint_format::layout_from_formats(&new_task, &exit).map_err(refuse)
}

/// A Linux capability, by its number in linux/capability.h.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Capability(u32);

/// Names of capabilities 0..=40, as linux/capability.h spells them.
const CAPABILITY_NAMES: [&str; 41] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_DAC_READ_SEARCH",
    "CAP_FOWNER",
    "CAP_FSETID",
    "CAP_KILL",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETPCAP",
    "CAP_LINUX_IMMUTABLE",
    "CAP_NET_BIND_SERVICE",
    "CAP_NET_BROADCAST",
    "CAP_NET_ADMIN",
    "CAP_NET_RAW",
    "CAP_IPC_LOCK",
    "CAP_IPC_OWNER",
    "CAP_SYS_MODULE",
    "CAP_SYS_RAWIO",
    "CAP_SYS_CHROOT",
    "CAP_SYS_PTRACE",
    "CAP_SYS_PACCT",
    "CAP_SYS_ADMIN",
    "CAP_SYS_BOOT",
    "CAP_SYS_NICE",
    "CAP_SYS_RESOURCE",
    "CAP_SYS_TIME",
    "CAP_SYS_TTY_CONFIG",
    "CAP_MKNOD",
    "CAP_LEASE",
    "CAP_AUDIT_WRITE",
    "CAP_AUDIT_CONTROL",
    "CAP_SETFCAP",
    "CAP_MAC_OVERRIDE",
    "CAP_MAC_ADMIN",
    "CAP_SYSLOG",
    "CAP_WAKE_ALARM",
    "CAP_BLOCK_SUSPEND",
    "CAP_AUDIT_READ",
    "CAP_PERFMON",
    "CAP_BPF",
    "CAP_CHECKPOINT_RESTORE",
];

impl Capability {
    pub const DAC_OVERRIDE: Self = Self(1);
    pub const DAC_READ_SEARCH: Self = Self(2);
    pub const NET_ADMIN: Self = Self(12);
    pub const SYS_PTRACE: Self = Self(19);
    pub const SYS_ADMIN: Self = Self(21);
    pub const SYS_RESOURCE: Self = Self(24);
    pub const PERFMON: Self = Self(38);
    pub const BPF: Self = Self(39);

    /// `CAP_BPF`; a number the table does not know yet as `CAP_<number>`.
    pub fn name(self) -> String {
        CAPABILITY_NAMES
            .get(self.0 as usize)
            .map_or_else(|| format!("CAP_{}", self.0), |name| name.to_string())
    }

    /// `BPF`, as Kubernetes' `securityContext.capabilities` spells it.
    pub fn short_name(self) -> String {
        let name = self.name();
        name.strip_prefix("CAP_").unwrap_or(&name).to_string()
    }
}

/// A capability set as `/proc/<pid>/status` shows it (`CapEff:` etc., 64 bits in hex).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CapabilitySet(u64);

impl CapabilitySet {
    /// The set in the `field` line (`CapEff`, `CapBnd`, ...) of a `/proc/<pid>/status` text.
    pub fn from_status(status: &str, field: &str) -> Result<Self> {
        let value = status
            .lines()
            .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
            .with_context(|| format!("no {field} line in /proc/self/status"))?;
        u64::from_str_radix(value.trim(), 16)
            .map(Self)
            .with_context(|| format!("{field} is not a hex number: {:?}", value.trim()))
    }

    /// This process's effective capabilities: what the kernel checks.
    pub fn effective() -> Result<Self> {
        let status =
            std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
        Self::from_status(&status, "CapEff")
    }

    pub fn contains(self, capability: Capability) -> bool {
        capability.0 < 64 && self.0 & (1u64 << capability.0) != 0
    }

    /// Every capability this build knows a name for (root's usual set).
    pub fn known() -> Self {
        Self((1u64 << CAPABILITY_NAMES.len()) - 1)
    }

    pub fn iter(self) -> impl Iterator<Item = Capability> {
        (0..64)
            .map(Capability)
            .filter(move |&cap| self.contains(cap))
    }
}

/// What to add to a uprobe's attach error when the capabilities explain it. Linux requires
/// CAP_SYS_ADMIN for uprobe perf events again since mid-2025 (the fix for c9e0924e5c2b, in
/// the stable kernels too), where CAP_PERFMON sufficed from 5.8; without it the kernel
/// answers EACCES, which aya reports as "Permission denied".
pub fn uprobe_refusal_hint(error: &str) -> &'static str {
    let lacks_admin = CapabilitySet::effective()
        .map(|caps| !caps.contains(Capability::SYS_ADMIN))
        .unwrap_or(false);
    if lacks_admin && error.contains("Permission denied") {
        " (this kernel attaches uprobes only with CAP_SYS_ADMIN, as Linux has since mid-2025: \
         grant it for TLS plaintext and task lineage)"
    } else {
        ""
    }
}

/// A capability the agent needs, what for, and what breaks without it.
#[derive(Debug)]
pub struct Requirement {
    pub capability: Capability,
    /// Capabilities the kernel accepts in its place (it checks `CAP_BPF || CAP_SYS_ADMIN`,
    /// `CAP_PERFMON || CAP_SYS_ADMIN`, and DAC_OVERRIDE covers DAC_READ_SEARCH).
    pub alternatives: &'static [Capability],
    pub needed_for: &'static str,
    pub without_it: &'static str,
}

impl Requirement {
    pub fn met_by(&self, caps: CapabilitySet) -> bool {
        caps.contains(self.capability) || self.alternatives.iter().any(|&c| caps.contains(c))
    }
}

/// The capabilities `gym-tracer run` needs, checked by `preflight` and shown by `doctor`.
/// Measured on 6.18 against uvicorn servers of uid 0 and of another uid, with the agent as
/// uid 65534 holding only these (ambient) and as uid 0 with only these in its bounding set.
pub const REQUIRED_CAPABILITIES: [Requirement; 4] = [
    Requirement {
        capability: Capability::BPF,
        alternatives: &[Capability::SYS_ADMIN],
        needed_for: "create the eBPF maps (ring buffer, PID filter) and load BTF and programs",
        without_it: "bpf(BPF_MAP_CREATE) fails with EPERM: nothing can be traced",
    },
    Requirement {
        capability: Capability::PERFMON,
        alternatives: &[Capability::SYS_ADMIN],
        needed_for: "load tracepoint programs (they read kernel and user memory) and attach \
                     them to system-wide tracepoints",
        without_it: "bpf(BPF_PROG_LOAD) fails with EPERM: nothing can be traced",
    },
    Requirement {
        capability: Capability::DAC_READ_SEARCH,
        alternatives: &[Capability::DAC_OVERRIDE],
        needed_for: "read tracefs (mode 0700, root's) unless running as uid 0, and the \
                     /proc/<pid>/environ (0400) and /proc/<pid>/fd (0500) of other users' processes",
        without_it: "as a non-root uid tracefs is unreadable and no tracepoint can be attached; \
                     as uid 0 other users' Gym servers lose their labels and discovery",
    },
    Requirement {
        capability: Capability::SYS_PTRACE,
        alternatives: &[],
        needed_for: "pass the kernel's ptrace-read check on /proc/<pid>/environ, exe and fd/* \
                     of processes of other users or with capabilities the agent lacks (every \
                     root-owned server)",
        without_it: "Gym servers of other users (and root's, unless the agent is fully \
                     privileged) lose their labels and gym.* spans, --discover gym misses them, \
                     process.executable.path is absent, and servers without a configured port \
                     get no route harvest",
    },
];

pub fn requirement(capability: Capability) -> &'static Requirement {
    REQUIRED_CAPABILITIES
        .iter()
        .find(|r| r.capability == capability)
        .expect("every capability asked for is in REQUIRED_CAPABILITIES")
}

/// "A", "A and B", "A, B and C".
fn and_list(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// The error for missing capabilities: which, what each is for, and how to grant the set.
pub fn missing_capabilities_message(missing: &[&Requirement]) -> String {
    let names: Vec<String> = missing.iter().map(|r| r.capability.name()).collect();
    let reasons: Vec<String> = missing
        .iter()
        .map(|r| format!("{} to {}", r.capability.name(), r.needed_for))
        .collect();
    let all: Vec<Capability> = REQUIRED_CAPABILITIES.iter().map(|r| r.capability).collect();
    let names_of = |f: fn(Capability) -> String, sep: &str| {
        all.iter().map(|&c| f(c)).collect::<Vec<_>>().join(sep)
    };
    format!(
        "gym-tracer lacks {} (it needs {}). Run it as root (sudo gym-tracer ...), or grant it \
         exactly {}: systemd `AmbientCapabilities={}`, Kubernetes \
         `securityContext.capabilities.add: [{}]`, or `setcap {}+ep gym-tracer`. \
         `gym-tracer doctor` shows what each one enables",
        and_list(&names),
        reasons.join("; "),
        names_of(Capability::name, ", "),
        names_of(Capability::name, " "),
        names_of(Capability::short_name, ", "),
        names_of(|c| c.name().to_lowercase(), ","),
    )
}

/// Where tracefs is, as far as this process can tell.
#[derive(Debug)]
pub enum Tracefs {
    /// Mounted and its `events` directory readable.
    Readable(PathBuf),
    /// Mounted (per /proc/self/mountinfo) but not readable by this process.
    Unreadable {
        path: PathBuf,
        error: io::Error,
    },
    NotMounted,
}

/// Finds tracefs where aya looks for it (`/sys/kernel/tracing`, then under debugfs).
pub fn locate_tracefs() -> Tracefs {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut unreadable = None;
    for place in TRACEFS_PLACES {
        let path = PathBuf::from(place);
        match std::fs::read_dir(path.join("events")) {
            Ok(_) => return Tracefs::Readable(path),
            Err(error) if is_tracefs_mount(&mountinfo, place) && unreadable.is_none() => {
                unreadable = Some(Tracefs::Unreadable { path, error });
            }
            Err(_) => {}
        }
    }
    unreadable.unwrap_or(Tracefs::NotMounted)
}

/// Whether `/proc/self/mountinfo` lists a tracefs mount at `place`.
fn is_tracefs_mount(mountinfo: &str, place: &str) -> bool {
    mountinfo.lines().any(|line| {
        let fields: Vec<&str> = line.split(' ').collect();
        // mount id, parent, dev, root, mount point, options, optional fields..., "-", type
        let fs_type = fields
            .iter()
            .position(|&f| f == "-")
            .and_then(|i| fields.get(i + 1));
        fields.get(4) == Some(&place) && fs_type == Some(&"tracefs")
    })
}

/// Fails with a message that names what is missing (capabilities, tracefs, tracepoints, the
/// host's PID namespace) and what to do about it.
pub fn preflight() -> Result<()> {
    let caps = CapabilitySet::effective()?;
    let missing: Vec<&Requirement> = REQUIRED_CAPABILITIES
        .iter()
        .filter(|r| !r.met_by(caps))
        .collect();
    if !missing.is_empty() {
        bail!("{}", missing_capabilities_message(&missing));
    }
    let mut tracefs = locate_tracefs();
    if matches!(tracefs, Tracefs::NotMounted) {
        mount_tracefs(caps)?;
        tracefs = locate_tracefs();
    }
    let tracefs = match tracefs {
        Tracefs::Readable(path) => path,
        Tracefs::Unreadable { path, error } => bail!(
            "tracefs at {} cannot be read ({error}); if a security module (SELinux, AppArmor) \
             denies it, allow gym-tracer to read tracefs",
            path.display()
        ),
        Tracefs::NotMounted => bail!("tracefs is not mounted: mount it at {TRACEFS}"),
    };
    if !in_initial_pid_namespace().unwrap_or(true) {
        bail!(
            "gym-tracer runs in a PID namespace of its own, but its kernel programs see host PIDs: \
             run it in the host's PID namespace (Kubernetes `hostPID: true`, docker `--pid=host`)"
        );
    }
    let events = tracefs.join("events");
    let absent: Vec<String> = attachments()
        .iter()
        .map(Attachment::tracepoint)
        .filter(|name| !events.join(name).join("id").exists())
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

/// Whether this process sees the host's PIDs (`bpf_get_current_pid_tgid` reports those);
/// `None` when `/proc/self/ns/pid` cannot be read.
pub fn in_initial_pid_namespace() -> Option<bool> {
    let link = std::fs::read_link("/proc/self/ns/pid").ok()?;
    let inode = link
        .to_str()?
        .strip_prefix("pid:[")?
        .strip_suffix(']')?
        .parse::<u64>()
        .ok()?;
    Some(inode == INIT_PID_NAMESPACE_INODE)
}

/// aya finds tracepoint ids under tracefs; mount it if the host has not.
fn mount_tracefs(caps: CapabilitySet) -> Result<()> {
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
        let error = io::Error::last_os_error();
        let grant = if caps.contains(Capability::SYS_ADMIN) {
            ""
        } else {
            " or grant gym-tracer CAP_SYS_ADMIN so that it can mount it itself"
        };
        bail!(
            "tracefs is not mounted and mounting it at {TRACEFS} failed ({error}). Mount it \
             with `mount -t tracefs nodev {TRACEFS}` (in a container: mount the host's \
             {TRACEFS}){grant}"
        );
    }
    tracing::info!("mounted tracefs at {TRACEFS}");
    Ok(())
}

/// Kernel struct offsets for connection addresses, or why they are unavailable.
pub fn socket_offsets() -> Result<KernelOffsets, String> {
    let data = std::fs::read(BTF_PATH).map_err(|e| {
        format!("{BTF_PATH} unreadable ({e}): the kernel has no BTF (CONFIG_DEBUG_INFO_BTF)")
    })?;
    Btf::parse(&data)
        .and_then(|btf| btf.kernel_offsets())
        .map_err(|e| format!("{e:#}"))
}

/// Loads the object and every program (maps created, verifier passed), attaching nothing.
fn load_programs(options: &LoadOptions) -> Result<(Ebpf, FeatureReport)> {
    let object = if options.injects() {
        EBPF_INJECT_OBJECT
    } else {
        EBPF_OBJECT
    };
    if object.is_empty() {
        bail!(
            "this gym-tracer was built without its eBPF programs (AYA_BUILD_SKIP was set); \
             rebuild it without AYA_BUILD_SKIP (`cargo xtask build`)"
        );
    }
    // Kernels before 5.11 charge BPF memory to RLIMIT_MEMLOCK; later ones to the memory
    // cgroup, so failing to raise it (no CAP_SYS_RESOURCE) does not matter there.
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: valid rlimit pointer.
    unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) };

    check_attachments_cover(&object_programs_or_none(object)?, &attachments())?;
    // Read now, refused below: a process that may not create maps at all learns that first.
    let layout = tracepoint_layout();
    let (offsets, socket_addresses) = match socket_offsets() {
        Ok(offsets) => (offsets, Ok(())),
        Err(why) => (KernelOffsets::default(), Err(why)),
    };
    if offsets.valid != 0 && offsets.seq_valid == 0 {
        tracing::warn!(
            "TCP sequence numbers are off (this kernel's BTF lacks sock.sk_protocol, \
             tcp_sock.write_seq or tcp_sock.copied_seq): the two ends of a connection are \
             matched by the order of its requests"
        );
    }
    let ring_bytes = options.ring_buffer_bytes.next_power_of_two().max(4096);
    let inject = options
        .inject_traceparent
        .map_or(tracer_abi::INJECT_OFF, InjectScope::kernel_value);
    let no_layout = TracepointLayout::default();
    let mut loader = EbpfLoader::new();
    loader
        .override_global("CAPTURE_BYTES", &options.capture_bytes, true)
        .override_global("KERNEL_OFFSETS", &offsets, true)
        .override_global("INJECT_TRACEPARENT", &inject, true)
        .override_global("MINT_KEY", &options.mint_key.0, true)
        .override_global(
            "TRACEPOINT_LAYOUT",
            layout.as_ref().unwrap_or(&no_layout),
            true,
        )
        .map_max_entries("EVENTS", ring_bytes)
        .map_max_entries("SOCKETS", options.socket_map_entries())
        // An LRU is allocated whole when it is created (about 100 bytes an entry).
        .map_max_entries("TASK_LINEAGE", options.max_tasks.max(1));
    if !options.injects() {
        // Never written without the flag: one entry each instead of ~6 MiB of kernel memory.
        for map in INJECTION_MAPS {
            loader.map_max_entries(map, 1);
        }
    }
    let mut ebpf = loader
        .load(object)
        .context("loading the eBPF programs into the kernel")?;
    // No program is in the kernel yet: the placeholder layout is never read.
    layout?;
    let mut programs: Vec<&str> = attachments().iter().map(|a| a.program).collect();
    programs.dedup();
    for name in programs {
        tracepoint(&mut ebpf, name)?
            .load()
            .with_context(|| format!("the kernel verifier rejected {name}"))?;
    }
    for name in uprobe_programs() {
        uprobe(&mut ebpf, name)?
            .load()
            .with_context(|| format!("the kernel verifier rejected {name}"))?;
    }
    for (slot, name) in (0u32..).zip(TAIL_CALLED_PROGRAMS) {
        let program = tracepoint(&mut ebpf, name)?;
        program
            .load()
            .with_context(|| format!("the kernel verifier rejected {name}"))?;
        let fd = program
            .fd()
            .with_context(|| format!("{name} has no fd"))?
            .try_clone()
            .with_context(|| format!("duplicating {name}'s fd"))?;
        let mut tail_calls = ProgramArray::try_from(
            ebpf.map_mut("TAIL_CALLS")
                .context("TAIL_CALLS map missing from the eBPF object")?,
        )?;
        tail_calls
            .set(slot, &fd, 0)
            .with_context(|| format!("putting {name} in TAIL_CALLS"))?;
    }
    Ok((ebpf, FeatureReport { socket_addresses }))
}

fn attach_programs(ebpf: &mut Ebpf) -> Result<usize> {
    let all = attachments();
    for attachment in &all {
        let Attachment {
            program,
            category,
            name,
        } = attachment;
        tracepoint(ebpf, program)?
            .attach(category, name)
            .with_context(|| format!("attaching {program} to {category}/{name}"))?;
    }
    Ok(all.len())
}

/// Loads the real programs and attaches them, then detaches and unloads at once: proof that
/// `run` would work, for `doctor`. Nothing is traced: the PID filter stays empty, so every
/// program returns at its first lookup. `Err` when loading failed; the inner result is the
/// attach (the number of tracepoints attached).
pub fn trial_load(
    options: &LoadOptions,
) -> Result<(FeatureReport, Result<usize>, Vec<MapFootprint>)> {
    let (mut ebpf, features) = load_programs(options)?;
    let attached = attach_programs(&mut ebpf);
    let maps = map_footprints();
    drop(ebpf);
    Ok((features, attached, maps))
}

/// For `doctor`: whether `--inject-traceparent` works here, attaching nothing to a cgroup:
/// its object loads (`options.inject_traceparent` set), its two programs pass the verifier,
/// the cgroup v2 root they attach to, and what `FIONREAD` reports on a socket in their
/// sockhash (`Some(n)`: `n`, not the bytes waiting).
pub fn trial_injection(options: &LoadOptions) -> Result<(PathBuf, Option<i32>)> {
    let (mut ebpf, _) = load_programs(options)?;
    injection::load(&mut ebpf)?;
    injection::attach_sk_msg(&mut ebpf)?;
    let hazard = injection::fionread_hazard(&mut ebpf)?;
    Ok((injection::cgroup2_root()?, hazard))
}

/// The eBPF maps this process holds, with their sizes and kernel memory, from
/// `/proc/self/fdinfo` (the map's name from its id). Maps whose fdinfo cannot be read are
/// left out.
pub fn map_footprints() -> Vec<MapFootprint> {
    let Ok(entries) = std::fs::read_dir("/proc/self/fdinfo") else {
        return Vec::new();
    };
    let mut maps: Vec<MapFootprint> = entries
        .filter_map(|entry| std::fs::read_to_string(entry.ok()?.path()).ok())
        .filter_map(|fdinfo| {
            let field = |name: &str| -> Option<u64> {
                fdinfo
                    .lines()
                    .find_map(|line| line.strip_prefix(name)?.strip_prefix(':'))?
                    .trim()
                    .parse()
                    .ok()
            };
            let id = u32::try_from(field("map_id")?).ok()?;
            let info = aya::maps::MapInfo::from_id(id).ok()?;
            Some(MapFootprint {
                name: info.name_as_str()?.to_string(),
                max_entries: field("max_entries")?,
                memlock_bytes: field("memlock")?,
            })
        })
        .collect();
    maps.sort_by(|a, b| a.name.cmp(&b.name));
    maps.dedup();
    maps
}

impl LoadedProbes {
    pub fn load(options: &LoadOptions) -> Result<Self> {
        if options.injects() && !CapabilitySet::effective()?.contains(Capability::NET_ADMIN) {
            bail!(
                "--inject-traceparent needs CAP_NET_ADMIN besides the four capabilities of \
                 `run` (sock_ops and sk_msg are network programs, attached to a cgroup): add \
                 it, or run without --inject-traceparent"
            );
        }
        let (mut ebpf, features) = load_programs(options)?;
        attach_programs(&mut ebpf)?;
        if options.injects() {
            injection::attach(&mut ebpf)?;
        }
        Ok(Self { ebpf, features })
    }

    /// Tells the kernel the trace the outbound requests of a handler task carry from now on.
    /// `Err` when the map is full.
    pub fn publish_trace(&mut self, key: InjectKey, trace: InjectTrace) -> Result<()> {
        let mut map: BpfHashMap<_, InjectKey, InjectTrace> = BpfHashMap::try_from(
            self.ebpf
                .map_mut("INJECT_TRACES")
                .context("INJECT_TRACES")?,
        )?;
        map.insert(key, trace, 0)?;
        Ok(())
    }

    pub fn withdraw_trace(&mut self, key: InjectKey) {
        if let Some(map) = self.ebpf.map_mut("INJECT_TRACES")
            && let Ok(mut map) = BpfHashMap::<_, InjectKey, InjectTrace>::try_from(map)
        {
            let _ = map.remove(&key);
        }
    }

    /// Attaches the SSL uprobes (entry and return) to the functions of `functions` that
    /// `library` defines: for process `pid` only, or (`None`) for every process that maps it
    /// (each program checks the PID filter first). `library` is a path the agent can open
    /// (`/proc/PID/root/...`). An error when not even `SSL_write` and `SSL_read` could be.
    pub fn attach_tls_library(
        &mut self,
        library: &std::path::Path,
        functions: &[&'static str],
        pid: Option<u32>,
    ) -> Result<TlsAttachment> {
        let scope = match pid.and_then(std::num::NonZeroU32::new) {
            Some(pid) => UProbeScope::OneProcess(pid),
            None => UProbeScope::AllProcesses,
        };
        let mut attachment = TlsAttachment::default();
        let mut failures = Vec::new();
        for (function, program) in SSL_FUNCTIONS {
            if !functions.contains(&function) {
                continue;
            }
            let entry = uprobe(&mut self.ebpf, program)?.attach(function, library, scope);
            let exit = entry.as_ref().ok().map(|_| {
                uprobe(&mut self.ebpf, SSL_RETURN_PROGRAM)
                    .map(|exit| exit.attach(function, library, scope))
            });
            match (entry, exit) {
                (Ok(entry), Some(Ok(Ok(exit)))) => {
                    attachment.functions.push(function);
                    attachment.links.push((program, entry));
                    attachment.links.push((SSL_RETURN_PROGRAM, exit));
                }
                (Ok(entry), exit) => {
                    // An entry without its return would leave calls pending: take it back.
                    let _ = uprobe(&mut self.ebpf, program).map(|p| p.detach(entry));
                    let why = match exit {
                        Some(Ok(Err(error))) => format!("{:#}", anyhow::Error::from(error)),
                        Some(Err(error)) => format!("{error:#}"),
                        _ => "no return probe".to_string(),
                    };
                    failures.push(format!("{function} (return): {why}"));
                }
                // With the cause: the errno says why the kernel refused.
                (Err(error), _) => {
                    failures.push(format!("{function}: {:#}", anyhow::Error::from(error)))
                }
            }
        }
        let attached = &attachment.functions;
        if !(attached.contains(&"SSL_write") || attached.contains(&"SSL_write_ex"))
            || !(attached.contains(&"SSL_read") || attached.contains(&"SSL_read_ex"))
        {
            bail!(
                "attaching uprobes to {}: {}",
                library.display(),
                if failures.is_empty() {
                    "it defines neither SSL_write nor SSL_read".to_string()
                } else {
                    failures.join("; ")
                }
            );
        }
        Ok(attachment)
    }

    /// Takes back the uprobes of one attachment (a traced process is gone).
    pub fn detach_tls(&mut self, attachment: TlsAttachment) {
        for (program, link) in attachment.links {
            if let Ok(probe) = uprobe(&mut self.ebpf, program) {
                let _ = probe.detach(link);
            }
        }
    }

    /// Probes task creation in process `pid`: its layout first (the probe's first hit reads
    /// it), then the uprobe on `symbol` in `file` (a path the agent can open), for that
    /// process only. On an error nothing stays behind.
    pub fn attach_task_probe(
        &mut self,
        pid: u32,
        layout: AsyncioProcess,
        file: &std::path::Path,
        symbol: &str,
    ) -> Result<UProbeLinkId> {
        let scope = std::num::NonZeroU32::new(pid)
            .map(UProbeScope::OneProcess)
            .context("pid 0")?;
        self.asyncio_processes()?
            .insert(pid, layout, 0)
            .with_context(|| format!("adding pid {pid} to ASYNCIO_PROCESSES"))?;
        let attached = uprobe(&mut self.ebpf, TASK_CREATED_PROGRAM)
            .and_then(|probe| Ok(probe.attach(symbol, file, scope)?));
        if attached.is_err() {
            self.forget_task_probe(pid, None);
        }
        attached
    }

    /// Takes back process `pid`'s task probe and every lineage the kernel keeps for it (a
    /// process that reuses the pid must not meet them). Returns the lineages deleted.
    pub fn forget_task_probe(&mut self, pid: u32, link: Option<UProbeLinkId>) -> u64 {
        if let Some(link) = link
            && let Ok(probe) = uprobe(&mut self.ebpf, TASK_CREATED_PROGRAM)
        {
            let _ = probe.detach(link);
        }
        if let Ok(mut processes) = self.asyncio_processes() {
            let _ = processes.remove(&pid);
        }
        let Some(map) = self.ebpf.map_mut("TASK_LINEAGE") else {
            return 0;
        };
        let Ok(mut lineages) = BpfHashMap::<_, TaskKey, TaskLineage>::try_from(map) else {
            return 0;
        };
        let gone: Vec<TaskKey> = lineages
            .keys()
            .filter_map(Result::ok)
            .filter(|key| key.tgid == pid)
            .collect();
        gone.iter()
            .map(|key| u64::from(lineages.remove(key).is_ok()))
            .sum()
    }

    fn asyncio_processes(&mut self) -> Result<BpfHashMap<&mut MapData, u32, AsyncioProcess>> {
        let map = self
            .ebpf
            .map_mut("ASYNCIO_PROCESSES")
            .context("ASYNCIO_PROCESSES map missing")?;
        BpfHashMap::try_from(map).context("ASYNCIO_PROCESSES has the wrong type")
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
            .with_context(|| format!("adding pid {pid} to the PID filter"))?;
        self.set_user_pid_bit(pid, true)
            .with_context(|| format!("adding pid {pid} to the PID filter's bitmap"))
    }

    /// Whether the kernel follows `pid` as a traced process's child (its fork record is on
    /// the ring, or was read).
    pub fn follows_as_child(&mut self, pid: u32) -> bool {
        self.traced_pids()
            .is_ok_and(|map| map.get(&pid, 0).ok() == Some(tracer_abi::TRACED_AS_CHILD))
    }

    /// A traced process exited: its filter entry goes, unless the kernel added it (a
    /// followed child, removed by the kernel at its exit): by the time user space reads the
    /// exit, its pid may already belong to a new child.
    pub fn untrace_exited_pid(&mut self, pid: u32) {
        let _ = self.set_user_pid_bit(pid, false);
        if let Ok(mut map) = self.traced_pids()
            && map.get(&pid, 0).ok() == Some(tracer_abi::TRACED_BY_USER)
        {
            let _ = map.remove(&pid);
        }
    }

    pub fn untrace_pid(&mut self, pid: u32) {
        let _ = self.set_user_pid_bit(pid, false);
        if let Ok(mut map) = self.traced_pids() {
            let _ = map.remove(&pid);
        }
    }

    /// Sets or clears `pid`'s bit in `USER_PID_BITS`, the kernel's first PID filter step.
    /// Read-modify-write is safe: this agent is the bitmap's only writer (the kernel's own
    /// additions go to `CHILD_PID_BITS`).
    fn set_user_pid_bit(&mut self, pid: u32, set: bool) -> Result<()> {
        let (word, bit) = tracer_abi::pid_bit(pid);
        let map = self
            .ebpf
            .map_mut("USER_PID_BITS")
            .context("USER_PID_BITS map missing")?;
        let mut bits: Array<&mut MapData, u64> =
            Array::try_from(map).context("USER_PID_BITS has the wrong type")?;
        let old = bits.get(&word, 0)?;
        let new = if set { old | bit } else { old & !bit };
        if new != old {
            bits.set(word, new, 0)?;
        }
        Ok(())
    }

    fn python_threads(&mut self) -> Result<BpfHashMap<&mut MapData, u32, PythonThread>> {
        let map = self
            .ebpf
            .map_mut("PYTHON_THREADS")
            .context("PYTHON_THREADS map missing")?;
        BpfHashMap::try_from(map).context("PYTHON_THREADS has the wrong type")
    }

    /// Lets the kernel read thread `tid`'s running context (see [`PythonThread`]).
    pub fn register_python_thread(&mut self, tid: u32, thread: PythonThread) -> Result<()> {
        self.python_threads()?
            .insert(tid, thread, 0)
            .with_context(|| format!("adding thread {tid} to PYTHON_THREADS"))
    }

    /// Stops the context reads of thread `tid` (a no-op if it has none).
    pub fn unregister_python_thread(&mut self, tid: u32) {
        if let Ok(mut map) = self.python_threads() {
            let _ = map.remove(&tid);
        }
    }

    fn sockets(&mut self) -> Option<BpfHashMap<&mut MapData, SocketKey, SocketState>> {
        BpfHashMap::try_from(self.ebpf.map_mut("SOCKETS")?).ok()
    }

    fn pending_calls(&mut self) -> Option<BpfHashMap<&mut MapData, u64, ThreadCalls>> {
        BpfHashMap::try_from(self.ebpf.map_mut("PENDING_CALLS")?).ok()
    }

    /// Stops the kernel from reporting a socket, if it still is the connection `conn_id`. A
    /// socket that is not HTTP stays (marked ignored) until it is closed, so that its
    /// transfers are not counted as transfers on sockets the kernel does not know; an evicted
    /// one is deleted, making room, and its transfers are counted so.
    pub fn untrack_socket(&mut self, pid: u32, fd: i32, conn_id: u64, keep_ignored: bool) {
        let Some(mut sockets) = self.sockets() else {
            return;
        };
        let key = SocketKey { tgid: pid, fd };
        let Ok(mut state) = sockets.get(&key, 0) else {
            return;
        };
        if state.conn_id != conn_id {
            return;
        }
        if keep_ignored {
            state.ignored = 1;
            let _ = sockets.insert(key, state, BPF_EXIST);
        } else {
            let _ = sockets.remove(&key);
        }
    }

    /// Deletes the kernel's entries of processes no longer in the PID filter and of threads
    /// that are gone. A process that dies (or is killed) does not call close() on its
    /// sockets, and nothing evicts them from the plain hash maps: user space untracks the
    /// sockets it knew at the exit record, and this finds the rest (sockets kept as not HTTP,
    /// entries of a process whose exit record was lost). Returns how many were deleted.
    pub fn sweep_gone(&mut self) -> u64 {
        let traced: std::collections::HashSet<u32> = match self.traced_pids() {
            Ok(map) => map.keys().filter_map(Result::ok).collect(),
            Err(_) => return 0,
        };
        self.sweep(|tgid, tid| {
            traced.contains(&tgid)
                && tid.is_none_or(|tid| {
                    std::path::Path::new(&format!("/proc/{tgid}/task/{tid}")).exists()
                })
        })
    }

    /// Deletes every socket (`keep(tgid, None)` false) and pending call (`keep(tgid,
    /// Some(tid))` false) entry. Keys are collected first: deleting while walking the keys
    /// restarts the kernel's walk.
    fn sweep(&mut self, keep: impl Fn(u32, Option<u32>) -> bool) -> u64 {
        let mut deleted = 0;
        if let Some(mut sockets) = self.sockets() {
            let gone: Vec<SocketKey> = sockets
                .keys()
                .filter_map(Result::ok)
                .filter(|key| !keep(key.tgid, None))
                .collect();
            for key in gone {
                deleted += u64::from(sockets.remove(&key).is_ok());
            }
        }
        if let Some(mut pending) = self.pending_calls() {
            let gone: Vec<u64> = pending
                .keys()
                .filter_map(Result::ok)
                .filter(|&pid_tgid| !keep((pid_tgid >> 32) as u32, Some(pid_tgid as u32)))
                .collect();
            for key in gone {
                deleted += u64::from(pending.remove(&key).is_ok());
            }
        }
        deleted
    }

    /// The counters the kernel programs keep, read now.
    pub fn kernel_counters(&self) -> KernelCounters {
        let untracked = self.per_cpu_counter("UNTRACKED", UNTRACKED_REASONS_READ);
        let reason = |index: u32| untracked.get(index as usize).copied().unwrap_or(0);
        let context = self.per_cpu_counter("CONTEXT_READS", CONTEXT_OUTCOMES);
        let outcome = |index: u32| context.get(index as usize).copied().unwrap_or(0);
        KernelCounters {
            events_lost_by_cpu: self.per_cpu_slot("LOST_EVENTS", 0),
            threads_ignored: self.per_cpu_slot("THREADS_IGNORED", 0).iter().sum(),
            forks_unfollowed: self.per_cpu_slot("FORKS_UNFOLLOWED", 0).iter().sum(),
            sockets_untracked_map_full: reason(UNTRACKED_SOCKET_MAP_FULL),
            transfers_on_unknown_sockets: reason(UNTRACKED_UNKNOWN_SOCKET_TRANSFER),
            socket_calls_untracked_map_full: reason(UNTRACKED_PENDING_CALLS_FULL),
            context_chains_read: outcome(CONTEXT_CHAIN_READ),
            context_chains_empty: outcome(CONTEXT_CHAIN_EMPTY),
            context_thread_unknown: outcome(CONTEXT_THREAD_UNKNOWN),
            context_not_a_context: outcome(CONTEXT_NOT_A_CONTEXT),
            context_reads_failed: outcome(CONTEXT_READ_FAILED),
            context_records_lost: outcome(CONTEXT_LOST),
            injection: InjectionCounters::from_slots(
                &self.per_cpu_counter("INJECTIONS", tracer_abi::INJECT_OUTCOMES),
            ),
            lineage: LineageProbeCounters::from_slots(
                &self.per_cpu_counter("LINEAGE_PROBES", tracer_abi::PROBE_OUTCOMES),
            ),
        }
    }

    /// Slots `0..slots` of a per-CPU counter map, each summed over CPUs.
    fn per_cpu_counter(&self, name: &str, slots: u32) -> Vec<u64> {
        (0..slots)
            .map(|slot| self.per_cpu_slot(name, slot).iter().sum())
            .collect()
    }

    /// One slot of a per-CPU counter map, per possible CPU; empty if the map is missing.
    fn per_cpu_slot(&self, name: &str, slot: u32) -> Vec<u64> {
        let Some(map) = self.ebpf.map(name) else {
            return Vec::new();
        };
        let Ok(counter) = PerCpuArray::<_, u64>::try_from(map) else {
            return Vec::new();
        };
        counter
            .get(&slot, 0)
            .map(|values| values.iter().copied().collect())
            .unwrap_or_default()
    }
}

const UNTRACKED_REASONS_READ: u32 = tracer_abi::UNTRACKED_REASONS;

/// `BPF_EXIST` (linux/bpf.h): update an entry only if it is still there.
const BPF_EXIST: u64 = 2;

fn uprobe<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut UProbe> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?
        .try_into()
        .with_context(|| format!("program {name} is not a uprobe"))
}

pub(crate) fn tracepoint<'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut TracePoint> {
    ebpf.program_mut(name)
        .with_context(|| format!("program {name} missing from the eBPF object"))?
        .try_into()
        .with_context(|| format!("program {name} is not a tracepoint"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const ROOT_STATUS: &str = "Name:\tgym-tracer\nCapInh:\t0000000000000000\n\
                               CapPrm:\t000001ffffffffff\nCapEff:\t000001ffffffffff\n\
                               CapBnd:\t000001ffffffffff\n";

    #[test]
    fn capability_sets_decode_from_proc_status() {
        let root = CapabilitySet::from_status(ROOT_STATUS, "CapEff").unwrap();
        assert_eq!(root.iter().count(), 41);
        assert_eq!(root, CapabilitySet::known());
        assert!(REQUIRED_CAPABILITIES.iter().all(|r| r.met_by(root)));
        // CAP_DAC_READ_SEARCH | CAP_SYS_PTRACE | CAP_PERFMON | CAP_BPF
        let agent = CapabilitySet::from_status("CapEff:\t000000c000080004\n", "CapEff").unwrap();
        let names: Vec<String> = agent.iter().map(Capability::name).collect();
        assert_eq!(
            names,
            [
                "CAP_DAC_READ_SEARCH",
                "CAP_SYS_PTRACE",
                "CAP_PERFMON",
                "CAP_BPF"
            ]
        );
        assert!(REQUIRED_CAPABILITIES.iter().all(|r| r.met_by(agent)));
        let none = CapabilitySet::from_status("CapEff:\t0000000000000000\n", "CapEff").unwrap();
        assert!(REQUIRED_CAPABILITIES.iter().all(|r| !r.met_by(none)));
        assert!(CapabilitySet::from_status("CapEff:\tzz\n", "CapEff").is_err());
        assert!(CapabilitySet::from_status(ROOT_STATUS, "CapAmb").is_err());
    }

    #[test]
    fn cap_sys_admin_stands_in_for_bpf_and_perfmon_only() {
        let admin = CapabilitySet(1 << Capability::SYS_ADMIN.0);
        assert!(requirement(Capability::BPF).met_by(admin));
        assert!(requirement(Capability::PERFMON).met_by(admin));
        assert!(!requirement(Capability::SYS_PTRACE).met_by(admin));
        assert!(!requirement(Capability::DAC_READ_SEARCH).met_by(admin));
        let dac_override = CapabilitySet(1 << Capability::DAC_OVERRIDE.0);
        assert!(requirement(Capability::DAC_READ_SEARCH).met_by(dac_override));
    }

    #[test]
    fn capability_names_cover_new_and_unknown_numbers() {
        assert_eq!(Capability::BPF.name(), "CAP_BPF");
        assert_eq!(Capability::BPF.short_name(), "BPF");
        assert_eq!(Capability(40).name(), "CAP_CHECKPOINT_RESTORE");
        assert_eq!(Capability(41).name(), "CAP_41");
    }

    #[test]
    fn the_missing_capability_message_names_them_and_how_to_grant_the_set() {
        let message = missing_capabilities_message(&[
            requirement(Capability::PERFMON),
            requirement(Capability::SYS_PTRACE),
        ]);
        assert!(message.starts_with("gym-tracer lacks CAP_PERFMON and CAP_SYS_PTRACE (it needs"));
        assert!(message.contains("root"));
        assert!(message.contains(
            "AmbientCapabilities=CAP_BPF CAP_PERFMON CAP_DAC_READ_SEARCH CAP_SYS_PTRACE"
        ));
        assert!(message.contains("add: [BPF, PERFMON, DAC_READ_SEARCH, SYS_PTRACE]"));
        assert!(
            message.contains("setcap cap_bpf,cap_perfmon,cap_dac_read_search,cap_sys_ptrace+ep")
        );
    }

    #[test]
    fn tracefs_mounts_are_recognised_in_mountinfo() {
        let mountinfo = "50 25 0:12 / /sys/kernel/tracing rw,relatime shared:4 - tracefs nodev rw\n\
                         51 25 0:13 / /sys/kernel/debug rw - debugfs debugfs rw";
        assert!(is_tracefs_mount(mountinfo, "/sys/kernel/tracing"));
        assert!(!is_tracefs_mount(mountinfo, "/sys/kernel/debug"));
        assert!(!is_tracefs_mount(mountinfo, "/sys/kernel/debug/tracing"));
    }

    /// Compares the attachment table with the programs of the object this build embeds.
    /// A build with `AYA_BUILD_SKIP=1` embeds no object, and this test then fails rather
    /// than pass on nothing: run it from a normal build.
    #[test]
    fn every_program_is_attached_and_tracepoints_are_unique() {
        assert!(
            !EBPF_OBJECT.is_empty(),
            "this build embeds no eBPF object (AYA_BUILD_SKIP was set): run the test from a \
             build without it"
        );
        let programs = object_programs(EBPF_OBJECT).unwrap();
        assert!(programs.len() > 1, "{programs:?}");
        let all = attachments();
        check_attachments_cover(&programs, &all).unwrap();
        for program in &programs {
            assert!(
                all.iter().any(|a| a.program == program)
                    || uprobe_programs().any(|uprobe| uprobe == program)
                    || INJECTION_PROGRAMS.contains(&program.as_str())
                    || TAIL_CALLED_PROGRAMS.contains(&program.as_str()),
                "{program} unattached"
            );
        }
    }

    #[test]
    fn a_mismatched_attachment_table_is_named() {
        let all = attachments();
        let mut programs: Vec<String> = all
            .iter()
            .map(|a| a.program)
            .chain(uprobe_programs())
            .chain(INJECTION_PROGRAMS)
            .chain(TAIL_CALLED_PROGRAMS)
            .map(str::to_string)
            .collect();
        programs.sort();
        programs.dedup();
        check_attachments_cover(&programs, &all).unwrap();
        let extra = [programs.clone(), vec!["uprobe_ssl_write".to_string()]].concat();
        let error = check_attachments_cover(&extra, &all)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("never attached: [\"uprobe_ssl_write\"]"),
            "{error}"
        );
        let fewer: Vec<String> = programs
            .iter()
            .filter(|p| *p != "new_task")
            .cloned()
            .collect();
        let error = check_attachments_cover(&fewer, &all)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("the object lacks: [\"new_task\"]"),
            "{error}"
        );
        let twice = [all.clone(), vec![all[0].clone()]].concat();
        let error = check_attachments_cover(&programs, &twice)
            .unwrap_err()
            .to_string();
        assert!(
            error.contains("attached twice: [\"syscalls/sys_enter_read\"]"),
            "{error}"
        );
    }

    #[test]
    fn the_socket_map_follows_max_connections_within_what_the_kernel_takes() {
        let entries = |max_connections| {
            LoadOptions {
                capture_bytes: 0,
                ring_buffer_bytes: 0,
                max_connections,
                inject_traceparent: None,
                mint_key: MintKey([0; 2]),
                max_tasks: 0,
            }
            .socket_map_entries()
        };
        assert_eq!(entries(16_384), 32_768);
        assert_eq!(entries(0), 1, "a map of no entries cannot be created");
        assert_eq!(entries(usize::MAX), u32::MAX);
    }

    #[test]
    fn this_kernels_tracepoint_layout_is_read() {
        let layout = tracepoint_layout().unwrap();
        assert_ne!(layout.new_task_clone_flags, 0);
        assert_ne!(layout.new_task_pid, 0);
    }
}
