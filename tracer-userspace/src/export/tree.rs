//! `--output tree`: each trace printed as an indented tree once it is complete.
//!
//! Spans arrive finished and in any order (children usually before their parents, since a
//! parent ends last), so they are held per trace until the trace has a root and nothing new
//! arrived for a quiet period. Memory is bounded: past the trace limit the oldest trace is
//! printed as it is; past the span limit a trace is printed as it is and its later spans
//! start a new tree. Both are counted. Nothing is dropped: every span is printed once.

use std::cmp::Reverse;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::{self, Write as _};
use std::io::Write;
use std::time::{Duration, Instant};

use super::{ExportTotals, SpanSink};
use crate::export::status::ExportStatus;
use crate::model::attributes as attr;
use crate::model::ids::{SpanId, TraceId};
use crate::model::rollout::Phase;
use crate::model::span::{AttributeValue, SpanKind, SpanRecord, SpanStatus};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TreeOptions {
    /// How long a trace with a root must see no new span before it is printed: the
    /// stitcher releases spans as their chains settle, so siblings of a root can still be on
    /// their way when the root arrives.
    pub quiet_period: Duration,
    pub max_traces: usize,
    pub max_spans_per_trace: usize,
}

impl Default for TreeOptions {
    fn default() -> Self {
        Self {
            quiet_period: Duration::from_secs(1),
            max_traces: 10_000,
            max_spans_per_trace: 1_000,
        }
    }
}

/// What the printer did, for the shutdown summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeCounters {
    pub trees_printed: u64,
    /// Printed without a root, or before the trace was complete (a limit was hit).
    pub trees_incomplete: u64,
    /// Printed early because `max_traces` traces were held.
    pub trees_evicted_at_trace_limit: u64,
    /// Printed early because the trace held `max_spans_per_trace` spans.
    pub trees_split_at_span_limit: u64,
    pub spans_printed: u64,
    /// Spans of trees whose write to the output failed (e.g. a closed pipe).
    pub spans_unwritten: u64,
}

impl TreeCounters {
    /// By name, as the exit summary and the summary file print them.
    pub fn counters(&self) -> [(&'static str, u64); 5] {
        [
            ("trees_printed", self.trees_printed),
            ("trees_incomplete", self.trees_incomplete),
            (
                "trees_evicted_at_trace_limit",
                self.trees_evicted_at_trace_limit,
            ),
            ("trees_split_at_span_limit", self.trees_split_at_span_limit),
            ("tree_spans_unwritten", self.spans_unwritten),
        ]
    }
}

impl fmt::Display for TreeCounters {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (index, (name, value)) in self.counters().iter().enumerate() {
            let separator = if index == 0 { "" } else { " " };
            write!(f, "{separator}{name}={value}")?;
        }
        Ok(())
    }
}

struct PendingTrace {
    spans: Vec<SpanRecord>,
    /// Key in `TreePrinter::arrival_order`.
    seq: u64,
    last_arrival: Instant,
}

/// Holds spans per trace and writes each trace to `out` as a tree when it is complete.
/// Time is passed in (`now`) rather than read, so tests control it.
pub struct TreePrinter<W: Write> {
    options: TreeOptions,
    out: W,
    traces: HashMap<TraceId, PendingTrace>,
    /// Held traces by the arrival of their first span; the first entry is the oldest.
    arrival_order: BTreeMap<u64, TraceId>,
    next_seq: u64,
    counters: TreeCounters,
}

/// Why a trace is printed now.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Release {
    /// Root seen and quiet, or shutdown: incomplete only if it has no root.
    Normal,
    /// A limit was hit: printed as it is, incomplete by definition.
    Forced,
}

impl<W: Write> TreePrinter<W> {
    pub fn new(options: TreeOptions, out: W) -> Self {
        Self {
            options: TreeOptions {
                max_traces: options.max_traces.max(1),
                max_spans_per_trace: options.max_spans_per_trace.max(1),
                ..options
            },
            out,
            traces: HashMap::new(),
            arrival_order: BTreeMap::new(),
            next_seq: 0,
            counters: TreeCounters::default(),
        }
    }

    /// Takes one finished span that arrived at `now`.
    pub fn add(&mut self, span: SpanRecord, now: Instant) {
        let trace_id = span.trace_id;
        if let Some(trace) = self.traces.get_mut(&trace_id) {
            if trace.spans.len() < self.options.max_spans_per_trace {
                trace.spans.push(span);
                trace.last_arrival = now;
                return;
            }
            self.counters.trees_split_at_span_limit += 1;
            self.release(trace_id, Release::Forced);
        } else if self.traces.len() >= self.options.max_traces
            && let Some((_, oldest)) = self.arrival_order.pop_first()
        {
            self.counters.trees_evicted_at_trace_limit += 1;
            self.release(oldest, Release::Forced);
        }
        let seq = self.next_seq;
        self.next_seq += 1;
        self.arrival_order.insert(seq, trace_id);
        self.traces.insert(
            trace_id,
            PendingTrace {
                spans: vec![span],
                seq,
                last_arrival: now,
            },
        );
    }

    /// Prints, oldest first, every trace that has a root and got no span for the quiet
    /// period before `now`. Call it periodically.
    pub fn print_ready(&mut self, now: Instant) {
        let quiet = self.options.quiet_period;
        let ready: Vec<TraceId> = self
            .arrival_order
            .values()
            .filter(|id| {
                self.traces.get(id).is_some_and(|trace| {
                    now.saturating_duration_since(trace.last_arrival) >= quiet
                        && has_root(&trace.spans)
                })
            })
            .copied()
            .collect();
        for id in ready {
            self.release(id, Release::Normal);
        }
        let _ = self.out.flush();
    }

    /// Prints everything still held, oldest first (at shutdown).
    pub fn flush_all(&mut self) {
        while let Some((_, id)) = self.arrival_order.pop_first() {
            self.release(id, Release::Normal);
        }
        let _ = self.out.flush();
    }

    pub fn counters(&self) -> TreeCounters {
        self.counters
    }

    /// Traces held, waiting to be printed.
    #[cfg(test)]
    pub fn pending_traces(&self) -> usize {
        self.traces.len()
    }

    #[cfg(test)]
    pub fn into_writer(self) -> W {
        self.out
    }

    fn release(&mut self, id: TraceId, release: Release) {
        let Some(trace) = self.traces.remove(&id) else {
            return;
        };
        self.arrival_order.remove(&trace.seq);
        let incomplete = release == Release::Forced || !has_root(&trace.spans);
        let text = render_trace(id, &trace.spans, incomplete);
        let count = trace.spans.len() as u64;
        self.counters.trees_printed += 1;
        self.counters.trees_incomplete += u64::from(incomplete);
        match self.out.write_all(text.as_bytes()) {
            Ok(()) => self.counters.spans_printed += count,
            Err(_) => self.counters.spans_unwritten += count,
        }
    }
}

/// A trace is complete once it holds a span with no parent, or whose parent is another
/// process's (`traceparent`) and not among the trace's spans: nothing above it will come.
fn has_root(spans: &[SpanRecord]) -> bool {
    let ids: HashSet<SpanId> = spans.iter().map(|s| s.span_id).collect();
    spans.iter().any(|span| is_root(span, &ids))
}

fn is_root(span: &SpanRecord, ids: &HashSet<SpanId>) -> bool {
    match span.parent_span_id {
        None => true,
        Some(parent) => span.parent_is_remote && !ids.contains(&parent),
    }
}

/// How a top-level line relates to the spans above it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum TopLevel {
    Root,
    RemoteParent,
    ParentNotSeen,
    /// Parent links that loop (a stitching bug): broken at the earliest span.
    ParentCycle,
}

/// The text of one trace: a header line, then one line per span, children under their
/// parent by start time. Spans whose parent is not in `spans` are extra top-level lines.
pub fn render_trace(trace_id: TraceId, spans: &[SpanRecord], incomplete: bool) -> String {
    // Rank = position in (start, longest first, name, id) order: deterministic however the
    // spans arrived, and a parent sorts before a child that starts at the same instant.
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&i| {
        let s = &spans[i];
        (
            s.start_unix_ns,
            Reverse(s.end_unix_ns),
            s.name.as_str(),
            s.span_id.0,
        )
    });
    let mut index: HashMap<SpanId, usize> = HashMap::new();
    for &i in &order {
        index.entry(spans[i].span_id).or_insert(i);
    }
    let mut parent_of: Vec<Option<usize>> = vec![None; spans.len()];
    let mut children: Vec<Vec<usize>> = vec![Vec::new(); spans.len()];
    let mut top: Vec<(usize, TopLevel)> = Vec::new();
    for &i in &order {
        let span = &spans[i];
        match span.parent_span_id {
            None => top.push((i, TopLevel::Root)),
            Some(parent) => match index.get(&parent) {
                Some(&j) if j != i => {
                    parent_of[i] = Some(j);
                    children[j].push(i);
                }
                Some(_) => top.push((i, TopLevel::ParentCycle)),
                None if span.parent_is_remote => top.push((i, TopLevel::RemoteParent)),
                None => top.push((i, TopLevel::ParentNotSeen)),
            },
        }
    }
    // Spans not reachable from a top-level line sit on a parent cycle.
    let mut reached = vec![false; spans.len()];
    let mark_reached = |from: usize, reached: &mut Vec<bool>, children: &[Vec<usize>]| {
        let mut stack = vec![from];
        while let Some(i) = stack.pop() {
            if !std::mem::replace(&mut reached[i], true) {
                stack.extend(&children[i]);
            }
        }
    };
    for &(i, _) in &top {
        mark_reached(i, &mut reached, &children);
    }
    for &i in &order {
        if !reached[i] {
            if let Some(parent) = parent_of[i] {
                children[parent].retain(|&c| c != i);
            }
            top.push((i, TopLevel::ParentCycle));
            mark_reached(i, &mut reached, &children);
        }
    }
    let rank: Vec<usize> = {
        let mut rank = vec![0; spans.len()];
        for (r, &i) in order.iter().enumerate() {
            rank[i] = r;
        }
        rank
    };
    top.sort_by_key(|&(i, _)| rank[i]);

    let mut text = String::new();
    write_header(&mut text, trace_id, spans, &order, &top, incomplete);
    let last_top = top.len().saturating_sub(1);
    for (n, &(root, relation)) in top.iter().enumerate() {
        // Depth-first with an explicit stack: a long parent chain cannot overflow it.
        let mut stack = vec![(root, String::new(), n == last_top, Some(relation))];
        while let Some((i, prefix, last, relation)) = stack.pop() {
            text.push_str(&prefix);
            text.push_str(if last { "└─ " } else { "├─ " });
            write_span(&mut text, &spans[i]);
            match relation {
                Some(TopLevel::RemoteParent) => text.push_str("  (remote parent)"),
                Some(TopLevel::ParentNotSeen) => text.push_str("  (parent not seen)"),
                Some(TopLevel::ParentCycle) => text.push_str("  (parent cycle)"),
                Some(TopLevel::Root) | None => {}
            }
            text.push('\n');
            let child_prefix = format!("{prefix}{}", if last { "   " } else { "│  " });
            let kids = &children[i];
            for (k, &child) in kids.iter().enumerate().rev() {
                stack.push((child, child_prefix.clone(), k + 1 == kids.len(), None));
            }
        }
    }
    text
}

fn write_header(
    text: &mut String,
    trace_id: TraceId,
    spans: &[SpanRecord],
    order: &[usize],
    top: &[(usize, TopLevel)],
    incomplete: bool,
) {
    let rollout = order
        .iter()
        .find_map(|&i| attribute(&spans[i], attr::GYM_ROLLOUT_ID));
    // The trace's duration is its root's; without a root, the extent of what was seen.
    let duration_ns = match top
        .iter()
        .find(|(_, relation)| matches!(relation, TopLevel::Root | TopLevel::RemoteParent))
    {
        Some(&(root, _)) => duration_ns(&spans[root]),
        None => {
            let start = spans.iter().map(|s| s.start_unix_ns).min().unwrap_or(0);
            let end = spans.iter().map(|s| s.end_unix_ns).max().unwrap_or(0);
            end.saturating_sub(start)
        }
    };
    text.push_str("trace ");
    for byte in trace_id.0 {
        let _ = write!(text, "{byte:02x}");
    }
    text.push_str("  rollout ");
    match rollout {
        Some(AttributeValue::Str(id)) => push_sanitized(text, id),
        Some(
            other @ (AttributeValue::Int(_) | AttributeValue::Bool(_) | AttributeValue::Double(_)),
        ) => {
            let _ = write!(text, "{other}");
        }
        None => text.push('-'),
    }
    let plural = if spans.len() == 1 { "" } else { "s" };
    let _ = write!(
        text,
        "  ({} span{plural}, {} ms)",
        spans.len(),
        milliseconds(duration_ns)
    );
    if incomplete {
        text.push_str("  (incomplete)");
    }
    text.push('\n');
}

/// A `gym.rollout`'s phases, the non-zero ones: `  (model 812 · queue 96 · agent 14 ms)`,
/// and `STRAGGLER` when it is one.
fn write_phases(text: &mut String, span: &SpanRecord) {
    let mut first = true;
    for phase in Phase::ALL {
        if let Some(AttributeValue::Int(ms)) = attribute(span, phase.attribute())
            && *ms > 0
        {
            let separator = if first { "  (" } else { " · " };
            let _ = write!(text, "{separator}{} {ms}", phase.as_str());
            first = false;
        }
    }
    if !first {
        text.push_str(" ms)");
    }
    if let Some(AttributeValue::Bool(true)) = attribute(span, attr::GYM_ROLLOUT_STRAGGLER) {
        text.push_str("  STRAGGLER");
    }
}

/// `name  [server]  1.2 ms  200  ERROR`; a CLIENT span names its peer when it is known:
/// `[caller → peer]`.
fn write_span(text: &mut String, span: &SpanRecord) {
    push_sanitized(text, &span.name);
    text.push_str("  [");
    let service = &span.service.attributes;
    match service
        .get(attr::GYM_SERVER_NAME)
        .or_else(|| service.get(attr::SERVICE_NAME))
    {
        Some(AttributeValue::Str(name)) => push_sanitized(text, name),
        Some(
            other @ (AttributeValue::Int(_) | AttributeValue::Bool(_) | AttributeValue::Double(_)),
        ) => {
            let _ = write!(text, "{other}");
        }
        None => text.push('?'),
    }
    if matches!(span.kind, SpanKind::Client)
        && let Some(AttributeValue::Str(peer)) = attribute(span, attr::PEER_SERVICE)
    {
        text.push_str(" → ");
        push_sanitized(text, peer);
    }
    let _ = write!(text, "]  {} ms", milliseconds(duration_ns(span)));
    match attribute(span, attr::HTTP_RESPONSE_STATUS_CODE) {
        Some(AttributeValue::Int(code)) => {
            let _ = write!(text, "  {code}");
        }
        Some(AttributeValue::Str(code)) => {
            text.push_str("  ");
            push_sanitized(text, code);
        }
        Some(AttributeValue::Bool(_) | AttributeValue::Double(_)) | None => {}
    }
    if span.status == SpanStatus::Error {
        text.push_str("  ERROR");
    }
    write_phases(text, span);
}

fn attribute<'a>(span: &'a SpanRecord, key: &str) -> Option<&'a AttributeValue> {
    span.attributes
        .iter()
        .find(|(k, _)| *k == key)
        .map(|(_, value)| value)
}

fn duration_ns(span: &SpanRecord) -> u64 {
    span.end_unix_ns.saturating_sub(span.start_unix_ns)
}

fn milliseconds(ns: u64) -> String {
    format!("{:.1}", ns as f64 / 1e6)
}

/// Names come from the wire (request paths): control characters are escaped so a request
/// cannot move the cursor or recolour the terminal.
fn push_sanitized(text: &mut String, value: &str) {
    for c in value.chars() {
        if c.is_control() {
            text.extend(c.escape_default());
        } else {
            text.push(c);
        }
    }
}

/// Spans count as exported when their tree is printed, so this sink counts itself: its
/// totals come from the printer, not from the export status.
impl<W: Write + Send + 'static> SpanSink for TreePrinter<W> {
    fn export(&mut self, batch: Vec<SpanRecord>, _status: &ExportStatus) {
        let now = Instant::now();
        for span in batch {
            self.add(span, now);
        }
    }

    /// Trees are printed on every tick (at least every batch delay), not only when spans
    /// arrive: a trace is printed when it has been quiet.
    async fn flush(&mut self, _status: &ExportStatus) {
        self.print_ready(Instant::now());
    }

    async fn shutdown(mut self, _status: &ExportStatus) -> ExportTotals {
        self.print_ready(Instant::now());
        self.flush_all();
        let counters = self.counters();
        ExportTotals {
            spans_exported: counters.spans_printed,
            spans_failed: counters.spans_unwritten,
            tree: Some(counters),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Arc;

    use opentelemetry_sdk::Resource;

    use super::*;
    use crate::model::service::GymLabels;
    use crate::model::service::ServiceIdentity;

    const TRACE: TraceId = TraceId([
        0x4b, 0xf9, 0x2f, 0x35, 0x77, 0xb3, 0x4d, 0xa6, 0xa3, 0xce, 0x92, 0x9d, 0x0e, 0x0e, 0x47,
        0x36,
    ]);
    const T0: u64 = 1_700_000_000_000_000_000;

    fn gym_server(name: &str) -> Arc<ServiceIdentity> {
        let mut attributes = BTreeMap::new();
        attributes.insert(
            "service.name",
            AttributeValue::Str(format!("nemo/{name}").into()),
        );
        attributes.insert(
            "nemo.gym.server.name",
            AttributeValue::Str(name.to_owned().into()),
        );
        Arc::new(ServiceIdentity {
            pid: 1,
            labels: GymLabels::default(),
            attributes,
            resource: Resource::builder_empty().build(),
        })
    }

    struct Span(SpanRecord);

    impl Span {
        fn new(
            server: &str,
            kind: SpanKind,
            name: &str,
            id: u8,
            start_us: u64,
            dur_us: u64,
        ) -> Self {
            Span(SpanRecord {
                service: gym_server(server),
                name: name.to_owned().into(),
                kind,
                trace_id: TRACE,
                span_id: SpanId([id; 8]),
                parent_span_id: None,
                parent_is_remote: false,
                start_unix_ns: T0 + start_us * 1_000,
                end_unix_ns: T0 + (start_us + dur_us) * 1_000,
                attributes: Vec::new(),
                status: SpanStatus::Unset,
                facts: Default::default(),
            })
        }
        fn parent(mut self, id: u8) -> Self {
            self.0.parent_span_id = Some(SpanId([id; 8]));
            self
        }
        fn status(mut self, code: i64) -> Self {
            self.0
                .attributes
                .push(("http.response.status_code", AttributeValue::Int(code)));
            if code >= 500 {
                self.0.status = SpanStatus::Error;
            }
            self
        }
        fn attr(mut self, key: &'static str, value: &str) -> Self {
            self.0
                .attributes
                .push((key, AttributeValue::Str(value.to_owned().into())));
            self
        }
        fn trace(mut self, byte: u8) -> Self {
            self.0.trace_id = TraceId([byte; 16]);
            self
        }
    }

    /// The contract's example rollout, children listed before parents as they arrive.
    fn rollout() -> Vec<SpanRecord> {
        use SpanKind::*;
        vec![
            Span::new(
                "policy_model",
                Internal,
                "gym.model.responses",
                5,
                1_000,
                2_600,
            )
            .parent(4)
            .attr("nemo.gym.rollout.id", "7-1"),
            Span::new(
                "policy_model",
                Server,
                "POST /v1/responses",
                4,
                1_000,
                2_600,
            )
            .parent(3)
            .status(200),
            Span::new("simple_agent", Client, "HTTP POST", 3, 700, 3_100)
                .parent(2)
                .status(200)
                .attr("peer.service", "policy_model"),
            Span::new("simple_agent", Client, "HTTP POST", 6, 20_000, 2_900)
                .parent(2)
                .status(500)
                .attr("peer.service", "example_verifier"),
            Span::new("simple_agent", Internal, "gym.rollout", 2, 0, 31_200)
                .parent(1)
                .attr("nemo.gym.rollout.id", "7-1"),
            Span::new("simple_agent", Server, "POST /run", 1, 0, 31_200).status(200),
        ]
        .into_iter()
        .map(|span| span.0)
        .collect()
    }

    const ROLLOUT_TREE: &str = "\
trace 4bf92f3577b34da6a3ce929d0e0e4736  rollout 7-1  (6 spans, 31.2 ms)
└─ POST /run  [simple_agent]  31.2 ms  200
   └─ gym.rollout  [simple_agent]  31.2 ms
      ├─ HTTP POST  [simple_agent → policy_model]  3.1 ms  200
      │  └─ POST /v1/responses  [policy_model]  2.6 ms  200
      │     └─ gym.model.responses  [policy_model]  2.6 ms
      └─ HTTP POST  [simple_agent → example_verifier]  2.9 ms  500  ERROR
";

    fn printer() -> TreePrinter<Vec<u8>> {
        TreePrinter::new(TreeOptions::default(), Vec::new())
    }

    fn output(printer: TreePrinter<Vec<u8>>) -> String {
        String::from_utf8(printer.into_writer()).unwrap()
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn complete_rollout_prints_as_in_the_contract() {
        let now = Instant::now();
        let mut printer = printer();
        for span in rollout() {
            printer.add(span, now);
        }
        printer.print_ready(now + ms(1_000));
        assert_eq!(printer.pending_traces(), 0);
        let counters = printer.counters();
        assert_eq!(counters.trees_printed, 1);
        assert_eq!(counters.trees_incomplete, 0);
        assert_eq!(counters.spans_printed, 6);
        assert_eq!(output(printer), ROLLOUT_TREE);
    }

    #[test]
    fn arrival_order_does_not_change_the_tree() {
        let spans = rollout();
        let mut orders = vec![spans.clone()];
        orders.push(spans.iter().rev().cloned().collect());
        orders.push([3, 0, 5, 1, 4, 2].map(|i| spans[i].clone()).to_vec());
        for order in orders {
            let now = Instant::now();
            let mut printer = printer();
            for span in order {
                printer.add(span, now);
            }
            printer.print_ready(now + ms(1_000));
            assert_eq!(output(printer), ROLLOUT_TREE);
        }
    }

    #[test]
    fn waits_for_the_root_and_a_quiet_second() {
        let t = Instant::now();
        let mut spans = rollout();
        let root = spans.pop().unwrap();
        let mut printer = printer();
        for span in spans {
            printer.add(span, t);
        }
        // Children alone, however long quiet, are not a complete trace.
        printer.print_ready(t + ms(5_000));
        assert_eq!(printer.pending_traces(), 1);
        printer.add(root, t + ms(5_000));
        printer.print_ready(t + ms(5_999));
        assert_eq!(printer.pending_traces(), 1, "quiet period not over yet");
        assert_eq!(printer.counters().trees_printed, 0);
        printer.print_ready(t + ms(6_000));
        assert_eq!(printer.pending_traces(), 0);
        assert_eq!(output(printer), ROLLOUT_TREE);
    }

    #[test]
    fn a_late_span_restarts_the_quiet_period() {
        let t = Instant::now();
        let mut spans = rollout();
        let late = spans.remove(3);
        let mut printer = TreePrinter::new(
            TreeOptions {
                quiet_period: ms(200),
                ..TreeOptions::default()
            },
            Vec::new(),
        );
        for span in spans {
            printer.add(span, t);
        }
        printer.add(late, t + ms(150));
        printer.print_ready(t + ms(300));
        assert_eq!(printer.pending_traces(), 1);
        printer.print_ready(t + ms(350));
        assert_eq!(output(printer), ROLLOUT_TREE);
    }

    #[test]
    fn a_remote_parent_that_is_absent_makes_a_root() {
        let t = Instant::now();
        let mut printer = printer();
        let mut server = Span::new("svc", SpanKind::Server, "GET /health", 9, 0, 1_500)
            .parent(8)
            .status(200)
            .0;
        server.parent_is_remote = true;
        printer.add(server, t);
        printer.print_ready(t + ms(1_000));
        assert_eq!(
            output(printer),
            "trace 4bf92f3577b34da6a3ce929d0e0e4736  rollout -  (1 span, 1.5 ms)\n\
             └─ GET /health  [svc]  1.5 ms  200  (remote parent)\n"
        );
    }

    #[test]
    fn a_remote_parent_that_is_present_is_not_a_root() {
        // Gym's own propagation: the callee's parent is the caller's traced CLIENT span.
        let t = Instant::now();
        let mut callee = Span::new("m", SpanKind::Server, "POST /v1/responses", 4, 10, 20)
            .parent(3)
            .0;
        callee.parent_is_remote = true;
        let caller = Span::new("a", SpanKind::Client, "HTTP POST", 3, 0, 40)
            .parent(2)
            .0;
        let mut printer = printer();
        printer.add(callee, t);
        printer.add(caller, t);
        printer.print_ready(t + ms(10_000));
        assert_eq!(printer.pending_traces(), 1);
    }

    #[test]
    fn orphans_are_extra_roots_in_start_order() {
        let t = Instant::now();
        let mut spans = rollout();
        spans.remove(4); // gym.rollout never arrives
        let mut printer = printer();
        for span in spans {
            printer.add(span, t);
        }
        printer.print_ready(t + ms(1_000));
        assert_eq!(
            output(printer),
            "\
trace 4bf92f3577b34da6a3ce929d0e0e4736  rollout 7-1  (5 spans, 31.2 ms)
├─ POST /run  [simple_agent]  31.2 ms  200
├─ HTTP POST  [simple_agent → policy_model]  3.1 ms  200  (parent not seen)
│  └─ POST /v1/responses  [policy_model]  2.6 ms  200
│     └─ gym.model.responses  [policy_model]  2.6 ms
└─ HTTP POST  [simple_agent → example_verifier]  2.9 ms  500  ERROR  (parent not seen)
"
        );
    }

    #[test]
    fn a_parent_cycle_is_still_printed() {
        let t = Instant::now();
        let mut printer = printer();
        printer.add(
            Span::new("s", SpanKind::Internal, "a", 1, 0, 10)
                .parent(2)
                .0,
            t,
        );
        printer.add(
            Span::new("s", SpanKind::Internal, "b", 2, 5, 10)
                .parent(1)
                .0,
            t,
        );
        printer.flush_all();
        assert_eq!(
            output(printer),
            "\
trace 4bf92f3577b34da6a3ce929d0e0e4736  rollout -  (2 spans, 0.0 ms)  (incomplete)
└─ a  [s]  0.0 ms  (parent cycle)
   └─ b  [s]  0.0 ms
"
        );
    }

    #[test]
    fn client_without_peer_and_control_characters() {
        let span = Span::new("a", SpanKind::Client, "GET /x\x1b[2J", 1, 0, 1_000).0;
        let text = render_trace(TRACE, &[span], false);
        assert!(
            text.ends_with("└─ GET /x\\u{1b}[2J  [a]  1.0 ms\n"),
            "{text}"
        );
    }

    #[test]
    fn falls_back_to_service_name() {
        let span = SpanRecord {
            service: Arc::new(ServiceIdentity::named("python3")),
            ..Span::new("x", SpanKind::Server, "GET /", 1, 0, 260).0
        };
        let text = render_trace(TRACE, &[span], false);
        assert!(text.ends_with("└─ GET /  [python3]  0.3 ms\n"), "{text}");
    }

    #[test]
    fn shutdown_flushes_everything_marking_rootless_trees() {
        let t = Instant::now();
        let mut printer = printer();
        let mut spans = rollout();
        let root = spans.pop().unwrap();
        printer.add(root.clone(), t);
        let orphan = Span::new("b", SpanKind::Server, "POST /verify", 7, 0, 2_000)
            .parent(6)
            .trace(0xaa)
            .0;
        printer.add(orphan, t);
        printer.flush_all();
        assert_eq!(printer.pending_traces(), 0);
        let counters = printer.counters();
        assert_eq!(counters.trees_printed, 2);
        assert_eq!(counters.trees_incomplete, 1);
        assert_eq!(
            output(printer),
            "\
trace 4bf92f3577b34da6a3ce929d0e0e4736  rollout -  (1 span, 31.2 ms)
└─ POST /run  [simple_agent]  31.2 ms  200
trace aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa  rollout -  (1 span, 2.0 ms)  (incomplete)
└─ POST /verify  [b]  2.0 ms  (parent not seen)
"
        );
    }

    #[test]
    fn trace_limit_prints_the_oldest_early() {
        let t = Instant::now();
        let mut printer = TreePrinter::new(
            TreeOptions {
                max_traces: 2,
                ..TreeOptions::default()
            },
            Vec::new(),
        );
        for byte in 1..=3 {
            let span = Span::new("s", SpanKind::Server, "GET /", byte, 0, 1_000)
                .trace(byte)
                .0;
            printer.add(span, t);
        }
        assert_eq!(printer.pending_traces(), 2);
        let counters = printer.counters();
        assert_eq!(counters.trees_evicted_at_trace_limit, 1);
        assert_eq!(counters.trees_incomplete, 1);
        assert_eq!(counters.spans_printed, 1);
        let text = String::from_utf8(printer.out.clone()).unwrap();
        assert_eq!(
            text,
            "trace 01010101010101010101010101010101  rollout -  (1 span, 1.0 ms)  (incomplete)\n\
             └─ GET /  [s]  1.0 ms\n"
        );
        printer.print_ready(t + ms(1_000));
        assert_eq!(printer.counters().trees_printed, 3);
        assert_eq!(printer.counters().trees_incomplete, 1);
    }

    #[test]
    fn span_limit_splits_the_trace() {
        let t = Instant::now();
        let mut printer = TreePrinter::new(
            TreeOptions {
                max_spans_per_trace: 4,
                ..TreeOptions::default()
            },
            Vec::new(),
        );
        for span in rollout() {
            printer.add(span, t);
        }
        let counters = printer.counters();
        assert_eq!(counters.trees_split_at_span_limit, 1);
        assert_eq!(counters.trees_incomplete, 1);
        assert_eq!(counters.spans_printed, 4);
        printer.print_ready(t + ms(1_000));
        let counters = printer.counters();
        assert_eq!(counters.trees_printed, 2);
        assert_eq!(counters.spans_printed, 6);
        assert_eq!(
            output(printer),
            "\
trace 4bf92f3577b34da6a3ce929d0e0e4736  rollout 7-1  (4 spans, 22.2 ms)  (incomplete)
├─ HTTP POST  [simple_agent → policy_model]  3.1 ms  200  (parent not seen)
│  └─ POST /v1/responses  [policy_model]  2.6 ms  200
│     └─ gym.model.responses  [policy_model]  2.6 ms
└─ HTTP POST  [simple_agent → example_verifier]  2.9 ms  500  ERROR  (parent not seen)
trace 4bf92f3577b34da6a3ce929d0e0e4736  rollout 7-1  (2 spans, 31.2 ms)
└─ POST /run  [simple_agent]  31.2 ms  200
   └─ gym.rollout  [simple_agent]  31.2 ms
"
        );
    }

    #[test]
    fn write_errors_are_counted() {
        struct Closed;
        impl Write for Closed {
            fn write(&mut self, _: &[u8]) -> std::io::Result<usize> {
                Err(std::io::ErrorKind::BrokenPipe.into())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut printer = TreePrinter::new(TreeOptions::default(), Closed);
        for span in rollout() {
            printer.add(span, Instant::now());
        }
        printer.flush_all();
        let counters = printer.counters();
        assert_eq!(counters.spans_unwritten, 6);
        assert_eq!(counters.spans_printed, 0);
        assert_eq!(
            counters.to_string(),
            "trees_printed=1 trees_incomplete=0 trees_evicted_at_trace_limit=0 \
             trees_split_at_span_limit=0 tree_spans_unwritten=6"
        );
    }
}
