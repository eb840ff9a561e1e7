//! `cargo xtask run`: build the agent and run it, exiting with its status.

use std::ffi::OsString;
use std::process::{Command, ExitCode, ExitStatus};

use anyhow::Result;

use crate::build;
use crate::command::{is_root, spawn_status};
use crate::ctx::Ctx;

#[derive(clap::Args)]
pub(crate) struct RunArgs {
    /// Build with the release profile (the default).
    #[arg(long, overrides_with = "debug")]
    release: bool,
    /// Build and run the debug profile instead.
    #[arg(long, overrides_with = "release")]
    debug: bool,
    /// Arguments passed to gym-tracer.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<OsString>,
}

/// `--release` is the default, so only `--debug` decides the profile.
pub(crate) fn run(ctx: &Ctx, args: &RunArgs) -> Result<ExitCode> {
    let bin = build::agent(ctx, !args.debug)?;
    if !is_root() {
        eprintln!(
            "xtask: warning: not running as root; the agent needs root or CAP_BPF, CAP_PERFMON, \
             CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE \
             to load its eBPF programs"
        );
    }
    println!("xtask: running {}", bin.display());
    let mut cmd = Command::new(&bin);
    cmd.env("PATH", &ctx.path).args(&args.args);
    let status = spawn_status(&mut cmd)?;
    Ok(exit_code(status))
}

/// Mirrors a child's exit status (128+signal when it was killed, like a shell).
fn exit_code(status: ExitStatus) -> ExitCode {
    use std::os::unix::process::ExitStatusExt;
    let code = status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1);
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
