//! Project automation for gym-tracer: `cargo xtask <command>`.
//!
//! Every step prints an `xtask: ...` line before it runs, child processes stream their
//! output straight to the terminal, and every failure says what to do about it.

use std::ffi::OsString;
use std::fs;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, ExitStatus};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "xtask",
    about = "Build, test and set up gym-tracer (run as `cargo xtask <command>`)"
)]
struct Cli {
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what a fresh machine lacks: nightly + rust-src, bpf-linker, the test
    /// venv, the real-Gym venv; as root also wrk and cc (the bench) and mount tracefs.
    /// Idempotent.
    Setup {
        /// Do not create the real-Gym venv (target/gym-venv, about 900 MB); the real-Gym
        /// integration test is then skipped.
        #[arg(long)]
        no_gym_venv: bool,
        /// Only the toolchain the build needs (nightly + rust-src, bpf-linker): no venvs,
        /// no tracefs. For image builds (deploy/Dockerfile).
        #[arg(long)]
        toolchain_only: bool,
    },
    /// Build the agent (the eBPF object is built by tracer-userspace's build.rs).
    Build {
        /// Build with the release profile.
        #[arg(long)]
        release: bool,
    },
    /// Build the agent (release by default) and run it with the given arguments.
    Run {
        /// Build with the release profile (the default).
        #[arg(long, overrides_with = "debug")]
        release: bool,
        /// Build and run the debug profile instead.
        #[arg(long, overrides_with = "release")]
        debug: bool,
        /// Arguments passed to gym-tracer.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<OsString>,
    },
    /// Run setup, the unit tests and (as root) the Python integration tests.
    Test {
        /// Only run `cargo test`; skip the integration tests (no root needed).
        #[arg(long)]
        unit_only: bool,
        /// Do not create the real-Gym venv; the real-Gym integration test is skipped.
        #[arg(long)]
        no_gym_venv: bool,
        /// Extra arguments for pytest (after `--`).
        #[arg(last = true)]
        pytest_args: Vec<OsString>,
    },
    /// Run setup, build the agent and run tests/demo.py against it (root needed).
    Demo,
    /// Measure what tracing costs: untraced vs gym-tracer vs in-process OpenTelemetry on the
    /// Gym-shaped servers, plus saturation, connection scale and the host-wide syscall tax.
    /// Prints one table and writes target/bench/latest.json (root needed; installs wrk).
    Bench(BenchArgs),
    /// `cargo fmt --check` and `cargo clippy -D warnings` over the workspace.
    Lint,
    /// Regenerate README.md's reference section (options, spans, metrics) from the code; a
    /// unit test fails while it is stale.
    Docs,
    /// Fuzz the HTTP reassembly path (cargo-fuzz target `http_reassembly`) for a bounded
    /// time, starting from the committed corpus; installs cargo-fuzz when missing.
    Fuzz {
        /// How long to fuzz.
        #[arg(long, default_value_t = 60)]
        seconds: u64,
        /// Build without AddressSanitizer (`cargo fuzz -s none`): faster, still catches
        /// panics, overflows (debug assertions are on), leaks of time and memory.
        #[arg(long)]
        no_sanitizer: bool,
        /// Afterwards, add to fuzz/corpus/http_reassembly the new inputs that reach at least
        /// 4 coverage edges the committed corpus does not (so it stays small).
        #[arg(long)]
        update_corpus: bool,
    },
}

/// Options of `cargo xtask bench`, passed on to bench/bench.py.
#[derive(clap::Args)]
struct BenchArgs {
    /// Short runs and one repeat: a smoke check (about 2 minutes).
    #[arg(long)]
    quick: bool,
    /// Seconds of load per measured run (default 8; 3 with --quick).
    #[arg(long)]
    duration: Option<u32>,
    /// Repeats per variant; the table shows the median of each figure (default 3; 1 with --quick).
    #[arg(long)]
    repeats: Option<u32>,
    /// Also run a memory soak of this many seconds under steady load (600 = the 10-minute soak).
    #[arg(long)]
    soak: Option<u32>,
    /// Only these sections, comma-separated: verify, run, saturation, connections, tax.
    #[arg(long)]
    only: Option<String>,
}

impl BenchArgs {
    /// The arguments bench/bench.py takes for these options.
    fn driver_args(&self) -> Vec<String> {
        let mut args = Vec::new();
        if self.quick {
            args.push("--quick".to_string());
        }
        let options = [
            ("--duration", self.duration.map(|v| v.to_string())),
            ("--repeats", self.repeats.map(|v| v.to_string())),
            ("--soak", self.soak.map(|v| v.to_string())),
            ("--only", self.only.clone()),
        ];
        for (flag, value) in options {
            if let Some(value) = value {
                args.extend([flag.to_string(), value]);
            }
        }
        args
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let ctx = match Ctx::new() {
        Ok(ctx) => ctx,
        Err(err) => return report(err),
    };
    let result = match cli.command {
        Cmd::Setup {
            toolchain_only: true,
            ..
        } => setup_toolchain(&ctx),
        Cmd::Setup { no_gym_venv, .. } => setup(&ctx, !no_gym_venv),
        Cmd::Build { release } => build(&ctx, release).map(|bin| {
            println!("xtask: built {}", bin.display());
        }),
        Cmd::Run { debug, args, .. } => return run(&ctx, !debug, &args).unwrap_or_else(report),
        Cmd::Test {
            unit_only,
            no_gym_venv,
            pytest_args,
        } => test(&ctx, unit_only, !no_gym_venv, &pytest_args),
        Cmd::Demo => demo(&ctx),
        Cmd::Bench(args) => bench(&ctx, &args),
        Cmd::Lint => lint(&ctx),
        Cmd::Docs => docs(&ctx),
        Cmd::Fuzz {
            seconds,
            no_sanitizer,
            update_corpus,
        } => fuzz(&ctx, seconds, !no_sanitizer, update_corpus),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(err) => report(err),
    }
}

/// Prints the error chain (what failed, then why) and returns a failing exit code.
fn report(err: anyhow::Error) -> ExitCode {
    eprintln!("xtask: error: {err:#}");
    ExitCode::FAILURE
}

/// Shared state: where the workspace is and the PATH child processes get.
struct Ctx {
    root: PathBuf,
    home: PathBuf,
    /// PATH for children; `~/.cargo/bin` is prepended when missing so a freshly
    /// installed bpf-linker is found by the eBPF build.
    path: OsString,
    /// Cargo's bin dir (`$CARGO_HOME/bin`, default `~/.cargo/bin`).
    cargo_bin: PathBuf,
    /// True when `path` differs from ours (we tell the user once, during setup).
    path_extended: bool,
}

impl Ctx {
    fn new() -> Result<Self> {
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
    fn cmd(&self, program: &str) -> Command {
        let mut cmd = Command::new(program);
        cmd.env("PATH", &self.path).current_dir(&self.root);
        cmd
    }

    fn venv_python(&self) -> PathBuf {
        self.root.join("target/venv/bin/python")
    }

    /// The venv the real nemo-gym servers run from (tests/real_gym).
    fn gym_venv(&self) -> PathBuf {
        self.root.join("target/gym-venv")
    }

    fn agent_bin(&self, release: bool) -> PathBuf {
        let profile = if release { "release" } else { "debug" };
        self.root.join("target").join(profile).join("gym-tracer")
    }
}

/// Runs a command with inherited stdio; fails with `hint` if it cannot start or fails.
fn run_checked(cmd: &mut Command, hint: &str) -> Result<()> {
    let status = spawn_status(cmd)?;
    if !status.success() {
        bail!("`{}` failed ({status}): {hint}", describe(cmd));
    }
    Ok(())
}

/// Runs a command with inherited stdio and returns its status.
fn spawn_status(cmd: &mut Command) -> Result<ExitStatus> {
    cmd.status().with_context(|| {
        format!(
            "could not start `{}`: is it installed and on PATH?",
            describe(cmd)
        )
    })
}

/// Runs a command quietly and returns its stdout, or None if it failed or is missing.
fn capture(cmd: &mut Command) -> Option<String> {
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

fn is_root() -> bool {
    euid() == Some(0)
}

/// Loading eBPF programs needs root; fail early with the command to use instead.
/// `what` completes "... eBPF programs", e.g. "the integration tests load".
fn require_root(what: &str, command: &str) -> Result<()> {
    if !is_root() {
        bail!("{what} eBPF programs: run as root (sudo -E cargo xtask {command})");
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// setup
// ---------------------------------------------------------------------------

/// `gym_venv`: also create the real-Gym venv (off with `--no-gym-venv`).
fn setup(ctx: &Ctx, gym_venv: bool) -> Result<()> {
    if ctx.path_extended {
        println!(
            "xtask: note: {} is not on your PATH; adding it for the commands xtask runs \
             (add it to your shell profile to use bpf-linker directly)",
            ctx.cargo_bin.display()
        );
    }
    setup_toolchain(ctx)?;
    ensure_venv(ctx)?;
    // The benchmark's load generator and the compiler of its syscall loop: `cargo xtask
    // bench` and tests/test_bench.py (run by `cargo xtask test`) need them.
    if is_root() {
        ensure_system_tool(ctx, "wrk", "wrk")?;
        ensure_system_tool(ctx, "cc", "gcc")?;
    } else {
        println!("xtask: not root: wrk and cc are not installed (the bench needs them)");
    }
    if gym_venv {
        ensure_gym_venv(ctx)?;
    } else {
        println!("xtask: skipping the real-Gym venv (target/gym-venv)");
    }
    ensure_tracefs(ctx);
    println!("xtask: setup complete");
    Ok(())
}

/// What building the agent needs: nightly with rust-src, and bpf-linker.
fn setup_toolchain(ctx: &Ctx) -> Result<()> {
    ensure_nightly(ctx)?;
    ensure_rust_src(ctx)?;
    ensure_bpf_linker(ctx)
}

/// The eBPF crate is built with nightly (`-Z build-std=core`).
fn ensure_nightly(ctx: &Ctx) -> Result<()> {
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

/// What `rustc +nightly -vV` tells us about the compiler's bundled LLVM.
#[derive(Debug, PartialEq, Eq)]
struct RustcInfo {
    /// e.g. `1.97.0-nightly`
    release: String,
    llvm_major: u32,
    llvm_minor: u32,
}

impl RustcInfo {
    /// Parses `rustc -vV` output (`release: ...` and `LLVM version: X.Y.Z` lines).
    fn parse(vv: &str) -> Result<Self> {
        let field = |name: &str| {
            vv.lines()
                .find_map(|l| l.strip_prefix(name))
                .map(str::trim)
                .with_context(|| format!("`rustc +nightly -vV` has no `{name}` line"))
        };
        let release = field("release:")?.to_string();
        let llvm = field("LLVM version:")?;
        let mut parts = llvm.split('.');
        let mut number = |what: &str| -> Result<u32> {
            parts
                .next()
                .and_then(|p| p.parse().ok())
                .with_context(|| format!("cannot read the LLVM {what} version from `{llvm}`"))
        };
        let llvm_major = number("major")?;
        let llvm_minor = number("minor")?;
        Ok(Self {
            release,
            llvm_major,
            llvm_minor,
        })
    }

    /// The name rustc gives its libLLVM, e.g. `libLLVM.so.22.1-rust-1.97.0-nightly`.
    fn soname(&self) -> String {
        format!(
            "libLLVM.so.{}.{}-rust-{}",
            self.llvm_major, self.llvm_minor, self.release
        )
    }

    /// Per-toolchain prefix dir name, so a nightly update gets a fresh prefix.
    fn prefix_name(&self) -> String {
        format!(
            "llvm-{}.{}-rust-{}",
            self.llvm_major, self.llvm_minor, self.release
        )
    }

    /// The bpf-linker cargo feature matching the LLVM major version.
    fn linker_feature(&self) -> String {
        format!("llvm-{}", self.llvm_major)
    }
}

/// bpf-linker links the eBPF object; it must use the nightly's own libLLVM, so we build
/// it against an LLVM_PREFIX that points at the sysroot's library.
fn ensure_bpf_linker(ctx: &Ctx) -> Result<()> {
    println!("xtask: checking for bpf-linker");
    if capture(ctx.cmd("bpf-linker").arg("--version")).is_some() {
        return Ok(());
    }
    let vv = capture(ctx.cmd("rustc").args(["+nightly", "-vV"]))
        .context("`rustc +nightly -vV` failed: make sure the nightly toolchain is installed")?;
    let info = RustcInfo::parse(&vv)?;
    let sysroot = capture(ctx.cmd("rustc").args(["+nightly", "--print", "sysroot"]))
        .context("`rustc +nightly --print sysroot` failed: reinstall the nightly toolchain")?;
    let sysroot_lib = PathBuf::from(sysroot.trim()).join("lib");
    let libllvm = find_libllvm(&sysroot_lib, &info.soname())?;
    let prefix = ctx
        .home
        .join(".local/share/gym-tracer")
        .join(info.prefix_name());
    println!(
        "xtask: linking {} into {}",
        libllvm.display(),
        prefix.display()
    );
    make_llvm_prefix(&prefix, &libllvm)?;

    let feature = info.linker_feature();
    println!(
        "xtask: installing bpf-linker (LLVM_PREFIX={}, feature {feature}); this takes about a minute",
        prefix.display()
    );
    run_checked(
        ctx.cmd("cargo")
            .args([
                "install",
                "bpf-linker",
                "--no-default-features",
                "--features",
                &feature,
            ])
            .env("LLVM_PREFIX", &prefix),
        "installing bpf-linker failed: check the output above (network access to crates.io, \
         a C++ toolchain) and retry `cargo xtask setup`",
    )?;
    println!("xtask: verifying bpf-linker");
    run_checked(
        ctx.cmd("bpf-linker").arg("--version"),
        "bpf-linker was installed but does not run: check that ~/.cargo/bin is on PATH and \
         that the nightly toolchain's libLLVM still exists, then rerun `cargo xtask setup`",
    )
}

/// The sysroot's libLLVM: the expected soname, else the one `libLLVM.so.*` file there.
fn find_libllvm(sysroot_lib: &Path, soname: &str) -> Result<PathBuf> {
    let expected = sysroot_lib.join(soname);
    if expected.exists() {
        return Ok(expected);
    }
    let entries = fs::read_dir(sysroot_lib)
        .with_context(|| format!("cannot list {}", sysroot_lib.display()))?;
    let mut found = Vec::new();
    for entry in entries {
        let name = entry?.file_name();
        if name.to_string_lossy().starts_with("libLLVM.so.") {
            found.push(sysroot_lib.join(name));
        }
    }
    match found.as_slice() {
        [one] => Ok(one.clone()),
        [] => bail!(
            "no libLLVM.so.* in {} (expected {soname}): reinstall the nightly toolchain \
             (`rustup toolchain install nightly --force --component rust-src`)",
            sysroot_lib.display()
        ),
        many => bail!(
            "several libLLVM.so.* in {} and none is {soname}: {many:?}; reinstall the nightly \
             toolchain",
            sysroot_lib.display()
        ),
    }
}

/// `P/lib/libLLVM.so` and `P/lib/<soname>`, both symlinks to the sysroot library.
fn make_llvm_prefix(prefix: &Path, libllvm: &Path) -> Result<()> {
    let lib = prefix.join("lib");
    fs::create_dir_all(&lib).with_context(|| format!("cannot create {}", lib.display()))?;
    let file_name = libllvm
        .file_name()
        .context("libLLVM path has no file name")?;
    for link in [lib.join("libLLVM.so"), lib.join(file_name)] {
        match fs::remove_file(&link) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => {
                return Err(e).with_context(|| format!("cannot replace {}", link.display()));
            }
        }
        std::os::unix::fs::symlink(libllvm, &link)
            .with_context(|| format!("cannot create symlink {}", link.display()))?;
    }
    Ok(())
}

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

/// The integration tests are pytest; keep their deps in a venv under target/.
fn ensure_venv(ctx: &Ctx) -> Result<()> {
    let requirements_path = ctx.root.join("tests/requirements.txt");
    let requirements = fs::read_to_string(&requirements_path).with_context(|| {
        format!(
            "cannot read {}: the test requirements file is missing; restore it (it lists \
             the Python packages the integration tests need) and rerun `cargo xtask setup`",
            requirements_path.display()
        )
    })?;
    let venv = ctx.root.join("target/venv");
    let python = ctx.venv_python();
    if !python.exists() {
        create_venv(
            ctx,
            &choose_python(ctx),
            &venv,
            "test",
            "could not create the Python venv: install Python 3 with the venv module \
             (e.g. `apt-get install python3-venv`), or `pyenv install 3.13.0`, and retry",
        )?;
    }
    let stamp = venv.join(".requirements-stamp");
    if fs::read_to_string(&stamp).ok().as_deref() == Some(requirements.as_str()) {
        println!("xtask: test venv is up to date");
        return Ok(());
    }
    println!(
        "xtask: installing the test requirements into {}",
        venv.display()
    );
    pip_install(
        ctx,
        &python,
        &[],
        &requirements_path,
        "pip could not install the test requirements: check the output above (network \
         access to PyPI); delete target/venv to start over, then rerun `cargo xtask setup`",
    )?;
    fs::write(&stamp, &requirements)
        .with_context(|| format!("cannot write {}", stamp.display()))?;
    Ok(())
}

/// The real nemo-gym 0.7.0 servers run from their own venv, target/gym-venv, made with
/// pyenv's Python 3.13.0: tests/real_gym/requirements.txt (the pinned web stack), then
/// tests/real_gym/requirements-nodeps.txt (nemo-gym and ray) with `--no-deps
/// --ignore-requires-python`. Stamped on both files' content, like the test venv.
fn ensure_gym_venv(ctx: &Ctx) -> Result<()> {
    let dir = ctx.root.join("tests/real_gym");
    let read =
        |name: &str| {
            let path = dir.join(name);
            fs::read_to_string(&path).map(|text| (path.clone(), text)).with_context(|| {
            format!(
                "cannot read {}: the real-Gym requirements are missing; restore tests/real_gym \
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

// ---------------------------------------------------------------------------
// build / run / test / demo / lint
// ---------------------------------------------------------------------------

/// Builds tracer-userspace (its build.rs builds the eBPF object) and returns the binary.
fn build(ctx: &Ctx, release: bool) -> Result<PathBuf> {
    let profile = if release { "release" } else { "debug" };
    println!("xtask: building gym-tracer ({profile})");
    let mut cmd = ctx.cmd("cargo");
    cmd.args(["build", "-p", "tracer-userspace"]);
    if release {
        cmd.arg("--release");
    }
    run_checked(
        &mut cmd,
        "the build failed: fix the errors above; if the eBPF build cannot find nightly, \
         rust-src or bpf-linker, run `cargo xtask setup` first",
    )?;
    Ok(ctx.agent_bin(release))
}

fn run(ctx: &Ctx, release: bool, args: &[OsString]) -> Result<ExitCode> {
    let bin = build(ctx, release)?;
    if !is_root() {
        eprintln!(
            "xtask: warning: not running as root; the agent needs root or CAP_BPF, CAP_PERFMON, \
             CAP_DAC_READ_SEARCH and CAP_SYS_PTRACE \
             to load its eBPF programs"
        );
    }
    println!("xtask: running {}", bin.display());
    let mut cmd = Command::new(&bin);
    cmd.env("PATH", &ctx.path).args(args);
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

fn test(ctx: &Ctx, unit_only: bool, gym_venv: bool, pytest_args: &[OsString]) -> Result<()> {
    setup(ctx, gym_venv)?;

    println!("xtask: running the unit tests");
    run_checked(
        ctx.cmd("cargo")
            .args(["test", "--workspace", "--exclude", "tracer-ebpf"]),
        "unit tests failed: see the failures above",
    )?;
    println!("xtask: unit tests passed");
    if unit_only {
        return Ok(());
    }

    require_root("the integration tests load", "test")?;
    let bin = build(ctx, true)?;
    println!(
        "xtask: running the integration tests against {}",
        bin.display()
    );
    let mut cmd = Command::new(ctx.venv_python());
    cmd.env("PATH", &ctx.path)
        .current_dir(&ctx.root)
        .env("GYM_TRACER_BIN", &bin)
        .env("PYTHONUNBUFFERED", "1")
        .args(["-m", "pytest"])
        .arg(ctx.root.join("tests"))
        .args(["-v", "-rA"])
        .args(pytest_args);
    // tests/test_real_gym.py runs the real servers from this venv; it skips only when told
    // the venv was left out on purpose, and fails when it is missing otherwise.
    if gym_venv {
        cmd.env("GYM_REAL_VENV", ctx.gym_venv())
            .env_remove("GYM_REAL_VENV_SKIPPED");
    } else {
        cmd.env("GYM_REAL_VENV_SKIPPED", "cargo xtask test --no-gym-venv");
    }
    run_checked(
        &mut cmd,
        "integration tests failed: see the pytest report above (rerun one with \
         `sudo -E cargo xtask test -- -k NAME`)",
    )?;
    println!("xtask: integration tests passed");
    Ok(())
}

fn demo(ctx: &Ctx) -> Result<()> {
    require_root("the demo loads", "demo")?;
    // The demo runs Gym-shaped servers from the test venv, not the real-Gym venv.
    setup(ctx, false)?;
    let bin = build(ctx, true)?;
    println!("xtask: running the demo against {}", bin.display());
    let mut cmd = Command::new(ctx.venv_python());
    cmd.env("PATH", &ctx.path)
        .current_dir(&ctx.root)
        .env("PYTHONUNBUFFERED", "1")
        .arg(ctx.root.join("tests/demo.py"))
        .arg("--agent")
        .arg(&bin);
    run_checked(&mut cmd, "the demo failed: see its output above")?;
    println!("xtask: demo finished");
    Ok(())
}

/// Setup (test venv, no real-Gym venv), wrk and a C compiler, the release build, then the
/// driver bench/bench.py with the venv's Python.
fn bench(ctx: &Ctx, args: &BenchArgs) -> Result<()> {
    require_root("the bench loads", "bench")?;
    setup(ctx, false)?;
    let bin = build(ctx, true)?;
    println!("xtask: running the benchmark against {}", bin.display());
    let mut cmd = Command::new(ctx.venv_python());
    cmd.env("PATH", &ctx.path)
        .current_dir(&ctx.root)
        .env("PYTHONUNBUFFERED", "1")
        .arg(ctx.root.join("bench/bench.py"))
        .arg("--agent")
        .arg(&bin)
        .arg("--out-dir")
        .arg(ctx.root.join("target/bench"))
        .args(args.driver_args());
    run_checked(&mut cmd, "the benchmark failed: see its output above")?;
    println!("xtask: benchmark finished; results in target/bench/latest.json");
    Ok(())
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

/// True when `program` is an executable file in one of ctx.path's directories.
fn on_path(ctx: &Ctx, program: &str) -> bool {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(&ctx.path).any(|dir| {
        fs::metadata(dir.join(program))
            .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    })
}

fn docs(ctx: &Ctx) -> Result<()> {
    let bin = build(ctx, true)?;
    let readme = ctx.root.join("README.md");
    run_checked(
        Command::new(&bin)
            .args(["reference", "--update"])
            .arg(&readme),
        "regenerating the README reference failed: see the error above",
    )?;
    println!("xtask: updated {}", readme.display());
    Ok(())
}

/// The one fuzz target: arbitrary event sequences through the agent's reassembly path.
const FUZZ_TARGET: &str = "http_reassembly";

/// Per-input limits: an input that takes longer or uses more is reported as a find (a
/// quadratic path, a table that is not bounded), not waited for.
const FUZZ_TIMEOUT_SECONDS: u64 = 10;
const FUZZ_RSS_LIMIT_MB: u64 = 1024;
/// Scripts longer than libFuzzer's default (4096) so that heads past the capture budget
/// and long pipelines are reachable.
const FUZZ_MAX_LEN: u64 = 65536;

fn fuzz(ctx: &Ctx, seconds: u64, sanitizer: bool, update_corpus: bool) -> Result<()> {
    ensure_nightly(ctx)?;
    if capture(ctx.cmd("cargo").args(["+nightly", "fuzz", "--version"])).is_none() {
        println!("xtask: installing cargo-fuzz");
        run_checked(
            ctx.cmd("cargo").args(["install", "cargo-fuzz", "--locked"]),
            "installing cargo-fuzz failed: see the error above, or install it yourself \
             (`cargo install cargo-fuzz --locked`) and retry",
        )?;
    }
    let fuzz_dir = ctx.root.join("fuzz");
    let committed = fuzz_dir.join("corpus").join(FUZZ_TARGET);
    // New inputs go to a scratch corpus, so a run leaves the committed one as it was.
    let scratch = fuzz_dir.join("target/corpus").join(FUZZ_TARGET);
    fs::create_dir_all(&scratch)
        .with_context(|| format!("creating the scratch corpus {}", scratch.display()))?;
    let cargo_fuzz = |extra: &[&str]| {
        let mut cmd = ctx.cmd("cargo");
        cmd.current_dir(&fuzz_dir)
            // The target never loads eBPF: skip building it (see tracer-userspace/build.rs).
            .env("AYA_BUILD_SKIP", "1")
            .args(["+nightly", "fuzz", "run", FUZZ_TARGET]);
        if !sanitizer {
            cmd.args(["--sanitizer", "none"]);
        }
        cmd.args(extra);
        cmd
    };
    println!(
        "xtask: fuzzing {FUZZ_TARGET} for {seconds} s (new inputs in {}; finds in {})",
        scratch.display(),
        fuzz_dir.join("artifacts").join(FUZZ_TARGET).display()
    );
    let scratch_arg = scratch.to_string_lossy().into_owned();
    let committed_arg = committed.to_string_lossy().into_owned();
    run_checked(
        &mut cargo_fuzz(&[
            &scratch_arg,
            &committed_arg,
            "--",
            &format!("-max_total_time={seconds}"),
            &format!("-timeout={FUZZ_TIMEOUT_SECONDS}"),
            &format!("-rss_limit_mb={FUZZ_RSS_LIMIT_MB}"),
            &format!("-max_len={FUZZ_MAX_LEN}"),
        ]),
        "the fuzzer found a failing input (saved under fuzz/artifacts/; replay it with \
         `cargo +nightly fuzz run http_reassembly <file>` in fuzz/), or could not build: \
         see above. Fix the bug, add a regression test, then rerun",
    )?;
    if update_corpus {
        update_corpus_from(&fuzz_dir, &committed, &scratch)?;
    }
    println!("xtask: fuzzing found nothing in {seconds} s");
    Ok(())
}

/// A new input joins the committed corpus only if it reaches this many coverage edges the
/// corpus does not: the long tail of inputs that each add one or two (formatting branches,
/// hash-order differences) would make it hundreds of files.
const CORPUS_MIN_NEW_EDGES: u64 = 4;

/// Adds to `committed` the scratch inputs that reach new code: libFuzzer's edge-only set
/// cover picks candidates, then each is kept, best first, if it adds
/// [`CORPUS_MIN_NEW_EDGES`] to what is kept already.
fn update_corpus_from(fuzz_dir: &Path, committed: &Path, scratch: &Path) -> Result<()> {
    let binary = fs::read_dir(fuzz_dir.join("target"))
        .context("reading fuzz/target: run the fuzzer first")?
        .filter_map(|entry| entry.ok())
        .map(|entry| entry.path().join("release").join(FUZZ_TARGET))
        .find(|path| path.exists())
        .context("no built fuzz target under fuzz/target/*/release: run the fuzzer first")?;
    let candidates = fuzz_dir.join("target/corpus-candidates");
    let trial = fuzz_dir.join("target/corpus-trial");
    for dir in [&candidates, &trial] {
        let _ = fs::remove_dir_all(dir);
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    println!(
        "xtask: choosing corpus candidates from {}",
        scratch.display()
    );
    run_checked(
        Command::new(&binary)
            .args([
                "-set_cover_merge=1",
                "-use_counters=0",
                "-use_value_profile=0",
            ])
            .arg(&candidates)
            .arg(scratch),
        "the corpus merge failed: see the error above",
    )?;
    let coverage = |dirs: &[&Path]| -> Result<u64> {
        let out = Command::new(&binary)
            .args(["-runs=0", "-rss_limit_mb=2048"])
            .args(dirs)
            .output()
            .with_context(|| format!("running {}", binary.display()))?;
        String::from_utf8_lossy(&out.stderr)
            .lines()
            .filter_map(|line| line.split("INITED cov: ").nth(1))
            .filter_map(|rest| rest.split_whitespace().next()?.parse().ok())
            .next_back()
            .context("the fuzz target printed no coverage figure")
    };
    let mut ranked = Vec::new();
    for entry in fs::read_dir(&candidates)? {
        let path = entry?.path();
        fs::copy(&path, trial.join("input"))?;
        ranked.push((coverage(&[&trial])?, path));
    }
    ranked.sort_by_key(|(edges, _)| std::cmp::Reverse(*edges));
    let _ = fs::remove_file(trial.join("input"));
    let mut covered = coverage(&[committed])?;
    let before = covered;
    let mut added = 0;
    for (_, path) in ranked {
        let name = path.file_name().context("a candidate without a name")?;
        fs::copy(&path, trial.join(name))?;
        let with = coverage(&[committed, &trial])?;
        if with >= covered + CORPUS_MIN_NEW_EDGES {
            fs::rename(trial.join(name), committed.join(name))?;
            covered = with;
            added += 1;
        } else {
            fs::remove_file(trial.join(name))?;
        }
    }
    println!(
        "xtask: added {added} inputs to {} (coverage {before} → {covered} edges)",
        committed.display()
    );
    Ok(())
}

fn lint(ctx: &Ctx) -> Result<()> {
    println!("xtask: checking formatting");
    run_checked(
        ctx.cmd("cargo").args(["fmt", "--all", "--", "--check"]),
        "code is not formatted: run `cargo fmt --all`",
    )?;
    println!("xtask: running clippy");
    run_checked(
        ctx.cmd("cargo")
            .args(["clippy", "--all-targets", "--", "-D", "warnings"]),
        "clippy found problems: fix the warnings above",
    )?;
    println!("xtask: lint passed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)
binary: rustc
commit-hash: e50aa6fba4e63ab34c72bf9acfd2c307c1155d1a
commit-date: 2026-05-19
host: x86_64-unknown-linux-gnu
release: 1.97.0-nightly
LLVM version: 22.1.4
";

    #[test]
    fn parses_rustc_vv() {
        let info = RustcInfo::parse(SAMPLE).unwrap();
        assert_eq!(
            info,
            RustcInfo {
                release: "1.97.0-nightly".into(),
                llvm_major: 22,
                llvm_minor: 1,
            }
        );
        assert_eq!(info.soname(), "libLLVM.so.22.1-rust-1.97.0-nightly");
        assert_eq!(info.prefix_name(), "llvm-22.1-rust-1.97.0-nightly");
        assert_eq!(info.linker_feature(), "llvm-22");
    }

    #[test]
    fn bench_options_reach_the_driver() {
        let Cli {
            command: Cmd::Bench(args),
        } = Cli::parse_from([
            "xtask",
            "bench",
            "--quick",
            "--repeats",
            "5",
            "--only",
            "tax",
        ])
        else {
            panic!("not the bench command");
        };
        assert_eq!(
            args.driver_args(),
            ["--quick", "--repeats", "5", "--only", "tax"]
        );
    }

    #[test]
    fn rejects_output_without_llvm_line() {
        let err = RustcInfo::parse("release: 1.97.0-nightly\n").unwrap_err();
        assert!(err.to_string().contains("LLVM version"), "{err}");
    }

    #[test]
    fn finds_libllvm_by_soname_or_fallback() {
        let dir = std::env::temp_dir().join(format!("xtask-test-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        fs::write(dir.join("libLLVM-22-rust-x.so"), "").unwrap();
        fs::write(dir.join("libLLVM.so.22.1-rust-x"), "").unwrap();
        let exact = find_libllvm(&dir, "libLLVM.so.22.1-rust-x").unwrap();
        assert_eq!(exact, dir.join("libLLVM.so.22.1-rust-x"));
        let fallback = find_libllvm(&dir, "libLLVM.so.99.0-rust-y").unwrap();
        assert_eq!(fallback, dir.join("libLLVM.so.22.1-rust-x"));

        let prefix = dir.join("prefix");
        make_llvm_prefix(&prefix, &exact).unwrap();
        make_llvm_prefix(&prefix, &exact).unwrap(); // idempotent
        for name in ["libLLVM.so", "libLLVM.so.22.1-rust-x"] {
            assert_eq!(fs::read_link(prefix.join("lib").join(name)).unwrap(), exact);
        }
        fs::remove_dir_all(&dir).unwrap();
    }
}
