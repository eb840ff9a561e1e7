//! The `gym-tracer` command: parses the command line and runs one of its commands; the
//! agent itself is the `gym_tracer` library (`lib.rs`).

use std::process::ExitCode;

use gym_tracer::config::cli::{self, Command};
use gym_tracer::ops::{doctor, logging, reference, replay, top};
use gym_tracer::{agent, config, report};

fn main() -> ExitCode {
    let loaded = match config::load() {
        Ok(loaded) => loaded,
        Err(error) => {
            eprintln!("gym-tracer: error: {error:#}");
            return ExitCode::FAILURE;
        }
    };
    logging::init(loaded.cli.log_format);
    let result = match &loaded.cli.command {
        Command::Run(args) => run_agent(args.clone()),
        Command::CheckConfig(_) => config::check_config(&loaded).map(|()| true),
        Command::Doctor(args) => doctor::run(args),
        Command::Reference(args) => reference::run(args).map(|()| true),
        Command::Top(args) => top::run(args),
        Command::Report(args) => report::run(args),
        Command::Replay(args) => replay::run(args),
    };
    match result {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(error) => {
            tracing::error!("error: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// Two runtimes, so that nothing the exporters do can delay the ring buffer: the hot path
/// (ring drain, parsing, stitching) runs alone on this thread's current-thread runtime,
/// whose timers and ring wake-ups need no other thread; exporters, metric readers, the
/// health server and route harvests run on one worker thread of their own. A multi-thread
/// runtime for everything cost a futex hand-off between threads on every drain tick.
fn run_agent(args: cli::RunArgs) -> anyhow::Result<bool> {
    config::validate(&args)?;
    let exporters = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("gym-tracer-export")
        .enable_all()
        .build()
        .map_err(|error| anyhow::anyhow!("starting the exporters' runtime: {error}"))?;
    let hot_path = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|error| anyhow::anyhow!("starting the agent's runtime: {error}"))?;
    let result = hot_path.block_on(agent::run(args, exporters.handle().clone()));
    // Everything was flushed (or given up on at --shutdown-timeout) inside `run`; a final
    // metric export abandoned then may still sit on a blocking thread: do not wait for it
    // (dropping the runtime would).
    exporters.shutdown_timeout(std::time::Duration::from_millis(100));
    result.map(|()| true)
}
