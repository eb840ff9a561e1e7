//! What the agent says when it stops, for people: grouped by stage, only the counters that
//! moved and mean something was lost or left undecided, and a verdict first. Every counter
//! is described once (its doc comment, or [`EXPORT_COUNTERS`] for the exporter's), and the
//! same descriptions make docs/troubleshooting.md's table, so the two cannot disagree.

use std::fmt::Write as _;
use std::time::Duration;

use crate::insight::InsightCounters;
use crate::model::counters::{CounterClass, CounterInfo};
use crate::ops::counters::{AgentCounters, HostCounters};
use crate::pipeline::PipelineCounters;
use crate::processes::tls_library::TlsProbeCounters;
use crate::reassembly::connections::ReassemblyCounters;
use crate::reassembly::tls::TlsCounters;
use crate::stitch::StitchCounters;

/// Where the troubleshooting page lists every counter (the verdict points there).
pub const COUNTERS_PAGE: &str = "docs/troubleshooting.md#every-counter";

/// The exporter's, the tree printer's and the exit's counters: not declared with
/// `counters!` (the exporter's are atomics shared with its tasks), described here.
pub const EXPORT_COUNTERS: &[CounterInfo] = &[
    info(
        "spans_exported",
        CounterClass::Traced,
        "Spans the exporter delivered: taken by the collector, or written to stdout. With `--output tree`, the spans printed in trees.",
    ),
    info(
        "spans_lost_in_export",
        CounterClass::Note,
        "Spans that reached the exporter but never the collector or stdout, in all. The sum of `spans_dropped_export_buffer_full`, `spans_dropped_rejected` and `spans_dropped_undelivered_at_shutdown` (with `--output tree` alone, `tree_spans_unwritten`), which say why and what to do; so the exit summary shows those, not this.",
    ),
    info(
        "spans_dropped_export_buffer_full",
        CounterClass::Lost,
        "Spans dropped, oldest first, from the full retry buffer during an outage. The collector was down, slow or refusing for longer than `--export-buffer-spans` spans (about 1 KiB each) could cover: fix the collector (`/healthz` and the log give its last error), or raise `--export-buffer-spans`.",
    ),
    info(
        "spans_dropped_rejected",
        CounterClass::Lost,
        "Spans the collector refused for good, or rejected in a partial success. Spans stdout could not take are counted here too. The log gives the collector's reason (the first partial rejection is logged): check the endpoint, its auth headers and its limits.",
    ),
    info(
        "spans_dropped_undelivered_at_shutdown",
        CounterClass::Lost,
        "Spans still undelivered when `--shutdown-timeout` ran out at exit. Raise `--shutdown-timeout`, or keep the collector up until the agent has stopped.",
    ),
    info(
        "spans_delivered_late",
        CounterClass::Note,
        "Spans the collector took after at least one failed attempt. Not a loss: they waited in the retry buffer during an outage (see `span_exports_failed`).",
    ),
    info(
        "span_exports_failed",
        CounterClass::Note,
        "Span export requests that failed, retries included. Not a loss by itself: what became of their spans is in `spans_delivered_late` and the `spans_dropped_*` counters; `/healthz` and the log give the last error.",
    ),
    info(
        "spans_discarded_exporter_none",
        CounterClass::Note,
        "Spans let go because the traces exporter is `none`. Not a loss: `--traces-exporter none` asks for it.",
    ),
    info(
        "metric_exports_failed",
        CounterClass::Note,
        "Metric export requests that failed, the agent's own included. Values are cumulative, so the next export carries what a failed one missed; only a failure at exit loses data. A trace-only backend (Arize Phoenix, Jaeger) takes no metrics: point `--otlp-metrics-endpoint` elsewhere or set `--metrics-exporter none`.",
    ),
    info(
        "requests_in_flight_at_exit",
        CounterClass::Lost,
        "Requests seen starting but not ending before the agent stopped: no span. Expected when the agent stops while servers still work; stop it after the run's last request to trace them all.",
    ),
    info(
        "connections_open_at_exit",
        CounterClass::Note,
        "Connections still open when the agent stopped. Not a loss: keep-alive connections stay open between requests.",
    ),
    info(
        "trees_printed",
        CounterClass::Traced,
        "Traces printed as trees (`--output tree`).",
    ),
    info(
        "trees_incomplete",
        CounterClass::Note,
        "Trees printed without a root, or cut short by a limit. Not a loss: every span is still printed once; see `trees_evicted_at_trace_limit` and `trees_split_at_span_limit`, and a tree printed without a root at exit had spans whose parent never came.",
    ),
    info(
        "trees_evicted_at_trace_limit",
        CounterClass::Note,
        "Trees printed early because 10,000 traces were waiting at once. Not a loss: that trace's later spans start a new tree.",
    ),
    info(
        "trees_split_at_span_limit",
        CounterClass::Note,
        "Trees printed early because their trace reached 1,000 spans. Not a loss: its later spans start a new tree.",
    ),
    info(
        "tree_spans_unwritten",
        CounterClass::Lost,
        "Spans of trees that stdout would not take (a closed pipe). Check what reads the agent's stdout; with `--output tree` alone they are also in `spans_lost_in_export`.",
    ),
];

const fn info(name: &'static str, class: CounterClass, doc: &'static str) -> CounterInfo {
    CounterInfo { name, class, doc }
}

/// Every counter the agent reports, by the stage that counts it, in the order printed.
pub fn catalog() -> [(&'static str, &'static [CounterInfo]); 9] {
    [
        ("kernel", HostCounters::INFO),
        ("pipeline", PipelineCounters::INFO),
        ("reassembly", ReassemblyCounters::INFO),
        ("tls", TlsCounters::INFO),
        ("tls probes", TlsProbeCounters::INFO),
        ("stitching", StitchCounters::INFO),
        ("insight", InsightCounters::INFO),
        ("agent", AgentCounters::INFO),
        ("export", EXPORT_COUNTERS),
    ]
}

/// Counters whose names changed, and why: (old, new, why).
pub const RENAMED_COUNTERS: &[(&str, &str, &str)] = &[
    (
        "exchanges",
        "requests_traced",
        "\"exchanges\" named an internal type, not what a user counts",
    ),
    (
        "parents_none",
        "parents_no_request_in_flight",
        "read as \"no parent\", which every undecided reason is",
    ),
    (
        "spans_export_failed",
        "spans_lost_in_export",
        "read as failed export requests; it counts spans lost",
    ),
    (
        "exports_failed",
        "span_exports_failed",
        "did not say which signal (`metric_exports_failed` is the other)",
    ),
];

/// Spans lost for good, by these counters: the verdict's number.
const SPANS_LOST: &[&str] = &[
    "spans_dropped_queue_full",
    "spans_dropped_export_buffer_full",
    "spans_dropped_rejected",
    "spans_dropped_undelivered_at_shutdown",
    "tree_spans_unwritten",
];

/// The one line that says whether anything was lost.
#[derive(Debug, PartialEq, Eq)]
pub struct Verdict {
    pub spans_lost: u64,
    /// Other `lost` counters that moved.
    pub other_losses: Vec<&'static str>,
}

impl Verdict {
    pub fn of(values: &[(&'static str, u64)]) -> Self {
        let value = |name: &str| value_of(values, name);
        let spans_lost = SPANS_LOST.iter().map(|name| value(name)).sum();
        let other_losses = catalog()
            .into_iter()
            .flat_map(|(_, infos)| infos)
            .filter(|info| info.class == CounterClass::Lost && !SPANS_LOST.contains(&info.name))
            .filter(|info| value(info.name) > 0)
            .map(|info| info.name)
            .collect();
        Self {
            spans_lost,
            other_losses,
        }
    }

    pub fn nothing_lost(&self) -> bool {
        self.spans_lost == 0 && self.other_losses.is_empty()
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.nothing_lost() {
            return f.write_str("nothing lost");
        }
        if self.spans_lost > 0 {
            write!(f, "{} spans lost", grouped(self.spans_lost))?;
            if !self.other_losses.is_empty() {
                f.write_str("; also ")?;
            }
        } else {
            f.write_str("lost: ")?;
        }
        write!(f, "{}", self.other_losses.join(", "))
    }
}

/// A counter's value among `values`; 0 when absent (a printer that did not run).
fn value_of(values: &[(&'static str, u64)], name: &str) -> u64 {
    values
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(0, |(_, v)| *v)
}

/// The block printed on stderr at exit when the log is text.
pub fn render(values: &[(&'static str, u64)], elapsed: Duration) -> String {
    let value = |name: &str| value_of(values, name);
    let verdict = Verdict::of(values);
    let mut out = format!("gym-tracer stopped after {}: {verdict}", duration(elapsed));
    if !verdict.nothing_lost() {
        let _ = write!(out, " (see below, and {COUNTERS_PAGE})");
    }
    out.push('\n');
    let decided: u64 = catalog()
        .into_iter()
        .flat_map(|(_, infos)| infos)
        .filter(|info| info.class == CounterClass::Decided)
        .map(|info| value(info.name))
        .sum();
    let mut traced = vec![
        counted(value("processes_attached"), "process", "processes"),
        counted(value("requests_traced"), "request", "requests"),
        counted(value("spans_exported"), "span exported", "spans exported"),
    ];
    for (name, one, many) in [
        ("trees_printed", "tree printed", "trees printed"),
        ("rollouts_completed", "rollout", "rollouts"),
    ] {
        if value(name) > 0 {
            traced.push(counted(value(name), one, many));
        }
    }
    if decided > 0 {
        traced.push(counted(
            decided,
            "parent decided by evidence",
            "parents decided by evidence",
        ));
    }
    let _ = writeln!(out, "  {:<11} {}", "traced", traced.join(" · "));
    let moved: Vec<(&str, &CounterInfo, u64)> = catalog()
        .into_iter()
        .flat_map(|(stage, infos)| infos.iter().map(move |info| (stage, info)))
        .filter(|(_, info)| matches!(info.class, CounterClass::Lost | CounterClass::Undecided))
        .map(|(stage, info)| (stage, info, value(info.name)))
        .filter(|(_, _, value)| *value > 0)
        .collect();
    let name_width = moved
        .iter()
        .map(|(_, info, _)| info.name.len())
        .max()
        .unwrap_or(0);
    let mut last_stage = "";
    for (stage, info, count) in &moved {
        let shown_stage = if *stage == last_stage { "" } else { stage };
        last_stage = stage;
        let undecided = if info.class == CounterClass::Undecided {
            "(parent undecided) "
        } else {
            ""
        };
        let _ = writeln!(
            out,
            "  {shown_stage:<11} {:<name_width$} {:>9}  {undecided}{}",
            info.name,
            grouped(*count),
            info.summary()
        );
    }
    out.push_str("  every counter: --summary-file FILE (JSON), /metrics with --health-listen\n");
    out
}

/// docs/troubleshooting.md's table: every counter, its stage and class, what it means and
/// what to do when it moves.
pub fn counters_markdown() -> String {
    let mut out = String::from(
        "| counter | stage | class | what it counts, and what to do when it moves |\n\
         |---|---|---|---|\n",
    );
    for (stage, infos) in catalog() {
        for info in infos {
            let _ = writeln!(
                out,
                "| `{}` | {stage} | {} | {} |",
                info.name,
                class_name(info.class),
                info.text().replace('|', "\\|")
            );
        }
    }
    out
}

/// The renamed options and counters, one table.
pub fn renamed_markdown() -> String {
    let mut out = String::from("| kind | old name | new name | why |\n|---|---|---|---|\n");
    for renamed in crate::config::RENAMED_OPTIONS {
        let _ = writeln!(
            out,
            "| option | `--{}`, `{}`, file key `{}` | `--{}` | {}; the old flag, variable and key still work |",
            renamed.old,
            renamed.old_env,
            renamed.old,
            renamed.new,
            renamed.why.split_whitespace().collect::<Vec<_>>().join(" ")
        );
    }
    for (old, new, why) in RENAMED_COUNTERS {
        let _ = writeln!(out, "| counter | `{old}` | `{new}` | {why} |");
    }
    out
}

fn class_name(class: CounterClass) -> &'static str {
    match class {
        CounterClass::Traced => "traced",
        CounterClass::Lost => "lost",
        CounterClass::Undecided => "undecided",
        CounterClass::Decided => "decided",
        CounterClass::Note => "note",
    }
}

/// "1 process", "1,204 processes".
fn counted(value: u64, one: &str, many: &str) -> String {
    format!("{} {}", grouped(value), if value == 1 { one } else { many })
}

/// 1234567 → "1,234,567", as the batch report writes numbers.
fn grouped(value: u64) -> String {
    crate::report::page::grouped(i64::try_from(value).unwrap_or(i64::MAX))
}

fn duration(elapsed: Duration) -> String {
    let seconds = elapsed.as_secs();
    match seconds {
        0..60 => format!("{:.1} s", elapsed.as_secs_f64()),
        60..3600 => format!("{}m {:02}s", seconds / 60, seconds % 60),
        _ => format!("{}h {:02}m", seconds / 3600, seconds / 60 % 60),
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::export::TreeCounters;
    use crate::export::status::ExportStatus;
    use crate::ops::counters::CounterSnapshot;

    /// Every name the agent's exit reports (as `Agent::shutdown` assembles them).
    fn reported_names() -> Vec<&'static str> {
        let mut names: Vec<&'static str> = CounterSnapshot::default()
            .counters()
            .into_iter()
            .map(|(name, _)| name)
            .collect();
        names.extend(ExportStatus::default().counters().map(|(name, _)| name));
        names.extend([
            "metric_exports_failed",
            "requests_in_flight_at_exit",
            "connections_open_at_exit",
        ]);
        names.extend(TreeCounters::default().counters().map(|(name, _)| name));
        names
    }

    #[test]
    fn every_reported_counter_is_described_once() {
        let mut described: BTreeMap<&str, usize> = BTreeMap::new();
        for (_, infos) in catalog() {
            for info in infos {
                *described.entry(info.name).or_default() += 1;
            }
        }
        let reported = reported_names();
        for name in &reported {
            assert_eq!(
                described.get(name),
                Some(&1),
                "{name}: described {:?} times",
                described.get(name)
            );
        }
        for name in described.keys() {
            assert!(
                reported.contains(name),
                "{name} is described but never reported"
            );
        }
        for (_, infos) in catalog() {
            for info in infos {
                let summary = info.summary();
                assert!(!summary.is_empty(), "{} has no doc", info.name);
                assert!(
                    summary.len() <= 100,
                    "{}: first sentence too long for a line: {summary}",
                    info.name
                );
                assert!(
                    !info.doc.contains('['),
                    "{}: intra-doc links show as brackets on the page",
                    info.name
                );
            }
        }
    }

    #[test]
    fn renamed_counters_are_gone_under_their_old_names() {
        let reported = reported_names();
        for (old, new, _) in RENAMED_COUNTERS {
            assert!(!reported.contains(old), "{old} still reported");
            assert!(reported.contains(new), "{new} not reported");
        }
    }

    #[test]
    fn a_clean_run_says_nothing_lost_and_what_was_traced() {
        let values = [
            ("processes_attached", 3),
            ("requests_traced", 1204),
            ("spans_exported", 3612),
            ("rollouts_completed", 256),
            ("parents_by_rollout_id", 500),
            ("parents_by_echoed_id", 12),
            ("lineage_inherited", 40),
            ("span_exports_failed", 2),
        ];
        let text = render(&values, Duration::from_millis(72_400));
        assert_eq!(
            text,
            "gym-tracer stopped after 1m 12s: nothing lost\n  \
             traced      3 processes · 1,204 requests · 3,612 spans exported · 256 rollouts · \
             512 parents decided by evidence\n  \
             every counter: --summary-file FILE (JSON), /metrics with --health-listen\n"
        );
    }

    #[test]
    fn losses_are_grouped_by_stage_with_the_verdict_first() {
        let values = [
            ("events_lost_in_kernel", 12),
            ("processes_attached", 1),
            ("requests_traced", 10),
            ("spans_exported", 8),
            ("parents_no_evidence", 2),
            ("parents_ambiguous", 1),
            ("spans_dropped_export_buffer_full", 1500),
            ("spans_lost_in_export", 1500),
        ];
        let verdict = Verdict::of(&values);
        assert_eq!(
            verdict.to_string(),
            "1,500 spans lost; also events_lost_in_kernel"
        );
        let text = render(&values, Duration::from_secs(5));
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].starts_with(
                "gym-tracer stopped after 5.0 s: 1,500 spans lost; also events_lost_in_kernel (see below"
            ),
            "{text}"
        );
        let rows: Vec<Vec<&str>> = lines[2..lines.len() - 1]
            .iter()
            .map(|line| line.split_whitespace().take(3).collect())
            .collect();
        assert_eq!(
            rows,
            [
                vec!["kernel", "events_lost_in_kernel", "12"],
                vec!["stitching", "parents_ambiguous", "1"],
                vec!["parents_no_evidence", "2", "(parent"],
                vec!["export", "spans_dropped_export_buffer_full", "1,500"],
            ],
            "{text}"
        );
        assert!(
            !text.contains("spans_lost_in_export"),
            "the sum is not a loss of its own: {text}"
        );
        let only_kernel = Verdict::of(&[("events_lost_in_kernel", 1)]);
        assert_eq!(only_kernel.to_string(), "lost: events_lost_in_kernel");
    }

    #[test]
    fn the_tables_list_every_counter_and_rename() {
        let table = counters_markdown();
        for name in reported_names() {
            assert!(table.contains(&format!("| `{name}` |")), "{name} missing");
        }
        let renamed = renamed_markdown();
        assert!(renamed.contains("`--max-pending-spans`"), "{renamed}");
        assert!(
            renamed.contains("| counter | `exchanges` | `requests_traced` |"),
            "{renamed}"
        );
    }
}
