//! The default output: spans and metric data points as JSON lines on stdout, in the format
//! DESIGN.md fixes (tests and users parse it).

use std::io::Write;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use opentelemetry::KeyValue;
use opentelemetry_sdk::error::OTelSdkResult;
use opentelemetry_sdk::metrics::Temporality;
use opentelemetry_sdk::metrics::data::{AggregatedMetrics, MetricData, ResourceMetrics};
use opentelemetry_sdk::metrics::exporter::PushMetricExporter;
use serde_json::{Map, Value, json};

use super::{ExportTotals, SpanSink};
use crate::export::status::{ExportStatus, SpanDrop};
use crate::gym::rollout_id::plain_run;
use crate::model::ids::hex_into;
use crate::model::service::ServiceIdentity;
use crate::model::span::AttributeValue;
use crate::model::span::SpanRecord;

/// `spans` as JSON lines (`--output json`), appended to `out`.
pub fn write_lines(spans: &[SpanRecord], out: &mut Vec<u8>) {
    let mut resources = ResourceCache::default();
    for span in spans {
        write_span(out, span, &mut resources);
        out.push(b'\n');
    }
}

/// Spans as JSON lines on stdout, one write per batch.
pub struct JsonLinesSink;

impl SpanSink for JsonLinesSink {
    /// One write for the batch: stdout is line-buffered, a syscall per span otherwise. A
    /// failed write drops the batch (counted as rejected): stdout does not come back.
    fn export(&mut self, batch: Vec<SpanRecord>, status: &ExportStatus) {
        let mut text = Vec::with_capacity(batch.len() * 1024);
        write_lines(&batch, &mut text);
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

    /// Nothing is held between batches.
    async fn flush(&mut self, _status: &ExportStatus) {}

    async fn shutdown(self, status: &ExportStatus) -> ExportTotals {
        ExportTotals {
            spans_exported: status.spans_exported(),
            spans_failed: status.spans_failed(),
            tree: None,
        }
    }
}

impl serde::Serialize for AttributeValue {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            AttributeValue::Str(s) => serializer.serialize_str(s),
            AttributeValue::Int(i) => serializer.serialize_i64(*i),
            AttributeValue::Bool(b) => serializer.serialize_bool(*b),
            AttributeValue::Double(d) => serializer.serialize_f64(*d),
        }
    }
}

#[cfg(test)]
/// Span attributes as a flat JSON object, without building one.
struct AttributeMap<'a>(&'a [(&'static str, AttributeValue)]);

#[cfg(test)]
impl serde::Serialize for AttributeMap<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(self.0.iter().map(|(k, v)| (k, v)))
    }
}

#[cfg(test)]
/// One span in the JSON-lines format fixed in DESIGN.md, through serde: what the sink's own
/// writer ([`write_span`]) is checked against.
pub struct SpanJson<'a>(pub &'a SpanRecord);

#[cfg(test)]
impl serde::Serialize for SpanJson<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use crate::model::ids::hex;
        use serde::ser::SerializeMap;
        let span = self.0;
        let mut map = serializer.serialize_map(Some(10))?;
        map.serialize_entry("name", span.name.as_str())?;
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

/// Each process's resource object, written once per batch: it is the same on every span of
/// the process and about half of a span's line.
#[derive(Default)]
struct ResourceCache {
    written: foldhash::HashMap<*const ServiceIdentity, Vec<u8>>,
}

impl ResourceCache {
    /// The resource of `service` as JSON. Keyed by the `Arc`'s address, which the batch's
    /// spans keep alive (and so unique) for as long as the cache lives.
    fn json(&mut self, service: &Arc<ServiceIdentity>) -> &[u8] {
        self.written.entry(Arc::as_ptr(service)).or_insert_with(|| {
            serde_json::to_vec(&service.attributes).expect("a map of strings serializes")
        })
    }
}

/// One span as the line [`SpanJson`] serializes, written without serde's per-field dispatch
/// (the JSON lines sink's whole cost on Gym's workload): the same bytes, which the unit test
/// `the_written_line_is_the_serialized_span` compares.
fn write_span(out: &mut Vec<u8>, span: &SpanRecord, resources: &mut ResourceCache) {
    out.extend_from_slice(b"{\"name\":");
    json_string(out, span.name.as_str());
    out.extend_from_slice(b",\"kind\":");
    json_string(out, span.kind.as_str());
    out.extend_from_slice(b",\"trace_id\":\"");
    hex_into(out, &span.trace_id.0);
    out.extend_from_slice(b"\",\"span_id\":\"");
    hex_into(out, &span.span_id.0);
    out.extend_from_slice(b"\",\"parent_span_id\":\"");
    if let Some(parent) = span.parent_span_id {
        hex_into(out, &parent.0);
    }
    let _ = write!(
        out,
        "\",\"start_time_unix_nano\":{},\"end_time_unix_nano\":{},\"attributes\":{{",
        span.start_unix_ns, span.end_unix_ns
    );
    for (index, (key, value)) in span.attributes.iter().enumerate() {
        if index > 0 {
            out.push(b',');
        }
        json_string(out, key);
        out.push(b':');
        match value {
            AttributeValue::Str(text) => json_string(out, text),
            other => {
                let _ = serde_json::to_writer(&mut *out, other);
            }
        }
    }
    out.extend_from_slice(b"},\"resource\":");
    out.extend_from_slice(resources.json(&span.service));
    out.extend_from_slice(b",\"status\":");
    json_string(out, span.status.as_str());
    out.push(b'}');
}

/// A JSON string: copied as it is when nothing in it needs an escape (as good as always),
/// else written by serde_json.
fn json_string(out: &mut Vec<u8>, text: &str) {
    // What serde_json escapes is exactly what ends a plain run: a quote, a backslash, a
    // control character.
    if plain_run(text.as_bytes()).is_none() {
        out.push(b'"');
        out.extend_from_slice(text.as_bytes());
        out.push(b'"');
    } else {
        let _ = serde_json::to_writer(&mut *out, text);
    }
}

/// The JSON-lines span format fixed in DESIGN.md, as a `Value` (tests read it).
#[cfg(test)]
pub fn span_json(span: &SpanRecord) -> Value {
    serde_json::to_value(SpanJson(span)).expect("a span always serializes")
}

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
                    histogram_lines(histogram, &base, &mut lines);
                }
                AggregatedMetrics::U64(MetricData::Histogram(histogram)) => {
                    histogram_lines(histogram, &base, &mut lines);
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

/// One line per point of a histogram of either number type.
fn histogram_lines<T: Copy + Into<Value>>(
    histogram: &opentelemetry_sdk::metrics::data::Histogram<T>,
    base: &impl Fn(Value, Value) -> Value,
    lines: &mut Vec<Value>,
) {
    for point in histogram.data_points() {
        lines.push(base(
            kv_json(point.attributes()),
            json!({
                "type": "histogram",
                "count": point.count(),
                "sum": point.sum().into(),
                "min": point.min().map(Into::into),
                "max": point.max().map(Into::into),
                "explicit_bounds": point.bounds().collect::<Vec<_>>(),
                "bucket_counts": point.bucket_counts().collect::<Vec<_>>(),
                "start_time_unix_nano": unix_nanos(histogram.start_time()),
                "time_unix_nano": unix_nanos(histogram.time()),
            }),
        ));
    }
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

#[cfg(test)]
mod tests {

    use super::*;
    use crate::model::ids::SpanId;
    use crate::model::ids::TraceId;
    use crate::model::span::SpanKind;
    use crate::pipeline::testing;

    #[test]
    fn span_json_has_the_documented_fields() {
        let span = SpanRecord {
            trace_id: TraceId([0xab; 16]),
            start_unix_ns: 10,
            end_unix_ns: 20,
            attributes: vec![("http.response.status_code", AttributeValue::Int(200))],
            ..testing::span("GET /health", SpanKind::Server, SpanId([0x01; 8]))
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
    fn the_written_line_is_the_serialized_span() {
        let service = testing::span("x", SpanKind::Server, SpanId([9; 8])).service;
        let spans = [
            SpanRecord {
                trace_id: TraceId([0xab; 16]),
                parent_span_id: Some(SpanId([0xfe; 8])),
                start_unix_ns: u64::MAX,
                end_unix_ns: 0,
                attributes: vec![
                    (
                        "a",
                        AttributeValue::Str("quote \" slash \\ tab \t nul \0 del \x7f é".into()),
                    ),
                    ("b", AttributeValue::Int(i64::MIN)),
                    ("c", AttributeValue::Bool(true)),
                    ("d", AttributeValue::Double(0.1)),
                    ("e", AttributeValue::Double(f64::NAN)),
                    ("a", AttributeValue::Str("repeated".into())),
                ],
                ..testing::span("POST /\"run\"\n", SpanKind::Client, SpanId([0x01; 8]))
            },
            SpanRecord {
                service: service.clone(),
                ..testing::span("GET /health", SpanKind::Server, SpanId([0; 8]))
            },
            SpanRecord {
                service,
                ..testing::span("GET /other", SpanKind::Internal, SpanId([3; 8]))
            },
        ];
        let mut resources = ResourceCache::default();
        for span in &spans {
            let mut written = Vec::new();
            write_span(&mut written, span, &mut resources);
            let serialized = serde_json::to_vec(&SpanJson(span)).unwrap();
            assert_eq!(
                String::from_utf8(written).unwrap(),
                String::from_utf8(serialized).unwrap()
            );
        }
    }
}
