//! What the exporters report back: spans exported, failed and dropped by reason, and the
//! collector's reachability, read by /healthz, /metrics and the self-telemetry.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why spans that reached the exporter never reached the collector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpanDrop {
    /// The retry buffer (`--export-buffer-spans`) was full during an outage: the oldest went.
    ExportBufferFull,
    /// The collector refused them for good, or said in a partial success that it rejected
    /// them (or stdout could not be written).
    Rejected,
    /// Still undelivered when `--shutdown-timeout` ran out.
    UndeliveredAtShutdown,
}

impl SpanDrop {
    pub const ALL: [SpanDrop; 3] = [
        SpanDrop::ExportBufferFull,
        SpanDrop::Rejected,
        SpanDrop::UndeliveredAtShutdown,
    ];

    /// The counter's name (`spans_dropped_<reason>`) and the `reason` of
    /// `gym_tracer.spans.dropped`.
    pub fn reason(self) -> &'static str {
        match self {
            SpanDrop::ExportBufferFull => "export_buffer_full",
            SpanDrop::Rejected => "rejected",
            SpanDrop::UndeliveredAtShutdown => "undelivered_at_shutdown",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What the exporters report after each attempt: read by `/healthz`, `/metrics`, the
/// self-telemetry and the exit summary.
#[derive(Debug, Default)]
pub struct ExportStatus {
    spans_exported: AtomicU64,
    /// Exported after at least one failed attempt (held in the retry buffer meanwhile).
    spans_delivered_late: AtomicU64,
    /// Span export requests that failed, whatever became of their spans.
    exports_failed: AtomicU64,
    /// Metric export requests that failed (the next export carries the cumulative values).
    metric_exports_failed: AtomicU64,
    spans_dropped: [AtomicU64; 3],
    /// Spans let go because the traces exporter is `none`.
    spans_discarded: AtomicU64,
    /// Spans in the retry buffer now.
    spans_buffered: AtomicU64,
    /// Failed exports since the last one that succeeded; 0 means the collector is reachable
    /// (or nothing was exported yet).
    pub consecutive_failures: AtomicU64,
    pub last_error: Mutex<Option<String>>,
}

impl ExportStatus {
    pub fn record_success(&self, spans: u64, delivered_late: bool) {
        self.spans_exported.fetch_add(spans, Ordering::Relaxed);
        if delivered_late {
            self.spans_delivered_late
                .fetch_add(spans, Ordering::Relaxed);
        }
        self.consecutive_failures.store(0, Ordering::Relaxed);
    }

    /// One failed span export request. `error` must not hold secrets (exporter errors name
    /// the endpoint, not the headers).
    pub fn record_failure(&self, error: String) {
        self.exports_failed.fetch_add(1, Ordering::Relaxed);
        self.consecutive_failures.fetch_add(1, Ordering::Relaxed);
        *self
            .last_error
            .lock()
            .unwrap_or_else(|poison| poison.into_inner()) = Some(error);
    }

    pub fn record_dropped(&self, reason: SpanDrop, spans: u64) {
        self.spans_dropped[reason.index()].fetch_add(spans, Ordering::Relaxed);
    }

    pub fn record_discarded(&self, spans: u64) {
        self.spans_discarded.fetch_add(spans, Ordering::Relaxed);
    }

    pub fn spans_discarded(&self) -> u64 {
        self.spans_discarded.load(Ordering::Relaxed)
    }

    pub fn record_metric_export_failure(&self) {
        self.metric_exports_failed.fetch_add(1, Ordering::Relaxed);
    }

    pub fn set_spans_buffered(&self, spans: u64) {
        self.spans_buffered.store(spans, Ordering::Relaxed);
    }

    pub fn spans_exported(&self) -> u64 {
        self.spans_exported.load(Ordering::Relaxed)
    }

    pub fn spans_delivered_late(&self) -> u64 {
        self.spans_delivered_late.load(Ordering::Relaxed)
    }

    pub fn spans_dropped(&self, reason: SpanDrop) -> u64 {
        self.spans_dropped[reason.index()].load(Ordering::Relaxed)
    }

    /// Spans the collector never got, for any reason.
    pub fn spans_failed(&self) -> u64 {
        SpanDrop::ALL
            .iter()
            .map(|&reason| self.spans_dropped(reason))
            .sum()
    }

    pub fn spans_buffered(&self) -> u64 {
        self.spans_buffered.load(Ordering::Relaxed)
    }

    pub fn exports_failed(&self) -> u64 {
        self.exports_failed.load(Ordering::Relaxed)
    }

    pub fn metric_exports_failed(&self) -> u64 {
        self.metric_exports_failed.load(Ordering::Relaxed)
    }

    /// The exporter's counters by name, as the exit summary and `/metrics` print them.
    pub fn counters(&self) -> [(&'static str, u64); 8] {
        [
            ("spans_exported", self.spans_exported()),
            ("spans_lost_in_export", self.spans_failed()),
            (
                "spans_dropped_export_buffer_full",
                self.spans_dropped(SpanDrop::ExportBufferFull),
            ),
            (
                "spans_dropped_rejected",
                self.spans_dropped(SpanDrop::Rejected),
            ),
            (
                "spans_dropped_undelivered_at_shutdown",
                self.spans_dropped(SpanDrop::UndeliveredAtShutdown),
            ),
            ("spans_delivered_late", self.spans_delivered_late()),
            ("span_exports_failed", self.exports_failed()),
            ("spans_discarded_exporter_none", self.spans_discarded()),
        ]
    }

    pub fn reachable(&self) -> bool {
        self.consecutive_failures.load(Ordering::Relaxed) == 0
    }
}
