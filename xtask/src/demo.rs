//! `cargo xtask demo`: tests/support/demo.py against a release build of the agent.

use std::process::Command;

use anyhow::Result;

use crate::command::{require_root, run_checked};
use crate::ctx::Ctx;
use crate::{build, setup};

pub(crate) fn run(ctx: &Ctx) -> Result<()> {
    require_root("the demo loads", "demo")?;
    // The demo runs Gym-shaped servers from the test venv, not the real-Gym venv.
    setup::machine(ctx, false)?;
    let bin = build::agent(ctx, true)?;
    println!("xtask: running the demo against {}", bin.display());
    let mut cmd = Command::new(ctx.venv_python());
    cmd.env("PATH", &ctx.path)
        .current_dir(&ctx.root)
        .env("PYTHONUNBUFFERED", "1")
        .arg(ctx.root.join("tests/support/demo.py"))
        .arg("--agent")
        .arg(&bin);
    run_checked(&mut cmd, "the demo failed: see its output above")?;
    println!("xtask: demo finished");
    Ok(())
}
