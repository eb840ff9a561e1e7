//! `cargo xtask demo`: tests/support/demo.py against a release build of the agent.

use std::process::Command;

use anyhow::Result;

use crate::command::{require_root, run_checked};
use crate::ctx::Ctx;
use crate::{build, setup};

#[derive(clap::Args)]
pub(crate) struct DemoArgs {
    /// Also show the rollouts in a trace UI: start Arize Phoenix on 127.0.0.1:6006 (installed
    /// into target/phoenix-venv first), send it the spans over OTLP, print the URL of each
    /// rollout's trace, and keep Phoenix up until Enter or Ctrl-C.
    #[arg(long)]
    ui: bool,
}

pub(crate) fn run(ctx: &Ctx, args: &DemoArgs) -> Result<()> {
    require_root("the demo loads", "demo")?;
    // The demo runs Gym-shaped servers from the test venv, not the real-Gym venv.
    setup::machine(ctx, false)?;
    if args.ui {
        setup::trace_ui(ctx, false)?;
    }
    let bin = build::agent(ctx, true)?;
    println!("xtask: running the demo against {}", bin.display());
    let mut cmd = Command::new(ctx.venv_python());
    cmd.env("PATH", &ctx.path)
        .current_dir(&ctx.root)
        .env("PYTHONUNBUFFERED", "1")
        .arg(ctx.root.join("tests/support/demo.py"))
        .arg("--agent")
        .arg(&bin);
    if args.ui {
        cmd.arg("--ui").env("GYM_PHOENIX_VENV", ctx.phoenix_venv());
    }
    run_checked(&mut cmd, "the demo failed: see its output above")?;
    println!("xtask: demo finished");
    Ok(())
}
