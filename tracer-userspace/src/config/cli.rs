//! Command-line interface. Every option documents itself in `--help`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::HealthListen;
use crate::export::otlp::options::{HeaderList, KeyValueList, OtlpCompression, OtlpProtocol};
use crate::gym::ServerType;
use crate::gym::routes::RouteTemplate;
use crate::gym::span_groups::SpanGroups;
use crate::kernel::injection::InjectScope;

#[derive(Debug, Parser)]
#[command(
    name = "gym-tracer",
    version,
    about = "Zero-code eBPF tracer for NeMo Gym's HTTP servers",
    long_about = long_about(),
    after_long_help = CONFIG_HELP
)]
pub struct Cli {
    /// A TOML file of options: the long option names as keys (`discover = "gym"`,
    /// `otlp-endpoint = "http://collector:4317"`, `pid = [1234]`). Command-line flags win
    /// over environment variables, which win over the file, which wins over the defaults.
    #[arg(long, global = true, env = "GYM_TRACER_CONFIG", value_name = "FILE")]
    pub config: Option<PathBuf>,

    /// Format of the agent's own log on stderr: `text` for people, `json` (one object per
    /// line) for log collectors; `auto` is text on a terminal and JSON otherwise. Levels
    /// are chosen with RUST_LOG (default `info`).
    #[arg(
        long,
        global = true,
        env = "GYM_TRACER_LOG_FORMAT",
        value_enum,
        default_value = "auto"
    )]
    pub log_format: LogFormat,

    #[command(subcommand)]
    pub command: Command,
}

const ABOUT_INTRO: &str = "Zero-code eBPF tracer for NeMo Gym's HTTP servers.\n\n\
    Attaches to running uvicorn/FastAPI processes from the kernel (syscall tracepoints) — \
    found with --discover gym or named with --pid — and rebuilds from their HTTP/1.x \
    traffic what NeMo Gym's own telemetry would emit: a SERVER span per request named \
    after its route template, a CLIENT span per call, the gym.rollout / gym.verify / \
    gym.agent.* / gym.model.* spans with server name and rollout id, \
    http.server.request.duration and the gym.* metrics; one rollout is one trace, across \
    processes and hosts. Exports them as JSON lines on stdout by default, or over OTLP when \
    an endpoint is configured. The traced processes are not changed, restarted or slowed by \
    in-process instrumentation; request bodies, query strings and Gym's config are never \
    exported.";

const ABOUT_PRIVILEGES: &str = "Needs root, or CAP_BPF + CAP_PERFMON + CAP_SYS_PTRACE + \
    CAP_DAC_READ_SEARCH (`gym-tracer doctor` checks this kernel and these privileges).";

/// `gym-tracer --help`: what it does, how parents are decided (the text docs/how-it-works.md
/// and the stitcher's module doc show too), what it needs.
fn long_about() -> String {
    format!(
        "{ABOUT_INTRO}\n\nHow parents are decided:\n\n{}\n{ABOUT_PRIVILEGES}",
        crate::stitch::EDGE_RULES.replace('`', "")
    )
}

const CONFIG_HELP: &str = "Configuration: every option of `run` can be given as a flag, as an \
    environment variable (shown as [env: ...]; the OpenTelemetry variables \
    OTEL_EXPORTER_OTLP_*, OTEL_EXPORTER_OTLP_{TRACES,METRICS}_*, OTEL_TRACES_EXPORTER, \
    OTEL_METRICS_EXPORTER, OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are honoured), or \
    as a key of the --config TOML file. Precedence: flag > environment > file > default; \
    then, as OpenTelemetry specifies, a per-signal setting wins over the generic one. \
    `gym-tracer check-config` prints the effective configuration and where each value came \
    from, with secrets masked.";

/// `--ring-buffer-bytes` when not set (doctor's trial load allocates the same).
pub const DEFAULT_RING_BUFFER_BYTES: u32 = 16 << 20;

/// Slowest rollouts given a timeline unless `report --slowest` says otherwise (and by
/// `run --report`).
pub const DEFAULT_SLOWEST: usize = 10;

/// `--max-connections` by default.
pub const DEFAULT_MAX_CONNECTIONS: usize = 65_536;

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Trace processes until SIGINT/SIGTERM (without --discover, also until every traced
    /// process has exited).
    Run(RunArgs),
    /// Print the effective configuration of `run` (each value and where it came from:
    /// flag, env, file or default; header values masked), check it, and exit non-zero if
    /// it is invalid. Loads nothing into the kernel.
    CheckConfig(RunArgs),
    /// Report what this kernel and these privileges support (BTF, tracefs, the
    /// tracepoints, ring buffer, capabilities, cgroup, /proc access) and which features
    /// will be on or off, and why. Exits non-zero when tracing cannot work.
    Doctor(DoctorArgs),
    /// Show the rollouts in flight live, slowest first (stragglers marked, the phase each is
    /// in), and the servers' event-loop load and queueing, from a running agent's
    /// `--health-listen` (`GET /rollouts`), refreshed every second; `q` quits. Without a
    /// terminal (or with --once) prints one plain snapshot.
    Top(TopArgs),
    /// Write one self-contained HTML page about a batch of rollouts (figures, duration
    /// histogram, where the time went, rollouts in flight, queueing and event-loop load per
    /// server, the slowest rollouts' critical paths, failures) from the agent's JSON-lines
    /// output (`--output json`; several files, e.g. one per host, are merged). Lines that
    /// are not the agent's are counted and skipped.
    Report(ReportArgs),
    /// Feed a recording (`run --record FILE`) to the tracer again, without a kernel or
    /// privileges, and print the spans it makes as JSON lines (as `run --output json`), with
    /// what it counted on stderr. For bug reports: what the agent made of the traffic, again.
    Replay(ReplayArgs),
    /// Print the generated parts of the docs as Markdown (the options, spans, metrics,
    /// counters and how parents are decided), or rewrite them in place.
    #[command(hide = true)]
    Reference(ReferenceArgs),
}

#[derive(Debug, Args)]
pub struct ReferenceArgs {
    /// Rewrite the marked generated sections (`reference:NAME:begin` … `end`) of these
    /// Markdown files in place, instead of printing.
    #[arg(long, value_name = "FILE", num_args = 1..)]
    pub update: Vec<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ReplayArgs {
    /// The recording `gym-tracer run --record FILE` wrote.
    #[arg(value_name = "FILE")]
    pub recording: PathBuf,
}

#[derive(Debug, Args)]
pub struct ReportArgs {
    /// The agent's JSON-lines output (`gym-tracer run --output json > spans.jsonl`): spans
    /// and metric points; several files merge (a span in two of them counts once).
    #[arg(value_name = "INPUT", required = true)]
    pub inputs: Vec<PathBuf>,
    /// The page to write.
    #[arg(short, long, value_name = "FILE", default_value = "report.html")]
    pub output: PathBuf,
    /// How many of the slowest rollouts get a timeline of their critical path.
    #[arg(long, value_name = "N", default_value_t = DEFAULT_SLOWEST)]
    pub slowest: usize,
    /// Link each slow rollout's trace id to this trace UI address, `{trace_id}` replaced
    /// (e.g. `http://jaeger:16686/trace/{trace_id}`).
    #[arg(long, value_name = "URL", value_parser = parse_trace_url)]
    pub trace_url: Option<String>,
}

fn parse_trace_url(url: &str) -> Result<String, String> {
    if url.contains("{trace_id}") {
        Ok(url.to_owned())
    } else {
        Err(format!(
            "{url:?} has no {{trace_id}} for the trace id to go in (e.g. http://jaeger:16686/trace/{{trace_id}})"
        ))
    }
}

#[derive(Debug, Args)]
pub struct TopArgs {
    /// The agent's health listener (`gym-tracer run --health-listen ADDR`), on this host or
    /// another: `http://HOST:PORT`, `HOST:PORT`, or a bare port on 127.0.0.1.
    #[arg(long, value_name = "URL", default_value = "http://127.0.0.1:9464")]
    pub agent: String,
    /// Print one plain snapshot and exit, even on a terminal.
    #[arg(long)]
    pub once: bool,
}

#[derive(Debug, Args)]
pub struct DoctorArgs {
    /// Also check that the agent could trace this process (read its environment and
    /// executable).
    #[arg(
        long = "pid",
        value_name = "PID",
        env = "GYM_TRACER_PID",
        value_delimiter = ','
    )]
    pub pids: Vec<u32>,
}

/// How the agent's own log lines are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Auto,
    Text,
    Json,
}

/// What is written to stdout when no OTLP endpoint is configured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Output {
    /// One JSON object per span and per metric data point (the machine format).
    Json,
    /// Each finished trace as an indented tree, as it completes (for people; no metrics).
    Tree,
}

/// Where one signal goes (`--traces-exporter`, `--metrics-exporter`), as OpenTelemetry's
/// `OTEL_TRACES_EXPORTER` / `OTEL_METRICS_EXPORTER` name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SignalExporter {
    /// To the OTLP endpoint (the signal's own, else --otlp-endpoint, else OpenTelemetry's
    /// default http://localhost:4318, or :4317 for gRPC).
    Otlp,
    /// To stdout, in the --output format.
    Console,
    /// Nowhere: the signal is not exported.
    None,
}

/// Which processes hit the SSL uprobes (`--tls-probe-scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TlsProbeScope {
    /// Attached per traced process (and library): the breakpoint is placed in traced
    /// processes only, so no other process pays for it.
    Process,
    /// Attached once per library file: every process that maps the file hits the uprobes
    /// and returns at the PID filter (a uprobe trap each: see `cargo xtask bench --only tls`).
    Library,
}

/// Which traced processes get task lineage (`--task-lineage`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum TaskLineageMode {
    /// Gym resources servers whose config names a model server (LLM judges).
    Auto,
    /// Every traced CPython 3.12 or 3.13 process.
    On,
    /// No process.
    Off,
}

/// Which outbound requests `--inject-traceparent` may write a `traceparent` into.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum InjectTraceparent {
    /// None: every request goes out byte for byte.
    #[value(alias = "false")]
    Off,
    /// Those to a peer that is not on this host (not loopback, not one of this host's own
    /// addresses): what joins hosts. Calls on this host need no header (this agent sees
    /// both ends) and go out unchanged.
    Remote,
    /// Every one, on this host too (for OpenTelemetry-instrumented services on this host
    /// that the agent does not trace).
    #[value(alias = "true")]
    All,
}

impl InjectTraceparent {
    /// Which calls the kernel writes into, when on.
    pub fn scope(self) -> Option<InjectScope> {
        match self {
            InjectTraceparent::Off => None,
            InjectTraceparent::Remote => Some(InjectScope::Remote),
            InjectTraceparent::All => Some(InjectScope::All),
        }
    }
}

/// What `--discover` looks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Discover {
    /// NeMo Gym servers: processes whose environment has NEMO_GYM_CONFIG_PATH (the server
    /// name) and NEMO_GYM_CONFIG_DICT (the run's config; only server names, types, hosts
    /// and ports are read from it).
    Gym,
}

#[derive(Clone, Debug, Args)]
pub struct RunArgs {
    /// Process id to trace; repeat for several processes. Connections that are already
    /// open when the agent attaches are not traced, new ones are. Children the process
    /// forks later (uvicorn --workers, reloaders) are traced with its identity. A Gym server
    /// is recognised from its environment; others can be labelled with --server-name and
    /// --server-type.
    #[arg(
        long = "pid",
        value_name = "PID",
        env = "GYM_TRACER_PID",
        value_delimiter = ','
    )]
    pub pids: Vec<u32>,

    /// Find the processes to trace: scan /proc every second, attach to each server found
    /// (and its children), drop servers that exit, and keep running until SIGINT/SIGTERM.
    #[arg(long, value_enum, value_name = "KIND", env = "GYM_TRACER_DISCOVER")]
    pub discover: Option<Discover>,

    /// nemo.gym.server.name for the --pid processes (when their environment does not say).
    #[arg(long, value_name = "NAME", env = "GYM_TRACER_SERVER_NAME")]
    pub server_name: Option<String>,

    /// nemo.gym.server.type for the --pid processes: responses_api_agents,
    /// responses_api_models, resources_servers (or agent, model, resources). Decides which
    /// gym.* span a route gets; without it the type is inferred from the server's routes.
    #[arg(long, value_name = "TYPE", env = "GYM_TRACER_SERVER_TYPE")]
    pub server_type: Option<ServerType>,

    /// Which spans to emit, as Gym's NEMO_GYM_OTEL_SPAN_GROUPS: a comma list of groups
    /// (server, http_client, rollout, verify, agent, model_call, job, sandbox) and presets
    /// (default = job,server,http_client,rollout; per_rollout = server,http_client,rollout,
    /// verify,agent,model_call; all). The tracer defaults to per_rollout, not Gym's
    /// `default`: observing from outside costs the servers nothing per span, so the
    /// per-request gym.verify / gym.agent.* / gym.model.* detail is on, and there is no
    /// run-long job span to hang every rollout under. Metrics are recorded whatever the
    /// groups.
    #[arg(
        long,
        env = "NEMO_GYM_OTEL_SPAN_GROUPS",
        value_name = "SPEC",
        default_value = "per_rollout"
    )]
    pub span_groups: SpanGroups,

    /// A route template, as FastAPI writes it (/items/{item_id}, /files/{p:path}), to name
    /// requests by; repeatable. Checked before the routes harvested from the server's
    /// /openapi.json and Gym's known routes. Paths no template matches are named with
    /// ids, numbers and hashes replaced by {id}, in the span name only (never http.route).
    #[arg(
        long = "route",
        value_name = "TEMPLATE",
        env = "GYM_TRACER_ROUTE",
        value_delimiter = ','
    )]
    pub routes: Vec<RouteTemplate>,

    /// Do not ask servers for their route table. By default the agent GETs
    /// /openapi.json once from each server it attaches to (the request is not traced).
    #[arg(long, env = "GYM_TRACER_NO_ROUTE_HARVEST")]
    pub no_route_harvest: bool,

    /// Do not read the running asyncio task's context in traced CPython processes. By
    /// default the kernel reads it at the first write of each request and response (a few
    /// memory reads, paid by the traced server), which is what ties a call to the request
    /// that made it when many are in flight. Without it, a call is placed by the rollout id
    /// it names, else the only request in flight, else the innermost of nested requests, else
    /// left without a parent (counted).
    #[arg(long, env = "GYM_TRACER_NO_TASK_CONTEXTS")]
    pub no_task_contexts: bool,

    /// Which traced CPython processes get task lineage: a uprobe on `_asyncio`'s
    /// `Task.__init__` records which request each new task descends from, so that a call
    /// written by any task a handler spawned (asyncio.gather and TaskGroup children, the
    /// tasks middleware runs the app in, an LLM judge called from /verify) hangs under the
    /// inbound request that caused it, decided as the call is written, whatever else is in
    /// flight. Each probed server pays a uprobe hit per task it creates (about 3 µs on the
    /// benchmark's VM, 3 to 10 tasks per request: `cargo xtask bench --only lineage`). auto: the Gym
    /// servers whose calls carry no evidence of their own, by their role in the run's config
    /// — model servers (their upstream calls; only some implementations echo the upstream's
    /// response id) and resources servers whose config names a model server (LLM judges) —
    /// and no other process, except with --inject-traceparent, where it is every traced
    /// process (the kernel must know a handler's request for its first call); on: every traced CPython
    /// 3.12 or 3.13 process; off: none. Needs the task-context reads (not with
    /// --no-task-contexts).
    #[arg(
        long,
        value_enum,
        value_name = "WHICH",
        default_value = "auto",
        env = "GYM_TRACER_TASK_LINEAGE"
    )]
    pub task_lineage: TaskLineageMode,

    /// Tasks whose lineage the kernel keeps, over all probed processes: an LRU allocated at
    /// start (about 100 bytes an entry). A live task it forgot makes its calls undecided by
    /// lineage (counted as lineage_calls_unseen); the default holds the live tasks of some
    /// 10,000 Gym requests in flight.
    #[arg(
        long,
        value_name = "N",
        env = "GYM_TRACER_MAX_TASKS",
        default_value_t = tracer_abi::DEFAULT_MAX_TASKS,
        value_parser = clap::value_parser!(u32).range(1..)
    )]
    pub max_tasks: u32,

    /// Insert a W3C `traceparent` header into traced processes' outbound plaintext
    /// HTTP/1.x requests, after the request line, when the request carries none: the callee
    /// (another host's agent, or an OpenTelemetry-instrumented service the agent does not
    /// trace) joins the caller's trace under the exact CLIENT span. Pick `remote` on more
    /// than one host (the DaemonSet and the systemd unit do): the calls between hosts carry
    /// the header, those on this host go out byte for byte; `all` also writes it into calls
    /// on this host; `off` (the default) changes no byte. The bare flag means `all`. The
    /// kernel gives each inbound request without a header its trace as it reads it, and
    /// with task lineage (which `--task-lineage auto` then turns on for every traced
    /// process) every call of the handler born for it carries that trace from the first;
    /// a call whose handler it cannot tell leaves unchanged (traceparents_not_known). Needs
    /// cgroup v2 (a sock_ops program on its root puts traced client sockets in a sockhash,
    /// where an sk_msg program inserts the line) and CAP_NET_ADMIN; on some kernels a socket
    /// in a sockhash reports 0 for FIONREAD (`gym-tracer doctor` says whether this one does).
    #[arg(
        long,
        value_enum,
        value_name = "WHICH",
        num_args = 0..=1,
        default_value = "off",
        default_missing_value = "all",
        env = "GYM_TRACER_INJECT_TRACEPARENT"
    )]
    pub inject_traceparent: InjectTraceparent,

    /// Do not attach uprobes to the OpenSSL library (libssl) of traced processes. By default
    /// each libssl file a traced process maps gets uprobes on SSL_read/SSL_write (and their
    /// _ex forms), so HTTPS calls (a model server's to its inference endpoint) become CLIENT
    /// spans like plaintext ones. Every process that maps the same file then pays a uprobe
    /// hit per call (`cargo xtask bench` measures it); without it, TLS connections are
    /// followed by their timing and bytes only.
    #[arg(long, env = "GYM_TRACER_NO_TLS")]
    pub no_tls: bool,

    /// Which processes hit the SSL uprobes: `process` attaches them per traced process, so
    /// processes the agent does not trace never trap into them (a uprobe hit cost ~7 µs on
    /// the benchmark's VM, three per HTTPS call); `library` attaches them once per libssl
    /// file, so every process on the host that maps it traps and returns at the PID filter.
    #[arg(
        long,
        value_enum,
        value_name = "SCOPE",
        default_value = "process",
        env = "GYM_TRACER_TLS_PROBE_SCOPE"
    )]
    pub tls_probe_scope: TlsProbeScope,

    /// Create this file once every probe is attached and the PIDs are in the filter
    /// (scripts and tests wait for it). Removed on exit.
    #[arg(long, value_name = "PATH", env = "GYM_TRACER_READY_FILE")]
    pub ready_file: Option<PathBuf>,

    /// At exit, write every counter (events, parse errors, drops by reason, exports) as one
    /// JSON object to this file: `{"counters": {name: value, ...}, "events_lost_by_cpu": [...]}`.
    /// The same names as `/metrics` and the JSON log's `stopped` record; the exit summary on stderr shows those that moved. For scripts and tests.
    #[arg(long, value_name = "PATH", env = "GYM_TRACER_SUMMARY_FILE")]
    pub summary_file: Option<PathBuf>,

    /// At exit, write the batch report of what this run traced to this HTML file (what
    /// `gym-tracer report` makes from the JSON output, with the event-loop load sampled every
    /// second). Keeps a copy of each exported span's key fields (about 300 bytes; at most
    /// 1,048,576 spans, ~300 MB, the rest counted on the page).
    #[arg(long, value_name = "FILE", env = "GYM_TRACER_REPORT")]
    pub report: Option<PathBuf>,

    /// Write everything the kernel reported and the agent did with it (processes attached,
    /// routes, timer ticks) to this file, so that the run can be fed to the tracer again
    /// without a kernel: for bug reports and tests. The file holds the traced servers'
    /// traffic as captured, bodies included, so keep it as private as the servers' data;
    /// it stops growing at 1 GiB (counted: inputs_not_recorded). Off by default.
    #[arg(long, value_name = "FILE", env = "GYM_TRACER_RECORD")]
    pub record: Option<PathBuf>,

    /// With --report: link each slow rollout's trace id to this trace UI address,
    /// `{trace_id}` replaced (e.g. `http://jaeger:16686/trace/{trace_id}`).
    #[arg(long, value_name = "URL", env = "GYM_TRACER_REPORT_TRACE_URL",
          value_parser = parse_trace_url)]
    pub report_trace_url: Option<String>,

    /// Bytes captured from the start of each HTTP message (head and first body bytes).
    /// Larger bodies are followed by length only. At most 8192.
    #[arg(long, value_name = "N", env = "GYM_TRACER_CAPTURE_BYTES",
          default_value_t = tracer_abi::DEFAULT_CAPTURE_BYTES,
          value_parser = clap::value_parser!(u32).range(64..=tracer_abi::MAX_CAPTURE_BYTES as i64))]
    pub capture_bytes: u32,

    /// Size of the kernel-to-agent ring buffer in bytes (rounded up to a power of two).
    /// Records that do not fit are counted as lost and reported.
    #[arg(long, value_name = "BYTES", env = "GYM_TRACER_RING_BUFFER_BYTES",
          default_value_t = DEFAULT_RING_BUFFER_BYTES)]
    pub ring_buffer_bytes: u32,

    /// OTLP endpoint, e.g. http://collector:4317 (gRPC) or http://collector:4318
    /// (HTTP; /v1/traces and /v1/metrics are appended). Without one (or a per-signal
    /// --otlp-traces-endpoint / --otlp-metrics-endpoint), spans and metrics are written to
    /// stdout as JSON lines. An https:// endpoint is reached over TLS.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,

    /// Headers sent with every OTLP export, as `key=value,key2=value2` (values may be
    /// percent-encoded), e.g. an authorization token. Masked by check-config and in logs.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_HEADERS",
        hide_env_values = true,
        value_name = "LIST"
    )]
    pub otlp_headers: Option<HeaderList>,

    /// Milliseconds an OTLP export may take before it is abandoned (and counted as failed).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TIMEOUT", value_name = "MS", default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub otlp_timeout: u64,

    /// Compression of OTLP export requests.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_COMPRESSION",
        value_enum,
        default_value = "none"
    )]
    pub otlp_compression: OtlpCompression,

    /// PEM file of the certificate authorities that sign the collector's certificate (for
    /// an https:// endpoint). Without it, the system's trusted roots are used.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_CERTIFICATE", value_name = "PEM")]
    pub otlp_ca_file: Option<PathBuf>,

    /// PEM client certificate for mutual TLS with the collector (with --otlp-client-key).
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_CLIENT_CERTIFICATE",
        value_name = "PEM"
    )]
    pub otlp_client_cert: Option<PathBuf>,

    /// PEM private key of --otlp-client-cert.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_CLIENT_KEY", value_name = "PEM")]
    pub otlp_client_key: Option<PathBuf>,

    /// Spans sent to the collector in one export request at most.
    #[arg(long, env = "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", value_name = "N", default_value_t = 512,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=65_536))]
    pub export_batch_size: usize,

    /// Finished spans waiting for export at most; past it spans are dropped and counted
    /// (spans_dropped_queue_full).
    #[arg(long, env = "OTEL_BSP_MAX_QUEUE_SIZE", value_name = "N", default_value_t = 65_536,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub export_queue_size: usize,

    /// Spans held for retry while the collector is down, slow or refusing (about 1 KiB
    /// each); past it the oldest are dropped and counted (spans_dropped_export_buffer_full).
    #[arg(long, env = "GYM_TRACER_EXPORT_BUFFER_SPANS", value_name = "N", default_value_t = 65_536,
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub export_buffer_spans: usize,

    /// Milliseconds the final export may take on exit (spans and metrics, side by side);
    /// spans still undelivered then are counted (spans_dropped_undelivered_at_shutdown).
    #[arg(
        long,
        env = "GYM_TRACER_SHUTDOWN_TIMEOUT",
        value_name = "MS",
        default_value_t = 5_000
    )]
    pub shutdown_timeout: u64,

    /// Extra resource attributes for everything exported, as `key=value,key2=value2`
    /// (e.g. k8s.node.name=$(NODE_NAME),host.name=$(NODE_NAME)). They may override host.name
    /// (in a pod the agent sees the pod's hostname), never service.name, nemo.gym.* or
    /// process.*.
    #[arg(long, env = "OTEL_RESOURCE_ATTRIBUTES", value_name = "LIST")]
    pub resource_attributes: Option<KeyValueList>,

    /// stdout format when no OTLP endpoint is set: `json` lines, or a `tree` per trace.
    #[arg(long, value_enum, env = "GYM_TRACER_OUTPUT", default_value = "json")]
    pub output: Output,

    /// OTLP transport.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_PROTOCOL",
        value_enum,
        default_value = "http/protobuf"
    )]
    pub otlp_protocol: OtlpProtocol,

    /// For Gym servers: the service group, as OTEL_SERVICE_NAME is for Gym (service.name is
    /// <group>/<server name>; a server's own OTEL_SERVICE_NAME wins, the default group is
    /// `nemo`). For other processes: their service.name (by default, the executable name).
    #[arg(long, env = "OTEL_SERVICE_NAME", value_name = "NAME")]
    pub service_name: Option<String>,

    /// Seconds between metric exports (a final export always happens on exit).
    #[arg(long, value_name = "SECONDS", env = "GYM_TRACER_METRIC_INTERVAL", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub metric_interval: u64,

    /// Finished spans held for stitching at most. A span is held until nothing can change
    /// its parent any more (its caller's end seen, the requests that could be its parent
    /// ended: events, not a delay), however long the servers queue; past this many the
    /// oldest are exported early (counted as spans_released_early). Formerly
    /// --max-pending-spans: that flag, GYM_TRACER_MAX_PENDING_SPANS and the file key
    /// max-pending-spans still work.
    #[arg(long, value_name = "N", env = "GYM_TRACER_MAX_STITCHING_SPANS", default_value_t = 100_000,
          visible_alias = "max-pending-spans",
          value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..))]
    pub max_stitching_spans: usize,

    /// Connections tracked at once, idle keep-alive ones included. The agent's table: when
    /// full, a new connection evicts the least recently active one (idle before
    /// waiting-on-a-response), counted as connections_evicted. The kernel's socket map has
    /// twice as many entries, allocated at start (room for sockets the table gave up as not
    /// HTTP): past it a new connection is not followed, counted as
    /// sockets_untracked_map_full (and its transfers as transfers_on_unknown_sockets). Each
    /// connection costs 2 × 96 bytes of kernel memory whether used or not (12 MiB at the
    /// default) and, while open, ~2 KiB of agent memory (16,384 idle connections: ~80 MiB
    /// agent RSS in all).
    #[arg(
        long,
        value_name = "N",
        env = "GYM_TRACER_MAX_CONNECTIONS",
        default_value_t = DEFAULT_MAX_CONNECTIONS
    )]
    pub max_connections: usize,

    /// Serve /healthz (probes attached, exporter reachable), /metrics (the agent's own
    /// counters, Prometheus text) and /rollouts (the live view `gym-tracer top` shows) on
    /// this address; a bare port means 127.0.0.1:PORT. Off by default.
    #[arg(long, env = "GYM_TRACER_HEALTH_LISTEN", value_name = "ADDR")]
    pub health_listen: Option<HealthListen>,

    #[command(flatten)]
    pub traces: TracesExportArgs,

    #[command(flatten)]
    pub metrics: MetricsExportArgs,
}

/// Where spans go, and how to reach their collector when that differs from the --otlp-*
/// options: each option here wins over its --otlp-* form for spans, as OpenTelemetry's
/// per-signal variables win over the generic ones.
#[derive(Clone, Debug, Args)]
#[command(next_help_heading = "Traces (per-signal export)")]
pub struct TracesExportArgs {
    /// Where spans go: `otlp`, `console` (stdout, in the --output format), both
    /// (`otlp,console`: the same spans in both places) or `none`. Unset: OTLP when an
    /// endpoint is configured for traces, else stdout.
    #[arg(
        long,
        env = "OTEL_TRACES_EXPORTER",
        value_enum,
        value_name = "EXPORTER",
        value_delimiter = ','
    )]
    pub traces_exporter: Vec<SignalExporter>,

    /// The full URL spans are sent to, used as it is (OTLP/HTTP appends no /v1/traces),
    /// e.g. http://phoenix:6006/v1/traces.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", value_name = "URL")]
    pub otlp_traces_endpoint: Option<String>,

    /// OTLP transport for spans.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", value_enum)]
    pub otlp_traces_protocol: Option<OtlpProtocol>,

    /// Headers sent with span exports, as `key=value,...`, instead of --otlp-headers.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
        hide_env_values = true,
        value_name = "LIST"
    )]
    pub otlp_traces_headers: Option<HeaderList>,

    /// Milliseconds a span export may take.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", value_name = "MS",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub otlp_traces_timeout: Option<u64>,

    /// Compression of span export requests.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", value_enum)]
    pub otlp_traces_compression: Option<OtlpCompression>,

    /// PEM file of the CAs that sign the traces collector's certificate.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_TRACES_CERTIFICATE",
        value_name = "PEM"
    )]
    pub otlp_traces_ca_file: Option<PathBuf>,

    /// PEM client certificate for mutual TLS with the traces collector.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_TRACES_CLIENT_CERTIFICATE",
        value_name = "PEM"
    )]
    pub otlp_traces_client_cert: Option<PathBuf>,

    /// PEM private key of --otlp-traces-client-cert.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_TRACES_CLIENT_KEY", value_name = "PEM")]
    pub otlp_traces_client_key: Option<PathBuf>,
}

/// Where metrics go (the servers' and the agent's own), and how to reach their collector
/// when that differs from the --otlp-* options: each option here wins over its --otlp-*
/// form for metrics. A trace-only backend (Arize Phoenix, Jaeger) takes no metrics: point
/// metrics elsewhere, or set `--metrics-exporter none`.
#[derive(Clone, Debug, Args)]
#[command(next_help_heading = "Metrics (per-signal export)")]
pub struct MetricsExportArgs {
    /// Where metrics go: `otlp`, `console` (stdout, in the --output format), both
    /// (`otlp,console`) or `none`. Unset: OTLP when an endpoint is configured for metrics,
    /// else stdout.
    #[arg(
        long,
        env = "OTEL_METRICS_EXPORTER",
        value_enum,
        value_name = "EXPORTER",
        value_delimiter = ','
    )]
    pub metrics_exporter: Vec<SignalExporter>,

    /// The full URL metrics are sent to, used as it is (OTLP/HTTP appends no /v1/metrics).
    #[arg(long, env = "OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", value_name = "URL")]
    pub otlp_metrics_endpoint: Option<String>,

    /// OTLP transport for metrics.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_METRICS_PROTOCOL", value_enum)]
    pub otlp_metrics_protocol: Option<OtlpProtocol>,

    /// Headers sent with metric exports, as `key=value,...`, instead of --otlp-headers.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
        hide_env_values = true,
        value_name = "LIST"
    )]
    pub otlp_metrics_headers: Option<HeaderList>,

    /// Milliseconds a metric export may take.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_METRICS_TIMEOUT", value_name = "MS",
          value_parser = clap::value_parser!(u64).range(1..))]
    pub otlp_metrics_timeout: Option<u64>,

    /// Compression of metric export requests.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", value_enum)]
    pub otlp_metrics_compression: Option<OtlpCompression>,

    /// PEM file of the CAs that sign the metrics collector's certificate.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_METRICS_CERTIFICATE",
        value_name = "PEM"
    )]
    pub otlp_metrics_ca_file: Option<PathBuf>,

    /// PEM client certificate for mutual TLS with the metrics collector.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_METRICS_CLIENT_CERTIFICATE",
        value_name = "PEM"
    )]
    pub otlp_metrics_client_cert: Option<PathBuf>,

    /// PEM private key of --otlp-metrics-client-cert.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_METRICS_CLIENT_KEY",
        value_name = "PEM"
    )]
    pub otlp_metrics_client_key: Option<PathBuf>,
}
