//! The report as one HTML file: inline CSS and SVG, no script, nothing fetched, so it opens
//! offline, attaches to an issue and prints. Every text that came from the input is escaped.

use std::fmt::Write as _;

use super::batch::{Batch, Outcome, Series};
use super::charts::{self, Axis};
use crate::model::rollout::{PerPhase, Phase};

/// What the page is asked to show beyond the batch.
#[derive(Clone, Debug, Default)]
pub struct PageOptions {
    /// A trace UI's address with `{trace_id}` where the id goes.
    pub trace_url: Option<String>,
    /// When the page was made, as a person reads it.
    pub generated: String,
}

const STYLE: &str = "body{font-family:system-ui,sans-serif;margin:24px auto;max-width:1000px;color:#222}\
h1{margin-bottom:4px}h2{margin-top:36px;border-bottom:1px solid #ddd;padding-bottom:4px}\
.sub{color:#666;margin-top:0}table{border-collapse:collapse}td,th{padding:3px 10px;text-align:left;\
border-bottom:1px solid #eee;vertical-align:top}th{font-weight:600}td.n{text-align:right;\
font-variant-numeric:tabular-nums}.numbers th{width:260px}.warn{background:#fff4e5;border:1px solid #f0b429;\
padding:8px 14px}.key{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;\
vertical-align:-1px}.straggler{color:#c0392b;font-weight:600}.muted{color:#777}svg{display:block}\
.error{color:#c0392b}code{font-size:90%}";

pub fn render(batch: &Batch, options: &PageOptions) -> String {
    let mut page = String::with_capacity(256 << 10);
    let n = &batch.numbers;
    let _ = write!(
        page,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>gym-tracer batch report: {} rollouts</title><style>{STYLE}</style></head><body>\
         <h1>Batch report</h1><p class=\"sub\">{} rollouts, {} spans, from {} · gym-tracer {} · {}</p>",
        n.rollouts,
        n.rollouts,
        batch.spans,
        escape(&sources(batch)),
        env!("CARGO_PKG_VERSION"),
        escape(&options.generated),
    );
    skipped(&mut page, batch);
    numbers(&mut page, batch);
    if batch.rollouts.is_empty() {
        page.push_str(
            "<p class=\"warn\">No <code>gym.rollout</code> span in the input: the agent makes \
             one per <code>/run</code> of a Gym agent server (is its <code>rollout</code> span \
             group on, and were the agent servers traced?).</p>",
        );
    } else {
        let _ = write!(
            page,
            "<h2 id=\"durations\">Rollout durations</h2>{}",
            charts::histogram(&batch.histogram)
        );
        phases(&mut page, batch);
        load(&mut page, batch);
        slowest(&mut page, batch, options);
    }
    failures(&mut page, batch);
    page.push_str(
        "<p class=\"muted\" style=\"margin-top:40px\">Quantiles are nearest-rank over every \
         rollout. A rollout's phases are its critical path split as gym-tracer's \
         <code>gym.rollout.phase.*_ms</code> attributes name them; the series are sampled \
         into at most 300 points (the most rollouts in flight, the p90 queue delay, the mean \
         loop load per interval); timelines show the spans holding most of each path.</p>\
         </body></html>\n",
    );
    page
}

fn sources(batch: &Batch) -> String {
    let names: Vec<String> = batch
        .sources
        .iter()
        .map(|(name, lines)| match lines {
            0 => name.clone(),
            lines => format!("{name} ({lines} lines)"),
        })
        .collect();
    names.join(", ")
}

fn skipped(page: &mut String, batch: &Batch) {
    let skipped = &batch.skipped;
    if skipped.lines() == 0 && skipped.duplicate_spans == 0 && skipped.spans_over_bound == 0 {
        return;
    }
    page.push_str(
        "<div class=\"warn\" id=\"skipped\"><b>Not all of the input is in this report.</b><ul>",
    );
    for (reason, count) in &skipped.by_reason {
        let _ = write!(page, "<li>{count} lines skipped: {reason}</li>");
    }
    if skipped.duplicate_spans > 0 {
        let _ = write!(
            page,
            "<li>{} spans given more than once (overlapping files): counted once</li>",
            skipped.duplicate_spans
        );
    }
    if skipped.spans_over_bound > 0 {
        let _ = write!(
            page,
            "<li>{} spans past the report's memory bound ({} spans) left out</li>",
            skipped.spans_over_bound,
            super::input::MAX_SPANS
        );
    }
    page.push_str("</ul>");
    if !skipped.examples.is_empty() {
        page.push_str("First skipped lines:<ul>");
        for example in &skipped.examples {
            let _ = write!(page, "<li><code>{}</code></li>", escape(example));
        }
        page.push_str("</ul>");
    }
    page.push_str("</div>");
}

pub fn seconds(ns: u64) -> String {
    format!("{:.3} s", ns as f64 / 1e9)
}

/// `1234567` → `1,234,567`.
pub fn grouped(value: i64) -> String {
    let digits = value.unsigned_abs().to_string();
    let mut out = String::new();
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    if value < 0 { format!("-{out}") } else { out }
}

fn numbers(page: &mut String, batch: &Batch) {
    let n = &batch.numbers;
    let failed: usize = n.failed.values().sum();
    let by_status: Vec<String> = n
        .failed
        .iter()
        .map(|(status, count)| match status {
            Some(status) => format!("{count} × /run {status}"),
            None => format!("{count} × no status"),
        })
        .collect();
    let slowest = batch.rollouts.last();
    let rows: [(&str, &str, String); 14] = [
        ("rollouts", "Rollouts", n.rollouts.to_string()),
        ("succeeded", "Succeeded", n.succeeded.to_string()),
        (
            "call_failed",
            "Answered, a call inside failed",
            n.call_failed.to_string(),
        ),
        (
            "failed",
            "Failed",
            if failed == 0 {
                "0".to_owned()
            } else {
                format!("{failed} ({})", by_status.join(", "))
            },
        ),
        ("p50", "Duration p50", seconds(n.p50_ns)),
        ("p90", "Duration p90", seconds(n.p90_ns)),
        ("p99", "Duration p99", seconds(n.p99_ns)),
        ("max", "Duration max", seconds(n.max_ns)),
        (
            "slowest",
            "Slowest rollout",
            slowest.map_or_else(String::new, |r| escape(&r.id)),
        ),
        ("input_tokens", "Tokens in", grouped(n.input_tokens)),
        ("output_tokens", "Tokens out", grouped(n.output_tokens)),
        (
            "per_minute",
            "Rollouts per minute",
            format!("{:.1}", n.per_minute),
        ),
        (
            "stragglers",
            "Stragglers (> 3× their agent's median)",
            n.stragglers.to_string(),
        ),
        ("wall", "First start to last end", seconds(n.wall_ns)),
    ];
    page.push_str("<h2 id=\"numbers\">The batch in numbers</h2><table class=\"numbers\">");
    for (key, label, value) in rows {
        let _ = write!(
            page,
            "<tr><th>{label}</th><td data-key=\"{key}\">{value}</td></tr>"
        );
    }
    page.push_str(
        "</table><p class=\"muted\">Failed: <code>/run</code> answered an error. Answered, a \
         call inside failed: <code>/run</code> answered, but a request below it failed, e.g. a \
         judge call, which Gym's <code>judge_failsafe</code> scores 0.0 and routes to the \
         failures file (see Failures below).</p>",
    );
}

fn legend(page: &mut String) {
    page.push_str("<p>");
    for phase in Phase::ALL {
        let color = charts::phase_color(phase);
        let _ = write!(
            page,
            "<span class=\"key\" style=\"background:rgb({},{},{})\"></span>{}",
            color.0,
            color.1,
            color.2,
            phase.as_str()
        );
    }
    page.push_str("</p>");
}

fn phases(page: &mut String, batch: &Batch) {
    page.push_str("<h2 id=\"phases\">Where the time went</h2>");
    if batch.phase_bars.is_empty() {
        page.push_str(
            "<p>The rollouts carry no <code>gym.rollout.phase.*_ms</code> attributes (an \
             agent older than the insight stage wrote them).</p>",
        );
        return;
    }
    legend(page);
    page.push_str(
        "<p>model: in a model server · tool, verify: in a resources server · queue: a call \
         waiting for a traced server to read it or for its caller to read the answer · \
         external: a call to an untraced peer · agent: the agent server's own time.</p>",
    );
    let rows: Vec<(String, PerPhase<u64>)> = batch
        .phase_bars
        .iter()
        .map(|bar| {
            let rollout = &batch.rollouts[bar.rollout];
            (
                format!(
                    "{} {} ({:.2} s)",
                    bar.rank,
                    rollout.id,
                    rollout.duration_ns() as f64 / 1e9
                ),
                bar.phases_ms,
            )
        })
        .collect();
    page.push_str(&charts::phase_bars(&rows));
    let total: u64 = batch.phase_totals_ms.iter().sum();
    let with_phases = batch
        .rollouts
        .iter()
        .filter(|r| r.phases_ms.is_some())
        .count();
    let _ = write!(
        page,
        "<h3>Over the whole batch ({with_phases} rollouts)</h3><table><tr><th>phase</th>\
         <th>total</th><th>share</th><th>per rollout</th></tr>"
    );
    for phase in Phase::ALL {
        let ms = batch.phase_totals_ms[phase as usize];
        let _ = write!(
            page,
            "<tr><td>{}</td><td class=\"n\" data-phase-total=\"{}\">{:.1} s</td><td class=\"n\">{:.1} %</td>\
             <td class=\"n\">{:.3} s</td></tr>",
            phase.as_str(),
            phase.as_str(),
            ms as f64 / 1e3,
            ms as f64 * 100.0 / total.max(1) as f64,
            ms as f64 / 1e3 / with_phases.max(1) as f64,
        );
    }
    page.push_str("</table>");
    page.push_str(&charts::phase_bars(&[(
        "all rollouts".to_owned(),
        batch.phase_totals_ms,
    )]));
}

fn load(page: &mut String, batch: &Batch) {
    page.push_str("<h2 id=\"in-flight\">Rollouts in flight</h2>");
    let in_flight = Series {
        server: 0,
        points: batch.in_flight.clone(),
    };
    page.push_str(&charts::lines(&[(String::new(), &in_flight)], Axis::Count));
    page.push_str(
        "<h2 id=\"queue-delay\">Queue delay per server (p90)</h2><p>How long the calls a \
         server received waited before it read them: from the caller's first write to the \
         server's first read. A rising line at a busy loop is a server that needs more workers.</p>",
    );
    let queue = by_server(batch, &batch.queue_delay);
    if queue.is_empty() {
        page.push_str("<p>No call whose server was traced too.</p>");
    } else {
        page.push_str(&charts::lines(&queue, Axis::Wait));
    }
    page.push_str("<h2 id=\"loop-load\">Event-loop load per server</h2>");
    let load = by_server(batch, &batch.loop_load);
    if load.is_empty() {
        page.push_str(
            "<p>No <code>gym.server.loop.utilization</code> points in the input: the agent \
             writes them every <code>--metric-interval</code> (60 s by default; run with a \
             shorter one for a finer line), and <code>run --report</code> samples every second.</p>",
        );
    } else {
        page.push_str(
            "<p>The share of each second the server's main thread (its event loop) was on a \
             CPU.</p>",
        );
        page.push_str(&charts::lines(&load, Axis::Busy));
    }
}

/// Each series named by its server, for a chart's legend.
fn by_server<'a>(batch: &Batch, series: &'a [Series]) -> Vec<(String, &'a Series)> {
    series
        .iter()
        .map(|s| (batch.server_name(s.server).to_owned(), s))
        .collect()
}

fn trace_link(trace_id: u128, options: &PageOptions) -> String {
    let id = format!("{trace_id:032x}");
    match &options.trace_url {
        Some(template) => format!(
            "<a href=\"{}\">{id}</a>",
            escape(&template.replace("{trace_id}", &id))
        ),
        None => id,
    }
}

fn slowest(page: &mut String, batch: &Batch, options: &PageOptions) {
    let _ = write!(
        page,
        "<h2 id=\"slowest\">The {} slowest rollouts</h2>",
        batch.timelines.len()
    );
    legend(page);
    page.push_str(
        "<p>Each one's critical path: a row per span on it (grey: the span's whole extent; \
         coloured: its own time on the path, by phase), seconds since the rollout started.</p>",
    );
    for (place, timeline) in batch.timelines.iter().enumerate() {
        let rollout = &batch.rollouts[timeline.rollout];
        let phases: Vec<String> = Phase::ALL
            .iter()
            .filter(|&&phase| timeline.phases_ns[phase as usize] > 0)
            .map(|&phase| {
                format!(
                    "{} {:.2} s",
                    phase.as_str(),
                    timeline.phases_ns[phase as usize] as f64 / 1e9
                )
            })
            .collect();
        let outcome = match rollout.outcome {
            Outcome::Succeeded => String::new(),
            Outcome::CallFailed => " · a call inside failed".to_owned(),
            Outcome::Failed { status: Some(s) } => format!(" · failed ({s})"),
            Outcome::Failed { status: None } => " · failed".to_owned(),
        };
        let _ = write!(
            page,
            "<h3 data-slowest=\"{}\">#{} {} — {}{}{}</h3><p>trace {} · {} · {}</p>",
            place + 1,
            place + 1,
            escape(&rollout.id),
            seconds(rollout.duration_ns()),
            if rollout.straggler {
                " <span class=\"straggler\">straggler</span>"
            } else {
                ""
            },
            outcome,
            trace_link(rollout.trace_id, options),
            escape(batch.server_name(rollout.agent)),
            phases.join(" · "),
        );
        page.push_str(&charts::timeline(
            &timeline.rows,
            rollout.start_ns,
            rollout.end_ns,
        ));
        if timeline.rows_left_out > 0 {
            let _ = write!(
                page,
                "<p class=\"muted\">{} more spans on its path are not drawn.</p>",
                timeline.rows_left_out
            );
        }
    }
}

fn failures(page: &mut String, batch: &Batch) {
    page.push_str("<h2 id=\"failures\">Failures</h2>");
    if batch.failures.is_empty() {
        page.push_str("<p data-key=\"no-failures\">No request failed.</p>");
        return;
    }
    page.push_str(
        "<table><tr><th>server</th><th>kind</th><th>route</th><th>status</th>\
         <th>requests</th><th>rollouts they broke</th><th>not tied to a rollout</th></tr>",
    );
    for (key, failures) in &batch.failures {
        let more = failures.rollouts_total - failures.rollouts.len();
        let _ = write!(
            page,
            "<tr data-failure><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"n\">{}</td><td>{}{}</td>\
             <td class=\"n\">{}</td></tr>",
            escape(batch.server_name(key.server)),
            key.kind,
            escape(&key.route),
            key.status.map_or_else(|| "—".to_owned(), |s| s.to_string()),
            failures.requests,
            escape(&failures.rollouts.join(", ")),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            },
            failures.untied,
        );
    }
    page.push_str(
        "</table><p class=\"muted\">A request is tied to a rollout by its parents up to the \
         rollout's <code>gym.rollout</code> span, or by its own rollout id; one with neither \
         (e.g. a failed model call of an agent that places its model calls by the answer's \
         id, which a failure does not carry) is counted, not guessed.</p>",
    );
}

pub fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '&' => out.push_str("&amp;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c if c.is_control() => out.push('\u{fffd}'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_are_grouped_and_text_escaped() {
        assert_eq!(grouped(1_234_567), "1,234,567");
        assert_eq!(grouped(12), "12");
        assert_eq!(grouped(-1000), "-1,000");
        assert_eq!(
            escape("<a href=\"x\">&'\u{7}"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;\u{fffd}"
        );
    }
}
