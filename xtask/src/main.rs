//! Project automation for gym-tracer: `cargo xtask <command>`.
//!
//! Every step prints an `xtask: ...` line before it runs, child processes stream their
//! output straight to the terminal, and every failure says what to do about it.
//!
//! This file parses the command line and dispatches; each subcommand lives in its own
//! module, [`ctx`] holds what they share and [`command`] how they run child processes.

mod bench;
mod build;
mod command;
mod ctx;
mod demo;
mod docs;
mod fuzz;
mod idle;
mod lint;
mod run;
mod setup;
mod test;
mod wheel;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

use crate::ctx::Ctx;

#[derive(Parser)]
#[command(
    name = "xtask",
    about = "Build, test and set up gym-tracer (run as `cargo xtask <command>`)"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what a fresh machine lacks: nightly + rust-src, bpf-linker, the test
    /// venv, the real-Gym venv; as root also wrk and cc (the bench) and mount tracefs.
    /// Idempotent.
    Setup(setup::SetupArgs),
    /// Build the agent (the eBPF object is built by tracer-userspace's build.rs).
    Build(build::BuildArgs),
    /// Build the agent (release by default) and run it with the given arguments.
    Run(run::RunArgs),
    /// Run setup, the unit tests and (as root) the Python integration tests.
    Test(test::TestArgs),
    /// Run setup, build the agent and run tests/support/demo.py against it (root needed):
    /// trace trees in the terminal; with --ui, also each rollout's trace in Arize Phoenix.
    Demo(demo::DemoArgs),
    /// Measure what tracing costs: untraced vs gym-tracer vs in-process OpenTelemetry on the
    /// Gym-shaped servers, plus saturation, connection scale and the host-wide syscall tax.
    /// Prints one table and writes target/bench/latest.json (root needed; installs wrk).
    Bench(bench::BenchArgs),
    /// `cargo fmt --check` and `cargo clippy -D warnings` over the workspace.
    Lint,
    /// Regenerate the docs' generated sections (options, spans, metrics, counters, how
    /// parents are decided) from the code; a unit test fails while any is stale.
    Docs,
    /// Build the agent as a Python wheel (maturin, the binary only) into target/wheels/,
    /// for `pip install`; installs maturin into target/wheel-venv.
    Wheel,
    /// Fuzz the HTTP reassembly path (libFuzzer target `http_reassembly`, built with the
    /// flags cargo-fuzz would use) for a bounded time, starting from the committed corpus.
    Fuzz(fuzz::FuzzArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let ctx = match Ctx::new() {
        Ok(ctx) => ctx,
        Err(err) => return report(err),
    };
    let result = match cli.command {
        Cmd::Setup(args) => setup::run(&ctx, &args),
        Cmd::Build(args) => build::run(&ctx, &args),
        // The agent's own exit status becomes ours.
        Cmd::Run(args) => return run::run(&ctx, &args).unwrap_or_else(report),
        Cmd::Test(args) => test::run(&ctx, &args),
        Cmd::Demo(args) => demo::run(&ctx, &args),
        Cmd::Bench(args) => bench::run(&ctx, &args),
        Cmd::Lint => lint::run(&ctx),
        Cmd::Wheel => wheel::run(&ctx),
        Cmd::Docs => docs::run(&ctx),
        Cmd::Fuzz(args) => fuzz::run(&ctx, &args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => report(err),
    }
}

/// Prints the error chain (what failed, then why) and returns a failing exit code.
fn report(err: anyhow::Error) -> ExitCode {
    eprintln!("xtask: error: {err:#}");
    ExitCode::FAILURE
}
