//! `cargo xtask lint`: rustfmt and clippy (warnings denied) over the workspace.

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
    run_checked(
        ctx.cmd("cargo")
            .args(["clippy", "--all-targets", "--", "-D", "warnings"]),
        "clippy found problems: fix the warnings above",
    )?;
    println!("xtask: lint passed");
    Ok(())
}
