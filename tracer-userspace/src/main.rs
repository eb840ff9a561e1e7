//! The `gym-tracer` command: parses the command line and runs one of its commands; the
//! agent itself is the `gym_tracer` library (`lib.rs`).

use std::process::ExitCode;

use gym_tracer::cli::{self, Command};
use gym_tracer::{agent, config, doctor, logging, reference};

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

fn run_agent(args: cli::RunArgs) -> anyhow::Result<bool> {
    config::validate(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|error| anyhow::anyhow!("starting the async runtime: {error}"))?;
    runtime.block_on(agent::run(args)).map(|()| true)
}
