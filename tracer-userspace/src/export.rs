//! Exporters: JSON lines on stdout (the default), trace trees on stdout (`--output tree`), or
//! OTLP over gRPC or HTTP/protobuf.
//!
//! Spans go through a bounded queue to one export task, which batches them and hands each
//! batch, grouped by traced process, to the OTLP exporter with that process's resource.
//! Metrics use one SDK meter provider per traced process, because a provider has one resource.

use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result};
use opentelemetry::trace::{SpanContext, TraceFlags, TraceState};
use opentelemetry::{InstrumentationScope, KeyValue};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
use opentelemetry_sdk::metrics::{SdkMeterProvider, Temporality};
use opentelemetry_sdk::trace::{SpanData, SpanEvents, SpanExporter, SpanLinks};
use serde_json::{Map, Value, json};
use tokio::sync::mpsc;

use crate::cli::OtlpCompression;
use crate::config::HeaderList;
use crate::identity::ServiceIdentity;
use crate::spans::{AttributeValue, SpanKind, SpanRecord, SpanStatus};
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

/// How spans are queued and batched on their way out, whatever the sink.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExportLimits {
    pub batch_size: usize,
    pub queue_size: usize,
}

const BATCH_DELAY: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, Debug, Default)]
pub struct ExportTotals {
    pub spans_exported: u64,
    pub spans_failed: u64,
    /// Set for [`ExportTarget::Tree`].
    pub tree: Option<TreeCounters>,
}

pub struct SpanPipeline {
    sender: mpsc::Sender<SpanRecord>,
    task: tokio::task::JoinHandle<ExportTotals>,
}

enum SpanSink {
    JsonLines,
    Tree(Box<TreePrinter<std::io::Stdout>>),
    Otlp(Box<opentelemetry_otlp::SpanExporter>),
}

fn http_signal_endpoint(endpoint: &str, signal: &str) -> String {
    format!("{}/v1/{signal}", endpoint.trim_end_matches('/'))
}

fn otlp_span_exporter(
    endpoint: &str,
    protocol: OtlpProtocol,
) -> Result<opentelemetry_otlp::SpanExporter> {
    let exporter = match protocol {
        OtlpProtocol::Grpc => opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .with_endpoint(endpoint)
            .with_protocol(Protocol::Grpc)
            .build(),
        OtlpProtocol::HttpProtobuf => opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_endpoint(http_signal_endpoint(endpoint, "traces"))
            .with_protocol(Protocol::HttpBinary)
            .build(),
    };
    exporter.with_context(|| format!("creating the OTLP span exporter for {endpoint}"))
}

impl SpanPipeline {
    /// Must be called inside the tokio runtime (the gRPC channel lives on it).
    pub fn start(target: &ExportTarget, limits: ExportLimits) -> Result<Self> {
        let sink = match target {
            ExportTarget::JsonLines => SpanSink::JsonLines,
            ExportTarget::Tree => SpanSink::Tree(Box::new(TreePrinter::new(
                TreeOptions::default(),
                std::io::stdout(),
            ))),
            ExportTarget::Otlp(options) => SpanSink::Otlp(Box::new(otlp_span_exporter(
                &options.endpoint,
                options.protocol,
            )?)),
        };
        let (sender, receiver) = mpsc::channel(limits.queue_size);
        let task = tokio::spawn(run_span_export(sink, receiver, limits.batch_size));
        Ok(Self { sender, task })
    }

    /// Queues a span; false when the queue is full (the caller counts the drop).
    pub fn offer(&self, span: SpanRecord) -> bool {
        self.sender.try_send(span).is_ok()
    }

    /// Exports everything queued, then stops.
    pub async fn shutdown(self) -> ExportTotals {
        drop(self.sender);
        self.task.await.unwrap_or_default()
    }
}

async fn run_span_export(
    mut sink: SpanSink,
    mut receiver: mpsc::Receiver<SpanRecord>,
    batch_size: usize,
) -> ExportTotals {
    let mut totals = ExportTotals::default();
    let mut batch = Vec::with_capacity(batch_size);
    loop {
        let deadline = tokio::time::sleep(BATCH_DELAY);
        tokio::pin!(deadline);
        let open = loop {
            tokio::select! {
                received = receiver.recv() => match received {
                    Some(span) => {
                        batch.push(span);
                        if batch.len() >= batch_size {
                            break true;
                        }
                    }
                    None => break false,
                },
                _ = &mut deadline => break true,
            }
        };
        if !batch.is_empty() {
            export_batch(&mut sink, std::mem::take(&mut batch), &mut totals).await;
        }
        // Trees are printed on this tick (at least every BATCH_DELAY), not only when spans
        // arrive: a trace is printed when it has been quiet.
        if let SpanSink::Tree(printer) = &mut sink {
            printer.print_ready(Instant::now());
        }
        if !open {
            match &mut sink {
                SpanSink::Otlp(exporter) => {
                    let _ = exporter.shutdown();
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

async fn export_batch(sink: &mut SpanSink, batch: Vec<SpanRecord>, totals: &mut ExportTotals) {
    match sink {
        SpanSink::JsonLines => {
            // One write for the batch: stdout is line-buffered, a syscall per span otherwise.
            let mut text = Vec::with_capacity(batch.len() * 1024);
            for span in &batch {
                let _ = serde_json::to_writer(&mut text, &SpanJson(span));
                text.push(b'\n');
            }
            let mut out = std::io::stdout().lock();
            match out.write_all(&text).and_then(|()| out.flush()) {
                Ok(()) => totals.spans_exported += batch.len() as u64,
                Err(_) => totals.spans_failed += batch.len() as u64,
            }
        }
        // Counted at shutdown, from the printer: a span is exported when its tree is printed.
        SpanSink::Tree(printer) => {
            let now = Instant::now();
            for span in batch {
                printer.add(span, now);
            }
        }
        SpanSink::Otlp(exporter) => {
            let mut by_service: HashMap<u32, (Arc<ServiceIdentity>, Vec<SpanData>)> =
                HashMap::new();
            for span in batch {
                let entry = by_service
                    .entry(span.service.pid)
                    .or_insert_with(|| (span.service.clone(), Vec::new()));
                entry.1.push(span_data(&span));
            }
            for (_, (service, spans)) in by_service {
                let count = spans.len() as u64;
                exporter.set_resource(&service.resource);
                match exporter.export(spans).await {
                    Ok(()) => totals.spans_exported += count,
                    Err(error) => {
                        totals.spans_failed += count;
                        eprintln!("gym-tracer: exporting {count} spans failed: {error}");
                    }
                }
            }
        }
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

/// Builds a meter provider with `service`'s resource that exports to `target` every
/// `interval` and once more at shutdown. Must be called inside the tokio runtime.
pub fn meter_provider(
    target: &ExportTarget,
    service: &ServiceIdentity,
    interval: Duration,
) -> Result<SdkMeterProvider> {
    use opentelemetry_sdk::metrics::periodic_reader_with_async_runtime::PeriodicReader;
    use opentelemetry_sdk::runtime::Tokio;
    let builder = SdkMeterProvider::builder().with_resource(service.resource.clone());
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
        ExportTarget::Otlp(OtlpOptions {
            endpoint, protocol, ..
        }) => {
            let exporter = match protocol {
                OtlpProtocol::Grpc => opentelemetry_otlp::MetricExporter::builder()
                    .with_tonic()
                    .with_endpoint(endpoint)
                    .with_protocol(Protocol::Grpc)
                    .build(),
                OtlpProtocol::HttpProtobuf => opentelemetry_otlp::MetricExporter::builder()
                    .with_http()
                    .with_endpoint(http_signal_endpoint(endpoint, "metrics"))
                    .with_protocol(Protocol::HttpBinary)
                    .build(),
            }
            .with_context(|| format!("creating the OTLP metric exporter for {endpoint}"))?;
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
    use crate::spans::{SpanId, TraceId};

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
            http_signal_endpoint("http://c:4318/", "traces"),
            "http://c:4318/v1/traces"
        );
        assert_eq!(
            http_signal_endpoint("http://c:4318", "metrics"),
            "http://c:4318/v1/metrics"
        );
    }
}
