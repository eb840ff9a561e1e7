//! `gym-tracer replay FILE`: a recording (`run --record FILE`) fed to a fresh pipeline core,
//! the spans printed as JSON lines, what the core counted on stderr. No kernel, no
//! privileges: what the agent made of a run's traffic, again, on any machine.

use std::io::Write;
use std::time::Instant;

use anyhow::Context;

use crate::config::cli::ReplayArgs;
use crate::export::json::write_lines;
use crate::model::counters::Counters;
use crate::pipeline::Pipeline;
use crate::pipeline::recording::{Input, Recording};

pub fn run(args: &ReplayArgs) -> anyhow::Result<bool> {
    let path = &args.recording;
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let recording = Recording::parse(&bytes).with_context(|| path.display().to_string())?;
    let mut pipeline = Pipeline::new(recording.config.pipeline_config(), ());
    let mut stdout = std::io::stdout().lock();
    let mut text = Vec::new();
    let mut spans = 0;
    let mut written = Ok(());
    recording.feed(&mut pipeline, Instant::now(), &mut (), |output| {
        if written.is_ok() && !output.released.is_empty() {
            spans += output.released.len();
            text.clear();
            write_lines(&output.released, &mut text);
            written = stdout.write_all(&text);
        }
    });
    written
        .and_then(|()| stdout.flush())
        .context("writing to stdout")?;
    let records = recording
        .entries
        .iter()
        .filter(|(_, input)| matches!(input, Input::Record(_)))
        .count();
    eprintln!(
        "gym-tracer: {records} kernel records replayed from {}: {spans} spans",
        path.display()
    );
    let core = pipeline.counters();
    let stages: [&dyn Counters; 5] = [
        &core.pipeline,
        &core.reassembly,
        &core.tls,
        &core.stitch,
        &core.insight,
    ];
    for stage in stages {
        stage.for_each(&mut |name, value| {
            if value > 0 {
                eprintln!("  {name} {value}");
            }
        });
    }
    Ok(true)
}
