//! Who a traced process is, as the exported resource says: `service.name`, pid, executable.

use std::collections::BTreeMap;

use opentelemetry::KeyValue;
use opentelemetry_sdk::Resource;

use crate::spans::AttributeValue;

/// The resource of one traced process, in both the JSON-lines and the OTLP shape.
#[derive(Debug)]
pub struct ServiceIdentity {
    pub pid: u32,
    /// Flat resource attributes, sorted for stable output.
    pub attributes: BTreeMap<&'static str, AttributeValue>,
    pub resource: Resource,
}

fn read_trimmed(path: String) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

fn host_name() -> String {
    read_trimmed("/proc/sys/kernel/hostname".into()).unwrap_or_else(|| "unknown".into())
}

impl ServiceIdentity {
    /// `service_name_override` is the agent's `OTEL_SERVICE_NAME`; without it a process is
    /// named after its executable (`comm`).
    pub fn of_process(pid: u32, service_name_override: Option<&str>) -> Self {
        let executable =
            read_trimmed(format!("/proc/{pid}/comm")).unwrap_or_else(|| format!("pid-{pid}"));
        let service_name = service_name_override
            .map(str::to_string)
            .unwrap_or_else(|| executable.clone());
        let mut attributes = BTreeMap::new();
        let text = |s: String| AttributeValue::Str(s);
        attributes.insert("service.name", text(service_name));
        attributes.insert("process.pid", AttributeValue::Int(pid as i64));
        attributes.insert("process.executable.name", text(executable));
        attributes.insert("host.name", text(host_name()));
        attributes.insert("telemetry.distro.name", text("gym-tracer".into()));
        attributes.insert(
            "telemetry.distro.version",
            text(env!("CARGO_PKG_VERSION").into()),
        );
        Self::from_attributes(pid, attributes)
    }

    fn from_attributes(pid: u32, attributes: BTreeMap<&'static str, AttributeValue>) -> Self {
        let resource = Resource::builder_empty()
            .with_attributes(attributes.iter().map(|(k, v)| match v {
                AttributeValue::Str(s) => KeyValue::new(*k, s.clone()),
                AttributeValue::Int(i) => KeyValue::new(*k, *i),
            }))
            .build();
        Self {
            pid,
            attributes,
            resource,
        }
    }

    #[cfg(test)]
    pub fn for_test(name: &str) -> Self {
        let mut attributes = BTreeMap::new();
        attributes.insert("service.name", AttributeValue::Str(name.to_string()));
        Self::from_attributes(1, attributes)
    }
}
