//! The `gym.*` INTERNAL spans Gym wraps its handlers in, by server type and route, and
//! the server type a route table gives away.

use super::ServerType;
use super::routes::RouteTemplate;
use super::span_groups::SpanGroup;

/// A semantic span: its name as Gym writes it and the group that gates it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SemanticSpan {
    pub name: &'static str,
    pub group: SpanGroup,
}

const fn span(name: &'static str, group: SpanGroup) -> Option<SemanticSpan> {
    Some(SemanticSpan { name, group })
}

/// The span Gym's handler for `method route` opens (`route` with the rollout prefix
/// stripped): `traced_rollout_endpoint` on the agent's `/run`, `traced_endpoint` on the
/// agent's `/v1/responses` (`nemo_gym/base_responses_api_agent.py:235-260`) and the model
/// routes (`nemo_gym/base_responses_api_model.py:250-268`), `traced_verify_endpoint` on
/// `/verify` (`nemo_gym/base_resources_server.py:253-258`). All are POST routes; another
/// method is a 405 with no handler. With the server type unknown, only routes that one
/// type alone serves are named: `/v1/responses` is both an agent's and a model's.
pub fn semantic_span(
    server_type: Option<ServerType>,
    method: &str,
    route: &str,
) -> Option<SemanticSpan> {
    use ServerType::{Agent, Model, Resources};
    if method != "POST" {
        return None;
    }
    match (server_type, route) {
        (Some(Agent) | None, "/run") => span("gym.rollout", SpanGroup::Rollout),
        (Some(Resources) | None, "/verify") => span("gym.verify", SpanGroup::Verify),
        (Some(Agent), "/v1/responses") => span("gym.agent.responses", SpanGroup::Agent),
        (Some(Model) | None, "/v1/chat/completions") => {
            span("gym.model.chat_completions", SpanGroup::ModelCall)
        }
        (Some(Model), "/v1/responses") => span("gym.model.responses", SpanGroup::ModelCall),
        (Some(Model) | None, "/v1/messages") => span("gym.model.messages", SpanGroup::ModelCall),
        _ => None,
    }
}

/// The POST routes every resources server has (`nemo_gym/base_resources_server.py:250-259`);
/// its other POST routes are its tools, which an agent calls by name.
const RESOURCES_SERVER_ROUTES: [&str; 4] = [
    "/seed_session",
    "/close_session",
    "/verify",
    "/aggregate_metrics",
];

/// Whether `method route` (a route template the server itself declares) is a tool of a
/// resources server.
pub fn is_tool_route(server_type: Option<ServerType>, method: &str, route: &str) -> bool {
    server_type == Some(ServerType::Resources)
        && method == "POST"
        && !RESOURCES_SERVER_ROUTES.contains(&route)
}

/// The server type a harvested route table shows: only an agent serves `/run`, only a
/// resources server `/verify`, and a model server `/v1/chat/completions` (an agent may
/// proxy that too, hence checked after `/run`).
pub fn infer_server_type(routes: &[RouteTemplate]) -> Option<ServerType> {
    let has = |path: &str| routes.iter().any(|t| t.as_str() == path);
    if has("/run") {
        Some(ServerType::Agent)
    } else if has("/verify") {
        Some(ServerType::Resources)
    } else if has("/v1/chat/completions") {
        Some(ServerType::Model)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ServerType::{Agent, Model, Resources};

    fn name(server_type: Option<ServerType>, method: &str, route: &str) -> Option<&'static str> {
        semantic_span(server_type, method, route).map(|s| s.name)
    }

    #[test]
    fn a_resources_servers_other_post_routes_are_its_tools() {
        assert!(is_tool_route(Some(Resources), "POST", "/get_weather"));
        assert!(!is_tool_route(Some(Resources), "POST", "/verify"));
        assert!(!is_tool_route(Some(Resources), "POST", "/seed_session"));
        assert!(!is_tool_route(Some(Resources), "GET", "/get_weather"));
        assert!(!is_tool_route(Some(Agent), "POST", "/get_weather"));
        assert!(!is_tool_route(None, "POST", "/get_weather"));
    }

    #[test]
    fn contract_table() {
        let table = [
            (Agent, "/run", "gym.rollout", SpanGroup::Rollout),
            (Resources, "/verify", "gym.verify", SpanGroup::Verify),
            (
                Agent,
                "/v1/responses",
                "gym.agent.responses",
                SpanGroup::Agent,
            ),
            (
                Model,
                "/v1/chat/completions",
                "gym.model.chat_completions",
                SpanGroup::ModelCall,
            ),
            (
                Model,
                "/v1/responses",
                "gym.model.responses",
                SpanGroup::ModelCall,
            ),
            (
                Model,
                "/v1/messages",
                "gym.model.messages",
                SpanGroup::ModelCall,
            ),
        ];
        for (server_type, route, want, group) in table {
            assert_eq!(
                semantic_span(Some(server_type), "POST", route),
                Some(SemanticSpan { name: want, group })
            );
            assert_eq!(name(Some(server_type), "GET", route), None);
            assert_eq!(name(Some(server_type), "post", route), None);
        }
    }

    #[test]
    fn routes_of_another_type_have_no_span() {
        assert_eq!(name(Some(Model), "POST", "/run"), None);
        assert_eq!(name(Some(Agent), "POST", "/verify"), None);
        assert_eq!(name(Some(Resources), "POST", "/v1/responses"), None);
        assert_eq!(name(Some(Agent), "POST", "/v1/chat/completions"), None);
        assert_eq!(name(Some(Resources), "POST", "/seed_session"), None);
        assert_eq!(name(Some(Agent), "POST", "/aggregate_metrics"), None);
        assert_eq!(name(Some(Resources), "POST", "/ng-rollout/r/verify"), None);
    }

    #[test]
    fn unknown_type_names_only_unambiguous_routes() {
        assert_eq!(name(None, "POST", "/run"), Some("gym.rollout"));
        assert_eq!(name(None, "POST", "/verify"), Some("gym.verify"));
        assert_eq!(
            name(None, "POST", "/v1/chat/completions"),
            Some("gym.model.chat_completions")
        );
        assert_eq!(
            name(None, "POST", "/v1/messages"),
            Some("gym.model.messages")
        );
        assert_eq!(name(None, "POST", "/v1/responses"), None);
    }

    #[test]
    fn server_type_from_routes() {
        let routes = |paths: &[&str]| -> Vec<RouteTemplate> {
            paths.iter().map(|p| p.parse().unwrap()).collect()
        };
        assert_eq!(
            infer_server_type(&routes(&["/run", "/v1/responses"])),
            Some(Agent)
        );
        assert_eq!(
            infer_server_type(&routes(&["/run", "/v1/chat/completions"])),
            Some(Agent)
        );
        assert_eq!(
            infer_server_type(&routes(&["/seed_session", "/verify"])),
            Some(Resources)
        );
        assert_eq!(
            infer_server_type(&routes(&[
                "/v1/chat/completions",
                "/v1/responses",
                "/v1/messages"
            ])),
            Some(Model)
        );
        assert_eq!(infer_server_type(&routes(&["/v1/responses"])), None);
        assert_eq!(infer_server_type(&[]), None);
    }
}
