//! `cargo xtask fuzz`: the libFuzzer target `http_reassembly` for a bounded time, and the
//! committed corpus grown only by inputs that reach new code.
//!
//! The target is built by cargo directly, with the flags `cargo fuzz` would give it (coverage
//! instrumentation, `--cfg fuzzing`, debug assertions, AddressSanitizer), and run as the
//! libFuzzer binary it is: nothing to install first, which on a fresh CI machine saved the
//! minutes `cargo install cargo-fuzz` took. Unlike `cargo fuzz`, it keeps the release
//! profile's codegen units: a faster build, for a fuzzer somewhat slower per input.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result};

use crate::command::run_checked;
use crate::ctx::Ctx;
use crate::setup;

#[derive(clap::Args)]
pub(crate) struct FuzzArgs {
    /// How long to fuzz.
    #[arg(long, default_value_t = 60)]
    seconds: u64,
    /// Build without AddressSanitizer: faster, still catches panics, overflows (debug
    /// assertions are on), leaks of time and memory.
    #[arg(long)]
    no_sanitizer: bool,
    /// Afterwards, add to fuzz/corpus/http_reassembly the new inputs that reach at least
    /// 4 coverage edges the committed corpus does not (so it stays small).
    #[arg(long)]
    update_corpus: bool,
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

/// What `cargo fuzz build` passes to rustc (cargo-fuzz's `project.rs`), but its single
/// codegen unit.
const COVERAGE_RUSTFLAGS: &[&str] = &[
    "-Cpasses=sancov-module",
    "-Cllvm-args=-sanitizer-coverage-level=4",
    "-Cllvm-args=-sanitizer-coverage-inline-8bit-counters",
    "-Cllvm-args=-sanitizer-coverage-pc-table",
    "-Cllvm-args=-sanitizer-coverage-trace-compares",
    "-Cllvm-args=-sanitizer-coverage-stack-depth",
    "-Cllvm-args=-simplifycfg-branch-fold-threshold=0",
    "--cfg",
    "fuzzing",
    "-Clink-dead-code",
    "-Cdebug-assertions",
];

pub(crate) fn run(ctx: &Ctx, args: &FuzzArgs) -> Result<()> {
    let FuzzArgs {
        seconds,
        no_sanitizer,
        update_corpus,
    } = *args;
    let (mut build, binary) = build_command(ctx, !no_sanitizer)?;
    run_checked(&mut build, BUILD_HINT)?;
    fuzz_for(ctx, &binary, seconds)?;
    if update_corpus {
        let fuzz_dir = ctx.root.join("fuzz");
        let scratch = fuzz_dir.join("target/corpus").join(FUZZ_TARGET);
        let committed = fuzz_dir.join("corpus").join(FUZZ_TARGET);
        update_corpus_from(&binary, &fuzz_dir, &committed, &scratch)?;
    }
    Ok(())
}

pub(crate) const BUILD_HINT: &str = "the fuzz target did not build: see the errors above (it \
                                     needs the nightly toolchain: `cargo xtask setup`)";

/// Runs the built target for `seconds` from the committed corpus; a failing input fails.
pub(crate) fn fuzz_for(ctx: &Ctx, binary: &Path, seconds: u64) -> Result<()> {
    let fuzz_dir = ctx.root.join("fuzz");
    let committed = fuzz_dir.join("corpus").join(FUZZ_TARGET);
    // New inputs go to a scratch corpus, so a run leaves the committed one as it was.
    let scratch = fuzz_dir.join("target/corpus").join(FUZZ_TARGET);
    let artifacts = fuzz_dir.join("artifacts").join(FUZZ_TARGET);
    for dir in [&scratch, &artifacts] {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    println!(
        "xtask: fuzzing {FUZZ_TARGET} for {seconds} s (new inputs in {}; finds in {})",
        scratch.display(),
        artifacts.display()
    );
    let mut fuzz = Command::new(binary);
    fuzz.current_dir(&fuzz_dir)
        .env("ASAN_OPTIONS", "detect_odr_violation=0")
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg(&scratch)
        .arg(&committed)
        .args([
            format!("-max_total_time={seconds}"),
            format!("-timeout={FUZZ_TIMEOUT_SECONDS}"),
            format!("-rss_limit_mb={FUZZ_RSS_LIMIT_MB}"),
            format!("-max_len={FUZZ_MAX_LEN}"),
            // How many inputs ran, and how fast, at the end of the log.
            "-print_final_stats=1".to_string(),
        ]);
    run_checked(
        &mut fuzz,
        &format!(
            "the fuzzer found a failing input (saved under fuzz/artifacts/{FUZZ_TARGET}/; replay \
             it with `{} <file>`): fix the bug, add a regression test, then rerun",
            binary.display()
        ),
    )?;
    println!("xtask: fuzzing found nothing in {seconds} s");
    Ok(())
}

/// The build of the instrumented target with nightly (sanitizers need it), and the binary
/// it makes. `--target` keeps the flags off build scripts and proc macros, as cargo-fuzz
/// does.
pub(crate) fn build_command(ctx: &Ctx, sanitizer: bool) -> Result<(Command, PathBuf)> {
    setup::ensure_nightly(ctx)?;
    let host = ctx.host_triple(&["+nightly"])?;
    let mut rustflags = COVERAGE_RUSTFLAGS.join(" ");
    if sanitizer {
        rustflags.push_str(" -Zsanitizer=address");
    }
    println!(
        "xtask: building the fuzz target {FUZZ_TARGET} (nightly, release, coverage{})",
        if sanitizer { ", AddressSanitizer" } else { "" }
    );
    let fuzz_dir = ctx.root.join("fuzz");
    let mut cmd = ctx.cmd("cargo");
    cmd.current_dir(&fuzz_dir)
        // The target never loads eBPF: skip building it (see tracer-userspace/build.rs).
        .env("AYA_BUILD_SKIP", "1")
        .env("RUSTFLAGS", rustflags)
        .args(["+nightly", "build", "--release", "--bin", FUZZ_TARGET])
        .args(["--target", &host]);
    let binary = fuzz_dir
        .join("target")
        .join(host)
        .join("release")
        .join(FUZZ_TARGET);
    Ok((cmd, binary))
}

/// A new input joins the committed corpus only if it reaches this many coverage edges the
/// corpus does not: the long tail of inputs that each add one or two (formatting branches,
/// hash-order differences) would make it hundreds of files.
const CORPUS_MIN_NEW_EDGES: u64 = 4;

/// Adds to `committed` the scratch inputs that reach new code: libFuzzer's edge-only set
/// cover picks candidates, then each is kept, best first, if it adds
/// [`CORPUS_MIN_NEW_EDGES`] to what is kept already.
fn update_corpus_from(
    binary: &Path,
    fuzz_dir: &Path,
    committed: &Path,
    scratch: &Path,
) -> Result<()> {
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
        Command::new(binary)
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
        let out = Command::new(binary)
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
