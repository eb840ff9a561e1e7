//! Who a traced process is, as the exported resource says: for a Gym server its service
//! group, server name and type (as Gym's own telemetry names them), plus the process and
//! host attributes of the OTel resource conventions.

use std::collections::BTreeMap;
use std::sync::Arc;

use opentelemetry::{KeyValue, StringValue};
use opentelemetry_sdk::Resource;

use crate::gym::ServerKind;
use crate::model::attributes as attr;
use crate::model::service::{AgentResource, GymLabels, ServiceIdentity};
use crate::model::span::AttributeValue;
use crate::processes::discovery::executable_path;

/// Gym's group when neither the server nor the agent names one (`nemo_gym.telemetry`).
pub const DEFAULT_SERVICE_GROUP: &str = "nemo";

fn read_trimmed(path: String) -> Option<String> {
    std::fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// The parent of `pid`, from `/proc/PID/stat` (the field after the parenthesised name).
pub(crate) fn parent_pid(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, after_name) = stat.rsplit_once(')')?;
    after_name.split_whitespace().nth(1)?.parse().ok()
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
        Self::of_process_named(pid, labels, agent, parent, None)
    }

    /// As [`of_process`](Self::of_process), for a process that just exec'd: `comm` is its new
    /// task name as the kernel read it at the exec, its name if /proc no longer has the
    /// process (a short-lived helper gone before a lagging agent gets to its exec).
    pub fn of_exec(
        pid: u32,
        labels: GymLabels,
        agent: &AgentResource,
        parent: Option<u32>,
        comm: &str,
    ) -> Self {
        Self::of_process_named(
            pid,
            labels,
            agent,
            parent,
            Some(comm).filter(|c| !c.is_empty()),
        )
    }

    fn of_process_named(
        pid: u32,
        labels: GymLabels,
        agent: &AgentResource,
        parent: Option<u32>,
        comm: Option<&str>,
    ) -> Self {
        let agent_service_name = agent.service_name.as_deref();
        let live = !agent.replayed;
        let executable = live
            .then(|| read_trimmed(format!("/proc/{pid}/comm")))
            .flatten()
            .or_else(|| comm.map(str::to_owned))
            .unwrap_or_else(|| format!("pid-{pid}"));
        let text = |s: &str| AttributeValue::Str(Arc::<str>::from(s).into());
        let mut attributes = BTreeMap::new();
        match &labels.server_name {
            Some(server_name) => {
                let group = labels
                    .service_group
                    .as_deref()
                    .or(agent_service_name)
                    .unwrap_or(DEFAULT_SERVICE_GROUP);
                attributes.insert(attr::SERVICE_NAME, text(&format!("{group}/{server_name}")));
                attributes.insert(attr::GYM_SERVICE_GROUP, text(group));
                attributes.insert(attr::GYM_SERVER_NAME, text(server_name));
            }
            None => {
                let name = agent_service_name.unwrap_or(&executable);
                attributes.insert(attr::SERVICE_NAME, text(name));
            }
        }
        if let Some(key) = labels.server_kind.as_ref().map(ServerKind::config_key) {
            attributes.insert(attr::GYM_SERVER_TYPE, text(key));
        }
        attributes.insert(attr::PROCESS_PID, AttributeValue::Int(pid as i64));
        if let Some(parent) = parent {
            attributes.insert(attr::PROCESS_PARENT_PID, AttributeValue::Int(parent as i64));
        }
        // The conventions: the base name of /proc/<pid>/exe's target, not `comm`.
        let path = live.then(|| executable_path(pid)).flatten();
        let executable_name = path
            .as_ref()
            .and_then(|path| path.file_name())
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_else(|| executable.clone());
        if let Some(path) = &path {
            attributes.insert(attr::PROCESS_EXECUTABLE_PATH, text(&path.to_string_lossy()));
        }
        if live {
            attributes.insert(attr::PROCESS_EXECUTABLE_NAME, text(&executable_name));
            attributes.insert(attr::HOST_NAME, text(&host_name()));
        }
        attributes.insert(attr::TELEMETRY_DISTRO_NAME, text("gym-tracer"));
        attributes.insert(
            attr::TELEMETRY_DISTRO_VERSION,
            text(env!("CARGO_PKG_VERSION")),
        );
        for (key, value) in &agent.extra {
            // What identifies the traced process is the agent's to say; the rest (host.name
            // in a pod, which sees the pod's hostname) the operator may correct.
            let per_process = *key == attr::SERVICE_NAME
                || key.starts_with(attr::GYM_PREFIX)
                || key.starts_with("process.");
            if per_process {
                attributes.entry(*key).or_insert_with(|| text(value));
            } else {
                attributes.insert(*key, text(value));
            }
        }
        Self::from_attributes(pid, labels, attributes)
    }

    pub(crate) fn from_attributes(
        pid: u32,
        labels: GymLabels,
        attributes: BTreeMap<&'static str, AttributeValue>,
    ) -> Self {
        let resource = Resource::builder_empty()
            .with_attributes(attributes.iter().map(|(k, v)| match v {
                AttributeValue::Str(s) => KeyValue::new(*k, StringValue::from(s)),
                AttributeValue::Int(i) => KeyValue::new(*k, *i),
                AttributeValue::Bool(b) => KeyValue::new(*k, *b),
                AttributeValue::Double(d) => KeyValue::new(*k, *d),
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

    /// `nemo.gym.server.name` as the process's spans carry it (shared, not copied per span).
    pub fn server_name_attribute(&self) -> Option<&AttributeValue> {
        self.attributes.get(attr::GYM_SERVER_NAME)
    }

    /// A process known by its `service.name` alone (unit tests, the cost measurement).
    pub fn named(name: &str) -> Self {
        let mut attributes = BTreeMap::new();
        attributes.insert(
            attr::SERVICE_NAME,
            AttributeValue::Str(name.to_string().into()),
        );
        Self::from_attributes(1, GymLabels::default(), attributes)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(identity: &ServiceIdentity, key: &str) -> Option<String> {
        match identity.attributes.get(key) {
            Some(AttributeValue::Str(s)) => Some(s.to_string()),
            _ => None,
        }
    }

    #[test]
    fn gym_server_is_named_group_slash_server() {
        let me = std::process::id();
        let labels = GymLabels {
            server_name: Some("math_verify".into()),
            server_kind: Some(ServerKind::Known(crate::gym::ServerType::Resources)),
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

    /// A helper gone before the agent read its exec: named by the kernel's task name, not
    /// `pid-N`; a live process by /proc.
    #[test]
    fn a_process_gone_at_its_exec_is_named_by_the_kernels_task_name() {
        let gone = u32::MAX - 1; // above pid_max: never a live process
        let exec = |pid, comm| {
            ServiceIdentity::of_exec(
                pid,
                GymLabels::default(),
                &AgentResource::default(),
                Some(1),
                comm,
            )
        };
        let identity = exec(gone, "codex");
        assert_eq!(text(&identity, "process.executable.name").unwrap(), "codex");
        assert!(!identity.attributes.contains_key("process.executable.path"));
        let unnamed = exec(gone, "");
        assert_eq!(
            text(&unnamed, "process.executable.name").unwrap(),
            format!("pid-{gone}")
        );
        let live = exec(std::process::id(), "codex");
        let comm = read_trimmed(format!("/proc/{}/comm", std::process::id())).unwrap();
        assert_ne!(comm, "codex");
        assert_eq!(text(&live, "service.name").unwrap(), comm);
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
