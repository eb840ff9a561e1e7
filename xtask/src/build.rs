//! `cargo xtask build`: the agent, which embeds the eBPF object its build script builds.

use std::path::PathBuf;

use anyhow::{Result, bail};

use crate::command::run_checked;
use crate::ctx::Ctx;

#[derive(clap::Args)]
pub(crate) struct BuildArgs {
    /// Build with the release profile.
    #[arg(long)]
    release: bool,
}

pub(crate) fn run(ctx: &Ctx, args: &BuildArgs) -> Result<()> {
    let bin = agent(ctx, args.release)?;
    println!("xtask: built {}", bin.display());
    Ok(())
}

/// The release builds of the bench's examples: `pipeline_cost` (the agent's user space alone,
/// the pipeline section) and `syscall_floor` (the floor programs, the tax sections).
pub(crate) struct BenchExamples {
    pub(crate) pipeline_cost: PathBuf,
    pub(crate) syscall_floor: PathBuf,
}

pub(crate) fn bench_examples(ctx: &Ctx) -> Result<BenchExamples> {
    println!("xtask: building the pipeline_cost and syscall_floor examples (release)");
    let mut cmd = ctx.cmd("cargo");
    cmd.args(["build", "-p", "tracer-userspace", "--release"]);
    cmd.args(["--example", "pipeline_cost", "--example", "syscall_floor"]);
    run_checked(
        &mut cmd,
        "the bench's examples failed to build: fix the errors above",
    )?;
    let examples = ctx.root.join("target/release/examples");
    Ok(BenchExamples {
        pipeline_cost: examples.join("pipeline_cost"),
        syscall_floor: examples.join("syscall_floor"),
    })
}

/// The same examples as `cargo test` leaves them (it builds every example, in the test
/// profile): for the bench's smoke tests, which check that each section runs, not its
/// figures. `cargo xtask bench` measures with [`bench_examples`].
pub(crate) fn tested_examples(ctx: &Ctx) -> Result<BenchExamples> {
    let examples = ctx.root.join("target/debug/examples");
    let found = BenchExamples {
        pipeline_cost: examples.join("pipeline_cost"),
        syscall_floor: examples.join("syscall_floor"),
    };
    for binary in [&found.pipeline_cost, &found.syscall_floor] {
        if !binary.exists() {
            bail!(
                "`cargo test` left no {}: the bench's examples are missing from its build",
                binary.display()
            );
        }
    }
    Ok(found)
}

/// Builds tracer-userspace (its build.rs builds the eBPF object) and returns the binary.
pub(crate) fn agent(ctx: &Ctx, release: bool) -> Result<PathBuf> {
    let profile = if release { "release" } else { "debug" };
    println!("xtask: building gym-tracer ({profile})");
    let mut cmd = ctx.cmd("cargo");
    cmd.args(["build", "-p", "tracer-userspace"]);
    if release {
        cmd.arg("--release");
    }
    run_checked(
        &mut cmd,
        "the build failed: fix the errors above; if the eBPF build cannot find nightly, \
         rust-src or bpf-linker, run `cargo xtask setup` first",
    )?;
    Ok(ctx.agent_bin(release))
}
