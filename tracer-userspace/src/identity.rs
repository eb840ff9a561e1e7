//! Who a traced process is, as the exported resource says: for a Gym server its service
//! group, server name and type (as Gym's own telemetry names them), plus the process and
//! host attributes of the OTel resource conventions.

use std::collections::BTreeMap;

use opentelemetry::KeyValue;
use opentelemetry_sdk::Resource;

use crate::discovery::executable_path;
use crate::gym::ServerType;
use crate::spans::AttributeValue;

/// Gym's group when neither the server nor the agent names one (`nemo_gym.telemetry`).
pub const DEFAULT_SERVICE_GROUP: &str = "nemo";

/// What a process is to Gym, when known: from its environment (`NEMO_GYM_CONFIG_PATH`,
/// `NEMO_GYM_CONFIG_DICT`, `OTEL_SERVICE_NAME`) or from `--server-name`/`--server-type`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GymLabels {
    pub server_name: Option<String>,
    pub server_type: Option<ServerType>,
    /// The type as the config spells it, also when it is a kind the tracer has no `gym.*`
    /// spans for (`environment_servers`).
    pub server_type_key: Option<String>,
    /// The traced process's own `OTEL_SERVICE_NAME`.
    pub service_group: Option<String>,
}

/// The resource of one traced process, in both the JSON-lines and the OTLP shape.
#[derive(Debug)]
pub struct ServiceIdentity {
    pub pid: u32,
    pub labels: GymLabels,
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
    /// `agent_service_name` is the agent's own `OTEL_SERVICE_NAME`/`--service-name`: the
    /// group of Gym servers that do not set one, the name of processes that are not Gym
    /// servers. `parent` is set for a forked child that inherits its parent's identity.
    pub fn of_process(
        pid: u32,
        labels: GymLabels,
        agent_service_name: Option<&str>,
        parent: Option<u32>,
    ) -> Self {
        let executable =
            read_trimmed(format!("/proc/{pid}/comm")).unwrap_or_else(|| format!("pid-{pid}"));
        let text = |s: &str| AttributeValue::Str(s.to_string());
        let mut attributes = BTreeMap::new();
        match &labels.server_name {
            Some(server_name) => {
                let group = labels
                    .service_group
                    .as_deref()
                    .or(agent_service_name)
                    .unwrap_or(DEFAULT_SERVICE_GROUP);
                attributes.insert("service.name", text(&format!("{group}/{server_name}")));
                attributes.insert("nemo.gym.service_group", text(group));
                attributes.insert("nemo.gym.server.name", text(server_name));
            }
            None => {
                let name = agent_service_name.unwrap_or(&executable);
                attributes.insert("service.name", text(name));
            }
        }
        let type_key = labels.server_type.map(ServerType::config_key);
        if let Some(key) = type_key.or(labels.server_type_key.as_deref()) {
            attributes.insert("nemo.gym.server.type", text(key));
        }
        attributes.insert("process.pid", AttributeValue::Int(pid as i64));
        if let Some(parent) = parent {
            attributes.insert("process.parent_pid", AttributeValue::Int(parent as i64));
        }
        // The conventions: the base name of /proc/<pid>/exe's target, not `comm`.
        let path = executable_path(pid);
        let executable_name = path
            .as_ref()
            .and_then(|path| path.file_name())
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_else(|| executable.clone());
        if let Some(path) = &path {
            attributes.insert("process.executable.path", text(&path.to_string_lossy()));
        }
        attributes.insert("process.executable.name", text(&executable_name));
        attributes.insert("host.name", text(&host_name()));
        attributes.insert("telemetry.distro.name", text("gym-tracer"));
        attributes.insert("telemetry.distro.version", text(env!("CARGO_PKG_VERSION")));
        Self::from_attributes(pid, labels, attributes)
    }

    fn from_attributes(
        pid: u32,
        labels: GymLabels,
        attributes: BTreeMap<&'static str, AttributeValue>,
    ) -> Self {
        let resource = Resource::builder_empty()
            .with_attributes(attributes.iter().map(|(k, v)| match v {
                AttributeValue::Str(s) => KeyValue::new(*k, s.clone()),
                AttributeValue::Int(i) => KeyValue::new(*k, *i),
            }))
            .build();
        Self {
            pid,
            labels,
            attributes,
            resource,
        }
    }

    /// `nemo.gym.server.name`, for span and metric attributes.
    pub fn server_name(&self) -> Option<&str> {
        self.labels.server_name.as_deref()
    }

    #[cfg(test)]
    pub fn for_test(name: &str) -> Self {
        let mut attributes = BTreeMap::new();
        attributes.insert("service.name", AttributeValue::Str(name.to_string()));
        Self::from_attributes(1, GymLabels::default(), attributes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(identity: &ServiceIdentity, key: &str) -> Option<String> {
        match identity.attributes.get(key) {
            Some(AttributeValue::Str(s)) => Some(s.clone()),
            _ => None,
        }
    }

    #[test]
    fn gym_server_is_named_group_slash_server() {
        let me = std::process::id();
        let labels = GymLabels {
            server_name: Some("math_verify".into()),
            server_type: Some(ServerType::Resources),
            ..GymLabels::default()
        };
        let identity = ServiceIdentity::of_process(me, labels.clone(), None, None);
        assert_eq!(text(&identity, "service.name").unwrap(), "nemo/math_verify");
        assert_eq!(text(&identity, "nemo.gym.service_group").unwrap(), "nemo");
        assert_eq!(
            text(&identity, "nemo.gym.server.type").unwrap(),
            "resources_servers"
        );
        let with_group = GymLabels {
            service_group: Some("exp7".into()),
            ..labels.clone()
        };
        let identity = ServiceIdentity::of_process(me, with_group, Some("agent"), None);
        assert_eq!(text(&identity, "service.name").unwrap(), "exp7/math_verify");
        let identity = ServiceIdentity::of_process(me, labels, Some("agent"), Some(1));
        assert_eq!(
            text(&identity, "service.name").unwrap(),
            "agent/math_verify"
        );
        assert_eq!(
            identity.attributes.get("process.parent_pid"),
            Some(&AttributeValue::Int(1))
        );
    }

    #[test]
    fn other_processes_keep_their_executable_name() {
        let identity =
            ServiceIdentity::of_process(std::process::id(), GymLabels::default(), None, None);
        let comm = read_trimmed(format!("/proc/{}/comm", std::process::id())).unwrap();
        assert_eq!(text(&identity, "service.name").unwrap(), comm);
        assert!(!identity.attributes.contains_key("nemo.gym.server.name"));
    }
}
