//! Who a traced process is, as its exported resource says.

use std::collections::BTreeMap;
use std::fmt;

use opentelemetry_sdk::Resource;

use crate::gym::{ServerKind, ServerType};

use super::span::AttributeValue;

/// What a process is to Gym, when known: from its environment (`NEMO_GYM_CONFIG_PATH`,
/// `NEMO_GYM_CONFIG_DICT`, `OTEL_SERVICE_NAME`) or from `--server-name`/`--server-type`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GymLabels {
    pub server_name: Option<String>,
    pub server_kind: Option<ServerKind>,
    /// The traced process's own `OTEL_SERVICE_NAME`.
    pub service_group: Option<String>,
}

impl GymLabels {
    /// A server of a known type named as Gym's examples name them (`resources_server`): what
    /// the fuzz replay and the cost benchmark attach their made-up processes as.
    pub fn example_server(server_type: ServerType) -> Self {
        Self {
            server_name: Some(format!("{}_server", server_type.short_name())),
            server_kind: Some(ServerKind::Known(server_type)),
            ..Self::default()
        }
    }
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
    /// The processes are a recording's (`gym-tracer replay`), not this host's: their
    /// executable and the host name are left out, as reading them here would name this
    /// host's.
    pub replayed: bool,
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
            replayed: false,
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

/// How the agent's log names a process: `math (resources_servers)`.
impl fmt::Display for GymLabels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.server_name, &self.server_kind) {
            (Some(name), Some(kind)) => write!(f, "{name} ({})", kind.config_key()),
            (Some(name), None) => write!(f, "{name} (type unknown)"),
            (None, _) => f.write_str("a process that is not a Gym server"),
        }
    }
}
