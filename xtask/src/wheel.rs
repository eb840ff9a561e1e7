//! `cargo xtask wheel`: the agent as a Python wheel (pyproject.toml: maturin, `bindings =
//! "bin"`) in target/wheels/, for `pip install`. The wheel holds the stripped binary and
//! nothing else. zig links it against glibc 2.17's symbols (manylinux2014), and maturin's
//! audit refuses a wheel whose binary needs more than its tag claims. It builds in a target
//! directory of its own (target/wheel-build): maturin builds for an explicit `--target` with
//! zig as the C compiler and linker, so none of the native release build's artifacts are
//! shared, and that build would otherwise be rebuilt at every turn. `cargo xtask test` runs
//! the integration tests against the binary this build ships (one release build, not two).

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::command::run_checked;
use crate::ctx::Ctx;
use crate::setup;

pub(crate) fn run(ctx: &Ctx) -> Result<()> {
    let Wheel { wheel, .. } = build(ctx)?;
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

/// A built wheel, and the binary maturin put in it (stripped, linked for glibc 2.17).
pub(crate) struct Wheel {
    /// The only wheel in target/wheels/.
    pub(crate) wheel: PathBuf,
    pub(crate) binary: PathBuf,
}

/// Builds the wheel (the eBPF objects first, by tracer-userspace's build script).
pub(crate) fn build(ctx: &Ctx) -> Result<Wheel> {
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
    let target_dir = ctx.root.join("target/wheel-build");
    // maturin finds zig (the ziglang package) through the venv's python on PATH.
    let mut path = vec![venv_bin.clone()];
    path.extend(std::env::split_paths(&ctx.path));
    let mut cmd = Command::new(venv_bin.join("maturin"));
    cmd.env(
        "PATH",
        std::env::join_paths(path).context("PATH holds an invalid entry")?,
    )
    .env("CARGO_TARGET_DIR", &target_dir)
    // The binary is stripped: the release profile's line tables would only cost build time.
    // (tracer-ebpf keeps its own `debug = 2`, a package override: its BTF comes from it.)
    .env("CARGO_PROFILE_RELEASE_DEBUG", "false")
    .current_dir(&ctx.root)
    .args(["build", "--release", "--zig", "--out"])
    .arg(&out);
    run_checked(
        &mut cmd,
        "maturin could not build the wheel: see the errors above (the eBPF build needs \
         `cargo xtask setup --toolchain-only`)",
    )?;
    // maturin builds for the host named as an explicit `--target`.
    let binary = target_dir
        .join(ctx.host_triple(&[])?)
        .join("release/gym-tracer");
    if !binary.exists() {
        bail!(
            "maturin built no {}: has its layout changed? (see the build above)",
            binary.display()
        );
    }
    match wheels_in(&out)?.as_slice() {
        [wheel] => Ok(Wheel {
            wheel: wheel.clone(),
            binary,
        }),
        found => bail!(
            "expected one gym_tracer wheel in {}, found {found:?}",
            out.display()
        ),
    }
}

fn wheels_in(dir: &Path) -> Result<Vec<PathBuf>> {
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
