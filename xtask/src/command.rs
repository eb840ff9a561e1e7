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

/// Runs a command with its output in `log` (for one that runs beside another whose output
/// is on the terminal); if it fails, prints the log and fails with `hint`.
pub(crate) fn run_logged(cmd: &mut Command, log: &std::path::Path, hint: &str) -> Result<()> {
    let file = fs::File::create(log).with_context(|| format!("creating {}", log.display()))?;
    cmd.stdout(file.try_clone()?).stderr(file);
    let status = spawn_status(cmd)?;
    if !status.success() {
        eprintln!("{}", fs::read_to_string(log).unwrap_or_default());
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

/// A command running beside the others at idle priority (`chrt --idle 0`: it gets a CPU
/// only when nothing else wants one), its output in a log file.
pub(crate) struct Background {
    what: String,
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl Background {
    /// Starts `program args` at idle priority, with `cmd`'s environment and directory.
    pub(crate) fn start(what: &str, cmd: &Command, log: std::path::PathBuf) -> Result<Self> {
        let file = fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut idle = Command::new("chrt");
        idle.args(["--idle", "0"])
            .arg(cmd.get_program())
            .args(cmd.get_args())
            .stdout(file.try_clone()?)
            .stderr(file);
        if let Some(dir) = cmd.get_current_dir() {
            idle.current_dir(dir);
        }
        for (key, value) in cmd.get_envs() {
            match value {
                Some(value) => idle.env(key, value),
                None => idle.env_remove(key),
            };
        }
        let child = idle
            .spawn()
            .with_context(|| format!("could not start `chrt --idle 0 {}`", describe(cmd)))?;
        println!(
            "xtask: {what} runs in the background (log: {})",
            log.display()
        );
        Ok(Self {
            what: what.to_string(),
            child,
            log,
        })
    }

    /// Waits for it; on failure prints its log and fails with `hint`.
    pub(crate) fn finish(mut self, hint: &str) -> Result<()> {
        let status = self
            .child
            .wait()
            .context("waiting for a background command")?;
        if !status.success() {
            let log = fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!("{log}");
            bail!("{} failed ({status}): {hint}", self.what);
        }
        println!("xtask: {} passed (log: {})", self.what, self.log.display());
        Ok(())
    }
}

impl Drop for Background {
    /// One left running when xtask stops early (a test failed) is stopped with it.
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
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
