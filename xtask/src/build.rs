//! `cargo xtask build`: the agent, which embeds the eBPF object its build script builds.

use std::path::PathBuf;

use anyhow::Result;

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

/// Builds tracer-userspace (its build.rs builds the eBPF object) and returns the binary.
/// The release build of the `pipeline_cost` example: the agent's user space alone, priced by
/// the bench's pipeline section.
pub(crate) fn pipeline_cost(ctx: &Ctx) -> Result<PathBuf> {
    println!("xtask: building the pipeline_cost example (release)");
    let mut cmd = ctx.cmd("cargo");
    cmd.args([
        "build",
        "-p",
        "tracer-userspace",
        "--release",
        "--example",
        "pipeline_cost",
    ]);
    run_checked(
        &mut cmd,
        "the pipeline_cost example failed to build: fix the errors above",
    )?;
    Ok(ctx.root.join("target/release/examples/pipeline_cost"))
}

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
