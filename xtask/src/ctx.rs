//! [`Ctx`], which every subcommand receives.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

/// Shared state: where the workspace is and the PATH child processes get.
pub(crate) struct Ctx {
    pub(crate) root: PathBuf,
    pub(crate) home: PathBuf,
    /// PATH for children; `~/.cargo/bin` is prepended when missing so a freshly
    /// installed bpf-linker is found by the eBPF build.
    pub(crate) path: OsString,
    /// Cargo's bin dir (`$CARGO_HOME/bin`, default `~/.cargo/bin`).
    pub(crate) cargo_bin: PathBuf,
    /// True when `path` differs from ours (we tell the user once, during setup).
    pub(crate) path_extended: bool,
}

impl Ctx {
    pub(crate) fn new() -> Result<Self> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .context("xtask's manifest dir has no parent: run xtask from the workspace")?
            .to_path_buf();
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .context("HOME is not set: set it (sudo -E keeps it) and retry")?;
        let cargo_bin = std::env::var_os("CARGO_HOME")
            .map(PathBuf::from)
            .unwrap_or_else(|| home.join(".cargo"))
            .join("bin");
        let current = std::env::var_os("PATH").unwrap_or_default();
        let mut dirs: Vec<PathBuf> = std::env::split_paths(&current).collect();
        let path_extended = !dirs.iter().any(|d| d == &cargo_bin);
        if path_extended {
            dirs.insert(0, cargo_bin.clone());
        }
        let path = std::env::join_paths(dirs).context("PATH contains an invalid entry")?;
        Ok(Self {
            root,
            home,
            path,
            cargo_bin,
            path_extended,
        })
    }

    /// A command with our PATH, run from the workspace root.
    pub(crate) fn cmd(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("PATH", &self.path).current_dir(&self.root);
        cmd
    }

    /// The host triple of `rustc` (with `toolchain`, e.g. `["+nightly"]`): builds for an
    /// explicit `--target` put their artifacts under it.
    pub(crate) fn host_triple(&self, toolchain: &[&str]) -> Result<String> {
        crate::command::capture(self.cmd("rustc").args(toolchain).arg("-vV"))
            .and_then(|vv| {
                vv.lines()
                    .find_map(|line| line.strip_prefix("host: "))
                    .map(str::to_string)
            })
            .with_context(|| {
                format!(
                    "`rustc {} -vV` names no host: is that toolchain installed?",
                    toolchain.join(" ")
                )
            })
    }

    pub(crate) fn venv_python(&self) -> PathBuf {
        self.root.join("target/venv/bin/python")
    }

    /// The venv the real nemo-gym servers run from (tests/support/real_gym).
    pub(crate) fn gym_venv(&self) -> PathBuf {
        self.root.join("target/gym-venv")
    }

    /// Where `cargo xtask setup` installs the `codex` CLI (npm prefix).
    pub(crate) fn codex_cli(&self) -> PathBuf {
        self.root.join("target/codex-cli")
    }

    /// The venv Arize Phoenix runs from (tests/support/phoenix).
    pub(crate) fn phoenix_venv(&self) -> PathBuf {
        self.root.join("target/phoenix-venv")
    }

    /// The venv maturin runs from (`cargo xtask wheel`).
    pub(crate) fn wheel_venv(&self) -> PathBuf {
        self.root.join("target/wheel-venv")
    }

    pub(crate) fn agent_bin(&self, release: bool) -> PathBuf {
        let profile = if release { "release" } else { "debug" };
        self.root.join("target").join(profile).join("gym-tracer")
    }
}
