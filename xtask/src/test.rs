//! `cargo xtask test`: setup, the unit tests, then (as root) the Python integration tests.
//!
//! On a fresh machine most of the run is waiting: for downloads (the venvs, the system
//! packages), then for the integration tests' servers, whose CPUs are often idle. So:
//! - the downloads run while cargo builds;
//! - the only build in the way of the integration tests is the release build, the wheel's,
//!   whose binary they run (one release build serves both);
//! - the unit tests' build (and with `--lint` clippy's, with `--fuzz-seconds` the fuzz
//!   target's) runs at idle priority beside everything ([`crate::idle`]); the unit tests run
//!   once it is done, then the bench's smoke tests, which run the examples it builds.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, anyhow, bail};

use crate::command::{require_root, run_checked, spawn_status};
use crate::ctx::Ctx;
use crate::idle::{IdleJob, IdleQueue};
use crate::{build, fuzz, lint, setup, wheel};

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
    /// Also run clippy (`cargo xtask lint`'s, in target/lint), at idle priority beside the
    /// integration tests.
    #[arg(long)]
    lint: bool,
    /// Also fuzz (`cargo xtask fuzz`'s target) for this many seconds after the integration
    /// tests; the target is built beside them, at idle priority.
    #[arg(long, value_name = "SECONDS")]
    fuzz_seconds: Option<u64>,
    /// Extra arguments for pytest (after `--`).
    #[arg(last = true)]
    pytest_args: Vec<OsString>,
}

/// The bench's smoke tests: they run the examples the unit tests' build makes, so they run
/// last, once that build is done.
const BENCH_TESTS: &str = "tests/test_bench.py";

const UNIT_HINT: &str = "unit tests failed: see the failures above";

pub(crate) fn run(ctx: &Ctx, args: &TestArgs) -> Result<()> {
    let gym_venv = !args.no_gym_venv;
    // The venvs and system packages are mostly downloads: they install while cargo builds,
    // and are joined before the integration tests need them.
    std::thread::scope(|scope| {
        let environment = scope.spawn(|| -> Result<()> {
            setup::environment(ctx, gym_venv)?;
            if !args.no_phoenix {
                setup::trace_ui(ctx, true)?;
            }
            Ok(())
        });
        let built = build_all(ctx, args);
        let environment = environment
            .join()
            .unwrap_or_else(|_| Err(anyhow!("the environment setup panicked")));
        environment.and(built)
    })
    .and_then(|built| match built {
        Some((queue, built)) => integration_tests(ctx, args, &queue, &built),
        None => Ok(()),
    })
}

/// What the integration tests run: the binary the wheel ships (tests/test_wheel.py installs
/// the wheel itself).
struct Built {
    agent: PathBuf,
    wheel: PathBuf,
    /// With `--fuzz-seconds`: the fuzz target the idle queue builds.
    fuzz_target: Option<PathBuf>,
}

/// The toolchain, then with `--unit-only` the unit tests alone; else the idle-priority
/// builds and, in the foreground, the release build.
fn build_all(ctx: &Ctx, args: &TestArgs) -> Result<Option<(IdleQueue, Built)>> {
    setup::toolchain(ctx)?;
    if args.unit_only {
        run_checked(&mut unit_tests(ctx), UNIT_HINT)?;
        println!("xtask: unit tests passed");
        return Ok(None);
    }
    require_root("the integration tests load", "test")?;
    let logs = ctx.root.join("target/logs");
    std::fs::create_dir_all(&logs)?;
    // In the order they are needed. Each has a target directory of its own: cargo locks one
    // per build, and a foreground build must never wait for an idle one.
    let mut build_tests = unit_tests(ctx);
    build_tests.arg("--no-run");
    let mut jobs = vec![IdleJob {
        what: "the unit tests' build",
        cmd: build_tests,
        log: logs.join("unit-tests-build.log"),
        hint: "fix the errors in its log above",
    }];
    if args.lint {
        let mut clippy = lint::clippy(ctx);
        clippy.env("CARGO_TARGET_DIR", ctx.root.join("target/lint"));
        jobs.push(IdleJob {
            what: "clippy",
            cmd: clippy,
            log: logs.join("clippy.log"),
            hint: lint::CLIPPY_HINT,
        });
    }
    let mut fuzz_target = None;
    if args.fuzz_seconds.is_some() {
        let (cmd, binary) = fuzz::build_command(ctx, true)?;
        fuzz_target = Some(binary);
        jobs.push(IdleJob {
            what: "the fuzz target's build",
            cmd,
            log: logs.join("fuzz-build.log"),
            hint: fuzz::BUILD_HINT,
        });
    }
    let queue = IdleQueue::start(jobs);
    // The release build is the wheel's: the tests run the binary it ships.
    let wheel::Wheel { wheel, binary } = wheel::build(ctx)?;
    Ok(Some((
        queue,
        Built {
            agent: binary,
            wheel,
            fuzz_target,
        },
    )))
}

/// `cargo test` over the workspace but the eBPF crate (which builds every example too).
fn unit_tests(ctx: &Ctx) -> Command {
    let mut cmd = ctx.cmd("cargo");
    cmd.args(["test", "--workspace", "--exclude", "tracer-ebpf"]);
    cmd
}

/// pytest over all but the bench's smoke tests; then, the unit tests' build done, the unit
/// tests and the bench's smoke tests; then what else was asked for.
fn integration_tests(ctx: &Ctx, args: &TestArgs, queue: &IdleQueue, built: &Built) -> Result<()> {
    println!(
        "xtask: running the integration tests against {}",
        built.agent.display()
    );
    let tests = ctx.root.join("tests");
    let bench_tests = ctx.root.join(BENCH_TESTS);
    let mut ignore_bench = OsString::from("--ignore=");
    ignore_bench.push(&bench_tests);
    pytest(
        ctx,
        args,
        built,
        None,
        &[tests.into_os_string(), ignore_bench],
    )?;
    println!("xtask: waiting for the unit tests' build");
    queue.next()?;
    run_checked(&mut unit_tests(ctx), UNIT_HINT)?;
    println!("xtask: unit tests passed");
    let examples = build::tested_examples(ctx)?;
    pytest(
        ctx,
        args,
        built,
        Some(&examples),
        &[bench_tests.into_os_string()],
    )?;
    println!("xtask: integration tests passed");
    if args.lint {
        queue.next()?;
    }
    if let (Some(seconds), Some(target)) = (args.fuzz_seconds, &built.fuzz_target) {
        queue.next()?;
        fuzz::fuzz_for(ctx, target, seconds)?;
    }
    Ok(())
}

/// pytest's exit status when no test was selected: fine for one of the two runs when
/// `pytest_args` select tests (`-k NAME`).
const PYTEST_NO_TESTS: i32 = 5;

fn pytest(
    ctx: &Ctx,
    args: &TestArgs,
    built: &Built,
    examples: Option<&build::BenchExamples>,
    selection: &[OsString],
) -> Result<()> {
    let mut cmd = Command::new(ctx.venv_python());
    cmd.env("PATH", &ctx.path)
        .current_dir(&ctx.root)
        .env("GYM_TRACER_BIN", &built.agent)
        .env("GYM_TRACER_WHEEL", &built.wheel)
        .env("PYTHONUNBUFFERED", "1")
        .args(["-m", "pytest", "-v", "-rA"])
        // The slowest tests, timed, at the end of the log: what the next change costs CI.
        .arg("--durations=30")
        .args(selection)
        .args(&args.pytest_args);
    if let Some(examples) = examples {
        cmd.env("GYM_PIPELINE_COST_BIN", &examples.pipeline_cost)
            .env("GYM_SYSCALL_FLOOR_BIN", &examples.syscall_floor);
    }
    // tests/test_real_gym.py runs the real servers from this venv; it skips only when told
    // the venv was left out on purpose, and fails when it is missing otherwise.
    if args.no_gym_venv {
        cmd.env("GYM_REAL_VENV_SKIPPED", "cargo xtask test --no-gym-venv");
    } else {
        cmd.env("GYM_REAL_VENV", ctx.gym_venv())
            .env("GYM_CODEX_CLI", ctx.codex_cli().join("node_modules/.bin"))
            .env_remove("GYM_REAL_VENV_SKIPPED");
    }
    // tests/test_backend.py exports to Phoenix from this venv, on the same terms.
    if args.no_phoenix {
        cmd.env("GYM_PHOENIX_SKIPPED", "cargo xtask test --no-phoenix");
    } else {
        cmd.env("GYM_PHOENIX_VENV", ctx.phoenix_venv())
            .env_remove("GYM_PHOENIX_SKIPPED");
    }
    let status = spawn_status(&mut cmd)?;
    let none_selected = status.code() == Some(PYTEST_NO_TESTS) && !args.pytest_args.is_empty();
    if !status.success() && !none_selected {
        bail!(
            "integration tests failed ({status}): see the pytest report above (rerun one with \
             `sudo -E cargo xtask test -- -k NAME`)"
        );
    }
    Ok(())
}
