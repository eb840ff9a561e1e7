//! Command-line interface. Every option documents itself in `--help`.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::export::OtlpProtocol;

#[derive(Debug, Parser)]
#[command(
    name = "gym-tracer",
    version,
    about = "Zero-code eBPF tracer for NeMo Gym's HTTP servers",
    long_about = "Zero-code eBPF tracer for NeMo Gym's HTTP servers.\n\n\
        Attaches to running uvicorn/FastAPI processes from the kernel (syscall tracepoints), \
        rebuilds a SERVER span for every HTTP/1.x request they serve and the \
        http.server.request.duration histogram, and exports them: as JSON lines on stdout by \
        default, or over OTLP when an endpoint is configured. The traced processes are not \
        changed, restarted or slowed by in-process instrumentation.\n\n\
        Needs root, or CAP_BPF + CAP_PERFMON."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Trace processes until SIGINT/SIGTERM (or until every traced process has exited).
    Run(RunArgs),
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// Process id to trace; repeat for several processes. Connections that are already
    /// open when the agent attaches are not traced, new ones are.
    #[arg(long = "pid", value_name = "PID", required = true)]
    pub pids: Vec<u32>,

    /// Create this file once every probe is attached and the PIDs are in the filter
    /// (scripts and tests wait for it). Removed on exit.
    #[arg(long, value_name = "PATH")]
    pub ready_file: Option<PathBuf>,

    /// Bytes captured from the start of each HTTP message (head and first body bytes).
    /// Larger bodies are followed by length only. At most 8192.
    #[arg(long, value_name = "N", default_value_t = tracer_abi::DEFAULT_CAPTURE_BYTES,
          value_parser = clap::value_parser!(u32).range(64..=tracer_abi::MAX_CAPTURE_BYTES as i64))]
    pub capture_bytes: u32,

    /// Size of the kernel-to-agent ring buffer in bytes (rounded up to a power of two).
    /// Records that do not fit are counted as lost and reported.
    #[arg(long, value_name = "BYTES", default_value_t = 16 << 20)]
    pub ring_buffer_bytes: u32,

    /// OTLP endpoint, e.g. http://collector:4317 (gRPC) or http://collector:4318
    /// (HTTP; /v1/traces and /v1/metrics are appended). Without one, spans and metrics
    /// are written to stdout as JSON lines. Headers come from OTEL_EXPORTER_OTLP_HEADERS.
    #[arg(long, env = "OTEL_EXPORTER_OTLP_ENDPOINT", value_name = "URL")]
    pub otlp_endpoint: Option<String>,

    /// OTLP transport.
    #[arg(
        long,
        env = "OTEL_EXPORTER_OTLP_PROTOCOL",
        value_enum,
        default_value = "http/protobuf"
    )]
    pub otlp_protocol: OtlpProtocol,

    /// service.name of every traced process; by default each is named after its
    /// executable.
    #[arg(long, env = "OTEL_SERVICE_NAME", value_name = "NAME")]
    pub service_name: Option<String>,

    /// Seconds between metric exports (a final export always happens on exit).
    #[arg(long, value_name = "SECONDS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub metric_interval: u64,

    /// Connections tracked at once; more are counted as dropped, not traced.
    #[arg(long, value_name = "N", default_value_t = 65_536)]
    pub max_connections: usize,
}
