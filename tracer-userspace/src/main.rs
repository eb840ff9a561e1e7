//! gym-tracer: attaches to NeMo Gym's HTTP server processes from the kernel and exports the
//! spans and metrics their own telemetry would have produced.
//!
//! Data flow, one module per stage: `discovery` (which processes) → `loader` (kernel
//! programs, PID filter) → ring buffer → `events` (decode) → `connections` (per-connection
//! state, `http` reassembly) → `classify` (Gym meaning: routes, rollout ids, `gym.*` spans,
//! from `gym` and the per-process state in `processes`, fed by `harvest`) → `spans` /
//! `metrics` → `export`. `agent` assembles it; this file only parses the command line.

mod agent;
mod btf;
mod classify;
mod cli;
mod clock;
mod connections;
mod discovery;
mod events;
mod export;
mod gym;
mod harvest;
mod http;
mod identity;
mod loader;
mod metrics;
mod processes;
mod spans;
mod stats;
mod stitch;
mod tree;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let cli = cli::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("gym-tracer: error: starting the async runtime: {error}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        match cli.command {
            cli::Command::Run(args) => agent::run(args).await,
        }
    });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("gym-tracer: error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
