//! `cargo xtask wheel`: the agent as a Python wheel (pyproject.toml: maturin, `bindings =
//! "bin"`) in target/wheels/, for `pip install`. The wheel holds the stripped binary and
//! nothing else. zig links it against glibc 2.17's symbols (manylinux2014), and maturin's
//! audit refuses a wheel whose binary needs more than its tag claims. It builds in a target
//! directory of its own (target/wheel-build): its linker and flags differ from the release
//! build's, which would otherwise be rebuilt, stripped, at every turn.

use std::path::PathBuf;
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::command::run_checked;
use crate::ctx::Ctx;
use crate::setup;

pub(crate) fn run(ctx: &Ctx) -> Result<()> {
    let wheel = build(ctx)?;
    let bytes = std::fs::metadata(&wheel)
        .with_context(|| format!("reading {}", wheel.display()))?
        .len();
    println!(
        "xtask: built {} ({:.1} MB); install it with `pip install {}`",
        wheel.display(),
        bytes as f64 / 1e6,
        wheel.display()
    );
    Ok(())
}

/// Builds the wheel (the eBPF objects first, by tracer-userspace's build script) and returns
/// its path: the only wheel in target/wheels/ afterwards.
pub(crate) fn build(ctx: &Ctx) -> Result<PathBuf> {
    setup::toolchain(ctx)?;
    setup::ensure_wheel_venv(ctx)?;
    let out = ctx.root.join("target/wheels");
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    for old in wheels_in(&out)? {
        std::fs::remove_file(&old).with_context(|| format!("removing {}", old.display()))?;
    }
    println!(
        "xtask: building the wheel with maturin (release, stripped, linked by zig for glibc 2.17)"
    );
    let venv_bin = ctx.wheel_venv().join("bin");
    // maturin finds zig (the ziglang package) through the venv's python on PATH.
    let mut path = vec![venv_bin.clone()];
    path.extend(std::env::split_paths(&ctx.path));
    let mut cmd = Command::new(venv_bin.join("maturin"));
    cmd.env(
        "PATH",
        std::env::join_paths(path).context("PATH holds an invalid entry")?,
    )
    .env("CARGO_TARGET_DIR", ctx.root.join("target/wheel-build"))
    .current_dir(&ctx.root)
    .args(["build", "--release", "--zig", "--out"])
    .arg(&out);
    run_checked(
        &mut cmd,
        "maturin could not build the wheel: see the errors above (the eBPF build needs \
         `cargo xtask setup --toolchain-only`)",
    )?;
    match wheels_in(&out)?.as_slice() {
        [wheel] => Ok(wheel.clone()),
        found => bail!(
            "expected one gym_tracer wheel in {}, found {found:?}",
            out.display()
        ),
    }
}

fn wheels_in(dir: &std::path::Path) -> Result<Vec<PathBuf>> {
    let mut wheels = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        let name = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        if name.starts_with("gym_tracer-") && name.ends_with(".whl") {
            wheels.push(path);
        }
    }
    Ok(wheels)
}
