//! `cargo xtask docs`: the generated sections of README.md and docs/*.md, rewritten by the
//! agent itself.

use std::process::Command;

use anyhow::{Context, Result};

use crate::build;
use crate::command::run_checked;
use crate::ctx::Ctx;

pub(crate) fn run(ctx: &Ctx) -> Result<()> {
    let bin = build::agent(ctx, true)?;
    let mut pages = vec![ctx.root.join("README.md")];
    let docs = ctx.root.join("docs");
    for entry in std::fs::read_dir(&docs).with_context(|| format!("reading {}", docs.display()))? {
        let path = entry?.path();
        if path.extension().is_some_and(|ext| ext == "md") {
            pages.push(path);
        }
    }
    run_checked(
        Command::new(&bin)
            .args(["reference", "--update"])
            .args(&pages),
        "regenerating the docs' reference sections failed: see the error above",
    )?;
    println!("xtask: docs/ and README.md are up to date");
    Ok(())
}
