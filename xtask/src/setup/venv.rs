//! The Python venvs: target/venv for the integration tests, target/gym-venv for real Gym.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

use crate::command::{capture, run_checked};
use crate::ctx::Ctx;

/// `pyenv root` when pyenv is on PATH, else `~/.pyenv`.
fn pyenv_root(ctx: &Ctx) -> PathBuf {
    capture(ctx.cmd("pyenv").arg("root"))
        .map(|s| PathBuf::from(s.trim()))
        .unwrap_or_else(|| ctx.home.join(".pyenv"))
}

/// pyenv's Python 3.13.0 (may not exist).
fn pyenv_python_3_13_0(ctx: &Ctx) -> PathBuf {
    pyenv_root(ctx).join("versions/3.13.0/bin/python")
}

/// pyenv's Python 3.12.1 (may not exist).
fn pyenv_python_3_12_1(ctx: &Ctx) -> PathBuf {
    pyenv_root(ctx).join("versions/3.12.1/bin/python")
}

/// Picks the Python for the test venv: pyenv's 3.13.0, else python3.13, else python3.
fn choose_python(ctx: &Ctx) -> PathBuf {
    let pyenv_python = pyenv_python_3_13_0(ctx);
    if pyenv_python.exists() {
        return pyenv_python;
    }
    if capture(ctx.cmd("python3.13").arg("--version")).is_some() {
        return PathBuf::from("python3.13");
    }
    PathBuf::from("python3")
}

/// `base -m venv venv`; `what` names the venv in the log line.
fn create_venv(ctx: &Ctx, base: &Path, venv: &Path, what: &str, hint: &str) -> Result<()> {
    println!(
        "xtask: creating the {what} venv at {} with {}",
        venv.display(),
        base.display()
    );
    let mut cmd = Command::new(base);
    cmd.env("PATH", &ctx.path)
        .current_dir(&ctx.root)
        .args(["-m", "venv"])
        .arg(venv);
    run_checked(&mut cmd, hint)
}

/// `python -m pip install -q FLAGS -r requirements`.
fn pip_install(
    ctx: &Ctx,
    python: &Path,
    flags: &[&str],
    requirements: &Path,
    hint: &str,
) -> Result<()> {
    let mut cmd = Command::new(python);
    cmd.env("PATH", &ctx.path)
        .current_dir(&ctx.root)
        .args(["-m", "pip", "install", "-q"])
        .args(flags)
        .arg("-r")
        .arg(requirements);
    run_checked(&mut cmd, hint)
}

/// A venv under target/ made from one requirements file, stamped on its content so that it is
/// reinstalled only when the file changes.
struct RequirementsVenv<'a> {
    /// Named in the log lines: "the {what} venv".
    what: &'a str,
    venv: PathBuf,
    requirements: PathBuf,
    /// What to do when pip fails (after "pip could not install ...: ").
    pip_hint: &'a str,
    /// The interpreter the venv is made with; `None`: [`choose_python`].
    base: Option<PathBuf>,
}

impl RequirementsVenv<'_> {
    fn ensure(&self, ctx: &Ctx) -> Result<()> {
        let requirements = fs::read_to_string(&self.requirements).with_context(|| {
            format!(
                "cannot read {}: restore it from git (it lists the Python packages of the {} \
                 venv) and rerun `cargo xtask setup`",
                self.requirements.display(),
                self.what
            )
        })?;
        let python = self.venv.join("bin/python");
        if !python.exists() {
            create_venv(
                ctx,
                &self.base.clone().unwrap_or_else(|| choose_python(ctx)),
                &self.venv,
                self.what,
                "could not create the Python venv: install Python 3 with the venv module \
                 (e.g. `apt-get install python3-venv`), or `pyenv install 3.13.0`, and retry",
            )?;
        }
        let stamp = self.venv.join(".requirements-stamp");
        if fs::read_to_string(&stamp).ok().as_deref() == Some(requirements.as_str()) {
            println!("xtask: the {} venv is up to date", self.what);
            return Ok(());
        }
        println!(
            "xtask: installing {} into {}",
            self.requirements.display(),
            self.venv.display()
        );
        let hint = format!(
            "pip could not install {}: check the output above (network access to PyPI); {}",
            self.requirements.display(),
            self.pip_hint
        );
        pip_install(ctx, &python, &[], &self.requirements, &hint)?;
        fs::write(&stamp, &requirements)
            .with_context(|| format!("cannot write {}", stamp.display()))?;
        Ok(())
    }
}

/// The integration tests are pytest; keep their deps in a venv under target/.
pub(super) fn ensure_venv(ctx: &Ctx) -> Result<()> {
    RequirementsVenv {
        what: "test",
        venv: ctx.root.join("target/venv"),
        requirements: ctx.root.join("tests/requirements.txt"),
        pip_hint: "delete target/venv to start over, then rerun `cargo xtask setup`",
        base: None,
    }
    .ensure(ctx)
}

/// The web stack under pyenv's Python 3.12.1 (target/venv-py312), for the tests that run the
/// same servers under the other CPython minor the tracer reads (task lineage, task contexts).
pub(super) fn ensure_py312_venv(ctx: &Ctx) -> Result<()> {
    let base = pyenv_python_3_12_1(ctx);
    if !base.exists() {
        bail!(
            "pyenv's Python 3.12.1 is not at {}: install it (`pyenv install 3.12.1`); the \
             tests run servers under CPython 3.12 and 3.13",
            base.display()
        );
    }
    RequirementsVenv {
        what: "CPython 3.12 test",
        venv: ctx.root.join("target/venv-py312"),
        requirements: ctx.root.join("tests/requirements-py312.txt"),
        pip_hint: "delete target/venv-py312 to start over, then rerun `cargo xtask setup`",
        base: Some(base),
    }
    .ensure(ctx)
}

/// The real nemo-gym 0.7.0 servers run from their own venv, target/gym-venv, made with
/// pyenv's Python 3.13.0: tests/support/real_gym/requirements.txt (the pinned web stack), then
/// tests/support/real_gym/requirements-nodeps.txt (nemo-gym and ray) with `--no-deps
/// --ignore-requires-python`. Stamped on both files' content, like the test venv.
pub(super) fn ensure_gym_venv(ctx: &Ctx) -> Result<()> {
    let dir = ctx.root.join("tests/support/real_gym");
    let read = |name: &str| {
        let path = dir.join(name);
        fs::read_to_string(&path).map(|text| (path.clone(), text)).with_context(|| {
            format!(
                "cannot read {}: the real-Gym requirements are missing; restore tests/support/real_gym \
                 from git, or run `cargo xtask setup --no-gym-venv` to skip the real-Gym test",
                path.display()
            )
        })
    };
    let (requirements_path, requirements) = read("requirements.txt")?;
    let (nodeps_path, nodeps) = read("requirements-nodeps.txt")?;
    let stamp_text = format!("{requirements}\n--no-deps--\n{nodeps}");

    let venv = ctx.gym_venv();
    let python = venv.join("bin/python");
    let stamp = venv.join(".requirements-stamp");
    if python.exists() && fs::read_to_string(&stamp).ok().as_deref() == Some(stamp_text.as_str()) {
        println!("xtask: real-Gym venv is up to date");
        return Ok(());
    }
    if !python.exists() {
        let base = pyenv_python_3_13_0(ctx);
        if !base.exists() {
            bail!(
                "pyenv's Python 3.13.0 is not at {}: install it (`pyenv install 3.13.0`; \
                 nemo-gym 0.7.0 is run with exactly that interpreter), or run \
                 `cargo xtask setup --no-gym-venv` to skip the real-Gym test",
                base.display()
            );
        }
        create_venv(
            ctx,
            &base,
            &venv,
            "real-Gym",
            "could not create the real-Gym venv: check that pyenv's Python 3.13.0 has the venv \
             module (reinstall it with `pyenv install --force 3.13.0`) and retry",
        )?;
    }
    println!(
        "xtask: installing nemo-gym 0.7.0 and its web stack into {}; about 90 s the first time",
        venv.display()
    );
    let hint = "pip could not install the real-Gym requirements: check the output above \
                (network access to PyPI); delete target/gym-venv to start over, then rerun \
                `cargo xtask setup` (or skip the real-Gym test with `--no-gym-venv`)";
    pip_install(ctx, &python, &[], &requirements_path, hint)?;
    pip_install(
        ctx,
        &python,
        &["--no-deps", "--ignore-requires-python"],
        &nodeps_path,
        hint,
    )?;
    fs::write(&stamp, &stamp_text).with_context(|| format!("cannot write {}", stamp.display()))?;
    Ok(())
}

/// Arize Phoenix (tests/support/phoenix/requirements.txt) in its own venv, target/phoenix-venv:
/// the trace UI of `cargo xtask demo --ui` and the backend tests/test_backend.py exports to
/// (about 820 MB; a minute the first time).
pub(crate) fn ensure_phoenix_venv(ctx: &Ctx) -> Result<()> {
    RequirementsVenv {
        what: "Phoenix",
        venv: ctx.phoenix_venv(),
        requirements: ctx.root.join("tests/support/phoenix/requirements.txt"),
        pip_hint: "delete target/phoenix-venv to start over, then rerun `cargo xtask setup` \
                   (or skip the trace-UI test with `cargo xtask test --no-phoenix`)",
        base: None,
    }
    .ensure(ctx)
}

/// maturin (packaging/requirements.txt) in its own venv, target/wheel-venv: what `cargo xtask
/// wheel` builds the Python wheel with.
pub(crate) fn ensure_wheel_venv(ctx: &Ctx) -> Result<()> {
    RequirementsVenv {
        what: "wheel-build",
        venv: ctx.wheel_venv(),
        requirements: ctx.root.join("packaging/requirements.txt"),
        pip_hint: "delete target/wheel-venv to start over, then rerun `cargo xtask wheel`",
        base: None,
    }
    .ensure(ctx)
}
