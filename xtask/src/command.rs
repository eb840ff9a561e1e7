//! Running child processes: each with inherited stdio, and each failure with what to do next.

use std::fs;
use std::process::{Command, ExitStatus};

use anyhow::{Context, Result, bail};

/// Runs a command with inherited stdio; fails with `hint` if it cannot start or fails.
pub(crate) fn run_checked(cmd: &mut Command, hint: &str) -> Result<()> {
    let status = spawn_status(cmd)?;
    if !status.success() {
        bail!("`{}` failed ({status}): {hint}", describe(cmd));
    }
    Ok(())
}

/// Runs a command with inherited stdio and returns its status.
pub(crate) fn spawn_status(cmd: &mut Command) -> Result<ExitStatus> {
    cmd.status().with_context(|| {
        format!(
            "could not start `{}`: is it installed and on PATH?",
            describe(cmd)
        )
    })
}

/// Runs a command quietly and returns its stdout, or None if it failed or is missing.
pub(crate) fn capture(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

/// Effective uid from /proc/self/status (`Uid: real effective saved fs`).
fn euid() -> Option<u32> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("Uid:"))?;
    line.split_whitespace().nth(2)?.parse().ok()
}

pub(crate) fn is_root() -> bool {
    euid() == Some(0)
}

/// Loading eBPF programs needs root; fail early with the command to use instead.
/// `what` completes "... eBPF programs", e.g. "the integration tests load".
pub(crate) fn require_root(what: &str, command: &str) -> Result<()> {
    if !is_root() {
        bail!("{what} eBPF programs: run as root (sudo -E cargo xtask {command})");
    }
    Ok(())
}
