//! `cargo xtask test`: setup, the unit tests, then (as root) the Python integration tests.
//!
//! On a fresh machine most of the run is waiting: for downloads (the venvs, the system
//! packages), then for the integration tests' servers, whose CPUs are often idle. So the
//! downloads run while cargo builds, the release build beside the unit tests' build, and with
//! `--lint` / `--fuzz-seconds` the clippy and fuzz-target builds at idle priority beside
//! everything else; one release build (the wheel's) serves the tests and the wheel alike.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::Command;

use anyhow::{Result, anyhow};

use crate::command::{Background, require_root, run_checked};
use crate::ctx::Ctx;
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

/// What the integration tests run.
struct Built {
    /// The binary the wheel ships (tests/test_wheel.py installs the wheel itself).
    agent: PathBuf,
    examples: build::BenchExamples,
    wheel: PathBuf,
}

/// What runs beside the integration tests, and the fuzz target it builds.
struct Beside {
    lint: Option<Background>,
    fuzz: Option<(Background, PathBuf, u64)>,
}

pub(crate) fn run(ctx: &Ctx, args: &TestArgs) -> Result<()> {
    let gym_venv = !args.no_gym_venv;
    // The venvs and system packages are mostly downloads: they install while cargo builds,
    // and are joined before the integration tests need them.
    let (built, beside) = std::thread::scope(|scope| {
        let environment = scope.spawn(|| -> Result<()> {
            setup::environment(ctx, gym_venv)?;
            if !args.no_phoenix {
                setup::trace_ui(ctx, true)?;
            }
            Ok(())
        });
        let built = build_and_unit_test(ctx, args);
        let environment = environment
            .join()
            .unwrap_or_else(|_| Err(anyhow!("the environment setup panicked")));
        environment.and(built)
    })?;
    let Some(built) = built else {
        return Ok(());
    };
    integration_tests(ctx, args, &built)?;
    if let Some(lint) = beside.lint {
        lint.finish(lint::CLIPPY_HINT)?;
    }
    if let Some((build, binary, seconds)) = beside.fuzz {
        build.finish(fuzz::BUILD_HINT)?;
        fuzz::fuzz_for(ctx, &binary, seconds)?;
    }
    Ok(())
}

/// The toolchain and the unit tests; unless `--unit-only`, beside them the release build (the
/// wheel's: neither build keeps both CPUs busy throughout), and what runs beside the
/// integration tests.
fn build_and_unit_test(ctx: &Ctx, args: &TestArgs) -> Result<(Option<Built>, Beside)> {
    setup::toolchain(ctx)?;
    let mut beside = Beside {
        lint: None,
        fuzz: None,
    };
    if args.unit_only {
        unit_tests(ctx)?;
        return Ok((None, beside));
    }
    require_root("the integration tests load", "test")?;
    // Started now, they get the CPU whenever a build or a test leaves one idle. Each has a
    // target directory of its own: cargo locks one per build.
    let logs = ctx.root.join("target/logs");
    std::fs::create_dir_all(&logs)?;
    if args.lint {
        let mut clippy = lint::clippy(ctx);
        clippy.env("CARGO_TARGET_DIR", ctx.root.join("target/lint"));
        beside.lint = Some(Background::start(
            "clippy",
            &clippy,
            logs.join("clippy.log"),
        )?);
    }
    if let Some(seconds) = args.fuzz_seconds {
        let (build, binary) = fuzz::build_command(ctx, true)?;
        let background = Background::start(
            "the fuzz target's build",
            &build,
            logs.join("fuzz-build.log"),
        )?;
        beside.fuzz = Some((background, binary, seconds));
    }
    let wheel_log = logs.join("wheel.log");
    let (wheel, unit) = std::thread::scope(|scope| {
        let wheel = scope.spawn(|| {
            println!(
                "xtask: building the wheel beside the unit tests (log: {})",
                wheel_log.display()
            );
            wheel::build(ctx, Some(&wheel_log))
        });
        let unit = unit_tests(ctx);
        let wheel = wheel
            .join()
            .unwrap_or_else(|_| Err(anyhow!("the wheel build panicked")));
        (wheel, unit)
    });
    unit?;
    // The wheel's build is the release build: the tests run the binary it ships.
    let wheel::Wheel { wheel, binary } = wheel?;
    println!("xtask: built {} and {}", wheel.display(), binary.display());
    let built = Built {
        agent: binary,
        examples: build::tested_examples(ctx)?,
        wheel,
    };
    Ok((Some(built), beside))
}

fn unit_tests(ctx: &Ctx) -> Result<()> {
    println!("xtask: running the unit tests");
    run_checked(
        ctx.cmd("cargo")
            .args(["test", "--workspace", "--exclude", "tracer-ebpf"]),
        "unit tests failed: see the failures above",
    )?;
    println!("xtask: unit tests passed");
    Ok(())
}

fn integration_tests(ctx: &Ctx, args: &TestArgs, built: &Built) -> Result<()> {
    println!(
        "xtask: running the integration tests against {}",
        built.agent.display()
    );
    let mut cmd = Command::new(ctx.venv_python());
    cmd.env("PATH", &ctx.path)
        .current_dir(&ctx.root)
        .env("GYM_TRACER_BIN", &built.agent)
        .env("GYM_PIPELINE_COST_BIN", &built.examples.pipeline_cost)
        .env("GYM_SYSCALL_FLOOR_BIN", &built.examples.syscall_floor)
        .env("GYM_TRACER_WHEEL", &built.wheel)
        .env("PYTHONUNBUFFERED", "1")
        .args(["-m", "pytest"])
        .arg(ctx.root.join("tests"))
        // The slowest tests, timed, at the end of the log: what the next change costs CI.
        .args(["-v", "-rA", "--durations=40"])
        .args(&args.pytest_args);
    // tests/test_real_gym.py runs the real servers from this venv; it skips only when told
    // the venv was left out on purpose, and fails when it is missing otherwise.
    if args.no_gym_venv {
        cmd.env("GYM_REAL_VENV_SKIPPED", "cargo xtask test --no-gym-venv");
    } else {
        cmd.env("GYM_REAL_VENV", ctx.gym_venv())
            .env_remove("GYM_REAL_VENV_SKIPPED");
    }
    // tests/test_backend.py exports to Phoenix from this venv, on the same terms.
    if args.no_phoenix {
        cmd.env("GYM_PHOENIX_SKIPPED", "cargo xtask test --no-phoenix");
    } else {
        cmd.env("GYM_PHOENIX_VENV", ctx.phoenix_venv())
            .env_remove("GYM_PHOENIX_SKIPPED");
    }
    run_checked(
        &mut cmd,
        "integration tests failed: see the pytest report above (rerun one with \
         `sudo -E cargo xtask test -- -k NAME`)",
    )?;
    println!("xtask: integration tests passed");
    Ok(())
}
