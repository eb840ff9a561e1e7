//! What the agent logs about a collector outage: once when exports start failing, once when
//! they work again, and once when what was held meanwhile has gone out.

use super::failure::failure_hint;
use super::retry::{BACKOFF_MAX, FailureKind};
use crate::export::status::ExportStatus;

/// What to log about an outage: when exports start failing, when they work again, and when
/// what was held meanwhile has gone out (not every batch: that would be twice a second for
/// as long as the collector is down).
#[derive(Debug, Default)]
pub struct FailureStreak {
    state: StreakState,
}

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
enum StreakState {
    #[default]
    Healthy,
    /// `failed_attempts` in a row; the exporter's totals when it started.
    Failing {
        failed_attempts: u64,
        since: OutageTotals,
    },
    /// Exports work again and the spans held during the outage are being sent.
    Recovering { since: OutageTotals },
}

/// The totals an outage's report is the difference of.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct OutageTotals {
    delivered_late: u64,
    dropped: u64,
}

impl FailureStreak {
    /// Whether exports are failing now (the last attempt failed).
    pub fn failing(&self) -> bool {
        matches!(self.state, StreakState::Failing { .. })
    }

    /// The message to log, for the first failure of a streak.
    pub fn failed(
        &mut self,
        spans: u64,
        error: &str,
        kind: FailureKind,
        buffer_spans: usize,
        totals: OutageTotals,
    ) -> Option<String> {
        match &mut self.state {
            StreakState::Failing {
                failed_attempts, ..
            } => {
                *failed_attempts += 1;
                None
            }
            state => {
                let since = match *state {
                    StreakState::Recovering { since } => since,
                    _ => totals,
                };
                *state = StreakState::Failing {
                    failed_attempts: 1,
                    since,
                };
                let then = match kind {
                    FailureKind::Retryable => format!(
                        "retrying with backoff (up to {} s apart), holding up to {buffer_spans} \
                         spans meanwhile (past that the oldest are dropped: \
                         spans_dropped_export_buffer_full)",
                        BACKOFF_MAX.as_secs()
                    ),
                    FailureKind::Permanent => "the collector refused them for good, so they are \
                     dropped (spans_dropped_rejected)"
                        .to_string(),
                };
                Some(format!(
                    "exporting {spans} spans failed: {error}{}; {then}",
                    failure_hint(error)
                ))
            }
        }
    }

    /// The message to log, when this success ends a streak.
    pub fn succeeded(&mut self, buffered: usize) -> Option<String> {
        let StreakState::Failing {
            failed_attempts,
            since,
        } = self.state
        else {
            return None;
        };
        self.state = StreakState::Recovering { since };
        Some(format!(
            "exporting spans works again after {failed_attempts} failed attempts; sending the \
             {buffered} spans still held"
        ))
    }

    /// The message to log, when the buffer is empty again after an outage.
    pub fn drained(&mut self, totals: OutageTotals) -> Option<String> {
        let StreakState::Recovering { since } = self.state else {
            return None;
        };
        self.state = StreakState::Healthy;
        Some(format!(
            "the outage is over: {} spans delivered late, {} dropped (spans_dropped_*)",
            totals.delivered_late - since.delivered_late,
            totals.dropped - since.dropped
        ))
    }
}

pub fn outage_totals(status: &ExportStatus) -> OutageTotals {
    OutageTotals {
        delivered_late: status.spans_delivered_late(),
        dropped: status.spans_failed(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_failing_collector_is_reported_once_per_outage() {
        let mut streak = FailureStreak::default();
        assert_eq!(streak.succeeded(0), None);
        assert_eq!(streak.drained(OutageTotals::default()), None);
        let start = OutageTotals {
            delivered_late: 10,
            dropped: 1,
        };
        let first = streak
            .failed(3, "transport error", FailureKind::Retryable, 100, start)
            .unwrap();
        assert!(
            first.starts_with("exporting 3 spans failed: transport error; retrying"),
            "{first}"
        );
        assert!(first.contains("holding up to 100 spans"), "{first}");
        assert_eq!(
            streak.failed(4, "transport error", FailureKind::Retryable, 100, start),
            None
        );
        assert_eq!(
            streak.succeeded(7).as_deref(),
            Some(
                "exporting spans works again after 2 failed attempts; sending the 7 spans still held"
            )
        );
        assert_eq!(streak.succeeded(0), None);
        let end = OutageTotals {
            delivered_late: 17,
            dropped: 3,
        };
        assert_eq!(
            streak.drained(end).as_deref(),
            Some("the outage is over: 7 spans delivered late, 2 dropped (spans_dropped_*)")
        );
        assert_eq!(streak.drained(end), None);
        let refused = streak
            .failed(
                1,
                "gRPC code: InvalidArgument",
                FailureKind::Permanent,
                100,
                end,
            )
            .unwrap();
        assert!(
            refused.contains("dropped (spans_dropped_rejected)"),
            "{refused}"
        );
    }
}
