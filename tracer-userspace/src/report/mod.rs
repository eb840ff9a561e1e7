//! The batch report: one self-contained HTML page about a batch of rollouts — how long they
//! took and why the tail is long, which servers queued, where tokens went, what failed —
//! from the agent's JSON-lines output (`gym-tracer report`) or from what a run exported
//! (`run --report`).
//!
//! ```text
//!  JSON lines ─┐                        ┌─ charts (plotters → SVG)
//!              ├─▶ input ─▶ batch ─▶ page
//!  run's spans ┘  (keep,    (aggregate,
//!                  dedupe)   sample)
//! ```
//!
//! The charts are drawn by `plotters` into inline SVG: a Rust crate (no JavaScript to vendor,
//! nothing fetched, no console to go wrong), vector output that stays sharp and small, and a
//! backend that needs no fonts. What keeps the page small at any scale is in [`batch`].

pub mod batch;
pub mod charts;
pub mod input;
pub mod page;

use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, Result};

use crate::config::cli::ReportArgs;
use crate::model::service::ServiceIdentity;
use crate::model::span::SpanRecord;
use batch::Batch;
use input::{Input, Server};
use page::PageOptions;

pub use crate::config::cli::DEFAULT_SLOWEST;

/// What was written.
#[derive(Debug)]
pub struct Written {
    pub rollouts: usize,
    pub failed: usize,
    pub spans: usize,
    pub bytes: usize,
    pub seconds: f64,
}

/// `gym-tracer report`.
pub fn run(args: &ReportArgs) -> Result<bool> {
    let started = Instant::now();
    let input = Input::read_files(&args.inputs)?;
    let skipped = input.skipped.clone();
    let written = write(
        input,
        args.slowest,
        args.trace_url.clone(),
        &args.output,
        started,
    )?;
    eprintln!("{}", describe(&written, &args.output, &skipped));
    Ok(true)
}

/// Builds the page from `input` and writes it to `path`.
pub fn write(
    input: Input,
    slowest: usize,
    trace_url: Option<String>,
    path: &Path,
    started: Instant,
) -> Result<Written> {
    let batch = Batch::build(input, slowest);
    let options = PageOptions {
        trace_url,
        generated: now_utc(),
    };
    let html = page::render(&batch, &options);
    std::fs::write(path, &html)
        .with_context(|| format!("cannot write the report to {}", path.display()))?;
    Ok(Written {
        rollouts: batch.numbers.rollouts,
        failed: batch.numbers.failed.values().sum(),
        spans: batch.spans,
        bytes: html.len(),
        seconds: started.elapsed().as_secs_f64(),
    })
}

/// The line `report` and `run --report` end with: what the page holds and what was left out.
pub fn describe(written: &Written, path: &Path, skipped: &input::Skipped) -> String {
    let mut line = format!(
        "gym-tracer: wrote {} ({} KB, {:.1} s): {} rollouts ({} failed), {} spans",
        path.display(),
        written.bytes.div_ceil(1024),
        written.seconds,
        written.rollouts,
        written.failed,
        written.spans
    );
    if skipped.lines() > 0 {
        let reasons: Vec<String> = skipped
            .by_reason
            .iter()
            .map(|(reason, count)| format!("{count} {reason}"))
            .collect();
        line.push_str(&format!(
            "; {} lines skipped ({}), first: {}",
            skipped.lines(),
            reasons.join(", "),
            skipped.examples.join("; ")
        ));
    }
    if skipped.duplicate_spans > 0 {
        line.push_str(&format!(
            "; {} spans given more than once, counted once",
            skipped.duplicate_spans
        ));
    }
    if skipped.spans_over_bound > 0 {
        line.push_str(&format!(
            "; {} spans past the memory bound left out",
            skipped.spans_over_bound
        ));
    }
    if written.rollouts == 0 {
        line.push_str("; no gym.rollout span in the input");
    }
    line
}

/// `run --report`: what the running agent exports, kept for the page it writes at exit.
pub struct RunReport {
    input: Input,
    path: PathBuf,
    trace_url: Option<String>,
}

impl RunReport {
    pub fn new(path: PathBuf, trace_url: Option<String>) -> Self {
        let mut input = Input::default();
        input.sources.push(("gym-tracer run".to_owned(), 0));
        Self {
            input,
            path,
            trace_url,
        }
    }

    pub fn add_spans(&mut self, spans: &[SpanRecord]) {
        for span in spans {
            self.input.add_record(span);
        }
    }

    /// The share of the last second `service`'s event loop was busy.
    pub fn add_loop_load(&mut self, service: &ServiceIdentity, share: f64) {
        let now_ns = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        self.input
            .add_loop_point(Server::of(service), now_ns, share);
    }

    /// Writes the page (at exit).
    pub fn finish(self) -> Result<String> {
        let skipped = self.input.skipped.clone();
        let written = write(self.input, 10, self.trace_url, &self.path, Instant::now())?;
        Ok(describe(&written, &self.path, &skipped))
    }
}

fn now_utc() -> String {
    let seconds = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rest) = (seconds / 86_400, seconds % 86_400);
    let (year, month, day) = civil_from_days(days as i64);
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02} UTC",
        rest / 3600,
        rest % 3600 / 60
    )
}

/// Days since 1970-01-01 to a proleptic Gregorian date (Howard Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dates_are_civil() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(20_792), (2026, 12, 5));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
    }
}
