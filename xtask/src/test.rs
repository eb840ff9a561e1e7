//! `cargo xtask test`: setup, the unit tests, then (as root) the Python integration tests.

use std::ffi::OsString;
use std::process::Command;

use anyhow::Result;

use crate::command::{require_root, run_checked};
use crate::ctx::Ctx;
use crate::{build, setup, wheel};

#[derive(clap::Args)]
pub(crate) struct TestArgs {
    /// Only run `cargo test`; skip the integration tests (no root needed).
    #[arg(long)]
    unit_only: bool,
    /// Do not create the real-Gym venv; the real-Gym integration test is skipped.
    #[arg(long)]
    no_gym_venv: bool,
    /// Do not install Arize Phoenix and Chromium; the trace-UI test is skipped.
    #[arg(long)]
    no_phoenix: bool,
    /// Extra arguments for pytest (after `--`).
    #[arg(last = true)]
    pytest_args: Vec<OsString>,
}

pub(crate) fn run(ctx: &Ctx, args: &TestArgs) -> Result<()> {
    let gym_venv = !args.no_gym_venv;
    setup::machine(ctx, gym_venv)?;
    if !args.no_phoenix {
        setup::trace_ui(ctx, true)?;
    }

    println!("xtask: running the unit tests");
    run_checked(
        ctx.cmd("cargo")
            .args(["test", "--workspace", "--exclude", "tracer-ebpf"]),
        "unit tests failed: see the failures above",
    )?;
    println!("xtask: unit tests passed");
    if args.unit_only {
        return Ok(());
    }

    require_root("the integration tests load", "test")?;
    let bin = build::agent(ctx, true)?;
    let examples = build::bench_examples(ctx)?;
    // tests/test_wheel.py installs it into a fresh venv, as `pip install gym-tracer` would.
    let wheel = wheel::build(ctx)?;
    println!(
        "xtask: running the integration tests against {}",
        bin.display()
    );
    let mut cmd = Command::new(ctx.venv_python());
    cmd.env("PATH", &ctx.path)
        .current_dir(&ctx.root)
        .env("GYM_TRACER_BIN", &bin)
        .env("GYM_PIPELINE_COST_BIN", &examples.pipeline_cost)
        .env("GYM_SYSCALL_FLOOR_BIN", &examples.syscall_floor)
        .env("GYM_TRACER_WHEEL", &wheel)
        .env("PYTHONUNBUFFERED", "1")
        .args(["-m", "pytest"])
        .arg(ctx.root.join("tests"))
        .args(["-v", "-rA"])
        .args(&args.pytest_args);
    // tests/test_real_gym.py runs the real servers from this venv; it skips only when told
    // the venv was left out on purpose, and fails when it is missing otherwise.
    if gym_venv {
        cmd.env("GYM_REAL_VENV", ctx.gym_venv())
            .env_remove("GYM_REAL_VENV_SKIPPED");
    } else {
        cmd.env("GYM_REAL_VENV_SKIPPED", "cargo xtask test --no-gym-venv");
    }
    // tests/test_backend.py exports to Phoenix from this venv, on the same terms.
    if args.no_phoenix {
        cmd.env("GYM_PHOENIX_SKIPPED", "cargo xtask test --no-phoenix");
    } else {
        cmd.env("GYM_PHOENIX_VENV", ctx.phoenix_venv())
            .env_remove("GYM_PHOENIX_SKIPPED");
    }
    run_checked(
        &mut cmd,
        "integration tests failed: see the pytest report above (rerun one with \
         `sudo -E cargo xtask test -- -k NAME`)",
    )?;
    println!("xtask: integration tests passed");
    Ok(())
}
