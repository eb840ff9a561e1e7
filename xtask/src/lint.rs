//! `cargo xtask lint`: rustfmt and clippy (warnings denied) over the workspace.

use std::process::Command;

use anyhow::Result;

use crate::command::run_checked;
use crate::ctx::Ctx;

pub(crate) fn run(ctx: &Ctx) -> Result<()> {
    println!("xtask: checking formatting");
    run_checked(
        ctx.cmd("cargo").args(["fmt", "--all", "--", "--check"]),
        "code is not formatted: run `cargo fmt --all`",
    )?;
    println!("xtask: running clippy");
    run_checked(&mut clippy(ctx), CLIPPY_HINT)?;
    println!("xtask: lint passed");
    Ok(())
}

pub(crate) const CLIPPY_HINT: &str = "clippy found problems: fix the warnings above";

/// clippy over every target, warnings denied (it builds the eBPF objects, by build.rs).
pub(crate) fn clippy(ctx: &Ctx) -> Command {
    let mut cmd = ctx.cmd("cargo");
    cmd.args(["clippy", "--all-targets", "--", "-D", "warnings"]);
    cmd
}
