//! What one inbound request means to Gym: its route template, its rollout id and the
//! `gym.*` span it stands for. Spans and metrics are both built from this, so they agree.

use crate::connections::{HttpExchange, Outcome};
use crate::gym::rollout_id::RolloutId;
use crate::gym::routes::{RouteName, strip_rollout_prefix};
use crate::gym::semantics::{SemanticSpan, semantic_span};
use crate::http::RequestHead;
use crate::processes::TracedProcess;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestMeaning {
    pub route: RouteName,
    pub rollout_id: Option<RolloutId>,
    /// `None` when no handler ran (404/405) or the route is not one Gym wraps.
    pub semantic: Option<SemanticSpan>,
}

/// The requests whose bodies are read: an agent's `/run` names its rollout only there.
pub fn wants_run_body(head: &RequestHead) -> bool {
    head.method == "POST" && strip_rollout_prefix(&head.path).route_path == "/run"
}

pub fn classify(process: &mut TracedProcess, exchange: &HttpExchange) -> RequestMeaning {
    let request = &exchange.request;
    let stripped = strip_rollout_prefix(&request.path);
    let route = process.namer.name(stripped.route_path);
    // Gym's `/run` takes the id from its body only; a prefix is what every other route has.
    let rollout_id = exchange.run_rollout_id.clone().or(stripped.rollout_id);
    let handled = !matches!(
        exchange.outcome,
        Outcome::Response(ref response) if response.status == 404 || response.status == 405
    );
    // Only a Gym server (named by its environment or --server-name) gets gym.* spans.
    let is_gym_server = process.identity.labels.server_name.is_some() && !process.other_server_type;
    let semantic = match &route {
        _ if !handled || !is_gym_server => None,
        RouteName::Template(template) => {
            semantic_span(process.server_type, &request.method, template)
        }
        _ => semantic_span(process.server_type, &request.method, stripped.route_path),
    };
    RequestMeaning {
        route,
        rollout_id,
        semantic,
    }
}
