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

/// What the agent's configuration adds to every traced process's resource.
#[derive(Clone, Debug, Default)]
pub struct AgentResource {
    /// The agent's own `OTEL_SERVICE_NAME`/`--service-name`: the group of Gym servers that
    /// do not set one, the name of processes that are not Gym servers.
    pub service_name: Option<String>,
    /// `--resource-attributes` / OTEL_RESOURCE_ATTRIBUTES: added to every resource, and
    /// override `host.name` & co., never `service.name`, `nemo.gym.*` or `process.*`. Keys are leaked once at start
    /// (a handful, for the agent's lifetime) so resources keep `&'static str` keys.
    pub extra: Vec<(&'static str, String)>,
}

impl AgentResource {
    pub fn new(service_name: Option<String>, extra: Vec<(String, String)>) -> Self {
        let extra = extra
            .into_iter()
            .map(|(key, value)| (&*Box::leak(key.into_boxed_str()), value))
            .collect();
        Self {
            service_name,
            extra,
        }
    }

    #[cfg(test)]
    pub fn named(service_name: &str) -> Self {
        Self::new(Some(service_name.to_owned()), Vec::new())
    }
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

pub(crate) fn host_name() -> String {
    read_trimmed("/proc/sys/kernel/hostname".into()).unwrap_or_else(|| "unknown".into())
}

impl ServiceIdentity {
    /// `parent` is set for a forked child that inherits its parent's identity.
    pub fn of_process(
        pid: u32,
        labels: GymLabels,
        agent: &AgentResource,
        parent: Option<u32>,
    ) -> Self {
        let agent_service_name = agent.service_name.as_deref();
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
        for (key, value) in &agent.extra {
            // What identifies the traced process is the agent's to say; the rest (host.name
            // in a pod, which sees the pod's hostname) the operator may correct.
            let per_process = *key == "service.name"
                || key.starts_with("nemo.gym.")
                || key.starts_with("process.");
            if per_process {
                attributes.entry(*key).or_insert_with(|| text(value));
            } else {
                attributes.insert(*key, text(value));
            }
        }
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
        let identity =
            ServiceIdentity::of_process(me, labels.clone(), &AgentResource::default(), None);
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
        let identity =
            ServiceIdentity::of_process(me, with_group, &AgentResource::named("agent"), None);
        assert_eq!(text(&identity, "service.name").unwrap(), "exp7/math_verify");
        let identity =
            ServiceIdentity::of_process(me, labels, &AgentResource::named("agent"), Some(1));
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
        let identity = ServiceIdentity::of_process(
            std::process::id(),
            GymLabels::default(),
            &AgentResource::default(),
            None,
        );
        let comm = read_trimmed(format!("/proc/{}/comm", std::process::id())).unwrap();
        assert_eq!(text(&identity, "service.name").unwrap(), comm);
        assert!(!identity.attributes.contains_key("nemo.gym.server.name"));
    }

    #[test]
    fn configured_attributes_may_correct_the_host_but_not_the_process() {
        let agent = AgentResource::new(
            None,
            vec![
                ("k8s.node.name".into(), "node-1".into()),
                ("host.name".into(), "node-1".into()),
                ("service.name".into(), "spoofed".into()),
                ("process.pid".into(), "1".into()),
            ],
        );
        let me = std::process::id();
        let identity = ServiceIdentity::of_process(me, GymLabels::default(), &agent, None);
        assert_eq!(text(&identity, "k8s.node.name").as_deref(), Some("node-1"));
        assert_eq!(text(&identity, "host.name").as_deref(), Some("node-1"));
        assert_ne!(text(&identity, "service.name").as_deref(), Some("spoofed"));
        assert_eq!(
            identity.attributes["process.pid"],
            AttributeValue::Int(me as i64)
        );
    }
}
