//! The agent's own telemetry: its counters exported as OTel metrics under `gym_tracer.`,
//! with a resource of its own (`service.name` `gym-tracer`), next to the traced servers'.
//!
//! Every instrument is observable: its callback reads the snapshot the pipeline publishes
//! each second (`Health`) when the SDK collects, so the hot path records nothing.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Result;
use opentelemetry::KeyValue;
use opentelemetry::metrics::{AsyncInstrument, Meter, MeterProvider};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::metrics::SdkMeterProvider;
use rand::Rng;

use crate::export::status::SpanDrop;
use crate::export::{ExportTarget, StdoutFormat, meter_provider};
use crate::model::attributes as attr;
use crate::model::service::AgentResource;
use crate::ops::counters::CounterSnapshot;
use crate::ops::health::{Gauges, Health};
use crate::signals::metrics::Instrument;

/// `service.name` of the agent's own resource.
pub const SERVICE_NAME: &str = "gym-tracer";

/// What one instrument reports from a snapshot: values with their attributes.
type Observe = fn(&Health, &CounterSnapshot, &Gauges) -> Vec<(u64, Vec<KeyValue>)>;

/// One self-telemetry instrument: its reference entry and how it reads the snapshot.
struct SelfInstrument {
    doc: Instrument,
    observe: Observe,
}

fn one(value: u64) -> Vec<(u64, Vec<KeyValue>)> {
    vec![(value, Vec::new())]
}

fn by(key: &'static str, values: &[(&'static str, u64)]) -> Vec<(u64, Vec<KeyValue>)> {
    values
        .iter()
        .map(|&(reason, value)| (value, vec![KeyValue::new(key, reason)]))
        .collect()
}

const COUNTER: &str = "counter";
const GAUGE: &str = "gauge";

const SELF_INSTRUMENTS: [SelfInstrument; 13] = [
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.events.received",
            kind: COUNTER,
            unit: "{event}",
            description: "Records read from the kernel's ring buffer.",
        },
        observe: |_, stats, _| one(stats.pipeline.events_in),
    },
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.events.lost",
            kind: COUNTER,
            unit: "{event}",
            description: "Records the kernel could not put on the full ring buffer, by `cpu`.",
        },
        observe: |_, stats, _| {
            stats
                .events_lost_by_cpu
                .iter()
                .enumerate()
                .map(|(cpu, &lost)| (lost, vec![KeyValue::new("cpu", cpu as i64)]))
                .collect()
        },
    },
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.events.undecodable",
            kind: COUNTER,
            unit: "{event}",
            description: "Records that did not decode (a kernel/agent version mismatch).",
        },
        observe: |_, stats, _| one(stats.pipeline.events_undecodable),
    },
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.spans.exported",
            kind: COUNTER,
            unit: "{span}",
            description: "Spans the collector accepted.",
        },
        observe: |health, _, _| one(health.export.spans_exported()),
    },
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.spans.dropped",
            kind: COUNTER,
            unit: "{span}",
            description: "Spans lost, by `reason`: `queue_full` (the export queue), \
                          `export_buffer_full` (the retry buffer, during an outage), \
                          `rejected` (refused for good by the collector), \
                          `undelivered_at_shutdown`.",
        },
        observe: |health, stats, _| {
            let mut points = vec![(
                stats.agent.spans_dropped_queue_full,
                vec![KeyValue::new("reason", "queue_full")],
            )];
            points.extend(SpanDrop::ALL.iter().map(|&drop| {
                (
                    health.export.spans_dropped(drop),
                    vec![KeyValue::new("reason", drop.reason())],
                )
            }));
            points
        },
    },
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.exports.failed",
            kind: COUNTER,
            unit: "{request}",
            description: "Export requests that failed, by `signal` (`traces`, `metrics`); \
                          failed span exports are retried.",
        },
        observe: |health, _, _| {
            by(
                "signal",
                &[
                    ("traces", health.export.exports_failed()),
                    ("metrics", health.export.metric_exports_failed()),
                ],
            )
        },
    },
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.parse.errors",
            kind: COUNTER,
            unit: "{error}",
            description: "Connections whose HTTP could not be followed, by `reason`: \
                          `not_http`, `head_too_large`, `uncaptured_start`, \
                          `lost_chunk_framing`.",
        },
        observe: |_, stats, _| {
            by(
                "reason",
                &[
                    ("not_http", stats.reassembly.parse_not_http),
                    ("head_too_large", stats.reassembly.parse_head_too_large),
                    ("uncaptured_start", stats.reassembly.parse_uncaptured_start),
                    (
                        "lost_chunk_framing",
                        stats.reassembly.parse_lost_chunk_framing,
                    ),
                ],
            )
        },
    },
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.requests.dropped",
            kind: COUNTER,
            unit: "{request}",
            description: "Requests not traced, by `reason`: `in_flight_limit` (too many \
                          pipelined on one connection).",
        },
        observe: |_, stats, _| {
            by(
                "reason",
                &[(
                    "in_flight_limit",
                    stats.reassembly.requests_dropped_overflow,
                )],
            )
        },
    },
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.connections.dropped",
            kind: COUNTER,
            unit: "{connection}",
            description: "Connections not traced, by `reason`: `table_full` \
                          (--max-connections).",
        },
        observe: |_, stats, _| {
            by(
                "reason",
                &[("table_full", stats.reassembly.connections_dropped)],
            )
        },
    },
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.connections.tracked",
            kind: GAUGE,
            unit: "{connection}",
            description: "Connections of traced processes followed now.",
        },
        observe: |_, _, gauges| one(gauges.connections_tracked),
    },
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.processes.traced",
            kind: GAUGE,
            unit: "{process}",
            description: "Processes traced now.",
        },
        observe: |_, _, gauges| one(gauges.processes_traced),
    },
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.spans.held",
            kind: GAUGE,
            unit: "{span}",
            description: "Spans held now, by `stage`: `stitching` (waiting until \
                          nothing can change their parent, --max-stitching-spans), `export_buffer` (waiting for the \
                          collector, --export-buffer-spans).",
        },
        observe: |health, _, gauges| {
            by(
                "stage",
                &[
                    ("stitching", gauges.spans_pending),
                    ("export_buffer", health.export.spans_buffered()),
                ],
            )
        },
    },
    SelfInstrument {
        doc: Instrument {
            name: "gym_tracer.memory.resident",
            kind: GAUGE,
            unit: "By",
            description: "The agent's resident memory.",
        },
        observe: |_, _, gauges| one(gauges.resident_memory_bytes),
    },
];

/// The reference entries of the self-telemetry instruments, for the README.
pub fn instruments() -> impl Iterator<Item = &'static Instrument> {
    SELF_INSTRUMENTS.iter().map(|instrument| &instrument.doc)
}

/// The agent's resource: `service.name` gym-tracer, its version, an id for this run, the
/// host, and `--resource-attributes` (they may add or override anything but the name).
fn resource(agent: &AgentResource) -> Resource {
    let instance: [u8; 16] = rand::rng().random();
    let instance = uuid_text(instance);
    let mut attributes = vec![
        KeyValue::new(attr::SERVICE_NAME, SERVICE_NAME),
        KeyValue::new(attr::SERVICE_VERSION, env!("CARGO_PKG_VERSION")),
        KeyValue::new(attr::SERVICE_INSTANCE_ID, instance),
        KeyValue::new(attr::HOST_NAME, crate::processes::identity::host_name()),
        KeyValue::new(attr::PROCESS_PID, i64::from(std::process::id())),
    ];
    for (key, value) in &agent.extra {
        if *key != attr::SERVICE_NAME {
            attributes.retain(|kv| kv.key.as_str() != *key);
            attributes.push(KeyValue::new(*key, value.clone()));
        }
    }
    Resource::builder_empty()
        .with_attributes(attributes)
        .build()
}

/// A random (version 4) UUID in its usual text form.
fn uuid_text(mut bytes: [u8; 16]) -> String {
    bytes[6] = (bytes[6] & 0x0f) | 0x40;
    bytes[8] = (bytes[8] & 0x3f) | 0x80;
    let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &hex[..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..]
    )
}

fn register(meter: &Meter, instrument: &'static SelfInstrument, health: Arc<Health>) {
    let callback = move |observer: &dyn AsyncInstrument<u64>| {
        let (stats, gauges) = health.snapshot();
        for (value, attributes) in (instrument.observe)(&health, &stats, &gauges) {
            observer.observe(value, &attributes);
        }
    };
    let doc = &instrument.doc;
    if doc.kind == COUNTER {
        meter
            .u64_observable_counter(doc.name)
            .with_unit(doc.unit)
            .with_description(doc.description)
            .with_callback(callback)
            .build();
    } else {
        meter
            .u64_observable_gauge(doc.name)
            .with_unit(doc.unit)
            .with_description(doc.description)
            .with_callback(callback)
            .build();
    }
}

/// Exports the self-telemetry every `interval` and once more on exit, over OTLP or as JSON
/// lines among the servers' metrics; `None` for `--output tree` (stdout is for people
/// there, and the exit summary says it all). The reader runs on `runtime`.
pub fn start(
    runtime: &tokio::runtime::Handle,
    target: &ExportTarget,
    agent: &AgentResource,
    interval: Duration,
    health: Arc<Health>,
) -> Result<Option<SdkMeterProvider>> {
    let target = ExportTarget {
        otlp: target.otlp.clone(),
        stdout: target
            .stdout
            .filter(|format| *format == StdoutFormat::JsonLines),
    };
    if target == ExportTarget::NOWHERE {
        return Ok(None);
    }
    let _runtime = runtime.enter();
    let provider = meter_provider(&target, &resource(agent), interval, &health.export)?;
    let meter = provider.meter("gym-tracer");
    for instrument in &SELF_INSTRUMENTS {
        register(&meter, instrument, health.clone());
    }
    Ok(Some(provider))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn instruments_follow_the_naming_conventions() {
        let mut names = std::collections::HashSet::new();
        for doc in instruments() {
            assert!(doc.name.starts_with("gym_tracer."), "{}", doc.name);
            assert!(names.insert(doc.name), "{} twice", doc.name);
            assert!(
                doc.unit == "By" || (doc.unit.starts_with('{') && doc.unit.ends_with('}')),
                "{}: {}",
                doc.name,
                doc.unit
            );
            assert!(doc.kind == COUNTER || doc.kind == GAUGE);
        }
    }

    #[test]
    fn every_value_comes_from_the_snapshot() {
        let health = Health::default();
        let mut stats = CounterSnapshot {
            events_lost_by_cpu: vec![0, 3],
            ..CounterSnapshot::default()
        };
        stats.pipeline.events_in = 5;
        stats.reassembly.parse_not_http = 2;
        stats.agent.spans_dropped_queue_full = 1;
        health.export.record_dropped(SpanDrop::ExportBufferFull, 4);
        let gauges = Gauges {
            connections_tracked: 7,
            ..Gauges::default()
        };
        let value = |name: &str, attribute: Option<(&str, &str)>| -> u64 {
            let instrument = SELF_INSTRUMENTS
                .iter()
                .find(|i| i.doc.name == name)
                .unwrap();
            (instrument.observe)(&health, &stats, &gauges)
                .into_iter()
                .find(|(_, attributes)| match attribute {
                    None => attributes.is_empty(),
                    Some((key, value)) => attributes
                        .iter()
                        .any(|kv| kv.key.as_str() == key && kv.value.as_str() == value),
                })
                .map(|(value, _)| value)
                .unwrap()
        };
        assert_eq!(value("gym_tracer.events.received", None), 5);
        assert_eq!(value("gym_tracer.events.lost", Some(("cpu", "1"))), 3);
        assert_eq!(
            value("gym_tracer.parse.errors", Some(("reason", "not_http"))),
            2
        );
        assert_eq!(
            value("gym_tracer.spans.dropped", Some(("reason", "queue_full"))),
            1
        );
        assert_eq!(
            value(
                "gym_tracer.spans.dropped",
                Some(("reason", "export_buffer_full"))
            ),
            4
        );
        assert_eq!(value("gym_tracer.connections.tracked", None), 7);
    }

    #[test]
    fn the_resource_is_the_agents_own() {
        let agent = AgentResource::new(
            Some("ignored".into()),
            vec![
                ("host.name".into(), "node-1".into()),
                ("service.name".into(), "not-this".into()),
            ],
        );
        let resource = resource(&agent);
        let get = |key: &str| {
            resource
                .get(&opentelemetry::Key::from(key.to_string()))
                .map(|v| v.to_string())
        };
        assert_eq!(get("service.name").as_deref(), Some(SERVICE_NAME));
        assert_eq!(get("host.name").as_deref(), Some("node-1"));
        assert_eq!(get("service.instance.id").map(|id| id.len()), Some(36));
    }
}
