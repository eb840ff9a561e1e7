//! The traced processes: who each one is and how its routes are named. Filled from `--pid`,
//! discovery and fork events; emptied by exits, which free everything kept per process.

use std::collections::HashMap;
use std::sync::Arc;

use crate::gym::routes::{RouteNamer, RouteTable, RouteTemplate};
use crate::gym::semantics::infer_server_type;
use crate::gym::{ServerKind, ServerType};
use crate::model::service::AgentResource;
use crate::model::service::GymLabels;
use crate::model::service::ServiceIdentity;

pub struct TracedProcess {
    pub identity: Arc<ServiceIdentity>,
    /// The process that was attached: itself, or the ancestor it was forked from. Routes
    /// harvested from a server apply to all of its worker processes.
    pub root: u32,
    /// The traced process it was forked from; none for an attached one.
    pub parent: Option<u32>,
    /// From the labels, or inferred from the harvested routes.
    /// From its labels, else inferred from its harvested routes; never for a kind the
    /// labels name that is none of Gym's three.
    pub server_type: Option<ServerType>,
    pub namer: RouteNamer,
}

impl TracedProcess {
    /// A server or a process it forked itself (uvicorn's workers, a verifier's fork): their
    /// starts and ends are logged at info level. Deeper descendants (a CLI agent's helpers,
    /// hundreds per rollout) are counted and logged at debug level.
    pub fn is_logged(&self) -> bool {
        self.parent.is_none_or(|parent| parent == self.root)
    }
}

/// Logs a process's start, exec or end at info level if `logged` ([`TracedProcess::is_logged`]),
/// else at debug level.
pub fn log_lifecycle(logged: bool, pid: u32, message: std::fmt::Arguments<'_>) {
    if logged {
        tracing::info!(pid, "{message}");
    } else {
        tracing::debug!(pid, "{message}");
    }
}

impl TracedProcess {
    /// Whether [`log_lifecycle`] writes for it at the current log level.
    pub fn lifecycle_logged_now(&self) -> bool {
        if self.is_logged() {
            tracing::enabled!(tracing::Level::INFO)
        } else {
            tracing::enabled!(tracing::Level::DEBUG)
        }
    }

    /// Its labels name a kind of server that is none of Gym's three: no `gym.*` spans.
    pub fn is_other_kind(&self) -> bool {
        matches!(self.identity.labels.server_kind, Some(ServerKind::Other(_)))
    }
}

pub struct ProcessTable {
    processes: HashMap<u32, TracedProcess>,
    user_routes: Vec<RouteTemplate>,
    agent: AgentResource,
}

impl ProcessTable {
    pub fn new(user_routes: Vec<RouteTemplate>, agent: AgentResource) -> Self {
        Self {
            processes: HashMap::new(),
            user_routes,
            agent,
        }
    }

    pub fn len(&self) -> usize {
        self.processes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.processes.is_empty()
    }

    /// Every traced process's pid, in no order.
    pub fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.processes.keys().copied()
    }

    pub fn contains(&self, pid: u32) -> bool {
        self.processes.contains_key(&pid)
    }

    pub fn get(&self, pid: u32) -> Option<&TracedProcess> {
        self.processes.get(&pid)
    }

    pub fn get_mut(&mut self, pid: u32) -> Option<&mut TracedProcess> {
        self.processes.get_mut(&pid)
    }

    /// Registers a process that was named or discovered.
    pub fn attach(&mut self, pid: u32, labels: GymLabels) -> &TracedProcess {
        let server_type = labels.server_kind.as_ref().and_then(ServerKind::known);
        let mut table = RouteTable::new(self.user_routes.clone());
        table.set_server_type(server_type);
        let identity = ServiceIdentity::of_process(pid, labels, &self.agent, None);
        self.processes.entry(pid).insert_entry(TracedProcess {
            identity: Arc::new(identity),
            root: pid,
            parent: None,
            server_type,
            namer: RouteNamer::new(table),
        });
        &self.processes[&pid]
    }

    /// Registers a forked child under its parent's identity; `None` if the parent is not
    /// (or no longer) traced.
    pub fn adopt_child(&mut self, parent: u32, child: u32) -> Option<&TracedProcess> {
        let parent_process = self.processes.get(&parent)?;
        let identity = ServiceIdentity::of_process(
            child,
            parent_process.identity.labels.clone(),
            &self.agent,
            Some(parent),
        );
        let process = TracedProcess {
            identity: Arc::new(identity),
            root: parent_process.root,
            parent: Some(parent),
            server_type: parent_process.server_type,
            namer: parent_process.namer.clone(),
        };
        self.processes.insert(child, process);
        self.processes.get(&child)
    }

    /// `pid` exec'd a new program. A followed child's resource names the new executable (a
    /// CLI's npm shim forks, and the child execs the CLI's binary: the spans are the
    /// binary's); an attached process keeps the identity it was attached under.
    pub fn execd(&mut self, pid: u32, comm: &str) {
        let Some(process) = self.processes.get_mut(&pid) else {
            return;
        };
        if process.parent.is_none() {
            return;
        }
        let identity = ServiceIdentity::of_exec(
            pid,
            process.identity.labels.clone(),
            &self.agent,
            process.parent,
            comm,
        );
        process.identity = Arc::new(identity);
    }

    pub fn remove(&mut self, pid: u32) -> Option<TracedProcess> {
        self.processes.remove(&pid)
    }

    /// Routes harvested from `root`'s `/openapi.json`, for it and its children. A server
    /// whose type is not known gets it from its routes.
    pub fn set_harvested_routes(&mut self, root: u32, templates: &[RouteTemplate]) {
        let inferred = infer_server_type(templates);
        for process in self.processes.values_mut().filter(|p| p.root == root) {
            if !process.is_other_kind() {
                process.server_type = process.server_type.or(inferred);
            }
            let table = process.namer.table_mut();
            table.set_harvested(templates.to_vec());
            table.set_server_type(process.server_type);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::span::AttributeValue;

    fn labels(name: &str, server_type: Option<ServerType>) -> GymLabels {
        GymLabels {
            server_name: Some(name.into()),
            server_kind: server_type.map(ServerKind::Known),
            service_group: None,
        }
    }

    #[test]
    fn a_child_inherits_identity_routes_and_root() {
        let mut table = ProcessTable::new(Vec::new(), AgentResource::default());
        table.attach(10, labels("math", Some(ServerType::Resources)));
        let routes: Vec<RouteTemplate> = vec!["/items/{item_id}".parse().unwrap()];
        table.set_harvested_routes(10, &routes);
        let child = table.adopt_child(10, 11).unwrap();
        assert_eq!(child.root, 10);
        assert_eq!(child.server_type, Some(ServerType::Resources));
        assert_eq!(child.identity.server_name(), Some("math"));
        assert_eq!(
            child.identity.attributes.get("process.parent_pid"),
            Some(&AttributeValue::Int(10))
        );
        let grandchild = table.adopt_child(11, 12).unwrap();
        assert_eq!(grandchild.root, 10, "routes are the attached server's");
        let named = table.get_mut(12).unwrap().namer.name("/items/3");
        assert_eq!(named.http_route().map(|r| &**r), Some("/items/{item_id}"));
        assert!(table.adopt_child(99, 100).is_none(), "untraced parent");
    }

    #[test]
    fn harvested_routes_give_an_unknown_type_but_never_override_one() {
        let mut table = ProcessTable::new(Vec::new(), AgentResource::default());
        table.attach(20, labels("unknown", None));
        table.attach(
            21,
            GymLabels {
                server_kind: Some(ServerKind::from_config_key("environment_servers")),
                ..labels("env", None)
            },
        );
        let agent_routes: Vec<RouteTemplate> = vec!["/run".parse().unwrap()];
        table.set_harvested_routes(20, &agent_routes);
        table.set_harvested_routes(21, &agent_routes);
        assert_eq!(
            table.get_mut(20).unwrap().server_type,
            Some(ServerType::Agent)
        );
        assert_eq!(table.get_mut(21).unwrap().server_type, None);
        assert!(table.remove(20).is_some());
        assert!(!table.contains(20));
    }
}
