//! `cargo xtask fuzz`: the cargo-fuzz target `http_reassembly` for a bounded time, and the
//! committed corpus grown only by inputs that reach new code.

use std::fs;
use std::path::Path;
use std::process::Command;

use anyhow::{Context, Result};

use crate::command::{capture, run_checked};
use crate::ctx::Ctx;
use crate::setup;

#[derive(clap::Args)]
pub(crate) struct FuzzArgs {
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

pub(crate) fn run(ctx: &Ctx, args: &FuzzArgs) -> Result<()> {
    let FuzzArgs {
        seconds,
        no_sanitizer,
        update_corpus,
    } = *args;
    setup::ensure_nightly(ctx)?;
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
        if no_sanitizer {
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
            // How many inputs ran, and how fast, at the end of the log.
            "-print_final_stats=1",
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
