//! A batch of rollouts, aggregated from the spans read: the figures, distributions and series
//! the page draws. Pure: [`Input`] in, [`Batch`] out.
//!
//! What is sampled, so that the page stays small at any scale: durations go into
//! [`HISTOGRAM_BINS`] bins; rollouts in flight, queue delays and loop load into at most
//! [`TIME_BUCKETS`] points per line (the maximum in flight, the p90 delay, the mean load of
//! each bucket); only the slowest rollouts get a timeline, each of at most
//! [`TIMELINE_ROWS`] spans of its critical path (the ones holding most of it).

use std::collections::BTreeMap;

use foldhash::{HashMap, HashMapExt};

use super::input::{Input, ReportSpan, Server, Skipped};
use crate::insight::critical_path::{self, PathSpan, SpanClass};
use crate::model::rollout::{PerPhase, Phase};
use crate::model::span::SpanKind;

pub const HISTOGRAM_BINS: usize = 40;
pub const TIME_BUCKETS: usize = 300;
pub const TIMELINE_ROWS: usize = 24;
/// Rollouts named per failure row at most.
const FAILED_ROLLOUTS_NAMED: usize = 12;

/// How a rollout ended, as its `/run` answered and its calls went.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Succeeded,
    /// `/run` answered, but a request below it failed: e.g. a judge call, which Gym's
    /// `judge_failsafe` turns into reward 0.0 and a row in the failures file.
    CallFailed,
    /// `/run` answered `status` (`None`: it ended in an error with no status, or its
    /// `gym.rollout` span says so).
    Failed {
        status: Option<u16>,
    },
}

#[derive(Clone, Debug)]
pub struct Rollout {
    /// `nemo.gym.rollout.id`, or `trace <id>` for a rollout whose `/run` named none.
    pub id: String,
    pub trace_id: u128,
    /// Its `gym.rollout` span, in the input.
    pub span: usize,
    pub agent: u32,
    pub start_ns: u64,
    pub end_ns: u64,
    pub phases_ms: Option<PerPhase<u64>>,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub model_calls: Option<i64>,
    pub tool_calls: Option<i64>,
    pub straggler: bool,
    pub outcome: Outcome,
}

impl Rollout {
    pub fn duration_ns(&self) -> u64 {
        self.end_ns - self.start_ns
    }
}

/// The batch in numbers. Quantiles are nearest-rank over every rollout's duration.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Numbers {
    pub rollouts: usize,
    pub succeeded: usize,
    /// Answered, a request below failed ([`Outcome::CallFailed`]).
    pub call_failed: usize,
    /// By `/run`'s status (`None`: no status).
    pub failed: BTreeMap<Option<u16>, usize>,
    pub p50_ns: u64,
    pub p90_ns: u64,
    pub p99_ns: u64,
    pub max_ns: u64,
    pub input_tokens: i64,
    pub output_tokens: i64,
    pub per_minute: f64,
    pub stragglers: usize,
    /// From the first rollout's start to the last one's end.
    pub wall_ns: u64,
}

/// One stacked bar: a rollout's phases.
#[derive(Clone, Debug)]
pub struct PhaseBar {
    /// `p50`, `p90`, `p99`, `slowest`.
    pub rank: &'static str,
    pub rollout: usize,
    pub phases_ms: PerPhase<u64>,
}

/// A line over the batch's time: (seconds since the first rollout started, value).
#[derive(Clone, Debug)]
pub struct Series {
    pub server: u32,
    pub points: Vec<(f64, f64)>,
}

/// One row of a slow rollout's timeline: a span on its critical path.
#[derive(Clone, Debug)]
pub struct TimelineRow {
    pub label: String,
    pub start_ns: u64,
    pub end_ns: u64,
    /// Its own stretches of the path.
    pub segments: Vec<(Phase, u64, u64)>,
}

#[derive(Clone, Debug)]
pub struct Timeline {
    pub rollout: usize,
    pub rows: Vec<TimelineRow>,
    /// Spans of the path not drawn ([`TIMELINE_ROWS`]).
    pub rows_left_out: usize,
    /// The path's time per phase, ns (sums to the rollout's duration when it is whole).
    pub phases_ns: PerPhase<u64>,
}

/// Requests that failed at one server and route with one status.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct FailureKey {
    pub server: u32,
    pub kind: &'static str,
    /// `http.route`, else the span's name.
    pub route: String,
    pub status: Option<u16>,
}

#[derive(Clone, Debug, Default)]
pub struct Failures {
    pub requests: u64,
    /// Ids of the rollouts they were part of (the first [`FAILED_ROLLOUTS_NAMED`]).
    pub rollouts: Vec<String>,
    pub rollouts_total: usize,
    /// Requests whose rollout the evidence does not name (no parent chain up to a
    /// `gym.rollout`, no rollout id of their own): not guessed.
    pub untied: u64,
}

#[derive(Debug)]
pub struct Batch {
    pub servers: Vec<Server>,
    /// By duration, shortest first.
    pub rollouts: Vec<Rollout>,
    pub numbers: Numbers,
    pub t0_ns: u64,
    /// (bin start s, bin end s, rollouts).
    pub histogram: Vec<(f64, f64, u64)>,
    pub phase_bars: Vec<PhaseBar>,
    /// Over every rollout with phases: ms per phase.
    pub phase_totals_ms: PerPhase<u64>,
    pub in_flight: Vec<(f64, f64)>,
    /// p90 queue delay (s) of the calls each server received, per bucket.
    pub queue_delay: Vec<Series>,
    pub loop_load: Vec<Series>,
    pub timelines: Vec<Timeline>,
    pub failures: BTreeMap<FailureKey, Failures>,
    pub spans: usize,
    pub skipped: Skipped,
    pub sources: Vec<(String, u64)>,
}

impl Batch {
    /// Aggregates `input`; the `slowest` rollouts get a timeline each.
    pub fn build(input: Input, slowest: usize) -> Batch {
        let by_id: HashMap<(u128, u64), usize> = input
            .spans
            .iter()
            .enumerate()
            .map(|(index, span)| ((span.trace_id, span.span_id), index))
            .collect();
        let failed = failed_requests(&input.spans, &by_id);
        let failed_below: foldhash::HashSet<usize> = failed
            .iter()
            .filter(|request| !request.is_run)
            .filter_map(|request| request.rollout)
            .collect();
        let mut rollouts = rollouts(&input.spans, &by_id, &failed_below);
        rollouts.sort_by_key(|r| (r.duration_ns(), r.start_ns));
        let t0_ns = rollouts.iter().map(|r| r.start_ns).min().unwrap_or(0);
        let t1_ns = rollouts.iter().map(|r| r.end_ns).max().unwrap_or(t0_ns);
        let clock = Clock::new(t0_ns, t1_ns);
        let numbers = numbers(&rollouts);
        let mut by_trace: HashMap<u128, Vec<usize>> = HashMap::new();
        for (index, span) in input.spans.iter().enumerate() {
            by_trace.entry(span.trace_id).or_default().push(index);
        }
        let timelines = (0..rollouts.len())
            .rev()
            .take(slowest)
            .map(|index| timeline(index, &rollouts[index], &input, &by_trace))
            .collect();
        Batch {
            histogram: histogram(&rollouts),
            phase_bars: phase_bars(&rollouts),
            phase_totals_ms: phase_totals(&rollouts),
            in_flight: in_flight(&rollouts, &clock),
            queue_delay: queue_delay(&input.spans, &by_id, &clock),
            loop_load: loop_load(&input, &clock),
            failures: failures(&input.spans, &failed, &rollouts),
            timelines,
            numbers,
            t0_ns,
            spans: input.spans.len(),
            servers: input.servers,
            skipped: input.skipped,
            sources: input.sources,
            rollouts,
        }
    }

    pub fn server_name(&self, server: u32) -> &str {
        self.servers
            .get(server as usize)
            .map_or("?", |s| s.name.as_str())
    }
}

/// Maps times to the batch's buckets.
struct Clock {
    t0_ns: u64,
    span_ns: u64,
}

impl Clock {
    fn new(t0_ns: u64, t1_ns: u64) -> Self {
        Self {
            t0_ns,
            span_ns: t1_ns.saturating_sub(t0_ns).max(1),
        }
    }

    fn bucket(&self, time_ns: u64) -> usize {
        let offset = time_ns.saturating_sub(self.t0_ns).min(self.span_ns - 1);
        (offset as u128 * TIME_BUCKETS as u128 / self.span_ns as u128) as usize
    }

    /// The start of `bucket`, in seconds since t0.
    fn seconds(&self, bucket: usize) -> f64 {
        bucket as f64 * self.span_ns as f64 / TIME_BUCKETS as f64 / 1e9
    }
}

/// The `gym.rollout` span a span is below (walking up its parents), or whose `/run` it is.
fn rollout_of(
    spans: &[ReportSpan],
    by_id: &HashMap<(u128, u64), usize>,
    runs: &HashMap<(u128, u64), usize>,
    span: usize,
) -> Option<usize> {
    let mut at = span;
    for _ in 0..MAX_DEPTH {
        let current = &spans[at];
        if current.is_rollout() {
            return Some(at);
        }
        if let Some(&rollout) = runs.get(&(current.trace_id, current.span_id)) {
            return Some(rollout);
        }
        at = *by_id.get(&(current.trace_id, current.parent?))?;
    }
    None
}

/// Deep enough for any rollout Gym makes; a deeper chain of parents is a loop.
const MAX_DEPTH: usize = 64;

/// `/run` SERVER spans by id: the `gym.rollout` span below each.
fn runs(spans: &[ReportSpan]) -> HashMap<(u128, u64), usize> {
    spans
        .iter()
        .enumerate()
        .filter(|(_, span)| span.is_rollout())
        .filter_map(|(index, span)| Some(((span.trace_id, span.parent?), index)))
        .collect()
}

/// A failed request (status ERROR; not a `gym.rollout` span), with the `gym.rollout` span it
/// belongs to where its parents or its `/run` say: walked once, for the rollouts' outcomes
/// and for the failure table.
struct FailedRequest {
    span: usize,
    rollout: Option<usize>,
    /// It is its rollout's own `/run` (that one fails the rollout, not a call inside it).
    is_run: bool,
}

fn failed_requests(
    spans: &[ReportSpan],
    by_id: &HashMap<(u128, u64), usize>,
) -> Vec<FailedRequest> {
    let runs = runs(spans);
    spans
        .iter()
        .enumerate()
        .filter(|(_, span)| span.error && !span.is_rollout())
        .map(|(index, span)| FailedRequest {
            span: index,
            rollout: rollout_of(spans, by_id, &runs, index),
            is_run: runs.contains_key(&(span.trace_id, span.span_id)),
        })
        .collect()
}

fn rollouts(
    spans: &[ReportSpan],
    by_id: &HashMap<(u128, u64), usize>,
    failed_below: &foldhash::HashSet<usize>,
) -> Vec<Rollout> {
    spans
        .iter()
        .enumerate()
        .filter_map(|(index, span)| {
            let facts = span.rollout.as_ref()?;
            // Its /run: the SERVER span it hangs under.
            let run = span
                .parent
                .and_then(|parent| by_id.get(&(span.trace_id, parent)))
                .map(|&index| &spans[index])
                .filter(|parent| parent.kind == SpanKind::Server);
            let run_failed = run.is_some_and(|run| run.error || run.status_code >= Some(400));
            let outcome = if run_failed || span.error {
                Outcome::Failed {
                    status: run.and_then(|run| run.status_code),
                }
            } else if failed_below.contains(&index) {
                Outcome::CallFailed
            } else {
                Outcome::Succeeded
            };
            Some(Rollout {
                id: span
                    .rollout_id
                    .as_deref()
                    .map_or_else(|| format!("trace {:032x}", span.trace_id), str::to_owned),
                trace_id: span.trace_id,
                span: index,
                agent: span.server,
                start_ns: span.start_ns,
                end_ns: span.end_ns,
                phases_ms: facts.phases_ms,
                input_tokens: span.input_tokens.unwrap_or(0),
                output_tokens: span.output_tokens.unwrap_or(0),
                model_calls: facts.model_calls,
                tool_calls: facts.tool_calls,
                straggler: facts.straggler,
                outcome,
            })
        })
        .collect()
}

/// Nearest rank: the smallest value at least `q` of the values are at or below.
pub fn nearest_rank(count: usize, q: f64) -> usize {
    ((q * count as f64).ceil() as usize).clamp(1, count.max(1)) - 1
}

fn numbers(rollouts: &[Rollout]) -> Numbers {
    let Some(last) = rollouts.last() else {
        return Numbers::default();
    };
    let at = |q| rollouts[nearest_rank(rollouts.len(), q)].duration_ns();
    let mut failed = BTreeMap::new();
    let mut call_failed = 0;
    for rollout in rollouts {
        match rollout.outcome {
            Outcome::Failed { status } => *failed.entry(status).or_default() += 1,
            Outcome::CallFailed => call_failed += 1,
            Outcome::Succeeded => {}
        }
    }
    let start = rollouts.iter().map(|r| r.start_ns).min().unwrap_or(0);
    let end = rollouts.iter().map(|r| r.end_ns).max().unwrap_or(0);
    let wall_ns = end.saturating_sub(start);
    Numbers {
        rollouts: rollouts.len(),
        succeeded: rollouts.len() - failed.values().sum::<usize>() - call_failed,
        call_failed,
        failed,
        p50_ns: at(0.5),
        p90_ns: at(0.9),
        p99_ns: at(0.99),
        max_ns: last.duration_ns(),
        input_tokens: rollouts.iter().map(|r| r.input_tokens).sum(),
        output_tokens: rollouts.iter().map(|r| r.output_tokens).sum(),
        per_minute: rollouts.len() as f64 / (wall_ns.max(1) as f64 / 60e9),
        stragglers: rollouts.iter().filter(|r| r.straggler).count(),
        wall_ns,
    }
}

fn histogram(rollouts: &[Rollout]) -> Vec<(f64, f64, u64)> {
    let Some(max_ns) = rollouts.last().map(Rollout::duration_ns) else {
        return Vec::new();
    };
    let width_ns = (max_ns / HISTOGRAM_BINS as u64).max(1);
    let mut counts = [0u64; HISTOGRAM_BINS];
    for rollout in rollouts {
        let bin = (rollout.duration_ns() / width_ns).min(HISTOGRAM_BINS as u64 - 1);
        counts[bin as usize] += 1;
    }
    counts
        .iter()
        .enumerate()
        .map(|(bin, &count)| {
            let start = bin as f64 * width_ns as f64 / 1e9;
            let end = if bin == HISTOGRAM_BINS - 1 {
                (max_ns as f64 / 1e9).max(start + width_ns as f64 / 1e9)
            } else {
                start + width_ns as f64 / 1e9
            };
            (start, end, count)
        })
        .collect()
}

fn phase_bars(rollouts: &[Rollout]) -> Vec<PhaseBar> {
    if rollouts.is_empty() {
        return Vec::new();
    }
    let n = rollouts.len();
    [("p50", 0.5), ("p90", 0.9), ("p99", 0.99)]
        .into_iter()
        .map(|(rank, q)| (rank, nearest_rank(n, q)))
        .chain([("slowest", n - 1)])
        .filter_map(|(rank, rollout)| {
            Some(PhaseBar {
                rank,
                rollout,
                phases_ms: rollouts[rollout].phases_ms?,
            })
        })
        .collect()
}

fn phase_totals(rollouts: &[Rollout]) -> PerPhase<u64> {
    let mut totals = [0u64; Phase::COUNT];
    for phases in rollouts.iter().filter_map(|r| r.phases_ms) {
        for (total, ms) in totals.iter_mut().zip(phases) {
            *total += ms;
        }
    }
    totals
}

/// The most rollouts in flight at once within each bucket.
fn in_flight(rollouts: &[Rollout], clock: &Clock) -> Vec<(f64, f64)> {
    if rollouts.is_empty() {
        return Vec::new();
    }
    let mut events: Vec<(u64, i64)> = rollouts
        .iter()
        .flat_map(|r| [(r.start_ns, 1), (r.end_ns, -1)])
        .collect();
    // Ends before starts at one instant: a rollout that ends as another starts is not
    // two in flight.
    events.sort_unstable();
    let mut most = vec![0i64; TIME_BUCKETS];
    let mut now = 0i64;
    let mut last_bucket = 0;
    for (time, change) in events {
        let bucket = clock.bucket(time);
        // The level held through the buckets no event fell in.
        for level in most.iter_mut().take(bucket + 1).skip(last_bucket + 1) {
            *level = (*level).max(now);
        }
        now += change;
        most[bucket] = most[bucket].max(now);
        last_bucket = bucket;
    }
    most.iter()
        .enumerate()
        .map(|(bucket, &level)| (clock.seconds(bucket), level as f64))
        .collect()
}

/// Per server, the p90 of how long the calls it received waited before it read them (from
/// the caller's CLIENT span start to the SERVER span's start), per bucket of call start.
fn queue_delay(
    spans: &[ReportSpan],
    by_id: &HashMap<(u128, u64), usize>,
    clock: &Clock,
) -> Vec<Series> {
    let mut delays: BTreeMap<u32, BTreeMap<usize, Vec<u64>>> = BTreeMap::new();
    for span in spans.iter().filter(|s| s.kind == SpanKind::Server) {
        let Some(caller) = span
            .parent
            .and_then(|parent| by_id.get(&(span.trace_id, parent)))
            .map(|&index| &spans[index])
            .filter(|caller| caller.kind == SpanKind::Client)
        else {
            continue;
        };
        delays
            .entry(span.server)
            .or_default()
            .entry(clock.bucket(caller.start_ns))
            .or_default()
            .push(span.start_ns.saturating_sub(caller.start_ns));
    }
    delays
        .into_iter()
        .map(|(server, buckets)| Series {
            server,
            points: buckets
                .into_iter()
                .map(|(bucket, mut values)| {
                    values.sort_unstable();
                    let p90 = values[nearest_rank(values.len(), 0.9)];
                    (clock.seconds(bucket), p90 as f64 / 1e9)
                })
                .collect(),
        })
        .collect()
}

/// Per server, the mean event-loop load of each bucket (0..=1).
fn loop_load(input: &Input, clock: &Clock) -> Vec<Series> {
    let mut sums: BTreeMap<u32, BTreeMap<usize, (f64, u32)>> = BTreeMap::new();
    for point in &input.loop_points {
        let (sum, count) = sums
            .entry(point.server)
            .or_default()
            .entry(clock.bucket(point.time_ns))
            .or_default();
        *sum += point.share;
        *count += 1;
    }
    sums.into_iter()
        .map(|(server, buckets)| Series {
            server,
            points: buckets
                .into_iter()
                .map(|(bucket, (sum, count))| (clock.seconds(bucket), sum / f64::from(count)))
                .collect(),
        })
        .collect()
}

/// Failed requests (status ERROR) by server, kind, route and status, with the rollouts they
/// were part of.
fn failures(
    spans: &[ReportSpan],
    failed: &[FailedRequest],
    rollouts: &[Rollout],
) -> BTreeMap<FailureKey, Failures> {
    let id_of: HashMap<usize, &str> = rollouts.iter().map(|r| (r.span, r.id.as_str())).collect();
    let mut failures: BTreeMap<FailureKey, (u64, std::collections::BTreeSet<String>, u64)> =
        BTreeMap::new();
    for request in failed {
        let span = &spans[request.span];
        let key = FailureKey {
            server: span.server,
            kind: span.kind.as_str(),
            route: span.route.as_deref().unwrap_or(&span.name).to_owned(),
            status: span.status_code,
        };
        let (requests, broken, untied) = failures.entry(key).or_default();
        *requests += 1;
        let rollout = request
            .rollout
            .and_then(|rollout| id_of.get(&rollout).copied())
            .or(span.rollout_id.as_deref());
        match rollout {
            Some(rollout) => {
                broken.insert(rollout.to_owned());
            }
            None => *untied += 1,
        }
    }
    failures
        .into_iter()
        .map(|(key, (requests, broken, untied))| {
            let rollouts_total = broken.len();
            let rollouts = broken.into_iter().take(FAILED_ROLLOUTS_NAMED).collect();
            (
                key,
                Failures {
                    requests,
                    rollouts,
                    rollouts_total,
                    untied,
                },
            )
        })
        .collect()
}

/// The critical path of `rollout` (its subtree in its trace), as rows of spans.
fn timeline(
    index: usize,
    rollout: &Rollout,
    input: &Input,
    by_trace: &HashMap<u128, Vec<usize>>,
) -> Timeline {
    let trace = by_trace
        .get(&rollout.trace_id)
        .map_or(&[][..], Vec::as_slice);
    let (tree, members) = critical_path::subtree(
        trace.iter().copied(),
        rollout.span,
        |i| input.spans[i].span_id,
        |i| input.spans[i].parent,
        |i| path_span(&input.spans[i], input),
    );
    let mut rows: BTreeMap<usize, TimelineRow> = BTreeMap::new();
    let mut phases_ns = [0u64; Phase::COUNT];
    for segment in critical_path::segments(&tree, 0) {
        phases_ns[segment.phase as usize] += segment.end_ns - segment.start_ns;
        let span = &input.spans[members[segment.span]];
        rows.entry(segment.span)
            .or_insert_with(|| TimelineRow {
                label: row_label(span, input),
                start_ns: span.start_ns,
                end_ns: span.end_ns,
                segments: Vec::new(),
            })
            .segments
            .push((segment.phase, segment.start_ns, segment.end_ns));
    }
    let mut rows: Vec<TimelineRow> = rows.into_values().collect();
    let drawn = rows.len().min(TIMELINE_ROWS);
    let rows_left_out = rows.len() - drawn;
    if rows_left_out > 0 {
        // The rows that hold most of the path.
        rows.sort_by_key(|row| {
            std::cmp::Reverse(row.segments.iter().map(|(_, s, e)| e - s).sum::<u64>())
        });
        rows.truncate(drawn);
    }
    rows.sort_by_key(|row| (row.start_ns, std::cmp::Reverse(row.end_ns)));
    Timeline {
        rollout: index,
        rows,
        rows_left_out,
        phases_ns,
    }
}

fn path_span(span: &ReportSpan, input: &Input) -> PathSpan {
    let verify = &*span.name == "gym.verify"
        || (span.kind == SpanKind::Server && span.route.as_deref() == Some("/verify"));
    let server_type = input
        .servers
        .get(span.server as usize)
        .and_then(|s| s.server_type);
    PathSpan {
        start_ns: span.start_ns,
        end_ns: span.end_ns,
        class: SpanClass::of(span.kind, server_type, verify, span.peer_traced),
        children: Vec::new(),
    }
}

/// `server · name`, a call's with the path it called.
fn row_label(span: &ReportSpan, input: &Input) -> String {
    let server = short_server(input, span.server);
    match (span.kind, span.route.as_deref()) {
        (SpanKind::Client, Some(path)) => format!("{server} · {} {path}", span.name),
        _ => format!("{server} · {}", span.name),
    }
}

/// A server's name without its service group (`nemo/simple_agent` → `simple_agent`).
pub fn short_server(input: &Input, server: u32) -> &str {
    let name = input
        .servers
        .get(server as usize)
        .map_or("?", |s| s.name.as_str());
    name.rsplit('/').next().unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::input::{Input, ReportSpan, RolloutFacts, Server};

    const MS: u64 = 1_000_000;

    /// A span of trace 1 with `id`, `parent`, `kind`, times in ms, its server, status code
    /// and error flag.
    fn span(
        id: u64,
        parent: Option<u64>,
        kind: SpanKind,
        name: &str,
        (start, end): (u64, u64),
        server: u32,
        status: Option<u16>,
    ) -> ReportSpan {
        ReportSpan {
            trace_id: 1,
            span_id: id,
            parent,
            name: name.into(),
            kind,
            start_ns: start * MS,
            end_ns: end * MS,
            server,
            error: status.is_some_and(|s| s >= 500),
            status_code: status,
            route: None,
            rollout_id: None,
            peer_traced: false,
            input_tokens: None,
            output_tokens: None,
            rollout: None,
        }
    }

    fn rollout(id: u64, run: u64, (start, end): (u64, u64), rollout_id: &str) -> ReportSpan {
        ReportSpan {
            rollout_id: Some(rollout_id.into()),
            input_tokens: Some(10),
            output_tokens: Some(20),
            rollout: Some(Box::new(RolloutFacts {
                phases_ms: Some([end - start, 0, 0, 0, 0, 0]),
                ..RolloutFacts::default()
            })),
            ..span(
                id,
                Some(run),
                SpanKind::Internal,
                "gym.rollout",
                (start, end),
                0,
                None,
            )
        }
    }

    /// Three rollouts: one clean, one whose judge call failed below an answered /run, one
    /// whose /run failed; a failed request no parent ties to a rollout is counted apart.
    #[test]
    fn outcomes_failures_and_figures_come_from_the_spans() {
        let mut input = Input::default();
        input.servers = vec![
            Server {
                name: "nemo/agent".into(),
                server_type: Some(crate::gym::ServerType::Agent),
            },
            Server {
                name: "nemo/judge".into(),
                server_type: Some(crate::gym::ServerType::Model),
            },
        ];
        input.spans = vec![
            span(
                1,
                None,
                SpanKind::Server,
                "POST /run",
                (0, 100),
                0,
                Some(200),
            ),
            rollout(2, 1, (1, 99), "0-0"),
            span(
                10,
                None,
                SpanKind::Server,
                "POST /run",
                (0, 300),
                0,
                Some(200),
            ),
            rollout(11, 10, (1, 299), "0-1"),
            span(
                12,
                Some(11),
                SpanKind::Client,
                "HTTP POST",
                (50, 250),
                0,
                Some(500),
            ),
            span(
                13,
                Some(12),
                SpanKind::Server,
                "POST /v1/responses",
                (60, 240),
                1,
                Some(500),
            ),
            span(
                20,
                None,
                SpanKind::Server,
                "POST /run",
                (0, 200),
                0,
                Some(500),
            ),
            rollout(21, 20, (1, 199), "0-2"),
            span(
                30,
                None,
                SpanKind::Server,
                "POST /v1/responses",
                (5, 6),
                1,
                Some(500),
            ),
        ];
        let batch = Batch::build(input, 2);
        let outcomes: Vec<(&str, Outcome)> = batch
            .rollouts
            .iter()
            .map(|r| (r.id.as_str(), r.outcome.clone()))
            .collect();
        assert_eq!(
            outcomes,
            [
                ("0-0", Outcome::Succeeded),
                ("0-2", Outcome::Failed { status: Some(500) }),
                ("0-1", Outcome::CallFailed),
            ]
        );
        let n = &batch.numbers;
        assert_eq!((n.rollouts, n.succeeded, n.call_failed), (3, 1, 1));
        assert_eq!(n.failed, BTreeMap::from([(Some(500), 1)]));
        assert_eq!((n.p50_ns, n.max_ns), (198 * MS, 298 * MS));
        assert_eq!((n.input_tokens, n.output_tokens), (30, 60));
        let rows: Vec<(&str, &str, Vec<String>, u64)> = batch
            .failures
            .iter()
            .map(|(key, f)| (key.kind, key.route.as_str(), f.rollouts.clone(), f.untied))
            .collect();
        assert_eq!(
            rows,
            [
                ("CLIENT", "HTTP POST", vec!["0-1".to_owned()], 0),
                ("SERVER", "POST /run", vec!["0-2".to_owned()], 0),
                ("SERVER", "POST /v1/responses", vec!["0-1".to_owned()], 1),
            ]
        );
        // The two slowest get timelines; the judge call's path runs through its model server.
        assert_eq!(batch.timelines.len(), 2);
        let slowest = &batch.timelines[0];
        assert_eq!(batch.rollouts[slowest.rollout].id, "0-1");
        assert_eq!(slowest.phases_ns.iter().sum::<u64>(), 298 * MS);
        assert_eq!(slowest.phases_ns[Phase::Model as usize], 180 * MS);
        // Most in flight at once: all three.
        let most = batch.in_flight.iter().map(|p| p.1).fold(0.0, f64::max);
        assert_eq!(most, 3.0);
    }

    #[test]
    fn nearest_rank_picks_the_smallest_value_with_q_at_or_below() {
        assert_eq!(nearest_rank(10, 0.5), 4);
        assert_eq!(nearest_rank(10, 0.9), 8);
        assert_eq!(nearest_rank(10, 0.99), 9);
        assert_eq!(nearest_rank(1, 0.5), 0);
        assert_eq!(nearest_rank(256, 0.5), 127);
    }
}
