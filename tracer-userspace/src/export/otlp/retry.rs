//! What the span exporter keeps while the collector is down, slow or refusing: a buffer of
//! span batches bounded in spans (oldest dropped first, counted), the backoff between
//! attempts, and which failures are worth retrying.
//!
//! Pure and synchronous, so the policy is unit-tested here; the OTLP span sink drives it.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use rand::Rng;

/// First wait after a failed export; it doubles with every failure in a row.
pub const BACKOFF_INITIAL: Duration = Duration::from_millis(250);
/// Longest wait between two attempts while the collector stays down.
pub const BACKOFF_MAX: Duration = Duration::from_secs(30);

/// Whether a failed export can succeed if sent again unchanged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FailureKind {
    /// The collector is down, overloaded, slow (the attempt timed out) or unreachable.
    Retryable,
    /// The collector understood the request and refused it for good (bad request, unknown
    /// path, wrong credentials, unsupported encoding): sending it again cannot help.
    Permanent,
}

/// Classifies an exporter's error by the text the OTLP exporters give (they return only a
/// string): `... gRPC code: Unavailable` or `... status code: 503`. Anything else (a
/// connection refused, a timeout, a TLS failure) is a transport problem and retryable.
///
/// Follows the OTLP specification's retryable codes (gRPC UNAVAILABLE, CANCELLED,
/// DEADLINE_EXCEEDED, ABORTED, OUT_OF_RANGE, DATA_LOSS, RESOURCE_EXHAUSTED; HTTP 429, 502,
/// 503, 504, and 408). Authentication errors (401/403, UNAUTHENTICATED/PERMISSION_DENIED)
/// are permanent: the agent's headers do not change while it runs, so the same request
/// would be refused again; the log says to check `--otlp-headers`.
pub fn classify(error: &str) -> FailureKind {
    if let Some(code) = after(error, "gRPC code: ") {
        let code: String = code.chars().take_while(char::is_ascii_alphabetic).collect();
        return match code.as_str() {
            "Unavailable" | "Cancelled" | "DeadlineExceeded" | "Aborted" | "OutOfRange"
            | "DataLoss" | "ResourceExhausted" => FailureKind::Retryable,
            // A transport failure tonic reports as Unknown keeps its cause after a colon.
            "Unknown" if error.contains("transport error") => FailureKind::Retryable,
            _ => FailureKind::Permanent,
        };
    }
    if let Some(status) = after(error, "status code: ") {
        let status: String = status.chars().take_while(char::is_ascii_digit).collect();
        return match status.parse::<u16>() {
            Ok(408 | 429 | 502 | 503 | 504) => FailureKind::Retryable,
            Ok(400..=599) => FailureKind::Permanent,
            _ => FailureKind::Retryable,
        };
    }
    FailureKind::Retryable
}

fn after<'a>(text: &'a str, marker: &str) -> Option<&'a str> {
    text.find(marker).map(|at| &text[at + marker.len()..])
}

/// Exponential backoff with jitter: after the n-th failure in a row the next attempt waits
/// between half and all of `min(BACKOFF_INITIAL * 2^(n-1), BACKOFF_MAX)`, so that agents on
/// many hosts do not all come back to a recovering collector at the same instant.
#[derive(Debug, Default)]
pub struct Backoff {
    failures: u32,
    next_attempt: Option<Instant>,
}

impl Backoff {
    /// The ceiling of the wait after `failures` failures in a row.
    pub fn ceiling(failures: u32) -> Duration {
        let doublings = failures.saturating_sub(1).min(16);
        BACKOFF_INITIAL
            .saturating_mul(1 << doublings)
            .min(BACKOFF_MAX)
    }

    /// Records a failure at `now`; returns how long until the next attempt.
    pub fn failed(&mut self, now: Instant) -> Duration {
        self.failures = self.failures.saturating_add(1);
        let ceiling = Self::ceiling(self.failures);
        let half = ceiling / 2;
        let wait = half + rand::rng().random_range(Duration::ZERO..=half);
        self.next_attempt = Some(now + wait);
        wait
    }

    pub fn succeeded(&mut self) {
        *self = Self::default();
    }

    /// Whether an attempt may be made at `now`.
    pub fn ready(&self, now: Instant) -> bool {
        self.next_attempt.is_none_or(|at| now >= at)
    }

    pub fn next_attempt(&self) -> Option<Instant> {
        self.next_attempt
    }
}

/// Spans of one traced process on their way to the collector (an OTLP request carries one
/// resource).
#[derive(Debug)]
pub struct PendingBatch<S, T> {
    pub service: S,
    pub spans: Vec<T>,
    /// Held by an outage: sending it failed, or it came while exports were failing.
    pub delayed: bool,
}

/// Batches waiting to be sent or re-sent, oldest first, holding `capacity_spans` spans at
/// most: past it the oldest spans are dropped (during a long outage the newest are what
/// someone looks at when the collector is back) and counted.
#[derive(Debug)]
pub struct RetryBuffer<S, T> {
    batches: VecDeque<PendingBatch<S, T>>,
    spans: usize,
    capacity_spans: usize,
}

impl<S, T> RetryBuffer<S, T> {
    pub fn new(capacity_spans: usize) -> Self {
        Self {
            batches: VecDeque::new(),
            spans: 0,
            capacity_spans: capacity_spans.max(1),
        }
    }

    /// Spans held.
    pub fn len(&self) -> usize {
        self.spans
    }

    pub fn is_empty(&self) -> bool {
        self.batches.is_empty()
    }

    /// Spans held at most.
    pub fn capacity(&self) -> usize {
        self.capacity_spans
    }

    /// Adds a batch at the back; returns how many of the oldest spans were dropped to make
    /// room (possibly some of this batch, when it alone is over the bound).
    pub fn push(&mut self, batch: PendingBatch<S, T>) -> usize {
        if batch.spans.is_empty() {
            return 0;
        }
        self.spans += batch.spans.len();
        self.batches.push_back(batch);
        let mut dropped = 0;
        while self.spans > self.capacity_spans {
            let excess = self.spans - self.capacity_spans;
            let Some(oldest) = self.batches.front_mut() else {
                break;
            };
            if oldest.spans.len() <= excess {
                let removed = oldest.spans.len();
                self.batches.pop_front();
                self.spans -= removed;
                dropped += removed;
            } else {
                oldest.spans.drain(..excess);
                self.spans -= excess;
                dropped += excess;
            }
        }
        dropped
    }

    /// Takes the oldest batch to send it.
    pub fn pop(&mut self) -> Option<PendingBatch<S, T>> {
        let batch = self.batches.pop_front()?;
        self.spans -= batch.spans.len();
        Some(batch)
    }

    /// Puts back a batch whose sending failed, as the oldest; returns the spans dropped to
    /// stay in bounds (the oldest first, so possibly this batch's).
    pub fn push_front(&mut self, batch: PendingBatch<S, T>) -> usize {
        if batch.spans.is_empty() {
            return 0;
        }
        self.spans += batch.spans.len();
        self.batches.push_front(batch);
        let mut dropped = 0;
        while self.spans > self.capacity_spans {
            let excess = self.spans - self.capacity_spans;
            let Some(oldest) = self.batches.front_mut() else {
                break;
            };
            let removed = excess.min(oldest.spans.len());
            oldest.spans.drain(..removed);
            self.spans -= removed;
            dropped += removed;
            if oldest.spans.is_empty() {
                self.batches.pop_front();
            }
        }
        dropped
    }

    /// Empties the buffer; returns the spans that were in it.
    pub fn clear(&mut self) -> usize {
        self.batches.clear();
        std::mem::take(&mut self.spans)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(first: u32, count: u32) -> PendingBatch<(), u32> {
        PendingBatch {
            service: (),
            spans: (first..first + count).collect(),
            delayed: false,
        }
    }

    #[test]
    fn failures_are_classified_as_the_otlp_specification_says() {
        let grpc = |code: &str| {
            classify(&format!(
                "TonicTracesClient export failed with gRPC code: {code}"
            ))
        };
        assert_eq!(grpc("Unavailable"), FailureKind::Retryable);
        assert_eq!(grpc("Cancelled: Timeout expired"), FailureKind::Retryable);
        assert_eq!(grpc("DeadlineExceeded"), FailureKind::Retryable);
        assert_eq!(grpc("ResourceExhausted"), FailureKind::Retryable);
        assert_eq!(grpc("InvalidArgument"), FailureKind::Permanent);
        assert_eq!(grpc("Unimplemented"), FailureKind::Permanent);
        assert_eq!(grpc("Unauthenticated"), FailureKind::Permanent);
        assert_eq!(
            grpc("Unknown: transport error: connection refused"),
            FailureKind::Retryable
        );
        let http =
            |status: u16| classify(&format!("HTTP export failed with status code: {status}"));
        for status in [408, 429, 502, 503, 504] {
            assert_eq!(http(status), FailureKind::Retryable, "{status}");
        }
        for status in [400, 401, 403, 404, 413, 500] {
            assert_eq!(http(status), FailureKind::Permanent, "{status}");
        }
        assert_eq!(
            classify("HTTP export failed: network error"),
            FailureKind::Retryable
        );
        assert_eq!(
            classify("export timed out after 1s"),
            FailureKind::Retryable
        );
    }

    #[test]
    fn backoff_doubles_to_its_cap_with_jitter_and_resets_on_success() {
        assert_eq!(Backoff::ceiling(1), BACKOFF_INITIAL);
        assert_eq!(Backoff::ceiling(2), BACKOFF_INITIAL * 2);
        assert_eq!(Backoff::ceiling(3), BACKOFF_INITIAL * 4);
        assert_eq!(Backoff::ceiling(9), BACKOFF_MAX);
        assert_eq!(Backoff::ceiling(u32::MAX), BACKOFF_MAX);
        let now = Instant::now();
        let mut backoff = Backoff::default();
        assert!(backoff.ready(now));
        for failures in 1..=12 {
            let wait = backoff.failed(now);
            let ceiling = Backoff::ceiling(failures);
            assert!(
                wait >= ceiling / 2 && wait <= ceiling,
                "{wait:?} {ceiling:?}"
            );
            assert!(!backoff.ready(now));
            assert!(backoff.ready(now + ceiling));
        }
        backoff.succeeded();
        assert!(backoff.ready(now));
        assert_eq!(backoff.next_attempt(), None);
    }

    #[test]
    fn the_buffer_keeps_the_newest_spans_and_counts_the_dropped() {
        let mut buffer = RetryBuffer::new(10);
        assert_eq!(buffer.push(batch(0, 4)), 0);
        assert_eq!(buffer.push(batch(4, 4)), 0);
        assert_eq!(buffer.len(), 8);
        // 3 over: the oldest batch loses its first three spans.
        assert_eq!(buffer.push(batch(8, 5)), 3);
        assert_eq!(buffer.len(), 10);
        let oldest = buffer.pop().unwrap();
        assert_eq!(oldest.spans, [3]);
        // A failed batch goes back in front; what does not fit goes from the front.
        assert_eq!(buffer.push_front(batch(100, 1)), 0);
        assert_eq!(buffer.push_front(batch(200, 3)), 3);
        assert_eq!(buffer.pop().unwrap().spans, [100]);
        // A batch larger than the whole buffer keeps its newest spans.
        let mut small = RetryBuffer::new(2);
        assert_eq!(small.push(batch(0, 5)), 3);
        assert_eq!(small.pop().unwrap().spans, [3, 4]);
        assert!(small.is_empty());
        assert_eq!(small.len(), 0);
        assert_eq!(buffer.clear(), 9);
        assert_eq!(buffer.len(), 0);
    }

    #[test]
    fn produced_spans_are_either_held_or_counted_as_dropped() {
        let mut buffer = RetryBuffer::new(7);
        let mut dropped = 0;
        let mut produced = 0;
        for round in 0..50u32 {
            let count = round % 6 + 1;
            produced += count as usize;
            dropped += buffer.push(batch(round * 10, count));
            if round % 3 == 0
                && let Some(failed) = buffer.pop()
            {
                dropped += buffer.push_front(failed);
            }
            assert!(buffer.len() <= 7);
            assert_eq!(buffer.len() + dropped, produced);
        }
    }
}
