//! An OTLP `ExportTraceServiceRequest` encoded straight from the span records: the SDK's
//! path (record → `SpanData` → generated proto structs → prost) allocated a string or a
//! vector for every id, name and attribute of every span, and was the largest cost of the
//! export thread. Here a batch is one buffer, written once.
//!
//! The bytes decode to exactly what the SDK's exporter sends for the same spans (the unit
//! tests compare the two), so collectors see no difference. The resource, once per request,
//! still goes through the SDK's conversion: it is small and already an SDK `Resource`.

use opentelemetry_proto::tonic::common::v1::InstrumentationScope;
use opentelemetry_proto::tonic::resource::v1::Resource as ProtoResource;
use opentelemetry_proto::transform::common::tonic::ResourceAttributesWithSchema;
use prost::Message;
use prost::encoding::{WireType, encode_varint, encoded_len_varint};

use crate::model::span::{AttributeValue, SpanKind, SpanRecord, SpanStatus};

/// `SpanFlags`: the W3C sampled flag, and whether the parent is remote is known (and if so,
/// that it is), as the SDK sets them.
const FLAG_SAMPLED: u32 = 0x01;
const FLAG_HAS_IS_REMOTE: u32 = 0x100;
const FLAG_IS_REMOTE: u32 = 0x200;

/// Appends to `out` one request carrying `spans`, all of one process whose resource is
/// `resource`.
pub fn encode_trace_request(
    resource: &opentelemetry_sdk::Resource,
    spans: &[SpanRecord],
    out: &mut Vec<u8>,
) {
    let resource = ResourceAttributesWithSchema::from(resource);
    let mut writer = Writer(out);
    // ExportTraceServiceRequest.resource_spans = 1
    writer.nested_sized(1, 3, |w| {
        // ResourceSpans.resource = 1
        let proto = ProtoResource {
            attributes: resource.attributes.0,
            dropped_attributes_count: 0,
            entity_refs: Vec::new(),
        };
        w.key(1, WireType::LengthDelimited);
        proto
            .encode_length_delimited(w.0)
            .expect("a Vec grows as needed");
        // ResourceSpans.scope_spans = 2
        w.nested_sized(2, 3, |w| {
            // ScopeSpans.scope = 1
            w.key(1, WireType::LengthDelimited);
            scope()
                .encode_length_delimited(w.0)
                .expect("a Vec grows as needed");
            for span in spans {
                // ScopeSpans.spans = 2
                w.nested_sized(2, 2, |w| write_span(w, span));
            }
        });
        if let Some(schema_url) = &resource.schema_url {
            w.string(3, schema_url);
        }
    });
}

/// The instrumentation scope every span is exported under.
fn scope() -> InstrumentationScope {
    InstrumentationScope {
        name: "gym-tracer".to_string(),
        version: env!("CARGO_PKG_VERSION").to_string(),
        attributes: Vec::new(),
        dropped_attributes_count: 0,
    }
}

/// `opentelemetry.proto.trace.v1.Span`, fields in number order as prost writes them.
fn write_span(w: &mut Writer<'_>, span: &SpanRecord) {
    w.bytes(1, &span.trace_id.0);
    w.bytes(2, &span.span_id.0);
    if let Some(parent) = span.parent_span_id {
        w.bytes(4, &parent.0);
    }
    w.string(5, &span.name);
    let kind: u64 = match span.kind {
        SpanKind::Internal => 1,
        SpanKind::Server => 2,
        SpanKind::Client => 3,
    };
    w.key(6, WireType::Varint);
    w.varint(kind);
    w.key(7, WireType::SixtyFourBit);
    w.0.extend_from_slice(&span.start_unix_ns.to_le_bytes());
    w.key(8, WireType::SixtyFourBit);
    w.0.extend_from_slice(&span.end_unix_ns.to_le_bytes());
    for (key, value) in &span.attributes {
        // Span.attributes = 9: KeyValue { key = 1, value = 2: AnyValue }
        w.nested(9, |w| {
            w.string(1, key);
            w.nested(2, |w| match value {
                AttributeValue::Str(s) => {
                    // AnyValue.string_value = 1, written even when empty (a oneof)
                    w.key(1, WireType::LengthDelimited);
                    w.varint(s.len() as u64);
                    w.0.extend_from_slice(s.as_bytes());
                }
                AttributeValue::Int(i) => {
                    // AnyValue.int_value = 3
                    w.key(3, WireType::Varint);
                    w.varint(*i as u64);
                }
                AttributeValue::Bool(b) => {
                    // AnyValue.bool_value = 2
                    w.key(2, WireType::Varint);
                    w.varint(u64::from(*b));
                }
                AttributeValue::Double(d) => {
                    // AnyValue.double_value = 4
                    w.key(4, WireType::SixtyFourBit);
                    w.0.extend_from_slice(&d.to_le_bytes());
                }
            });
        });
    }
    // Span.status = 15: Status { code = 3 } (the message stays empty), always present.
    w.nested(15, |w| {
        if span.status == SpanStatus::Error {
            w.key(3, WireType::Varint);
            w.varint(2);
        }
    });
    let remote = if span.parent_is_remote {
        FLAG_IS_REMOTE
    } else {
        0
    };
    w.key(16, WireType::ThirtyTwoBit);
    w.0.extend_from_slice(&(FLAG_SAMPLED | FLAG_HAS_IS_REMOTE | remote).to_le_bytes());
}

/// Appends protobuf fields to a buffer.
struct Writer<'a>(&'a mut Vec<u8>);

impl Writer<'_> {
    fn key(&mut self, field: u32, wire_type: WireType) {
        self.varint(u64::from(field << 3 | wire_type as u32));
    }

    /// Most varints here (keys, attribute lengths) are one byte: written inline, not
    /// through prost's general loop, which was a fifth of encoding.
    fn varint(&mut self, value: u64) {
        if value < 0x80 {
            self.0.push(value as u8);
        } else {
            encode_varint(value, self.0);
        }
    }

    /// A `string` or `bytes` field; proto3 leaves an empty one out.
    fn bytes(&mut self, field: u32, bytes: &[u8]) {
        if bytes.is_empty() {
            return;
        }
        self.key(field, WireType::LengthDelimited);
        self.varint(bytes.len() as u64);
        self.0.extend_from_slice(bytes);
    }

    fn string(&mut self, field: u32, text: &str) {
        self.bytes(field, text.as_bytes());
    }

    /// A message field whose body is usually under 128 bytes (an attribute).
    fn nested(&mut self, field: u32, body: impl FnOnce(&mut Writer<'_>)) {
        self.nested_sized(field, 1, body);
    }

    /// A message field: its body is written after room for a `width_guess`-byte length,
    /// and moved only if the length turns out to need another width (a span takes two
    /// bytes, 128 B to 16 KiB; a batch's envelopes three, up to 2 MiB).
    fn nested_sized(&mut self, field: u32, width_guess: usize, body: impl FnOnce(&mut Writer<'_>)) {
        self.key(field, WireType::LengthDelimited);
        let length_at = self.0.len();
        self.0.resize(length_at + width_guess, 0);
        body(self);
        let body_at = length_at + width_guess;
        let length = (self.0.len() - body_at) as u64;
        let width = encoded_len_varint(length);
        if width != width_guess {
            let end = self.0.len();
            if width > width_guess {
                self.0.resize(end + width - width_guess, 0);
            }
            self.0.copy_within(body_at..end, length_at + width);
            self.0.truncate(length_at + width + (end - body_at));
        }
        if width == 1 {
            self.0[length_at] = length as u8;
        } else {
            encode_varint(length, &mut &mut self.0[length_at..length_at + width]);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use opentelemetry::KeyValue;
    use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
    use opentelemetry_proto::transform::trace::tonic::group_spans_by_resource_and_scope;

    use super::*;
    use crate::export::otlp::sink::span_data;
    use crate::model::ids::{SpanId, TraceId};
    use crate::model::service::ServiceIdentity;

    fn service() -> Arc<ServiceIdentity> {
        let resource = opentelemetry_sdk::Resource::builder_empty()
            .with_attributes([
                KeyValue::new("service.name", "math_with_judge"),
                KeyValue::new("process.pid", 4242_i64),
            ])
            .build();
        Arc::new(ServiceIdentity {
            pid: 4242,
            labels: Default::default(),
            attributes: Default::default(),
            resource,
        })
    }

    fn span(service: &Arc<ServiceIdentity>, n: u8) -> SpanRecord {
        SpanRecord {
            service: service.clone(),
            name: format!("POST /verify{}", "x".repeat(n as usize * 20)).into(),
            kind: [SpanKind::Server, SpanKind::Client, SpanKind::Internal][n as usize % 3],
            trace_id: TraceId([n; 16]),
            span_id: SpanId([n + 1; 8]),
            parent_span_id: (n % 2 == 1).then_some(SpanId([0xab; 8])),
            parent_is_remote: n % 4 == 1,
            start_unix_ns: 1_764_000_000_000_000_000 + u64::from(n),
            end_unix_ns: 1_764_000_000_123_456_789,
            attributes: vec![
                ("http.request.method", AttributeValue::Str("POST".into())),
                ("http.response.status_code", AttributeValue::Int(200)),
                ("negative", AttributeValue::Int(-3)),
                ("empty", AttributeValue::Str("".into())),
                ("long", AttributeValue::Str("y".repeat(300).into())),
                ("seconds", AttributeValue::Double(0.25)),
                ("flag", AttributeValue::Bool(true)),
            ],
            status: if n.is_multiple_of(3) {
                SpanStatus::Error
            } else {
                SpanStatus::Unset
            },
            facts: Default::default(),
        }
    }

    /// What the SDK's HTTP exporter puts in its request body for the same spans.
    fn sdk_request(service: &ServiceIdentity, spans: &[SpanRecord]) -> ExportTraceServiceRequest {
        let resource = ResourceAttributesWithSchema::from(&service.resource);
        let data = spans.iter().map(span_data).collect();
        ExportTraceServiceRequest {
            resource_spans: group_spans_by_resource_and_scope(data, &resource),
        }
    }

    #[test]
    fn the_request_decodes_to_what_the_sdk_sends() {
        let service = service();
        for count in [1u8, 2, 7, 40] {
            let spans: Vec<_> = (0..count).map(|n| span(&service, n)).collect();
            let mut bytes = Vec::new();
            encode_trace_request(&service.resource, &spans, &mut bytes);
            let decoded = ExportTraceServiceRequest::decode(bytes.as_slice()).unwrap();
            assert_eq!(decoded, sdk_request(&service, &spans), "{count} spans");
            // Byte for byte, too: prost writes fields in number order, as this does.
            assert_eq!(bytes, sdk_request(&service, &spans).encode_to_vec());
        }
    }

    #[test]
    fn lengths_of_every_width_are_written_whatever_the_guess() {
        for length in [0usize, 1, 127, 128, 16_383, 16_384, 2_097_152] {
            let mut expected = Vec::new();
            prost::encoding::bytes::encode(1, &vec![7u8; length], &mut expected);
            for guess in 1..=4 {
                let mut out = vec![9];
                Writer(&mut out).nested_sized(1, guess, |w| w.0.resize(w.0.len() + length, 7));
                assert_eq!(out[1..], expected, "{length} bytes, {guess}-byte guess");
            }
        }
    }
}
