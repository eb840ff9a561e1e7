//! What one inbound request means to Gym: its route template, its rollout id and the
//! `gym.*` span it stands for. Spans and metrics are both built from this, so they agree.

use crate::model::exchange::HttpExchange;

use crate::gym::ServerType;
use crate::gym::rollout_id::RolloutId;
use crate::gym::routes::{RouteName, strip_rollout_prefix};
use crate::gym::semantics::{SemanticSpan, is_tool_route, semantic_span};
use crate::model::exchange::Outcome;
use crate::model::exchange::RequestHead;
use crate::model::exchange::Role;
use crate::processes::TracedProcess;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestMeaning {
    pub route: RouteName,
    pub rollout_id: Option<RolloutId>,
    /// `None` when no handler ran (404/405) or the route is not one Gym wraps.
    pub semantic: Option<SemanticSpan>,
    /// A call of a resources server's tool: a route its own table declares, not one every
    /// resources server has.
    pub tool_call: bool,
}

/// The requests whose bodies are read: an agent's `/run` names its rollout only there.
pub fn wants_run_body(head: &RequestHead) -> bool {
    head.method == "POST" && strip_rollout_prefix(&head.path).route_path == "/run"
}

pub fn classify(process: &mut TracedProcess, exchange: &HttpExchange) -> RequestMeaning {
    let request = &exchange.request;
    let stripped = strip_rollout_prefix(&request.path);
    if exchange.role == Role::Client {
        // A call is named `HTTP {method}`; what matters is the rollout its path names.
        return RequestMeaning {
            route: RouteName::Unnamed,
            rollout_id: stripped.rollout_id,
            semantic: None,
            tool_call: false,
        };
    }
    let route = process.namer.name(stripped.route_path);
    // Gym's `/run` takes the id from its body only; a prefix is what every other route has.
    let rollout_id = exchange.run_rollout_id.clone().or(stripped.rollout_id);
    let handled = !matches!(
        exchange.outcome,
        Outcome::Response(ref response) if response.status == 404 || response.status == 405
    );
    let semantic = if handled {
        semantic_at_start(process, &request.method, stripped.route_path)
    } else {
        None
    };
    let tool_call = handled
        && is_gym_server(process)
        && route
            .http_route()
            .is_some_and(|route| is_tool_route(process.server_type, &request.method, route));
    RequestMeaning {
        route,
        rollout_id,
        semantic,
        tool_call,
    }
}

/// The `gym.*` span an inbound request will have, judged from its head alone (its calls
/// must know what to hang under before it ends). Gym's wrapped routes are literal paths, so
/// the prefix-stripped path decides, with no route matching.
pub fn semantic_at_start(
    process: &TracedProcess,
    method: &str,
    route_path: &str,
) -> Option<SemanticSpan> {
    if !is_gym_server(process) {
        return None;
    }
    semantic_span(process.server_type, method, route_path)
}

/// Whether an inbound request comes from another Gym server, which an agent on its host
/// traces: any request to a Gym server but an agent's `/run` and `/aggregate_metrics`, which
/// rollout collection sends. Only such a request's SERVER span may name a parent on another
/// host: a parent nobody exports would leave the span an orphan in its backend.
pub fn caller_is_gym_server(process: &TracedProcess, route_path: &str) -> bool {
    is_gym_server(process)
        && !(process.server_type == Some(ServerType::Agent)
            && matches!(route_path, "/run" | "/aggregate_metrics"))
}

/// Only a Gym server (named by its environment or --server-name) gets Gym's meanings.
fn is_gym_server(process: &TracedProcess) -> bool {
    process.identity.labels.server_name.is_some() && !process.is_other_kind()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gym::routes::RouteTemplate;
    use crate::gym::span_groups::SpanGroup;
    use crate::gym::{ServerKind, ServerType};
    use crate::model::exchange::AbortReason;
    use crate::model::service::GymLabels;
    use crate::pipeline::testing;
    use crate::processes::ProcessTable;

    const PID: u32 = 4242;

    fn exchange(path: &str, status: Option<u16>, body_id: Option<&str>) -> HttpExchange {
        let outcome = match status {
            Some(status) => testing::response(status),
            None => Outcome::Aborted(AbortReason::ConnectionClosed),
        };
        HttpExchange {
            run_rollout_id: body_id.and_then(RolloutId::parse),
            ..testing::exchange(PID, Role::Server, testing::request("POST", path), outcome)
        }
    }

    fn table(
        name: Option<&str>,
        server_type: Option<ServerType>,
        key: Option<&str>,
    ) -> ProcessTable {
        let mut table =
            ProcessTable::new(Vec::new(), crate::model::service::AgentResource::default());
        table.attach(
            PID,
            GymLabels {
                server_name: name.map(String::from),
                server_kind: server_type
                    .map(ServerKind::Known)
                    .or(key.map(ServerKind::from_config_key)),
                service_group: None,
            },
        );
        table
    }

    fn meaning(table: &mut ProcessTable, exchange: &HttpExchange) -> RequestMeaning {
        classify(table.get_mut(PID).unwrap(), exchange)
    }

    #[test]
    fn a_prefixed_verify_is_named_by_its_route_with_the_prefix_id() {
        let mut resources = table(Some("math"), Some(ServerType::Resources), None);
        let verify = meaning(
            &mut resources,
            &exchange("/ng-rollout/r-1/verify", Some(200), None),
        );
        assert_eq!(verify.route, RouteName::Template("/verify".into()));
        assert_eq!(verify.rollout_id, RolloutId::parse("r-1"));
        let semantic = verify.semantic.unwrap();
        assert_eq!(
            (semantic.name, semantic.group),
            ("gym.verify", SpanGroup::Verify)
        );
        // A dropped connection still ran the handler: a failed gym.verify.
        let dropped = meaning(&mut resources, &exchange("/verify", None, None));
        assert_eq!(dropped.semantic.unwrap().name, "gym.verify");
    }

    #[test]
    fn a_tool_is_a_declared_post_route_of_a_resources_server() {
        let mut resources = table(Some("weather"), Some(ServerType::Resources), None);
        let process = resources.get_mut(PID).unwrap();
        process
            .namer
            .table_mut()
            .set_harvested(vec![RouteTemplate::parse("/get_weather").unwrap()]);
        let tool = |table: &mut ProcessTable, path: &str, status| {
            meaning(table, &exchange(path, Some(status), None)).tool_call
        };
        assert!(tool(&mut resources, "/get_weather", 200));
        assert!(!tool(&mut resources, "/get_weather", 404), "no handler ran");
        assert!(!tool(&mut resources, "/verify", 200));
        assert!(!tool(&mut resources, "/undeclared", 200), "a guessed route");
        let mut agent = table(Some("agent"), Some(ServerType::Agent), None);
        assert!(!tool(&mut agent, "/get_weather", 200));
    }

    #[test]
    fn run_takes_its_id_from_the_body() {
        let mut agent = table(Some("agent"), Some(ServerType::Agent), None);
        let run = meaning(&mut agent, &exchange("/run", Some(200), Some("7-1-a2")));
        assert_eq!(run.rollout_id, RolloutId::parse("7-1-a2"));
        assert_eq!(run.semantic.unwrap().name, "gym.rollout");
    }

    #[test]
    fn no_semantic_span_without_a_handler_or_a_gym_identity() {
        let mut resources = table(Some("math"), Some(ServerType::Resources), None);
        for status in [404, 405] {
            let missing = meaning(&mut resources, &exchange("/verify", Some(status), None));
            assert_eq!(missing.semantic, None, "{status}");
        }
        let mut plain = table(None, None, None);
        assert_eq!(
            meaning(&mut plain, &exchange("/verify", Some(200), None)).semantic,
            None
        );
        // A Gym server of a kind without gym.* spans: its /run is not a rollout.
        let mut environment = table(Some("env"), None, Some("environment_servers"));
        assert_eq!(
            meaning(&mut environment, &exchange("/run", Some(200), None)).semantic,
            None
        );
    }

    #[test]
    fn run_bodies_are_read_only_for_run() {
        let head = |path: &str, method: &str| RequestHead {
            method: method.into(),
            ..exchange(path, Some(200), None).request
        };
        assert!(wants_run_body(&head("/run", "POST")));
        assert!(wants_run_body(&head("/ng-rollout/x/run", "POST")));
        assert!(!wants_run_body(&head("/run", "GET")));
        assert!(!wants_run_body(&head("/verify", "POST")));
    }
}
