//! Exporters: JSON lines on stdout (the default), trace trees on stdout (`--output tree`), or
//! OTLP over gRPC or HTTP/protobuf.
//!
//! Spans go through a bounded queue to one export task, which batches them and hands each
//! batch, grouped by traced process, to the OTLP exporter with that process's resource.
//! Metrics use one SDK meter provider per traced process, because a provider has one resource.

use std::borrow::Cow;
use std::collections::HashMap;
use std::future::Future;
use std::io::Write;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use opentelemetry::trace::{SpanContext, TraceFlags, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig, WithHttpConfig, WithTonicConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
use opentelemetry_sdk::metrics::{SdkMeterProvider, Temporality};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter, SpanLinks};
use serde_json::{Map, Value, json};
use tokio::sync::{mpsc, watch};

use crate::config::HeaderList;
use crate::config::cli::OtlpCompression;
use crate::model::service::ServiceIdentity;
use crate::model::span::AttributeValue;
use crate::model::span::SpanKind;
use crate::model::span::SpanRecord;
use crate::model::span::SpanStatus;
use crate::ops::health::{ExportStatus, SpanDrop};
use crate::retry::{Backoff, FailureKind, PendingBatch, RetryBuffer, classify};
use crate::tree::{TreeCounters, TreeOptions, TreePrinter};

/// OTLP transport, as `OTEL_EXPORTER_OTLP_PROTOCOL` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OtlpProtocol {
    #[value(name = "grpc")]
    Grpc,
    #[value(name = "http/protobuf")]
    HttpProtobuf,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExportTarget {
    JsonLines,
    /// Each finished trace as an indented tree on stdout, for a human; metrics are not
    /// exported (stdout is the tree's).
    Tree,
    Otlp(OtlpOptions),
}

/// Everything about reaching the collector, from the `--otlp-*` options.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OtlpOptions {
    pub endpoint: String,
    pub protocol: OtlpProtocol,
    /// Sent with every export; printing this type masks the values.
    pub headers: HeaderList,
    pub timeout: Duration,
    pub compression: OtlpCompression,
    /// CA bundle to verify the collector with (else the system roots, for https://).
    pub ca_file: Option<PathBuf>,
    /// Client certificate and key for mutual TLS.
    pub client_identity: Option<(PathBuf, PathBuf)>,
}

/// How spans are queued, batched and kept on their way out, whatever the sink.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportLimits {
    pub batch_size: usize,
    pub queue_size: usize,
    /// Spans held for retry while the collector fails (OTLP only); past it the oldest are
    /// dropped and counted.
    pub buffer_spans: usize,
    /// How long the final export may take at shutdown; what is left after it is counted.
    pub shutdown_timeout: Duration,
}

const BATCH_DELAY: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, Debug, Default)]
pub struct ExportTotals {
    pub spans_exported: u64,
    pub spans_failed: u64,
    /// Set for [`ExportTarget::Tree`].
    pub tree: Option<TreeCounters>,
}

/// Spans cross to the export task in batches (one per release tick), not one by one: each
/// send may wake the task on the other thread, and a wake-up per span cost the agent more
/// than building the span.
pub struct SpanPipeline {
    sender: mpsc::UnboundedSender<Vec<SpanRecord>>,
    /// Spans sent and not yet taken by the export task; bounded by `queue_size`.
    queued: Arc<AtomicUsize>,
    queue_size: usize,
    task: tokio::task::JoinHandle<ExportTotals>,
    /// Set to the final export's deadline when shutdown begins: it also cuts short an
    /// attempt already waiting on a slow collector.
    shutdown: watch::Sender<Option<Instant>>,
    shutdown_timeout: Duration,
}

enum SpanSink {
    JsonLines,
    Tree(Box<TreePrinter<std::io::Stdout>>),
    Otlp(Box<OtlpSpanSink>),
}

/// The collector's side of the span pipeline: every batch goes through the retry buffer,
/// so that a collector that is down, slow or refusing costs bounded memory, and what fit is
/// delivered, oldest first, when it is back.
struct OtlpSpanSink {
    exporter: opentelemetry_otlp::SpanExporter,
    buffer: RetryBuffer<Arc<ServiceIdentity>, SpanRecord>,
    backoff: Backoff,
    streak: FailureStreak,
    /// `--otlp-timeout`: bounds each attempt (a slow collector is a failed attempt).
    attempt_timeout: Duration,
    /// The deadline of the final export, once shutdown has begun.
    shutdown: watch::Receiver<Option<Instant>>,
}

/// What to log about an outage: when exports start failing, when they work again, and when
/// what was held meanwhile has gone out (not every batch: that would be twice a second for
/// as long as the collector is down).
#[derive(Debug, Default)]
struct FailureStreak {
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
struct OutageTotals {
    delivered_late: u64,
    dropped: u64,
}

impl FailureStreak {
    /// Whether exports are failing now (the last attempt failed).
    fn failing(&self) -> bool {
        matches!(self.state, StreakState::Failing { .. })
    }

    /// The message to log, for the first failure of a streak.
    fn failed(
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
                        crate::retry::BACKOFF_MAX.as_secs()
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
    fn succeeded(&mut self, buffered: usize) -> Option<String> {
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
    fn drained(&mut self, totals: OutageTotals) -> Option<String> {
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

fn outage_totals(status: &ExportStatus) -> OutageTotals {
    OutageTotals {
        delivered_late: status.spans_delivered_late(),
        dropped: status.spans_failed(),
    }
}

impl OtlpSpanSink {
    /// Puts a batch in the retry buffer, one entry per traced process.
    fn enqueue(&mut self, batch: Vec<SpanRecord>, status: &ExportStatus) {
        let mut by_service: Vec<PendingBatch<Arc<ServiceIdentity>, SpanRecord>> = Vec::new();
        for span in batch {
            match by_service
                .iter_mut()
                .find(|pending| pending.service.pid == span.service.pid)
            {
                Some(pending) => pending.spans.push(span),
                None => by_service.push(PendingBatch {
                    service: span.service.clone(),
                    spans: vec![span],
                    delayed: self.streak.failing(),
                }),
            }
        }
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
            self.exporter.set_resource(&pending.service.resource);
            let data = pending.spans.iter().map(span_data).collect();
            let attempt = tokio::time::timeout(timeout, self.exporter.export(data));
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
                Ok(()) => {
                    status.record_success(count, pending.delayed);
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

    fn buffer_capacity(&self) -> usize {
        self.buffer.capacity()
    }

    /// The final export: tries until the buffer is empty or `--shutdown-timeout` is over,
    /// then counts what is left.
    async fn flush(&mut self, status: &ExportStatus) {
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
        let _ = self.exporter.shutdown();
    }
}

/// What is exported; the OTLP/HTTP path and the SDK's per-signal environment variables
/// follow from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Signal {
    Traces,
    Metrics,
}

impl Signal {
    const ALL: [Signal; 2] = [Signal::Traces, Signal::Metrics];

    fn name(self) -> &'static str {
        match self {
            Signal::Traces => "traces",
            Signal::Metrics => "metrics",
        }
    }

    fn headers_var(self) -> &'static str {
        match self {
            Signal::Traces => opentelemetry_otlp::OTEL_EXPORTER_OTLP_TRACES_HEADERS,
            Signal::Metrics => opentelemetry_otlp::OTEL_EXPORTER_OTLP_METRICS_HEADERS,
        }
    }

    fn compression_var(self) -> &'static str {
        match self {
            Signal::Traces => opentelemetry_otlp::OTEL_EXPORTER_OTLP_TRACES_COMPRESSION,
            Signal::Metrics => opentelemetry_otlp::OTEL_EXPORTER_OTLP_METRICS_COMPRESSION,
        }
    }
}

fn http_signal_endpoint(endpoint: &str, signal: Signal) -> String {
    format!("{}/v1/{}", endpoint.trim_end_matches('/'), signal.name())
}

/// The `--otlp-*` options made ready for the SDK's exporter builders: headers validated, the
/// certificate files read and checked. The span and the metric exporter are both configured
/// by [`OtlpTransport::grpc`] or [`OtlpTransport::http`], so the two cannot drift.
struct OtlpTransport {
    endpoint: String,
    timeout: Duration,
    compression: Option<opentelemetry_otlp::Compression>,
    headers: http::HeaderMap,
    /// PEM bundle of the CAs that replace the system roots.
    ca_pem: Option<Vec<u8>>,
    /// PEM client certificate and key.
    identity_pem: Option<(Vec<u8>, Vec<u8>)>,
}

/// Everything [`OtlpTransport::load`] checks before an exporter is built (`check-config`
/// and `run` call this before loading anything into the kernel).
pub fn check_otlp_options(options: &OtlpOptions) -> Result<()> {
    OtlpTransport::load(options).map(drop)
}

impl OtlpTransport {
    fn load(options: &OtlpOptions) -> Result<Self> {
        install_crypto_provider();
        let headers = header_map(&options.headers)?;
        check_sdk_environment(&headers, options.compression, |name| {
            std::env::var(name).ok()
        })?;
        let ca_pem = options
            .ca_file
            .as_deref()
            .map(|path| read_pem("--otlp-ca-file", path, PemContent::Certificates))
            .transpose()?;
        let identity_pem = options
            .client_identity
            .as_ref()
            .map(|(cert, key)| {
                Ok::<_, anyhow::Error>((
                    read_pem("--otlp-client-cert", cert, PemContent::Certificates)?,
                    read_pem("--otlp-client-key", key, PemContent::PrivateKey)?,
                ))
            })
            .transpose()?;
        Ok(Self {
            endpoint: options.endpoint.clone(),
            timeout: options.timeout,
            compression: match options.compression {
                OtlpCompression::None => None,
                OtlpCompression::Gzip => Some(opentelemetry_otlp::Compression::Gzip),
            },
            headers,
            ca_pem,
            identity_pem,
        })
    }

    fn is_https(&self) -> bool {
        self.endpoint.starts_with("https://")
    }

    fn grpc<B: WithExportConfig + WithTonicConfig>(&self, builder: B) -> B {
        use opentelemetry_otlp::tonic_types::metadata::MetadataMap;
        use opentelemetry_otlp::tonic_types::transport::{Certificate, ClientTlsConfig, Identity};
        let mut builder = builder
            .with_endpoint(&self.endpoint)
            .with_protocol(Protocol::Grpc)
            .with_timeout(self.timeout)
            .with_metadata(MetadataMap::from_headers(self.headers.clone()));
        if let Some(compression) = self.compression {
            builder = builder.with_compression(compression);
        }
        if self.is_https() {
            // tonic trusts no roots unless told to.
            let tls = match &self.ca_pem {
                Some(pem) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(pem)),
                None => ClientTlsConfig::new().with_native_roots(),
            };
            builder = builder.with_tls_config(match &self.identity_pem {
                Some((cert, key)) => tls.identity(Identity::from_pem(cert, key)),
                None => tls,
            });
        }
        builder
    }

    fn http<B: WithExportConfig + WithHttpConfig>(&self, builder: B, signal: Signal) -> Result<B> {
        let mut client = reqwest::Client::builder().timeout(self.timeout);
        if let Some(pem) = &self.ca_pem {
            let roots = reqwest::Certificate::from_pem_bundle(pem)
                .context("--otlp-ca-file: the certificates do not parse")?;
            client = client.tls_certs_only(roots);
        }
        if let Some((cert, key)) = &self.identity_pem {
            let identity = reqwest::Identity::from_pem(&[cert.as_slice(), b"\n", key].concat())
                .context("--otlp-client-cert / --otlp-client-key do not parse as a PEM identity")?;
            client = client.identity(identity);
        }
        let client = client.build().context("building the HTTP client")?;
        let mut builder = builder
            .with_endpoint(http_signal_endpoint(&self.endpoint, signal))
            .with_protocol(Protocol::HttpBinary)
            .with_timeout(self.timeout)
            .with_headers(http_builder_headers(&self.headers))
            .with_http_client(ExplainedHttpClient {
                client,
                failing: AtomicBool::new(false),
            });
        if let Some(compression) = self.compression {
            builder = builder.with_compression(compression);
        }
        Ok(builder)
    }
}

/// The reqwest client for the collector, logging why a request failed: the SDK reports every
/// transport failure as "network error" (the cause goes to its debug log), which hides, say,
/// a collector certificate that is not trusted. Logged once per run of failures.
#[derive(Debug)]
struct ExplainedHttpClient {
    client: reqwest::Client,
    failing: AtomicBool,
}

impl opentelemetry_http::HttpClient for ExplainedHttpClient {
    fn send_bytes<'life0, 'async_trait>(
        &'life0 self,
        request: http::Request<opentelemetry_http::Bytes>,
    ) -> Pin<Box<dyn Future<Output = HttpResult> + Send + 'async_trait>>
    where
        'life0: 'async_trait,
        Self: 'async_trait,
    {
        Box::pin(async move {
            let result = self.client.send_bytes(request).await;
            match &result {
                Ok(_) => self.failing.store(false, Ordering::Relaxed),
                Err(error) if !self.failing.swap(true, Ordering::Relaxed) => {
                    let cause = error_chain(error.as_ref());
                    tracing::warn!("OTLP/HTTP export: {cause}{}", failure_hint(&cause));
                }
                Err(_) => {}
            }
            result
        })
    }
}

type HttpResult = Result<http::Response<opentelemetry_http::Bytes>, opentelemetry_http::HttpError>;

/// `error` and its sources, as `a: b: c` (a source that repeats its parent is left out).
fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.ends_with(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// What to check, for the failures a misconfigured export runs into.
fn failure_hint(error: &str) -> &'static str {
    const HINTS: [(&str, &str); 12] = [
        (
            "without sending TLS close_notify",
            "; the collector hung up during TLS: does it want a client certificate \
             (--otlp-client-cert and --otlp-client-key)?",
        ),
        (
            "KeyMismatch",
            "; is --otlp-client-key the key of --otlp-client-cert?",
        ),
        (
            "no native certs",
            "; this system has no trusted CAs: give the collector's CA with --otlp-ca-file",
        ),
        (
            "UnknownIssuer",
            "; the collector's certificate is not signed by a trusted CA: give its CA with \
             --otlp-ca-file",
        ),
        (
            "NotValidForName",
            "; the collector's certificate is not for the host in --otlp-endpoint",
        ),
        (
            "CertificateRequired",
            "; the collector wants a client certificate: --otlp-client-cert and \
             --otlp-client-key",
        ),
        (
            "Connection refused",
            "; is the collector listening at --otlp-endpoint?",
        ),
        (
            "Unauthenticated",
            "; the collector refused the credentials: check --otlp-headers",
        ),
        (
            "Status Code: 401",
            "; the collector refused the credentials: check --otlp-headers",
        ),
        (
            "Status Code: 403",
            "; the collector refused the credentials: check --otlp-headers",
        ),
        (
            "status code: 401",
            "; the collector refused the credentials: check --otlp-headers",
        ),
        (
            "status code: 403",
            "; the collector refused the credentials: check --otlp-headers",
        ),
    ];
    HINTS
        .iter()
        .find(|(symptom, _)| error.contains(symptom))
        .map_or("", |(_, hint)| hint)
}

/// reqwest is built with `rustls-no-provider` (aws-lc-rs is slow to build and needs cmake), so
/// rustls needs a process-wide provider before the first client is built; tonic uses it too.
fn install_crypto_provider() {
    if rustls::crypto::CryptoProvider::get_default().is_none() {
        // Err only when another thread installed one first, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    }
}

/// Headers for the HTTP builder, which percent-decodes every value it is given (the gRPC one
/// does not): `%` is escaped so that the decoded values arrive as they are.
fn http_builder_headers(headers: &http::HeaderMap) -> HashMap<String, String> {
    headers
        .iter()
        .filter_map(|(name, value)| {
            Some((name.to_string(), value.to_str().ok()?.replace('%', "%25")))
        })
        .collect()
}

/// `--otlp-headers` as HTTP headers; a later duplicate replaces an earlier one. Errors name
/// the header, never its value (it is usually a credential).
fn header_map(headers: &HeaderList) -> Result<http::HeaderMap> {
    let mut map = http::HeaderMap::new();
    for (key, value) in &headers.0 {
        let name = http::HeaderName::from_bytes(key.as_bytes()).map_err(|_| {
            anyhow::anyhow!("--otlp-headers: `{key}` is not a valid HTTP header name")
        })?;
        // The HTTP builder passes on only values that are printable ASCII.
        let value = http::HeaderValue::from_str(value)
            .ok()
            .filter(|value| value.to_str().is_ok())
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "--otlp-headers: the value of `{key}` must be printable ASCII (a header \
                     cannot carry anything else); fix the value"
                )
            })?;
        map.insert(name, value);
    }
    Ok(map)
}

/// The SDK's builders also read `OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]HEADERS` and
/// `..._COMPRESSION` themselves, and let them win over what they are given: headers key by
/// key, compression when none is given. Where that would send something the options do not
/// say, refuse. (Endpoint, protocol and timeout are given explicitly, which the SDK lets win;
/// `..._INSECURE` only applies to an endpoint without a scheme, which `config::validate`
/// refuses.)
fn check_sdk_environment(
    headers: &http::HeaderMap,
    compression: OtlpCompression,
    env: impl Fn(&str) -> Option<String>,
) -> Result<()> {
    for signal in Signal::ALL {
        // As the SDK: the signal's variable if set (even empty), else the generic one.
        let variable = [
            signal.headers_var(),
            opentelemetry_otlp::OTEL_EXPORTER_OTLP_HEADERS,
        ]
        .into_iter()
        .find_map(|name| env(name).map(|value| (name, value)));
        if let Some((name, value)) = variable {
            for (key, value) in sdk_header_pairs(&value) {
                if headers.get(key.as_str()).and_then(|v| v.to_str().ok()) != Some(value.as_str()) {
                    anyhow::bail!(
                        "{name} is set and the OTLP exporter would send its `{key}` header, which \
                         --otlp-headers does not say; unset {name}, or give the same headers \
                         with --otlp-headers"
                    );
                }
            }
        }
        if compression == OtlpCompression::None {
            for name in [
                signal.compression_var(),
                opentelemetry_otlp::OTEL_EXPORTER_OTLP_COMPRESSION,
            ] {
                let Some(value) = env(name).filter(|value| !value.is_empty()) else {
                    continue;
                };
                if value.eq_ignore_ascii_case("none") {
                    break;
                }
                if value.eq_ignore_ascii_case("gzip") {
                    anyhow::bail!(
                        "{name}={value} would make the OTLP exporter compress {} although \
                         --otlp-compression is none; unset {name}, or pass --otlp-compression gzip",
                        signal.name()
                    );
                }
                // The SDK ignores what it cannot use (zstd is not built in) and reads on.
            }
        }
    }
    Ok(())
}

/// A headers variable as the SDK reads it: `key=value` pairs, percent-decoded where that
/// works, pairs with an empty key or value or an invalid name or value skipped.
fn sdk_header_pairs(text: &str) -> Vec<(String, String)> {
    text.split_terminator(',')
        .filter_map(|item| {
            let (key, raw) = item.trim().split_once('=')?;
            let key = key.trim();
            let raw = raw.trim();
            let value = match format!("k={raw}").parse::<crate::config::KeyValueList>() {
                Ok(pairs) => pairs
                    .0
                    .into_iter()
                    .next()
                    .map_or_else(String::new, |(_, v)| v),
                Err(_) => raw.to_owned(),
            };
            let valid = http::HeaderName::from_bytes(key.as_bytes()).is_ok()
                && http::HeaderValue::from_str(&value).is_ok();
            (valid && !value.is_empty()).then(|| (key.to_ascii_lowercase(), value))
        })
        .collect()
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PemContent {
    Certificates,
    PrivateKey,
}

/// Reads `path` (given as `flag`) and checks it holds `content`: the TLS libraries skip PEM
/// sections they cannot use, which would turn a wrong file into a failed handshake later.
fn read_pem(flag: &str, path: &std::path::Path, content: PemContent) -> Result<Vec<u8>> {
    let pem = std::fs::read(path)
        .with_context(|| format!("{flag} {}: cannot be read", path.display()))?;
    check_pem(&pem, content).map_err(|why| anyhow::anyhow!("{flag} {}: {why}", path.display()))?;
    Ok(pem)
}

fn check_pem(pem: &[u8], content: PemContent) -> Result<(), String> {
    use rustls_pki_types::pem::{Error, PemObject};
    use rustls_pki_types::{CertificateDer, PrivateKeyDer};
    let found = match content {
        PemContent::Certificates => CertificateDer::pem_slice_iter(pem)
            .collect::<Result<Vec<_>, _>>()
            .map(|certs| !certs.is_empty()),
        PemContent::PrivateKey => match PrivateKeyDer::from_pem_slice(pem) {
            Ok(_) => Ok(true),
            Err(Error::NoItemsFound) => Ok(false),
            Err(error) => Err(error),
        },
    }
    .map_err(|error| format!("not valid PEM ({error}); is the file truncated?"))?;
    match (found, content) {
        (true, _) => Ok(()),
        (false, PemContent::Certificates) => Err("no PEM certificate in it: it must hold \
             `-----BEGIN CERTIFICATE-----` blocks (convert a DER file with \
             `openssl x509 -inform der -in FILE -out FILE.pem`)"
            .into()),
        (false, PemContent::PrivateKey) => Err("no unencrypted PEM private key in it: it must \
             hold a `-----BEGIN PRIVATE KEY-----` (or RSA / EC PRIVATE KEY) block; decrypt an \
             encrypted key with `openssl pkey -in KEY -out KEY.pem`"
            .into()),
    }
}

/// The SDK's span and metric exporter builders are different types with the same methods
/// (and no trait for `with_tonic`, `with_http`, `build`): this builds either one from an
/// [`OtlpTransport`], over the protocol `options` name.
macro_rules! build_otlp_exporter {
    ($exporter:ident, $signal:expr, $options:expr, $retry:expr) => {{
        use opentelemetry_otlp::$exporter;
        let options: &OtlpOptions = $options;
        let transport = OtlpTransport::load(options)?;
        let exporter = match options.protocol {
            OtlpProtocol::Grpc => transport
                .grpc($exporter::builder().with_tonic().with_retry_policy($retry))
                .build(),
            OtlpProtocol::HttpProtobuf => transport
                .http(
                    $exporter::builder().with_http().with_retry_policy($retry),
                    $signal,
                )
                .map_err(|error| build_error(&error, $signal, &options.endpoint))?
                .build(),
        };
        exporter.map_err(|error| build_error(&error.into(), $signal, &options.endpoint))
    }};
}

/// One attempt per export: the span pipeline retries itself, with a buffer and backoff
/// that outlast an outage (the SDK's retries give up within the export timeout).
fn otlp_span_exporter(options: &OtlpOptions) -> Result<opentelemetry_otlp::SpanExporter> {
    build_otlp_exporter!(
        SpanExporter,
        Signal::Traces,
        options,
        opentelemetry_otlp::RetryPolicy::disabled()
    )
}

/// The SDK's recommended retries, within the export timeout: metrics are cumulative, so an
/// export that fails loses nothing the next one does not carry.
fn otlp_metric_exporter(options: &OtlpOptions) -> Result<opentelemetry_otlp::MetricExporter> {
    build_otlp_exporter!(
        MetricExporter,
        Signal::Metrics,
        options,
        opentelemetry_otlp::RetryPolicy::recommended()
    )
}

/// An exporter that could not be built, with what to check.
fn build_error(error: &anyhow::Error, signal: Signal, endpoint: &str) -> anyhow::Error {
    let text = format!("{error:#}");
    anyhow::anyhow!(
        "creating the OTLP {} exporter for {}: {text}{}",
        signal.name(),
        crate::config::printable_endpoint(endpoint),
        failure_hint(&text)
    )
}

impl SpanPipeline {
    /// The export task, and the gRPC channel, live on `runtime`.
    /// `status` is told the outcome of every batch (for `/healthz` and `/metrics`).
    pub fn start(
        runtime: &tokio::runtime::Handle,
        target: &ExportTarget,
        limits: ExportLimits,
        status: Arc<ExportStatus>,
    ) -> Result<Self> {
        let _runtime = runtime.enter();
        let (shutdown, shutdown_receiver) = watch::channel(None);
        let sink = match target {
            ExportTarget::JsonLines => SpanSink::JsonLines,
            ExportTarget::Tree => SpanSink::Tree(Box::new(TreePrinter::new(
                TreeOptions::default(),
                std::io::stdout(),
            ))),
            ExportTarget::Otlp(options) => SpanSink::Otlp(Box::new(OtlpSpanSink {
                exporter: otlp_span_exporter(options)?,
                buffer: RetryBuffer::new(limits.buffer_spans),
                backoff: Backoff::default(),
                streak: FailureStreak::default(),
                attempt_timeout: options.timeout,
                shutdown: shutdown_receiver,
            })),
        };
        let (sender, receiver) = mpsc::unbounded_channel();
        let queued = Arc::new(AtomicUsize::new(0));
        let task = tokio::spawn(run_span_export(
            sink,
            QueueReceiver {
                receiver,
                queued: queued.clone(),
            },
            limits.batch_size,
            status,
        ));
        Ok(Self {
            sender,
            queued,
            queue_size: limits.queue_size,
            task,
            shutdown,
            shutdown_timeout: limits.shutdown_timeout,
        })
    }

    /// Queues the spans in `spans` (leaving it empty) as far as the queue has room; returns
    /// how many were queued and how many dropped because it was full (the caller counts).
    pub fn offer(&self, spans: &mut Vec<SpanRecord>) -> (usize, usize) {
        let room = self
            .queue_size
            .saturating_sub(self.queued.load(Ordering::Relaxed));
        let dropped = spans.len().saturating_sub(room);
        spans.truncate(spans.len() - dropped);
        let queued = spans.len();
        if queued > 0 {
            self.queued.fetch_add(queued, Ordering::Relaxed);
            if let Err(unsent) = self.sender.send(std::mem::take(spans)) {
                // The export task is gone (it only stops at shutdown).
                self.queued.fetch_sub(queued, Ordering::Relaxed);
                return (0, dropped + unsent.0.len());
            }
        }
        (queued, dropped)
    }

    /// Exports everything queued (for OTLP within the shutdown timeout; what is left is
    /// counted), then stops.
    pub async fn shutdown(self) -> ExportTotals {
        self.shutdown
            .send_replace(Some(Instant::now() + self.shutdown_timeout));
        drop(self.sender);
        self.task.await.unwrap_or_default()
    }
}

/// The export task's end of the span queue.
struct QueueReceiver {
    receiver: mpsc::UnboundedReceiver<Vec<SpanRecord>>,
    queued: Arc<AtomicUsize>,
}

async fn run_span_export(
    mut sink: SpanSink,
    mut queue: QueueReceiver,
    batch_size: usize,
    status: Arc<ExportStatus>,
) -> ExportTotals {
    let mut batch = Vec::with_capacity(batch_size);
    loop {
        let deadline = tokio::time::sleep(BATCH_DELAY);
        tokio::pin!(deadline);
        let open = loop {
            tokio::select! {
                received = queue.receiver.recv() => match received {
                    Some(spans) => {
                        queue.queued.fetch_sub(spans.len(), Ordering::Relaxed);
                        batch.extend(spans);
                        if batch.len() >= batch_size {
                            break true;
                        }
                    }
                    None => break false,
                },
                _ = &mut deadline => break true,
            }
        };
        while !batch.is_empty() {
            let rest = batch.split_off(batch.len().min(batch_size));
            export_batch(&mut sink, std::mem::replace(&mut batch, rest), &status).await;
        }
        // Held spans are retried on this tick too, when their backoff is over.
        if let SpanSink::Otlp(otlp) = &mut sink
            && open
        {
            otlp.deliver(&status).await;
        }
        // Trees are printed on this tick (at least every BATCH_DELAY), not only when spans
        // arrive: a trace is printed when it has been quiet.
        if let SpanSink::Tree(printer) = &mut sink {
            printer.print_ready(Instant::now());
        }
        if !open {
            // The exporter's outcomes were recorded in `status` batch by batch; a tree's spans
            // count as exported when the tree is printed.
            let mut totals = ExportTotals {
                spans_exported: status.spans_exported(),
                spans_failed: status.spans_failed(),
                tree: None,
            };
            match &mut sink {
                SpanSink::Otlp(otlp) => {
                    otlp.flush(&status).await;
                    totals.spans_exported = status.spans_exported();
                    totals.spans_failed = status.spans_failed();
                }
                SpanSink::Tree(printer) => {
                    printer.flush_all();
                    let counters = printer.counters();
                    totals.spans_exported = counters.spans_printed;
                    totals.spans_failed = counters.spans_unwritten;
                    totals.tree = Some(counters);
                }
                SpanSink::JsonLines => {}
            }
            return totals;
        }
    }
}

async fn export_batch(sink: &mut SpanSink, batch: Vec<SpanRecord>, status: &ExportStatus) {
    match sink {
        SpanSink::JsonLines => {
            // One write for the batch: stdout is line-buffered, a syscall per span otherwise.
            let mut text = Vec::with_capacity(batch.len() * 1024);
            for span in &batch {
                let _ = serde_json::to_writer(&mut text, &SpanJson(span));
                text.push(b'\n');
            }
            let mut out = std::io::stdout().lock();
            let count = batch.len() as u64;
            match out.write_all(&text).and_then(|()| out.flush()) {
                Ok(()) => {
                    status.record_success(count, false);
                }
                Err(error) => {
                    status.record_failure(format!("writing to stdout: {error}"));
                    status.record_dropped(SpanDrop::Rejected, count);
                }
            }
        }
        // Counted at shutdown, from the printer: a span is exported when its tree is printed.
        SpanSink::Tree(printer) => {
            let now = Instant::now();
            for span in batch {
                printer.add(span, now);
            }
        }
        // Sent by `deliver`, on this tick or when the backoff allows.
        SpanSink::Otlp(otlp) => otlp.enqueue(batch, status),
    }
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut text = String::with_capacity(bytes.len() * 2);
    for byte in bytes {
        text.push(DIGITS[(byte >> 4) as usize] as char);
        text.push(DIGITS[(byte & 0xf) as usize] as char);
    }
    text
}

impl serde::Serialize for AttributeValue {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            AttributeValue::Str(s) => serializer.serialize_str(s),
            AttributeValue::Int(i) => serializer.serialize_i64(*i),
        }
    }
}

/// Span attributes as a flat JSON object, without building one.
struct AttributeMap<'a>(&'a [(&'static str, AttributeValue)]);

impl serde::Serialize for AttributeMap<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

/// One span in the JSON-lines format fixed in DESIGN.md, serialized straight from the
/// record: the agent writes one per request, so no intermediate `Value` tree.
pub struct SpanJson<'a>(pub &'a SpanRecord);

impl serde::Serialize for SpanJson<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let span = self.0;
        let mut map = serializer.serialize_map(Some(10))?;
        map.serialize_entry("name", &span.name)?;
        map.serialize_entry("kind", span.kind.as_str())?;
        map.serialize_entry("trace_id", &hex(&span.trace_id.0))?;
        map.serialize_entry("span_id", &hex(&span.span_id.0))?;
        map.serialize_entry(
            "parent_span_id",
            &span.parent_span_id.map(|p| hex(&p.0)).unwrap_or_default(),
        )?;
        map.serialize_entry("start_time_unix_nano", &span.start_unix_ns)?;
        map.serialize_entry("end_time_unix_nano", &span.end_unix_ns)?;
        map.serialize_entry("attributes", &AttributeMap(&span.attributes))?;
        map.serialize_entry("resource", &span.service.attributes)?;
        map.serialize_entry("status", span.status.as_str())?;
        map.end()
    }
}

/// The JSON-lines span format fixed in DESIGN.md, as a `Value` (tests read it).
#[cfg(test)]
pub fn span_json(span: &SpanRecord) -> Value {
    serde_json::to_value(SpanJson(span)).expect("a span always serializes")
}

fn scope() -> InstrumentationScope {
    InstrumentationScope::builder("gym-tracer")
        .with_version(env!("CARGO_PKG_VERSION"))
        .build()
}

fn key_value(key: &'static str, value: &AttributeValue) -> KeyValue {
    match value {
        AttributeValue::Str(s) => KeyValue::new(key, s.clone()),
        AttributeValue::Int(i) => KeyValue::new(key, *i),
    }
}

fn span_data(span: &SpanRecord) -> SpanData {
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
        name: Cow::Owned(span.name.clone()),
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

// ---------------------------------------------------------------------------------------
// Metrics
// ---------------------------------------------------------------------------------------

/// Writes every metric data point to stdout as one line: JSON (the format in DESIGN.md), or
/// for people, next to `--output tree`, `metric <name> {attributes} <values>`.
#[derive(Debug)]
pub struct StdoutMetricExporter {
    pub human: bool,
}

/// One data point, as a line a person reads: only the values that say something.
fn human_metric_line(line: &Value) -> String {
    let field = |key: &str| line.get(key).cloned().unwrap_or(Value::Null);
    let attributes = match field("attributes") {
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| match v {
                Value::String(s) => format!("{k}={s}"),
                other => format!("{k}={other}"),
            })
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    };
    let values = match field("type").as_str() {
        Some("histogram") => format!(
            "count={} sum={} min={} max={}",
            field("count"),
            field("sum"),
            field("min"),
            field("max")
        ),
        _ => format!("value={}", field("value")),
    };
    format!(
        "metric {} {{{attributes}}} {values} {}",
        field("metric").as_str().unwrap_or("?"),
        field("unit").as_str().unwrap_or("")
    )
}

fn kv_json(attributes: impl Iterator<Item = impl std::borrow::Borrow<KeyValue>>) -> Value {
    let mut map = Map::new();
    for kv in attributes {
        let kv = kv.borrow();
        let value = match &kv.value {
            opentelemetry::Value::I64(i) => Value::from(*i),
            opentelemetry::Value::F64(f) => Value::from(*f),
            opentelemetry::Value::Bool(b) => Value::from(*b),
            other => Value::String(other.to_string()),
        };
        map.insert(kv.key.to_string(), value);
    }
    Value::Object(map)
}

fn unix_nanos(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0)
}

/// One JSON object per data point of `metrics`.
pub fn metric_lines(metrics: &ResourceMetrics) -> Vec<Value> {
    let resource = kv_json(
        metrics
            .resource()
            .iter()
            .map(|(k, v)| KeyValue::new(k.clone(), v.clone())),
    );
    let mut lines = Vec::new();
    for scope in metrics.scope_metrics() {
        for metric in scope.metrics() {
            let base = |attributes: Value, values: Value| {
                let mut line = json!({
                    "metric": metric.name(),
                    "unit": metric.unit(),
                    "attributes": attributes,
                    "resource": resource.clone(),
                });
                if let (Value::Object(line), Value::Object(values)) = (&mut line, values) {
                    line.extend(values);
                }
                line
            };
            match metric.data() {
                AggregatedMetrics::F64(MetricData::Histogram(histogram)) => {
                    for point in histogram.data_points() {
                        lines.push(base(
                            kv_json(point.attributes()),
                            json!({
                                "type": "histogram",
                                "count": point.count(),
                                "sum": point.sum(),
                                "min": point.min(),
                                "max": point.max(),
                                "explicit_bounds": point.bounds().collect::<Vec<_>>(),
                                "bucket_counts": point.bucket_counts().collect::<Vec<_>>(),
                                "start_time_unix_nano": unix_nanos(histogram.start_time()),
                                "time_unix_nano": unix_nanos(histogram.time()),
                            }),
                        ));
                    }
                }
                AggregatedMetrics::U64(MetricData::Sum(sum)) => {
                    for point in sum.data_points() {
                        lines.push(base(
                            kv_json(point.attributes()),
                            json!({"type": "sum", "value": point.value(), "time_unix_nano": unix_nanos(sum.time())}),
                        ));
                    }
                }
                AggregatedMetrics::U64(MetricData::Gauge(gauge)) => {
                    for point in gauge.data_points() {
                        lines.push(base(
                            kv_json(point.attributes()),
                            json!({"type": "gauge", "value": point.value(), "time_unix_nano": unix_nanos(gauge.time())}),
                        ));
                    }
                }
                AggregatedMetrics::F64(MetricData::Gauge(gauge)) => {
                    for point in gauge.data_points() {
                        lines.push(base(
                            kv_json(point.attributes()),
                            json!({"type": "gauge", "value": point.value(), "time_unix_nano": unix_nanos(gauge.time())}),
                        ));
                    }
                }
                other => lines.push(base(
                    Value::Object(Map::new()),
                    json!({"type": format!("{other:?}")}),
                )),
            }
        }
    }
    lines
}

impl PushMetricExporter for StdoutMetricExporter {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let lines = metric_lines(metrics);
        let mut out = std::io::stdout().lock();
        for line in lines {
            let _ = if self.human {
                writeln!(out, "{}", human_metric_line(&line))
            } else {
                writeln!(out, "{line}")
            };
        }
        let _ = out.flush();
        Ok(())
    }

    fn force_flush(&self) -> OTelSdkResult {
        Ok(())
    }

    fn shutdown_with_timeout(&self, _timeout: Duration) -> OTelSdkResult {
        Ok(())
    }

    fn temporality(&self) -> Temporality {
        Temporality::Cumulative
    }
}

/// The OTLP metric exporter, counting its failures in `status` (the SDK only logs them).
#[derive(Debug)]
struct CountedMetricExporter {
    inner: opentelemetry_otlp::MetricExporter,
    status: Arc<ExportStatus>,
}

impl PushMetricExporter for CountedMetricExporter {
    async fn export(&self, metrics: &ResourceMetrics) -> OTelSdkResult {
        let result = self.inner.export(metrics).await;
        if result.is_err() {
            self.status.record_metric_export_failure();
        }
        result
    }

    fn force_flush(&self) -> OTelSdkResult {
        self.inner.force_flush()
    }

    fn shutdown_with_timeout(&self, timeout: Duration) -> OTelSdkResult {
        self.inner.shutdown_with_timeout(timeout)
    }

    fn temporality(&self) -> Temporality {
        self.inner.temporality()
    }
}

/// Builds a meter provider with `resource` that exports to `target` every `interval` and
/// once more at shutdown; failed OTLP exports are counted in `status`. Must be called
/// inside the tokio runtime.
pub fn meter_provider(
    target: &ExportTarget,
    resource: &opentelemetry_sdk::Resource,
    interval: Duration,
    status: &Arc<ExportStatus>,
) -> Result<SdkMeterProvider> {
    use opentelemetry_sdk::metrics::periodic_reader_with_async_runtime::PeriodicReader;
    use opentelemetry_sdk::runtime::Tokio;
    let builder = SdkMeterProvider::builder().with_resource(resource.clone());
    let provider = match target {
        ExportTarget::Tree | ExportTarget::JsonLines => builder
            .with_reader(
                PeriodicReader::builder(
                    StdoutMetricExporter {
                        human: matches!(target, ExportTarget::Tree),
                    },
                    Tokio,
                )
                .with_interval(interval)
                .build(),
            )
            .build(),
        ExportTarget::Otlp(options) => {
            let exporter = CountedMetricExporter {
                inner: otlp_metric_exporter(options)?,
                status: status.clone(),
            };
            builder
                .with_reader(
                    PeriodicReader::builder(exporter, Tokio)
                        .with_interval(interval)
                        .build(),
                )
                .build()
        }
    };
    Ok(provider)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::ids::SpanId;
    use crate::model::ids::TraceId;

    #[test]
    fn span_json_has_the_documented_fields() {
        let span = SpanRecord {
            service: Arc::new(ServiceIdentity::for_test("svc")),
            name: "GET /health".into(),
            kind: SpanKind::Server,
            trace_id: TraceId([0xab; 16]),
            span_id: SpanId([0x01; 8]),
            parent_span_id: None,
            parent_is_remote: false,
            start_unix_ns: 10,
            end_unix_ns: 20,
            attributes: vec![("http.response.status_code", AttributeValue::Int(200))],
            status: SpanStatus::Unset,
        };
        let line = span_json(&span);
        assert_eq!(line["trace_id"], "abababababababababababababababab");
        assert_eq!(line["span_id"], "0101010101010101");
        assert_eq!(line["parent_span_id"], "");
        assert_eq!(line["kind"], "SERVER");
        assert_eq!(line["status"], "UNSET");
        assert_eq!(line["start_time_unix_nano"], 10);
        assert_eq!(line["attributes"]["http.response.status_code"], 200);
        assert_eq!(line["resource"]["service.name"], "svc");
    }

    #[test]
    fn http_endpoints_get_signal_paths() {
        assert_eq!(
            http_signal_endpoint("http://c:4318/", Signal::Traces),
            "http://c:4318/v1/traces"
        );
        assert_eq!(
            http_signal_endpoint("http://c:4318", Signal::Metrics),
            "http://c:4318/v1/metrics"
        );
    }
    const CERT_PEM: &str = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n";
    const KEY_PEM: &str = "-----BEGIN PRIVATE KEY-----\nMIIB\n-----END PRIVATE KEY-----\n";

    fn headers(list: &str) -> http::HeaderMap {
        header_map(&list.parse::<HeaderList>().unwrap()).unwrap()
    }

    fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let vars: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| vars.get(name).cloned()
    }

    fn otlp_options(endpoint: &str, protocol: OtlpProtocol) -> OtlpOptions {
        OtlpOptions {
            endpoint: endpoint.into(),
            protocol,
            headers: "authorization=Bearer%20x".parse().unwrap(),
            timeout: Duration::from_secs(2),
            compression: OtlpCompression::Gzip,
            ca_file: None,
            client_identity: None,
        }
    }

    #[test]
    fn pem_files_are_checked_for_what_they_must_hold() {
        assert_eq!(
            check_pem(CERT_PEM.as_bytes(), PemContent::Certificates),
            Ok(())
        );
        assert_eq!(
            check_pem(KEY_PEM.as_bytes(), PemContent::PrivateKey),
            Ok(())
        );
        let no_cert = check_pem(KEY_PEM.as_bytes(), PemContent::Certificates).unwrap_err();
        assert!(no_cert.starts_with("no PEM certificate in it"), "{no_cert}");
        let not_pem = check_pem(b"hello\n", PemContent::Certificates).unwrap_err();
        assert!(not_pem.starts_with("no PEM certificate in it"), "{not_pem}");
        let encrypted =
            "-----BEGIN ENCRYPTED PRIVATE KEY-----\nMIIB\n-----END ENCRYPTED PRIVATE KEY-----\n";
        let no_key = check_pem(encrypted.as_bytes(), PemContent::PrivateKey).unwrap_err();
        assert!(no_key.contains("openssl pkey"), "{no_key}");
        let truncated = "-----BEGIN CERTIFICATE-----\nMIIB\n";
        let broken = check_pem(truncated.as_bytes(), PemContent::Certificates).unwrap_err();
        assert!(broken.starts_with("not valid PEM"), "{broken}");
    }

    #[test]
    fn read_pem_names_the_flag_and_the_file() {
        let path = std::env::temp_dir().join(format!("gym-tracer-test-{}.pem", std::process::id()));
        std::fs::write(&path, KEY_PEM).unwrap();
        let error = read_pem("--otlp-ca-file", &path, PemContent::Certificates).unwrap_err();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(
            error.to_string().split(": no PEM").next().unwrap(),
            format!("--otlp-ca-file {}", path.display())
        );
    }

    #[test]
    fn header_errors_name_the_header_never_the_value() {
        let list = HeaderList(vec![("authorization".into(), "Bearer \u{e9}secret".into())]);
        let error = header_map(&list).unwrap_err().to_string();
        assert!(error.contains("`authorization`"), "{error}");
        assert!(!error.contains("secret"), "{error}");
        let map = headers("Authorization=a,x-tenant=t,x-tenant=u");
        assert_eq!(map.get("authorization").unwrap(), "a");
        assert_eq!(map.get_all("x-tenant").iter().collect::<Vec<_>>(), ["u"]);
    }

    #[test]
    fn http_builder_headers_survive_its_percent_decoding() {
        let map = headers("authorization=Bearer%20x,discount=50%2525");
        let given = http_builder_headers(&map);
        assert_eq!(given["authorization"], "Bearer x");
        // The builder decodes %25 back to %, so it sends `50%25` as given.
        assert_eq!(given["discount"], "50%2525");
    }

    #[test]
    fn sdk_header_variables_are_read_as_the_sdk_reads_them() {
        assert_eq!(
            sdk_header_pairs(" Authorization = Bearer%20x ,empty=,=v,bad key=1,raw=%zz,"),
            [
                ("authorization".to_string(), "Bearer x".to_string()),
                ("raw".to_string(), "%zz".to_string()),
            ]
        );
    }

    #[test]
    fn sdk_environment_that_agrees_with_the_options_is_accepted() {
        let ours = headers("authorization=Bearer%20x");
        let env = env_of(&[
            ("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20x"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "none"),
            ("OTEL_EXPORTER_OTLP_METRICS_COMPRESSION", "zstd"),
        ]);
        assert!(check_sdk_environment(&ours, OtlpCompression::None, &env).is_ok());
        // Given compression wins in the SDK.
        let gzip_env = env_of(&[("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")]);
        assert!(check_sdk_environment(&ours, OtlpCompression::Gzip, gzip_env).is_ok());
        // A signal variable set empty hides the generic one, in the SDK too.
        let masked = env_of(&[
            ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", ""),
            ("OTEL_EXPORTER_OTLP_METRICS_HEADERS", ""),
            ("OTEL_EXPORTER_OTLP_HEADERS", "authorization=old"),
        ]);
        assert!(check_sdk_environment(&ours, OtlpCompression::None, masked).is_ok());
    }

    #[test]
    fn sdk_environment_that_would_override_the_options_is_refused() {
        let ours = headers("authorization=Bearer%20new");
        let refusal = |vars: &[(&str, &str)]| {
            check_sdk_environment(&ours, OtlpCompression::None, env_of(vars))
                .unwrap_err()
                .to_string()
        };
        let stale = refusal(&[("OTEL_EXPORTER_OTLP_HEADERS", "authorization=Bearer%20old")]);
        assert!(
            stale.starts_with("OTEL_EXPORTER_OTLP_HEADERS is set"),
            "{stale}"
        );
        assert!(
            stale.contains("`authorization`") && !stale.contains("old"),
            "{stale}"
        );

        let extra = refusal(&[("OTEL_EXPORTER_OTLP_METRICS_HEADERS", "x-tenant=a")]);
        assert!(
            extra.starts_with("OTEL_EXPORTER_OTLP_METRICS_HEADERS"),
            "{extra}"
        );

        let gzip = refusal(&[
            ("OTEL_EXPORTER_OTLP_TRACES_COMPRESSION", "zstd"),
            ("OTEL_EXPORTER_OTLP_COMPRESSION", "GZIP"),
        ]);
        assert!(
            gzip.starts_with("OTEL_EXPORTER_OTLP_COMPRESSION=GZIP"),
            "{gzip}"
        );
        assert!(gzip.contains("--otlp-compression gzip"), "{gzip}");
    }

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

    /// Gzip, headers and TLS need cargo features of opentelemetry-otlp; a missing one only
    /// shows when the exporter is built.
    #[tokio::test]
    async fn exporters_build_for_every_protocol_with_gzip_headers_and_tls() {
        for endpoint in ["http://127.0.0.1:1", "https://127.0.0.1:1"] {
            for protocol in [OtlpProtocol::Grpc, OtlpProtocol::HttpProtobuf] {
                let options = otlp_options(endpoint, protocol);
                otlp_span_exporter(&options).unwrap();
                otlp_metric_exporter(&options).unwrap();
            }
        }
    }
    #[derive(Debug)]
    struct Layer(&'static str, Option<Box<Layer>>);

    impl std::fmt::Display for Layer {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Layer {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1
                .as_deref()
                .map(|layer| -> &(dyn std::error::Error + 'static) { layer })
        }
    }

    #[test]
    fn transport_errors_keep_their_cause_and_say_what_to_check() {
        let cause = Layer("invalid peer certificate: UnknownIssuer", None);
        let error = Layer(
            "error sending request",
            Some(Box::new(Layer(
                "client error (Connect)",
                Some(Box::new(cause)),
            ))),
        );
        let text = error_chain(&error);
        assert_eq!(
            text,
            "error sending request: client error (Connect): invalid peer certificate: UnknownIssuer"
        );
        assert!(failure_hint(&text).contains("--otlp-ca-file"));
        assert!(
            failure_hint("received fatal alert: CertificateRequired")
                .contains("--otlp-client-cert")
        );
        assert!(failure_hint("Status Code: 401, Response: no").contains("--otlp-headers"));
        assert_eq!(failure_hint("HTTP export failed: network error"), "");
        // A source that repeats its parent is said once.
        let repeated = Layer("timed out", Some(Box::new(Layer("timed out", None))));
        assert_eq!(error_chain(&repeated), "timed out");
    }
}
