//! `gym-tracer doctor`: what this kernel and these privileges support, and which features
//! will be on or off.
//!
//! Every check reads what `run` would read, and the program check loads the real eBPF
//! object and attaches it, then detaches at once: with the PID filter empty nothing is
//! traced. Only a problem that stops tracing altogether is a failure (exit 1); a feature
//! that is off is a warning.

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};

use anyhow::Result;
use aya::{maps::MapType, programs::ProgramType};

use crate::config::cli::DoctorArgs;
use crate::export::otlp::error_chain;
use crate::kernel::injection::InjectScope;
use crate::kernel::loader::{
    self, Attachment, BTF_PATH, Capability, CapabilitySet, FeatureReport, LoadOptions,
    MapFootprint, REQUIRED_CAPABILITIES, TRACEFS, Tracefs,
};
use crate::kernel::tracepoint_format;
use crate::model::ids::MintKey;
use crate::processes::discovery::{executable_path, gym_server_from_env, read_process_env};
use tracer_abi::TracepointLayout;

/// The first kernel with the BPF ring buffer (and `CAP_BPF`/`CAP_PERFMON`).
const MIN_KERNEL: (u32, u32) = (5, 8);
/// From 5.11 BPF memory is charged to the memory cgroup instead of `RLIMIT_MEMLOCK`.
const MEMCG_ACCOUNTING_KERNEL: (u32, u32) = (5, 11);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Ok,
    Info,
    Warn,
    /// Tracing cannot work: `doctor` exits 1.
    Fail,
    /// Feature states.
    On,
    Off,
}

impl Status {
    fn label(self) -> &'static str {
        match self {
            Status::Ok => "ok",
            Status::Info => "info",
            Status::Warn => "warn",
            Status::Fail => "FAIL",
            Status::On => "on",
            Status::Off => "off",
        }
    }
}

/// One line of the report: what was checked, the verdict, why, and what to do about it.
#[derive(Debug)]
struct Row {
    name: String,
    status: Status,
    detail: String,
    fix: Option<String>,
}

fn row(name: impl Into<String>, status: Status, detail: impl Into<String>) -> Row {
    Row {
        name: name.into(),
        status,
        detail: detail.into(),
        fix: None,
    }
}

impl Row {
    fn fix(mut self, fix: impl Into<String>) -> Self {
        self.fix = Some(fix.into());
        self
    }
}

struct Section {
    title: &'static str,
    rows: Vec<Row>,
}

/// The report as an aligned table, one section after another; a fix goes on its own line
/// under the detail it belongs to.
fn render(sections: &[Section]) -> String {
    let name_width = sections
        .iter()
        .flat_map(|s| &s.rows)
        .map(|r| r.name.chars().count())
        .max()
        .unwrap_or(0);
    let status_width = "info".len();
    let mut out = String::new();
    for (i, section) in sections.iter().enumerate() {
        if i > 0 {
            out.push('\n');
        }
        let _ = writeln!(out, "{}", section.title);
        for row in &section.rows {
            let _ = writeln!(
                out,
                "  {:name_width$}  {:status_width$}  {}",
                row.name,
                row.status.label(),
                row.detail
            );
            if let Some(fix) = &row.fix {
                let indent = 2 + name_width + 2 + status_width + 2;
                let _ = writeln!(out, "{:indent$}→ {fix}", "");
            }
        }
    }
    out
}

/// `(major, minor)` of a release string like `6.18.44-fc-v595`.
fn kernel_version(release: &str) -> Option<(u32, u32)> {
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    let major = parts.next()?.parse().ok()?;
    let minor = parts.next()?.parse().ok()?;
    Some((major, minor))
}

/// Mount points of a filesystem type in a `/proc/self/mountinfo` text.
fn mounts_of_type<'a>(mountinfo: &'a str, fs_type: &str) -> Vec<&'a str> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let separator = fields.iter().position(|&f| f == "-")?;
            (fields.get(separator + 1) == Some(&fs_type))
                .then(|| fields.get(4).copied())
                .flatten()
        })
        .collect()
}

/// Signs that this process runs in a container, from files and the cgroup path.
fn container_markers(
    files_present: &[&str],
    init_cgroup: &str,
    kubernetes_env: bool,
) -> Vec<String> {
    let mut markers: Vec<String> = files_present.iter().map(|f| f.to_string()).collect();
    if kubernetes_env {
        markers.push("KUBERNETES_SERVICE_HOST".to_string());
    }
    for runtime in ["kubepods", "docker", "containerd", "libpod", "lxc"] {
        if init_cgroup.contains(runtime) {
            markers.push(format!("/proc/1/cgroup mentions {runtime}"));
            break;
        }
    }
    markers
}

/// The capabilities in a set by name; a nearly full set (root's) by what it lacks.
fn capability_names(caps: CapabilitySet) -> String {
    let held: Vec<String> = caps.iter().map(Capability::name).collect();
    let lacked: Vec<String> = CapabilitySet::known()
        .iter()
        .filter(|&c| !caps.contains(c))
        .map(Capability::name)
        .collect();
    if held.is_empty() {
        "none".to_string()
    } else if lacked.is_empty() {
        format!("all {} capabilities", held.len())
    } else if lacked.len() < held.len() {
        format!("all but {}", lacked.join(", "))
    } else {
        held.join(", ")
    }
}

fn io_reason(error: &io::Error) -> String {
    match error.kind() {
        io::ErrorKind::PermissionDenied => "permission denied".to_string(),
        io::ErrorKind::NotFound => "not found".to_string(),
        _ => error.to_string(),
    }
}

/// What the checks found that the feature verdicts depend on.
struct Findings {
    tracing: Result<(), String>,
    fork_tracepoint: bool,
    host_pid_namespace: bool,
    socket_addresses: Result<(), String>,
}

/// Everything `doctor` reads about the host, read once; each check below is a function of
/// it that returns its report line(s).
struct Host {
    caps: CapabilitySet,
    uid: String,
    mountinfo: String,
    release: String,
    version: Option<(u32, u32)>,
    socket_addresses: Result<(), String>,
    /// `tcp_sock.write_seq` and `copied_seq` offsets, when this kernel's BTF has them.
    sequence_numbers: Option<(u32, u32)>,
    tracefs: Tracefs,
    /// `/proc/filesystems` lists tracefs.
    tracefs_known: bool,
    /// `<tracefs>/events`, when tracefs is readable.
    events: Option<PathBuf>,
    layout: Result<TracepointLayout, String>,
    host_pid_namespace: Option<bool>,
    /// The error chain when the probe itself was refused.
    ring_buffer: Result<bool, String>,
    /// The real object, loaded and attached (the inner result), then detached.
    /// With the maps the load created, at `run`'s default sizes.
    trial: Result<(FeatureReport, Result<usize>, Vec<MapFootprint>)>,
    /// `--inject-traceparent`: the cgroup v2 root and what FIONREAD says, or why it fails.
    injection: Result<(PathBuf, Option<i32>), String>,
    /// Programs in the embedded object.
    programs: usize,
    kprobe_pmu: bool,
    fentry: Result<bool, String>,
    init_environ: io::Result<()>,
}

impl Host {
    fn snapshot() -> Result<Self> {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let caps = CapabilitySet::from_status(&status, "CapEff")?;
        let uid = status
            .lines()
            .find_map(|l| l.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            .unwrap_or("?")
            .to_string();
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|r| r.trim().to_string())
            .unwrap_or_default();
        let tracefs = loader::locate_tracefs();
        let events = match &tracefs {
            Tracefs::Readable(path) => Some(path.join("events")),
            _ => None,
        };
        let tracefs_known = std::fs::read_to_string("/proc/filesystems")
            .map(|f| {
                f.lines()
                    .any(|l| l.split_whitespace().last() == Some("tracefs"))
            })
            .unwrap_or(false);
        let trial = loader::trial_load(&LoadOptions {
            capture_bytes: tracer_abi::DEFAULT_CAPTURE_BYTES,
            // What `run` allocates by default (the memory cgroup is charged for it).
            ring_buffer_bytes: crate::config::cli::DEFAULT_RING_BUFFER_BYTES,
            max_connections: crate::config::cli::DEFAULT_MAX_CONNECTIONS,
            inject_traceparent: None,
            mint_key: MintKey([0; 2]),
            max_tasks: tracer_abi::DEFAULT_MAX_TASKS,
        });
        let injection = loader::trial_injection(&LoadOptions {
            capture_bytes: tracer_abi::DEFAULT_CAPTURE_BYTES,
            ring_buffer_bytes: 4096,
            max_connections: 1,
            inject_traceparent: Some(InjectScope::All),
            mint_key: MintKey([0; 2]),
            max_tasks: 1,
        })
        .map_err(|e| error_chain(e.as_ref()));
        let offsets = loader::socket_offsets();
        Ok(Self {
            caps,
            uid,
            mountinfo: std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default(),
            version: kernel_version(&release),
            release,
            socket_addresses: offsets.as_ref().map(|_| ()).map_err(Clone::clone),
            sequence_numbers: offsets
                .ok()
                .filter(|o| o.seq_valid != 0)
                .map(|o| (o.tcp_write_seq, o.tcp_copied_seq)),
            tracefs,
            tracefs_known,
            events,
            layout: loader::tracepoint_layout().map_err(|e| format!("{e:#}")),
            host_pid_namespace: loader::in_initial_pid_namespace(),
            ring_buffer: aya::sys::is_map_supported(MapType::RingBuf).map_err(|e| error_chain(&e)),
            trial,
            injection,
            programs: loader::embedded_programs().map_or(0, |programs| programs.len()),
            kprobe_pmu: Path::new("/sys/bus/event_source/devices/kprobe/type").exists(),
            fentry: aya::sys::is_program_supported(ProgramType::Tracing)
                .map_err(|e| error_chain(&e)),
            init_environ: std::fs::read("/proc/1/environ").map(|_| ()),
        })
    }

    /// The capabilities `run` requires and this process lacks.
    fn missing_capabilities(&self) -> Vec<String> {
        REQUIRED_CAPABILITIES
            .iter()
            .filter(|r| !r.met_by(self.caps))
            .map(|r| r.capability.name())
            .collect()
    }
}

pub fn run(args: &DoctorArgs) -> Result<bool> {
    let host = Host::snapshot()?;
    let kernel = vec![
        kernel_row(&host),
        btf_row(&host),
        sequence_row(&host),
        tracefs_row(&host),
        tracepoints_row(&host),
        layout_row(&host),
        pid_namespace_row(&host),
        ring_buffer_row(&host),
        programs_row(&host),
        injection_row(&host),
        maps_row(&host),
        kprobes_row(&host),
        fentry_row(&host),
    ];
    let mut processes = vec![init_environ_row(&host)];
    processes.extend(args.pids.iter().flat_map(|&pid| {
        [
            pid_row(pid),
            python_row(pid),
            lineage_row(pid),
            tls_row(pid),
        ]
    }));
    let sections = [
        Section {
            title: "Kernel",
            rows: kernel,
        },
        Section {
            title: "Privileges",
            rows: privilege_rows(&host),
        },
        Section {
            title: "Processes",
            rows: processes,
        },
        Section {
            title: "Features",
            rows: feature_rows(&findings(&host)),
        },
    ];
    Ok(print_report(&sections))
}

/// Prints the report and its verdict; true when nothing failed.
fn print_report(sections: &[Section]) -> bool {
    print!("{}", render(sections));
    let failed = sections
        .iter()
        .flat_map(|s| &s.rows)
        .any(|r| r.status == Status::Fail);
    println!(
        "\n{}",
        if failed {
            "gym-tracer cannot trace on this host as it runs now: see FAIL above."
        } else {
            "gym-tracer can trace on this host."
        }
    );
    !failed
}

fn findings(host: &Host) -> Findings {
    let missing = host.missing_capabilities();
    let tracing = match &host.trial {
        Ok((_, Ok(_), _)) if !missing.is_empty() => Err(format!(
            "the kernel allows it, but `gym-tracer run` first requires {}",
            missing.join(", ")
        )),
        Ok((_, Ok(_), _)) => Ok(()),
        Ok((_, Err(error), _)) => Err(format!("attaching failed: {}", error_chain(error.as_ref()))),
        Err(error) => Err(format!("loading failed: {}", error_chain(error.as_ref()))),
    };
    Findings {
        tracing,
        fork_tracepoint: host
            .events
            .as_ref()
            .is_some_and(|events| events.join("task/task_newtask/id").exists()),
        host_pid_namespace: host.host_pid_namespace.unwrap_or(true),
        socket_addresses: host.socket_addresses.clone(),
    }
}

fn kernel_row(host: &Host) -> Row {
    let release = &host.release;
    match host.version {
        Some(v) if v >= MEMCG_ACCOUNTING_KERNEL => row(
            "kernel",
            Status::Ok,
            format!(
                "{release}: ring buffer, CAP_BPF/CAP_PERFMON, BPF memory charged to the memory cgroup"
            ),
        ),
        Some(v) if v >= MIN_KERNEL => row(
            "kernel",
            Status::Warn,
            format!("{release}: BPF memory counts against RLIMIT_MEMLOCK (before 5.11)"),
        )
        .fix("run with LimitMEMLOCK=infinity (systemd) or CAP_SYS_RESOURCE"),
        _ => row(
            "kernel",
            Status::Fail,
            format!("{release:?}: gym-tracer needs Linux 5.8 or later (BPF ring buffer)"),
        )
        .fix("upgrade the kernel"),
    }
}

fn btf_row(host: &Host) -> Row {
    match &host.socket_addresses {
        Ok(()) => row(
            "BTF",
            Status::Ok,
            format!("{BTF_PATH}: socket struct offsets found"),
        ),
        Err(why) => row("BTF", Status::Warn, why.clone()).fix(
            "use a kernel with CONFIG_DEBUG_INFO_BTF=y; without it spans lack connection addresses",
        ),
    }
}

/// Exact edges (on one host whatever either end missed, across hosts and NAT at all) need
/// the TCP sequence numbers.
fn sequence_row(host: &Host) -> Row {
    const NAME: &str = "TCP sequence numbers";
    match (&host.socket_addresses, host.sequence_numbers) {
        (Ok(()), Some((write_seq, copied_seq))) => row(
            NAME,
            Status::Ok,
            format!(
                "tcp_sock.write_seq +{write_seq}, copied_seq +{copied_seq}: a request's two ends \
                 are matched exactly, across hosts and NAT too"
            ),
        ),
        (Ok(()), None) => row(
            NAME,
            Status::Warn,
            "this kernel's BTF lacks sock.sk_protocol, tcp_sock.write_seq or copied_seq",
        )
        .fix(
            "nothing to set: a connection's two ends are then matched by the order of its \
             requests on one host, and spans from another host are not joined",
        ),
        (Err(_), _) => row(NAME, Status::Warn, "not checked: no BTF (see the BTF row)"),
    }
}

fn tracefs_row(host: &Host) -> Row {
    match &host.tracefs {
        Tracefs::Readable(path) => row(
            "tracefs",
            Status::Ok,
            format!("mounted at {}", path.display()),
        ),
        Tracefs::Unreadable { path, error } => row(
            "tracefs",
            Status::Fail,
            format!(
                "mounted at {} but unreadable ({}): tracepoint ids cannot be read",
                path.display(),
                io_reason(error)
            ),
        )
        .fix("grant CAP_DAC_READ_SEARCH (or run as uid 0)"),
        Tracefs::NotMounted if !host.tracefs_known => {
            row("tracefs", Status::Fail, "this kernel has no tracefs")
                .fix("use a kernel with CONFIG_FTRACE (tracefs) and CONFIG_FTRACE_SYSCALLS")
        }
        Tracefs::NotMounted if host.caps.contains(Capability::SYS_ADMIN) => row(
            "tracefs",
            Status::Warn,
            format!("not mounted; `run` will mount it at {TRACEFS} (CAP_SYS_ADMIN)"),
        )
        .fix(format!(
            "or mount it yourself: mount -t tracefs nodev {TRACEFS}"
        )),
        Tracefs::NotMounted => row(
            "tracefs",
            Status::Fail,
            "not mounted, and mounting it needs CAP_SYS_ADMIN",
        )
        .fix(format!(
            "mount -t tracefs nodev {TRACEFS} (in a container: mount the host's {TRACEFS})"
        )),
    }
}

fn tracepoints_row(host: &Host) -> Row {
    let attachments = loader::attachments();
    let Some(events) = &host.events else {
        return row(
            "tracepoints",
            Status::Warn,
            format!(
                "not checked ({} needed): tracefs is not readable",
                attachments.len()
            ),
        );
    };
    let absent: Vec<String> = attachments
        .iter()
        .map(Attachment::tracepoint)
        .filter(|tp| !events.join(tp).join("id").exists())
        .collect();
    if absent.is_empty() {
        row(
            "tracepoints",
            Status::Ok,
            format!(
                "all {} present: {}",
                attachments.len(),
                tracepoint_summary(&attachments)
            ),
        )
    } else {
        row(
            "tracepoints",
            Status::Fail,
            format!("missing: {}", absent.join(", ")),
        )
        .fix("use a kernel built with CONFIG_FTRACE_SYSCALLS=y")
    }
}

/// The record layout the fork and exit programs were told, from the `format` files.
fn layout_row(host: &Host) -> Row {
    if host.events.is_none() {
        return row(
            "tracepoint layout",
            Status::Warn,
            "not checked: tracefs is not readable",
        );
    }
    match &host.layout {
        Ok(layout) => row(
            "tracepoint layout",
            Status::Ok,
            format!(
                "syscall arguments in 8-byte slots from 16; {}",
                tracepoint_format::describe(layout)
            ),
        ),
        Err(why) => row("tracepoint layout", Status::Fail, why.clone())
            .fix("gym-tracer refuses to load on this layout: report it with the format file named"),
    }
}

fn pid_namespace_row(host: &Host) -> Row {
    match host.host_pid_namespace {
        Some(true) => row("PID namespace", Status::Ok, "the host's: PIDs match what the kernel programs see"),
        Some(false) => row(
            "PID namespace",
            Status::Fail,
            "a namespace of its own: the kernel programs report host PIDs, so --pid and discovery cannot match them",
        )
        .fix("run in the host's PID namespace (Kubernetes hostPID: true, docker --pid=host)"),
        None => row("PID namespace", Status::Warn, "/proc/self/ns/pid unreadable"),
    }
}

fn ring_buffer_row(host: &Host) -> Row {
    match &host.ring_buffer {
        Ok(true) => row("ring buffer", Status::Ok, "BPF_MAP_TYPE_RINGBUF supported"),
        Ok(false) => row(
            "ring buffer",
            Status::Fail,
            "BPF_MAP_TYPE_RINGBUF not supported",
        )
        .fix("use Linux 5.8 or later"),
        Err(chain) => {
            let by_version = if host.version.is_some_and(|v| v >= MIN_KERNEL) {
                "; the kernel version has it"
            } else {
                ""
            };
            row(
                "ring buffer",
                Status::Warn,
                format!("could not probe ({chain}){by_version}"),
            )
            .fix("probing needs CAP_BPF")
        }
    }
}

fn programs_row(host: &Host) -> Row {
    match &host.trial {
        Ok((_, Ok(attached), _)) => row(
            "eBPF programs",
            Status::Ok,
            format!(
                "the real object's {} programs loaded (maps, verifier) and attached to {attached} tracepoints, then detached; nothing was traced",
                host.programs
            ),
        ),
        Ok((_, Err(error), _)) => row(
            "eBPF programs",
            Status::Fail,
            format!(
                "loaded, but attaching failed: {}",
                error_chain(error.as_ref())
            ),
        )
        .fix(attach_fix(host.caps, &host.tracefs)),
        Err(error) => row(
            "eBPF programs",
            Status::Fail,
            format!("loading failed: {}", error_chain(error.as_ref())),
        )
        .fix(load_fix(host.caps)),
    }
}

/// `--inject-traceparent` is off by default; this says whether it would work here and
/// whether this kernel has the sockmap change that makes FIONREAD report 0.
fn injection_row(host: &Host) -> Row {
    const NAME: &str = "traceparent injection";
    match &host.injection {
        Ok((root, None)) => row(
            NAME,
            Status::Ok,
            format!(
                "sock_ops and sk_msg load; cgroup v2 at {}; a socket in the sockhash still \
                 reports its waiting bytes to FIONREAD: --inject-traceparent can be used",
                root.display()
            ),
        ),
        Ok((root, Some(reported))) => row(
            NAME,
            Status::Warn,
            format!(
                "sock_ops and sk_msg load (cgroup v2 at {}), but a socket in the sockhash \
                 reports {reported} to FIONREAD with bytes waiting",
                root.display()
            ),
        )
        .fix(
            "with --inject-traceparent, a runtime that sizes its reads by FIONREAD may stall \
             on traced processes' outbound connections (aiohttp, uvloop and asyncio do not); \
             leave it off if yours does",
        ),
        Err(error) => row(NAME, Status::Warn, format!("unavailable: {error}")).fix(
            "nothing needed unless you want --inject-traceparent: it needs cgroup v2 mounted \
             and CAP_NET_ADMIN",
        ),
    }
}

/// The kernel maps `run` creates at its default sizes (`SOCKETS` follows --max-connections):
/// what the kernel holds for the agent, allocated up front.
fn maps_row(host: &Host) -> Row {
    let Ok((_, _, maps)) = &host.trial else {
        return row("eBPF maps", Status::Info, "not loaded (see eBPF programs)");
    };
    let total: u64 = maps.iter().map(|map| map.memlock_bytes).sum();
    let each: Vec<String> = maps
        .iter()
        .map(|map| {
            format!(
                "{} {} entries {} KiB",
                map.name,
                map.max_entries,
                map.memlock_bytes / 1024
            )
        })
        .collect();
    row(
        "eBPF maps",
        Status::Info,
        format!(
            "{} KiB of kernel memory at the default sizes: {}",
            total / 1024,
            each.join(", ")
        ),
    )
}

fn kprobes_row(host: &Host) -> Row {
    row(
        "kprobes",
        Status::Info,
        format!(
            "{}; not used: gym-tracer attaches only to stable tracepoints",
            if host.kprobe_pmu {
                "available"
            } else {
                "not available"
            }
        ),
    )
}

fn fentry_row(host: &Host) -> Row {
    let caps = host.caps;
    let fentry = match &host.fentry {
        Ok(true) => "available".to_string(),
        Ok(false) => "not available".to_string(),
        Err(chain)
            if loader::requirement(Capability::BPF).met_by(caps)
                && loader::requirement(Capability::PERFMON).met_by(caps) =>
        {
            format!("not available (its probe program was refused: {chain})")
        }
        Err(chain) => format!("could not probe ({chain})"),
    };
    row("fentry/fexit", Status::Info, format!("{fentry}; not used"))
}

fn privilege_rows(host: &Host) -> Vec<Row> {
    let caps = host.caps;
    let mut privileges = vec![row(
        "in effect",
        Status::Info,
        format!("uid {}, CapEff {}", host.uid, capability_names(caps)),
    )];
    for requirement in &REQUIRED_CAPABILITIES {
        let name = requirement.capability.name();
        privileges.push(if requirement.met_by(caps) {
            row(&name, Status::Ok, format!("to {}", requirement.needed_for))
        } else {
            row(
                &name,
                Status::Fail,
                format!("missing: {}", requirement.without_it),
            )
            .fix(format!(
                "grant {name}: `gym-tracer run` refuses to start without it"
            ))
        });
    }
    let mount_needed = matches!(host.tracefs, Tracefs::NotMounted);
    privileges.push(row(
        Capability::SYS_ADMIN.name(),
        Status::Info,
        format!(
            "for uprobes (TLS plaintext, task lineage) on Linux since mid-2025, which no \
             longer accepts CAP_PERFMON for them, and to mount tracefs when the host has not{}",
            if mount_needed { ": needed here" } else { "" }
        ),
    ));
    privileges.push(row(
        Capability::SYS_RESOURCE.name(),
        Status::Info,
        "only before Linux 5.11, to lift RLIMIT_MEMLOCK for BPF memory",
    ));
    privileges.push(cgroup_row(&host.mountinfo));
    privileges.push(container_row());
    privileges
}

fn init_environ_row(host: &Host) -> Row {
    match &host.init_environ {
        Ok(()) => row(
            "/proc/1/environ",
            Status::Ok,
            "readable: other processes' environment can be read",
        ),
        // Seen in a microVM whose init refuses even root with every capability.
        Err(e) if host.caps.contains(Capability::SYS_PTRACE) => row(
            "/proc/1/environ",
            Status::Info,
            format!(
                "unreadable ({}) even with CAP_SYS_PTRACE: process 1 refuses it (some sandboxes' init does); other processes are not affected",
                io_reason(e)
            ),
        ),
        Err(e) => row(
            "/proc/1/environ",
            Status::Warn,
            format!("unreadable ({})", io_reason(e)),
        )
        .fix("grant CAP_SYS_PTRACE to read other users' processes"),
    }
}

/// `syscalls/sys_{enter,exit}_{read,...}, ...`: the tracepoints without 25 lines of them.
fn tracepoint_summary(attachments: &[Attachment]) -> String {
    let mut paired: Vec<&str> = attachments
        .iter()
        .filter_map(|a| a.name.strip_prefix("sys_exit_"))
        .collect();
    paired.dedup();
    let others: Vec<String> = attachments
        .iter()
        .filter(|a| {
            let syscall = a
                .name
                .strip_prefix("sys_enter_")
                .or(a.name.strip_prefix("sys_exit_"));
            !syscall.is_some_and(|s| paired.contains(&s))
        })
        .map(Attachment::tracepoint)
        .collect();
    format!(
        "syscalls/sys_{{enter,exit}}_{{{}}}, {}",
        paired.join(","),
        others.join(", ")
    )
}

fn load_fix(caps: CapabilitySet) -> String {
    let missing: Vec<String> = REQUIRED_CAPABILITIES
        .iter()
        .filter(|r| {
            matches!(r.capability, Capability::BPF | Capability::PERFMON) && !r.met_by(caps)
        })
        .map(|r| r.capability.name())
        .collect();
    if missing.is_empty() {
        "the verifier or the kernel refused the programs: report this with the error above"
            .to_string()
    } else {
        format!("grant {} (or run as root)", missing.join(" and "))
    }
}

fn attach_fix(caps: CapabilitySet, tracefs: &Tracefs) -> String {
    match tracefs {
        Tracefs::Readable(_) if !loader::requirement(Capability::PERFMON).met_by(caps) => {
            "grant CAP_PERFMON (perf_event_open of system-wide tracepoints)".to_string()
        }
        Tracefs::Readable(_) => "see the error above".to_string(),
        Tracefs::Unreadable { .. } => "grant CAP_DAC_READ_SEARCH (or run as uid 0)".to_string(),
        Tracefs::NotMounted => format!("mount tracefs: mount -t tracefs nodev {TRACEFS}"),
    }
}

fn cgroup_row(mountinfo: &str) -> Row {
    let v2 = mounts_of_type(mountinfo, "cgroup2");
    let v1 = mounts_of_type(mountinfo, "cgroup");
    let layout = match (v2.first(), v1.is_empty()) {
        (Some(v2), true) => format!("v2 at {v2}"),
        (Some(v2), false) => format!("hybrid: v1 controllers and v2 at {v2}"),
        (None, false) => "v1 only".to_string(),
        (None, true) => "none mounted".to_string(),
    };
    row(
        "cgroup",
        Status::Info,
        format!("{layout}; BPF maps (the ring buffer) are charged to the agent's memory cgroup"),
    )
}

fn container_row() -> Row {
    let files: Vec<&str> = ["/.dockerenv", "/run/.containerenv"]
        .into_iter()
        .filter(|f| Path::new(f).exists())
        .collect();
    let init_cgroup = std::fs::read_to_string("/proc/1/cgroup").unwrap_or_default();
    let markers = container_markers(
        &files,
        &init_cgroup,
        std::env::var_os("KUBERNETES_SERVICE_HOST").is_some(),
    );
    if markers.is_empty() {
        row("container", Status::Info, "no container markers")
    } else {
        row(
            "container",
            Status::Info,
            format!(
                "probably ({}): it needs the host's PID namespace and tracefs, and to reach the servers' ports for the route harvest",
                markers.join(", ")
            ),
        )
    }
}

/// What the agent could read about one `--pid` process.
fn pid_row(pid: u32) -> Row {
    let name = format!("pid {pid}");
    if !Path::new(&format!("/proc/{pid}")).exists() {
        return row(
            &name,
            Status::Fail,
            "no such process (in this PID namespace)",
        )
        .fix("check the PID; in a container, run in the host's PID namespace");
    }
    let environ = read_process_env(Path::new("/proc"), pid);
    let exe = executable_path(pid);
    // Listing the fds is not enough: the route harvest reads where they link.
    let fd = std::fs::read_dir(format!("/proc/{pid}/fd")).and_then(|entries| {
        match entries.flatten().next() {
            Some(entry) => std::fs::read_link(entry.path()).map(|_| ()),
            None => Ok(()),
        }
    });
    let what = match &environ {
        Ok(env) => match gym_server_from_env(env) {
            Ok(Some(server)) => format!(
                "Gym server {:?} ({})",
                server.name,
                server.server_type.as_deref().unwrap_or("type unknown")
            ),
            Ok(None) => "not a Gym server".to_string(),
            Err(error) => format!("Gym server {:?} (config unreadable)", error.server().name),
        },
        Err(_) => "unknown".to_string(),
    };
    let mut unreadable = Vec::new();
    if let Err(e) = &environ {
        unreadable.push(format!("environ ({})", io_reason(e)));
    }
    if exe.is_none() {
        unreadable.push("exe".to_string());
    }
    if let Err(e) = &fd {
        unreadable.push(format!("fd ({})", io_reason(e)));
    }
    if unreadable.is_empty() {
        row(
            &name,
            Status::Ok,
            format!("environ, exe and fd readable: {what}"),
        )
    } else {
        row(
            &name,
            Status::Warn,
            format!(
                "traceable, but {} unreadable: its Gym labels, executable path or listening port are unknown",
                unreadable.join(", ")
            ),
        )
        .fix("grant CAP_SYS_PTRACE")
    }
}

/// Whether the agent could read a `--pid` process's Python runtime from outside (issue #13):
/// an interpreter it does not know is off for that process, with the reason.
fn python_row(pid: u32) -> Row {
    use crate::processes::python::{self, ProcessMemory, RuntimeOff};
    let name = format!("pid {pid} python");
    match python::inspect(pid) {
        Ok(runtime) => {
            let threads = ProcessMemory::new(pid)
                .ok_or(RuntimeOff::Unreadable(pid))
                .and_then(|memory| runtime.kernel_threads(pid, &memory, &python::host_tids(pid)));
            let described = format!(
                "CPython {} ({:?}, {}): _PyRuntime at {:#x}, walk from {:?}",
                runtime.version,
                runtime.linkage,
                runtime.library.display(),
                runtime.runtime_address,
                runtime.walk_source
            );
            match threads {
                Ok(threads) => row(
                    &name,
                    Status::On,
                    format!(
                        "{described}; task context reads on ({} thread(s), PyContext_Type at \
                         {:#x})",
                        threads.len(),
                        runtime.context_type.unwrap_or(0)
                    ),
                ),
                Err(why) => row(
                    &name,
                    Status::Warn,
                    format!(
                        "{described}; task context reads off: {} ({why})",
                        why.reason()
                    ),
                ),
            }
        }
        Err(RuntimeOff::NotPython) => row(&name, Status::Info, "not a CPython process"),
        Err(why) => row(
            &name,
            Status::Off,
            format!("{} ({why}); task context reads off", why.reason()),
        ),
    }
}

/// Whether the task-creation probe could serve a `--pid` process (`--task-lineage`), where it
/// would go, and whether `--task-lineage auto` would probe it.
fn lineage_row(pid: u32) -> Row {
    use crate::processes::discovery::{gym_server_from_env, read_process_env};
    use crate::processes::python::{self, asyncio};
    use crate::processes::tls_library::path_in_process;
    let name = format!("pid {pid} lineage");
    let runtime = match python::inspect(pid) {
        Ok(runtime) => runtime,
        Err(python::RuntimeOff::NotPython) => {
            return row(&name, Status::Info, "not a CPython process");
        }
        Err(why) => {
            return row(
                &name,
                Status::Off,
                format!(
                    "task lineage off: its runtime is not read ({})",
                    why.reason()
                ),
            );
        }
    };
    let server = read_process_env(Path::new("/proc"), pid)
        .ok()
        .and_then(|env| gym_server_from_env(&env).ok().flatten());
    let auto = if server.as_ref().is_some_and(|s| s.wants_task_lineage()) {
        "--task-lineage auto probes it (a Gym resources server that names a model server)"
    } else {
        "--task-lineage auto leaves it (not a Gym resources server naming a model server); \
         --task-lineage on would probe it"
    };
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    match asyncio::asyncio_site(&maps, &runtime, |path| {
        std::fs::read(path_in_process(pid, path)).ok()
    }) {
        Ok(site) => row(
            &name,
            Status::On,
            format!(
                "task lineage possible: a uprobe on Task.__init__ in {}{} (Task.task_context at \
                 {:#x}, confirmed by its machine code); {auto}",
                site.path.display(),
                if site.built_in { " (built in)" } else { "" },
                site.layout.task_context
            ),
        ),
        Err(asyncio::LineageOff::NotImported) => row(
            &name,
            Status::Info,
            format!("asyncio is not imported yet (the agent looks again every 5 s); {auto}"),
        ),
        Err(why) => row(
            &name,
            Status::Off,
            format!("task lineage off: {} ({why})", why.reason()),
        ),
    }
}

/// Which TLS library of a `--pid` process the SSL uprobes would attach to (issue #14), or why
/// its HTTPS requests would not be seen.
fn tls_row(pid: u32) -> Row {
    use crate::processes::tls_library::{
        TlsSupport, defined_ssl_functions, mapped_tls_libraries, path_in_process, tls_support,
    };
    let name = format!("pid {pid} tls");
    let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else {
        return row(&name, Status::Warn, "its /proc/PID/maps is unreadable");
    };
    let in_process = |path: &Path| path_in_process(pid, path);
    let libraries = mapped_tls_libraries(&maps);
    let support = tls_support(&libraries, |library| {
        std::fs::read(in_process(&library.path))
            .map(|elf| defined_ssl_functions(&elf))
            .unwrap_or_default()
    });
    match support {
        TlsSupport::Probe(files) => {
            let described: Vec<String> = files
                .iter()
                .map(|library| {
                    let functions = std::fs::read(in_process(&library.path))
                        .map(|elf| defined_ssl_functions(&elf))
                        .unwrap_or_default();
                    format!("{} ({})", library.path.display(), functions.join(", "))
                })
                .collect();
            row(
                &name,
                Status::On,
                format!(
                    "HTTPS plaintext through uprobes on {}",
                    described.join("; ")
                ),
            )
        }
        TlsSupport::Nothing => row(
            &name,
            Status::Info,
            "no TLS library mapped (yet: CPython maps libssl on `import ssl`; the agent looks              again every 5 s and when the process opens a TLS connection)",
        ),
        TlsSupport::Unsupported(path) => row(
            &name,
            Status::Off,
            format!(
                "it maps {}, a TLS library the uprobes do not know: its HTTPS requests would                  be followed by timing and bytes only",
                path.display()
            ),
        ),
        TlsSupport::StaticUnknown(path) => row(
            &name,
            Status::Off,
            format!(
                "its TLS module {} has no OpenSSL symbols (stripped or statically linked):                  its HTTPS requests would be followed by timing and bytes only",
                path.display()
            ),
        ),
    }
}

/// Every feature needs tracing; `run` starts only with the full capability set, so beyond
/// that each depends on the kernel alone.
fn feature_rows(f: &Findings) -> Vec<Row> {
    let others = [
        "fork following",
        "discovery",
        "route harvest",
        "connection addresses",
    ];
    if let Err(why) = &f.tracing {
        let mut rows = vec![row("tracing", Status::Off, why.clone())];
        rows.extend(
            others
                .into_iter()
                .map(|name| row(name, Status::Off, "tracing is off")),
        );
        return rows;
    }
    vec![
        row(
            "tracing",
            Status::On,
            "syscall tracepoints attach; the kernel filters by PID",
        ),
        if f.fork_tracepoint {
            row(
                "fork following",
                Status::On,
                "task_newtask puts new processes (not threads) of traced processes in the PID filter",
            )
        } else {
            row(
                "fork following",
                Status::Off,
                "task/task_newtask tracepoint missing",
            )
        },
        if f.host_pid_namespace {
            row(
                "discovery",
                Status::On,
                "--discover gym reads every process's environment (CAP_SYS_PTRACE, CAP_DAC_READ_SEARCH)",
            )
        } else {
            row("discovery", Status::Off, "not in the host's PID namespace")
        },
        row(
            "route harvest",
            Status::On,
            "GET /openapi.json at the configured port, else the one found via /proc/<pid>/fd; the servers' addresses must be reachable from the agent's network namespace",
        ),
        match &f.socket_addresses {
            Ok(()) => row(
                "connection addresses",
                Status::On,
                "client.address, server.address and ports from the socket (struct offsets from BTF)",
            ),
            Err(why) => row("connection addresses", Status::Off, why.clone()),
        },
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_sets_are_named_by_what_they_hold_or_lack() {
        let set =
            |hex: &str| CapabilitySet::from_status(&format!("CapEff:\t{hex}\n"), "CapEff").unwrap();
        assert_eq!(capability_names(set("0000000000000000")), "none");
        assert_eq!(
            capability_names(set("000001ffffffffff")),
            "all 41 capabilities"
        );
        assert_eq!(
            capability_names(set("000001fffeffffff")),
            "all but CAP_SYS_RESOURCE"
        );
        assert_eq!(
            capability_names(set("000000c000080004")),
            "CAP_DAC_READ_SEARCH, CAP_SYS_PTRACE, CAP_PERFMON, CAP_BPF"
        );
    }

    #[test]
    fn kernel_versions_parse_with_any_suffix() {
        assert_eq!(kernel_version("6.18.44-fc-v595"), Some((6, 18)));
        assert_eq!(kernel_version("5.8.0"), Some((5, 8)));
        assert_eq!(kernel_version("5.15-rc1"), Some((5, 15)));
        assert_eq!(kernel_version("garbage"), None);
        assert!(kernel_version("5.10.0").unwrap() < MEMCG_ACCOUNTING_KERNEL);
        assert!(kernel_version("5.11.0").unwrap() >= MEMCG_ACCOUNTING_KERNEL);
    }

    #[test]
    fn render_aligns_columns_and_puts_fixes_under_the_detail() {
        let sections = [
            Section {
                title: "Kernel",
                rows: vec![
                    row("BTF", Status::Ok, "present"),
                    row("tracepoints", Status::Fail, "missing: x").fix("rebuild"),
                ],
            },
            Section {
                title: "Features",
                rows: vec![row(
                    "discovery",
                    Status::Off,
                    "not in the host's PID namespace",
                )],
            },
        ];
        let text = render(&sections);
        assert_eq!(
            text,
            "Kernel\n\
             \x20 BTF          ok    present\n\
             \x20 tracepoints  FAIL  missing: x\n\
             \x20                    → rebuild\n\
             \n\
             Features\n\
             \x20 discovery    off   not in the host's PID namespace\n"
        );
    }

    #[test]
    fn mountinfo_mounts_are_found_by_type_after_optional_fields() {
        let mountinfo = "\
30 25 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755
41 30 0:35 / /sys/fs/cgroup/unified rw,relatime shared:9 - cgroup2 cgroup2 rw
42 30 0:36 / /sys/fs/cgroup/cpu rw,relatime shared:10 master:3 - cgroup cgroup rw,cpu
50 25 0:12 / /sys/kernel/tracing rw,relatime - tracefs nodev rw";
        assert_eq!(
            mounts_of_type(mountinfo, "cgroup2"),
            ["/sys/fs/cgroup/unified"]
        );
        assert_eq!(mounts_of_type(mountinfo, "cgroup"), ["/sys/fs/cgroup/cpu"]);
        assert_eq!(
            mounts_of_type(mountinfo, "tracefs"),
            ["/sys/kernel/tracing"]
        );
        assert!(cgroup_row(mountinfo).detail.starts_with("hybrid"));
    }

    #[test]
    fn container_markers_come_from_files_env_and_cgroup() {
        assert!(container_markers(&[], "0::/init.scope\n", false).is_empty());
        let markers =
            container_markers(&["/.dockerenv"], "0::/kubepods/besteffort/pod1/abc\n", true);
        assert_eq!(
            markers,
            [
                "/.dockerenv",
                "KUBERNETES_SERVICE_HOST",
                "/proc/1/cgroup mentions kubepods"
            ]
        );
    }

    #[test]
    fn tracepoints_are_summarised_without_losing_any() {
        let summary = tracepoint_summary(&loader::attachments());
        assert!(summary.starts_with("syscalls/sys_{enter,exit}_{read,recvfrom,"));
        for name in [
            "accept4",
            "connect",
            "syscalls/sys_enter_close",
            "sched/sched_process_exit",
            "task/task_newtask",
            "sched/sched_process_exec",
        ] {
            assert!(summary.contains(name), "{name} not in {summary}");
        }
    }

    #[test]
    fn features_follow_the_findings() {
        let findings = |tracing: Result<(), String>, socket_addresses| Findings {
            tracing,
            fork_tracepoint: true,
            host_pid_namespace: true,
            socket_addresses,
        };
        let rows = feature_rows(&findings(Ok(()), Ok(())));
        assert_eq!(rows.len(), 5);
        assert!(rows.iter().all(|r| r.status == Status::On), "{rows:?}");
        let rows = feature_rows(&findings(Ok(()), Err("no BTF".into())));
        assert_eq!(rows[4].status, Status::Off);
        assert_eq!(rows[4].detail, "no BTF");
        let rows = feature_rows(&findings(Err("loading failed: EPERM".into()), Ok(())));
        assert!(rows.iter().all(|r| r.status == Status::Off), "{rows:?}");
        assert_eq!(rows[0].detail, "loading failed: EPERM");
    }
}
