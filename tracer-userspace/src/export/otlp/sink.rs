//! The OTLP span sink: batches go through the retry buffer to the collector, one traced
//! process (one resource) per request.

use std::sync::Arc;
use std::time::{Duration, Instant, UNIX_EPOCH};

use anyhow::Result;
use opentelemetry::trace::{SpanContext, TraceFlags, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue, StringValue};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter, SpanLinks};
use tokio::sync::watch;

use super::http_spans::{Accepted, EncodedSpans};
use super::options::OtlpOptions;
use super::outage::{FailureStreak, outage_totals};
use super::retry::{Backoff, FailureKind, PendingBatch, RetryBuffer, classify};
use super::transport::{SpanTransport, otlp_span_transport};
use crate::export::status::{ExportStatus, SpanDrop};
use crate::export::{ExportTotals, SpanSink};
use crate::model::service::ServiceIdentity;
use crate::model::span::AttributeValue;
use crate::model::span::SpanKind;
use crate::model::span::SpanRecord;
use crate::model::span::SpanStatus;

/// The collector's side of the span pipeline: every batch goes through the retry buffer,
/// so that a collector that is down, slow or refusing costs bounded memory, and what fit is
/// delivered, oldest first, when it is back.
pub struct OtlpSpanSink {
    exporter: SpanTransport,
    /// A partial success was logged: later ones are only counted.
    partial_success_logged: bool,
    buffer: RetryBuffer<Arc<ServiceIdentity>, SpanRecord>,
    backoff: Backoff,
    streak: FailureStreak,
    /// `--otlp-timeout`: bounds each attempt (a slow collector is a failed attempt).
    attempt_timeout: Duration,
    /// The deadline of the final export, once shutdown has begun.
    shutdown: watch::Receiver<Option<Instant>>,
}

impl OtlpSpanSink {
    /// `shutdown` carries the final export's deadline once shutdown begins (see
    /// [`SpanPipeline::shutdown`](crate::export::SpanPipeline::shutdown)).
    pub fn new(
        options: &OtlpOptions,
        buffer_spans: usize,
        shutdown: watch::Receiver<Option<Instant>>,
    ) -> Result<Self> {
        Ok(Self {
            exporter: otlp_span_transport(options)?,
            partial_success_logged: false,
            buffer: RetryBuffer::new(buffer_spans),
            backoff: Backoff::default(),
            streak: FailureStreak::default(),
            attempt_timeout: options.timeout,
            shutdown,
        })
    }

    /// Puts a batch in the retry buffer, one entry per traced process.
    fn enqueue(&mut self, batch: Vec<SpanRecord>, status: &ExportStatus) {
        let delayed = self.streak.failing();
        // Each process's span count first, so that each list is allocated once at its size;
        // a batch of one process is passed on as it is.
        let mut counts: Vec<(Arc<ServiceIdentity>, usize)> = Vec::new();
        for span in &batch {
            match counts
                .iter_mut()
                .find(|(service, _)| service.pid == span.service.pid)
            {
                Some((_, count)) => *count += 1,
                None => counts.push((span.service.clone(), 1)),
            }
        }
        let pending = |service, spans| PendingBatch {
            service,
            spans,
            delayed,
        };
        let by_service = if counts.len() == 1 {
            let (service, _) = counts.pop().expect("one process");
            vec![pending(service, batch)]
        } else {
            let mut by_service: Vec<_> = counts
                .into_iter()
                .map(|(service, count)| pending(service, Vec::with_capacity(count)))
                .collect();
            for span in batch {
                if let Some(group) = by_service
                    .iter_mut()
                    .find(|group| group.service.pid == span.service.pid)
                {
                    group.spans.push(span);
                }
            }
            by_service
        };
        for pending in by_service {
            let dropped = self.buffer.push(pending);
            status.record_dropped(SpanDrop::ExportBufferFull, dropped as u64);
        }
        status.set_spans_buffered(self.buffer.len() as u64);
    }

    /// Sends what is buffered, oldest first, until it is empty or an attempt fails (then
    /// the backoff says when to try again). With `deadline`, no attempt outlives it.
    async fn deliver(&mut self, status: &ExportStatus) {
        while self.backoff.ready(Instant::now()) {
            let deadline = *self.shutdown.borrow();
            let now = Instant::now();
            let timeout = match deadline {
                Some(deadline) => self
                    .attempt_timeout
                    .min(deadline.saturating_duration_since(now)),
                None => self.attempt_timeout,
            };
            if timeout.is_zero() {
                break;
            }
            let Some(mut pending) = self.buffer.pop() else {
                break;
            };
            let count = pending.spans.len() as u64;
            let attempt = tokio::time::timeout(
                timeout,
                self.exporter.send(&pending.service, &pending.spans),
            );
            let shutdown = &mut self.shutdown;
            let result = tokio::select! {
                result = attempt => match result {
                    Ok(result) => result.map_err(|error| error.to_string()),
                    Err(_) => Err(format!(
                        "no answer within {} ms (--otlp-timeout, or what was left of \
                         --shutdown-timeout)",
                        timeout.as_millis()
                    )),
                },
                // Shutdown began: the final flush sends this batch again, within its bound.
                _ = shutdown.wait_for(Option::is_some), if deadline.is_none() => {
                    self.buffer.push_front(pending);
                    break;
                }
            };
            match result {
                Ok(accepted) => {
                    let rejected = accepted.rejected.min(count);
                    status.record_success(count - rejected, pending.delayed);
                    if rejected > 0 {
                        status.record_dropped(SpanDrop::Rejected, rejected);
                        self.log_partial_success(&accepted);
                    }
                    self.backoff.succeeded();
                    if let Some(message) = self.streak.succeeded(self.buffer.len()) {
                        tracing::info!("{message}");
                    }
                }
                Err(error) => {
                    status.record_failure(error.clone());
                    let kind = classify(&error);
                    let message = self.streak.failed(
                        count,
                        &error,
                        kind,
                        self.buffer_capacity(),
                        outage_totals(status),
                    );
                    if let Some(message) = message {
                        tracing::warn!(spans = count, "{message}");
                    }
                    match kind {
                        FailureKind::Permanent => {
                            status.record_dropped(SpanDrop::Rejected, count);
                        }
                        FailureKind::Retryable => {
                            pending.delayed = true;
                            let dropped = self.buffer.push_front(pending);
                            status.record_dropped(SpanDrop::ExportBufferFull, dropped as u64);
                            self.backoff.failed(Instant::now());
                        }
                    }
                }
            }
        }
        status.set_spans_buffered(self.buffer.len() as u64);
        if self.buffer.is_empty()
            && let Some(message) = self.streak.drained(outage_totals(status))
        {
            tracing::info!("{message}");
        }
    }

    fn log_partial_success(&mut self, accepted: &Accepted) {
        if std::mem::replace(&mut self.partial_success_logged, true) {
            return;
        }
        tracing::warn!(
            spans = accepted.rejected,
            "the collector took an export but rejected {} of its spans: {:?} (counted as \
             spans_dropped_rejected; later partial rejections are counted, not logged)",
            accepted.rejected,
            accepted.message
        );
    }

    fn buffer_capacity(&self) -> usize {
        self.buffer.capacity()
    }

    /// The final export: tries until the buffer is empty or `--shutdown-timeout` is over,
    /// then counts what is left.
    async fn final_export(&mut self, status: &ExportStatus) {
        let deadline = *self.shutdown.borrow();
        // Set by `SpanPipeline::shutdown` before the channel closes.
        let deadline = deadline.unwrap_or_else(Instant::now);
        // A collector that was backed off for long gets one more chance now.
        self.backoff.succeeded();
        loop {
            self.deliver(status).await;
            let now = Instant::now();
            if self.buffer.is_empty() || now >= deadline {
                break;
            }
            let next = self.backoff.next_attempt().unwrap_or(now).min(deadline);
            tokio::time::sleep_until(next.into()).await;
        }
        let undelivered = self.buffer.clear() as u64;
        status.set_spans_buffered(0);
        if undelivered > 0 {
            status.record_dropped(SpanDrop::UndeliveredAtShutdown, undelivered);
            tracing::warn!(
                spans = undelivered,
                "{undelivered} spans were not delivered within --shutdown-timeout: the \
                 collector did not take them (spans_dropped_undelivered_at_shutdown)"
            );
        }
        if let SpanTransport::Grpc(exporter) = &mut self.exporter {
            let _ = exporter.shutdown();
        }
    }
}

impl SpanTransport {
    /// One attempt at sending `spans` of `service`. The future owns what it sends, so that
    /// the batch can go back to the retry buffer while it is pending.
    fn send(
        &mut self,
        service: &ServiceIdentity,
        spans: &[SpanRecord],
    ) -> impl Future<Output = Result<Accepted, String>> + use<'_> {
        enum Payload<'a> {
            Grpc(&'a opentelemetry_otlp::SpanExporter, Vec<SpanData>),
            Http(&'a super::http_spans::HttpSpanPoster, EncodedSpans),
        }
        let payload = match self {
            SpanTransport::Grpc(exporter) => {
                exporter.set_resource(&service.resource);
                Payload::Grpc(exporter, spans.iter().map(span_data).collect())
            }
            SpanTransport::Http(poster) => {
                let body = poster.encode(service, spans);
                Payload::Http(poster, body)
            }
        };
        async move {
            match payload {
                Payload::Grpc(exporter, data) => exporter
                    .export(data)
                    .await
                    .map(|()| Accepted::default())
                    .map_err(|error| error.to_string()),
                Payload::Http(poster, body) => poster.post(body).await,
            }
        }
    }
}

impl SpanSink for OtlpSpanSink {
    /// Only buffers: sending waits for `flush`, on this tick or when the backoff allows.
    fn export(&mut self, batch: Vec<SpanRecord>, status: &ExportStatus) {
        self.enqueue(batch, status);
    }

    /// Held spans are retried on every tick, when their backoff is over.
    async fn flush(&mut self, status: &ExportStatus) {
        self.deliver(status).await;
    }

    /// The exporter's outcomes were recorded in `status` batch by batch.
    async fn shutdown(mut self, status: &ExportStatus) -> ExportTotals {
        self.final_export(status).await;
        ExportTotals {
            spans_exported: status.spans_exported(),
            spans_failed: status.spans_failed(),
            tree: None,
        }
    }
}

fn scope() -> InstrumentationScope {
    InstrumentationScope::builder("gym-tracer")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build()
}

fn key_value(key: &'static str, value: &AttributeValue) -> KeyValue {
    match value {
        AttributeValue::Str(s) => KeyValue::new(key, StringValue::from(s)),
        AttributeValue::Int(i) => KeyValue::new(key, *i),
        AttributeValue::Bool(b) => KeyValue::new(key, *b),
        AttributeValue::Double(d) => KeyValue::new(key, *d),
    }
}

/// The SDK's form of a span, for its gRPC exporter.
pub(super) fn span_data(span: &SpanRecord) -> SpanData {
    let time = |ns: u64| UNIX_EPOCH + Duration::from_nanos(ns);
    SpanData {
        span_context: SpanContext::new(
            opentelemetry::trace::TraceId::from_bytes(span.trace_id.0),
            opentelemetry::trace::SpanId::from_bytes(span.span_id.0),
            TraceFlags::SAMPLED,
            false,
            TraceState::default(),
        ),
        parent_span_id: span
            .parent_span_id
            .map(|p| opentelemetry::trace::SpanId::from_bytes(p.0))
            .unwrap_or(opentelemetry::trace::SpanId::INVALID),
        parent_span_is_remote: span.parent_is_remote,
        span_kind: match span.kind {
            SpanKind::Server => opentelemetry::trace::SpanKind::Server,
            SpanKind::Client => opentelemetry::trace::SpanKind::Client,
            SpanKind::Internal => opentelemetry::trace::SpanKind::Internal,
        },
        name: span.name.clone().into(),
        start_time: time(span.start_unix_ns),
        end_time: time(span.end_unix_ns),
        attributes: span
            .attributes
            .iter()
            .map(|(k, v)| key_value(k, v))
            .collect(),
        dropped_attributes_count: 0,
        events: SpanEvents::default(),
        links: SpanLinks::default(),
        status: match span.status {
            SpanStatus::Unset => opentelemetry::trace::Status::Unset,
            SpanStatus::Error => opentelemetry::trace::Status::error(""),
        },
        instrumentation_scope: scope(),
    }
}
