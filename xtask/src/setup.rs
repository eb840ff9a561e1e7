//! `cargo xtask setup`: what a fresh machine lacks, installed idempotently.

mod bpf_linker;
mod venv;

use std::fs;
use std::path::Path;

use anyhow::{Context, Result, bail};

use crate::command::{capture, is_root, run_checked};
use crate::ctx::Ctx;

#[derive(clap::Args)]
pub(crate) struct SetupArgs {
    /// Do not create the real-Gym venv (target/gym-venv, about 900 MB); the real-Gym
    /// integration test is then skipped.
    #[arg(long)]
    no_gym_venv: bool,
    /// Do not create the Arize Phoenix venv (target/phoenix-venv, about 820 MB) nor install
    /// Chromium; the trace-UI test is then skipped.
    #[arg(long)]
    no_phoenix: bool,
    /// Only the toolchain the build needs (nightly + rust-src, bpf-linker): no venvs,
    /// no tracefs. For image builds (deploy/Dockerfile).
    #[arg(long)]
    toolchain_only: bool,
}

pub(crate) use venv::ensure_wheel_venv;

pub(crate) fn run(ctx: &Ctx, args: &SetupArgs) -> Result<()> {
    if args.toolchain_only {
        return toolchain(ctx);
    }
    machine(ctx, !args.no_gym_venv)?;
    if !args.no_phoenix {
        trace_ui(ctx, true)?;
    }
    Ok(())
}

/// Arize Phoenix (`cargo xtask demo --ui`, tests/test_backend.py) and, with `browser`, the
/// headless Chromium the test looks at its pages with and the tmux `top`'s test captures
/// its screen in (apt, as root).
pub(crate) fn trace_ui(ctx: &Ctx, browser: bool) -> Result<()> {
    venv::ensure_phoenix_venv(ctx)?;
    if browser {
        if is_root() {
            ensure_system_tool(ctx, "chromium", "chromium")?;
            // Terminal UIs are checked as a person sees them: `gym-tracer top` under tmux.
            ensure_system_tool(ctx, "tmux", "tmux")?;
        } else {
            println!(
                "xtask: not root: chromium and tmux are not installed (the trace-UI and top tests need them)"
            );
        }
    }
    Ok(())
}

/// All of setup, which test, demo and bench run first; `gym_venv`: also create the
/// real-Gym venv (off with `--no-gym-venv`).
pub(crate) fn machine(ctx: &Ctx, gym_venv: bool) -> Result<()> {
    toolchain(ctx)?;
    environment(ctx, gym_venv)
}

/// What the tests, demo and bench run with besides the build: the Python venvs, the system
/// tools, tracefs. Mostly downloads: `cargo xtask test` runs it while cargo builds.
pub(crate) fn environment(ctx: &Ctx, gym_venv: bool) -> Result<()> {
    venv::ensure_venv(ctx)?;
    venv::ensure_py312_venv(ctx)?;
    // The benchmark's load generator and the compiler of its syscall loop: `cargo xtask
    // bench` and tests/test_bench.py (run by `cargo xtask test`) need them; the HTTPS tests
    // make their certificates with openssl and use wget as a client whose TLS is GnuTLS.
    if is_root() {
        ensure_system_tool(ctx, "wrk", "wrk")?;
        ensure_system_tool(ctx, "cc", "gcc")?;
        ensure_system_tool(ctx, "openssl", "openssl")?;
        ensure_system_tool(ctx, "wget", "wget")?;
        // The cross-host test makes a network namespace with a veth pair, and runs an agent
        // in it.
        ensure_system_tool(ctx, "ip", "iproute2")?;
        ensure_system_tool(ctx, "nsenter", "util-linux")?;
        // tests/test_deploy.py verifies the systemd unit and scores its exposure.
        ensure_system_tool(ctx, "systemd-analyze", "systemd")?;
    } else {
        println!(
            "xtask: not root: wrk, cc, openssl, wget, iproute2 and systemd-analyze are not \
             installed (the bench, the HTTPS tests, the cross-host test and the unit-file \
             tests need them)"
        );
    }
    if gym_venv {
        venv::ensure_gym_venv(ctx)?;
        ensure_codex_cli(ctx)?;
    } else {
        println!("xtask: skipping the real-Gym venv (target/gym-venv)");
    }
    ensure_tracefs(ctx);
    println!("xtask: setup complete");
    Ok(())
}

/// What building the agent needs: nightly with rust-src, and bpf-linker.
pub(crate) fn toolchain(ctx: &Ctx) -> Result<()> {
    static PATH_NOTE: std::sync::Once = std::sync::Once::new();
    if ctx.path_extended {
        PATH_NOTE.call_once(|| {
            println!(
                "xtask: note: {} is not on your PATH; adding it for the commands xtask runs \
                 (add it to your shell profile to use bpf-linker directly)",
                ctx.cargo_bin.display()
            )
        });
    }
    ensure_nightly(ctx)?;
    ensure_rust_src(ctx)?;
    bpf_linker::ensure_bpf_linker(ctx)
}

/// The eBPF crate is built with nightly (`-Z build-std=core`).
pub(crate) fn ensure_nightly(ctx: &Ctx) -> Result<()> {
    println!("xtask: checking for the nightly toolchain");
    let list = capture(ctx.cmd("rustup").args(["toolchain", "list"]))
        .context("`rustup toolchain list` failed: install rustup (https://rustup.rs) and retry")?;
    if list.lines().any(|l| l.starts_with("nightly")) {
        return Ok(());
    }
    println!("xtask: installing the nightly toolchain with rust-src");
    run_checked(
        ctx.cmd("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
            "--component",
            "rust-src",
        ]),
        "the nightly toolchain with rust-src is required for building the eBPF programs; \
         install it with `rustup toolchain install nightly --component rust-src` and retry",
    )
}

/// `-Z build-std=core` needs the standard library sources.
fn ensure_rust_src(ctx: &Ctx) -> Result<()> {
    println!("xtask: checking for rust-src on nightly");
    let installed = capture(ctx.cmd("rustup").args([
        "component",
        "list",
        "--toolchain",
        "nightly",
        "--installed",
    ]))
    .unwrap_or_default();
    if installed.lines().any(|l| l.trim().starts_with("rust-src")) {
        return Ok(());
    }
    println!("xtask: adding rust-src to nightly");
    run_checked(
        ctx.cmd("rustup")
            .args(["component", "add", "rust-src", "--toolchain", "nightly"]),
        "rust-src on nightly is required for building the eBPF programs; \
         run `rustup component add rust-src --toolchain nightly` and retry",
    )
}

/// The agent attaches to syscall tracepoints, which live in tracefs.
fn ensure_tracefs(ctx: &Ctx) {
    if Path::new("/sys/kernel/tracing/events").exists() || !is_root() {
        return;
    }
    println!("xtask: mounting tracefs at /sys/kernel/tracing");
    let result = run_checked(
        ctx.cmd("mount")
            .args(["-t", "tracefs", "nodev", "/sys/kernel/tracing"]),
        "mount it yourself (`mount -t tracefs nodev /sys/kernel/tracing`) before running the agent",
    );
    if let Err(err) = result {
        eprintln!("xtask: warning: {err:#}");
    }
}

/// Installs `tool` from the distribution's `package` with apt-get when it is not on PATH.
fn ensure_system_tool(ctx: &Ctx, tool: &str, package: &str) -> Result<()> {
    println!("xtask: checking for {tool}");
    if on_path(ctx, tool) {
        return Ok(());
    }
    if !on_path(ctx, "apt-get") {
        bail!(
            "{tool} is not on PATH and there is no apt-get: install {tool} with your package manager and retry"
        );
    }
    println!("xtask: installing {package} with apt-get");
    let install = |ctx: &Ctx| {
        ctx.cmd("apt-get")
            .args(["install", "-y", "--no-install-recommends", package])
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .is_ok_and(|status| status.success())
    };
    if !install(ctx) {
        // A fresh image may have no package lists yet.
        run_checked(
            ctx.cmd("apt-get").arg("update"),
            "apt-get update failed: check network access to the package mirrors",
        )?;
        run_checked(
            ctx.cmd("apt-get")
                .args(["install", "-y", "--no-install-recommends", package])
                .env("DEBIAN_FRONTEND", "noninteractive"),
            &format!("installing {package} failed: install {tool} yourself and retry"),
        )?;
    }
    Ok(())
}

/// The `codex` CLI codex_agent spawns per rollout (tests/test_breadth.py), at the version
/// its package config pins (`codex_version`), in target/codex-cli from npm (as root, npm
/// from apt when missing). About 340 MB, most of it the CLI's native binary.
fn ensure_codex_cli(ctx: &Ctx) -> Result<()> {
    const PACKAGE: &str = "@openai/codex@0.144.4";
    let prefix = ctx.codex_cli();
    let stamp = prefix.join(".package-stamp");
    if prefix.join("node_modules/.bin/codex").exists()
        && fs::read_to_string(&stamp).ok().as_deref() == Some(PACKAGE)
    {
        println!("xtask: the codex CLI is up to date");
        return Ok(());
    }
    if !on_path(ctx, "npm") {
        if !is_root() {
            bail!(
                "npm is not on PATH: install Node.js and npm (the codex_agent test runs the                  `codex` CLI from npm), or run `cargo xtask setup --no-gym-venv`"
            );
        }
        ensure_system_tool(ctx, "npm", "npm")?;
    }
    println!("xtask: installing {PACKAGE} into {}", prefix.display());
    fs::create_dir_all(&prefix)?;
    run_checked(
        ctx.cmd("npm")
            .args(["install", "--no-audit", "--no-fund", "--prefix"])
            .arg(&prefix)
            .arg(PACKAGE),
        &format!("npm install {PACKAGE} failed: check network access to the npm registry"),
    )?;
    fs::write(&stamp, PACKAGE)?;
    Ok(())
}

/// True when `program` is an executable file in one of ctx.path's directories.
fn on_path(ctx: &Ctx, program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(&ctx.path).any(|dir| {
        fs::metadata(dir.join(program))
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}
