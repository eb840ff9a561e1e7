//! How a span's own time on the critical path is named: the context a span runs in (inherited
//! down the tree) and the phase that gives its time.

use super::critical_path::SpanClass;
use crate::model::rollout::Phase;

/// Where in a rollout a span runs, inherited down the tree: once inside a model server,
/// everything below is the model's; inside `/verify`, a resources server's time is verify.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Context {
    Agent,
    Tool,
    Verify,
    Model,
}

impl Context {
    /// The context of a span of `class` entered from this one.
    pub fn within(self, class: SpanClass) -> Context {
        match (self, class) {
            (Context::Model, _) | (_, SpanClass::Model) => Context::Model,
            (Context::Verify, SpanClass::Resources { .. })
            | (_, SpanClass::Resources { verify: true }) => Context::Verify,
            (_, SpanClass::Resources { verify: false }) => Context::Tool,
            (_, SpanClass::Agent) => Context::Agent,
            (context, SpanClass::Call { .. }) => context,
        }
    }

    /// The phase of a span's own time in this context (calls aside).
    pub fn phase(self) -> Phase {
        match self {
            Context::Agent => Phase::Agent,
            Context::Tool => Phase::Tool,
            Context::Verify => Phase::Verify,
            Context::Model => Phase::Model,
        }
    }
}
