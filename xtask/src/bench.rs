//! `cargo xtask bench`: bench/bench.py against a release build of the agent.

use std::process::Command;

use anyhow::Result;

use crate::command::{require_root, run_checked};
use crate::ctx::Ctx;
use crate::{build, setup};

/// Options of `cargo xtask bench`, passed on to bench/bench.py.
#[derive(clap::Args)]
pub(crate) struct BenchArgs {
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
    /// Only these sections, comma-separated: verify, run, lineage, gym-scale (the real nemo-gym
    /// servers at 256, 1,024 and 4,096 rollouts in flight, about 10 minutes), saturation,
    /// connections, tax, traced-tax, ctx, tls, pipeline.
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

/// Setup (test venv, no real-Gym venv), wrk and a C compiler, the release build, then the
/// driver bench/bench.py with the venv's Python.
pub(crate) fn run(ctx: &Ctx, args: &BenchArgs) -> Result<()> {
    require_root("the bench loads", "bench")?;
    setup::machine(ctx, false)?;
    let bin = build::agent(ctx, true)?;
    let examples = build::bench_examples(ctx)?;
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
        .arg("--pipeline-cost")
        .arg(&examples.pipeline_cost)
        .arg("--syscall-floor")
        .arg(&examples.syscall_floor)
        .args(args.driver_args());
    run_checked(&mut cmd, "the benchmark failed: see its output above")?;
    println!("xtask: benchmark finished; results in target/bench/latest.json");
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::{Cli, Cmd};

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
}
