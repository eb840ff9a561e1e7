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

    /// The phase of the own time of a span of `class` running in this context (the one
    /// [`Context::within`] gave it): the one rule set of the critical path and of the live
    /// view's phase now. A call's own time is waiting on a traced server (its own event loop
    /// included) when the callee is traced or answered below it, else on the outside world.
    pub fn own_phase(self, class: SpanClass, callee_answered_below: bool) -> Phase {
        match (self, class) {
            (Context::Model, _) => Phase::Model,
            (_, SpanClass::Call { callee_traced }) if callee_traced || callee_answered_below => {
                Phase::Queue
            }
            (_, SpanClass::Call { .. }) => Phase::External,
            (context, _) => context.phase(),
        }
    }

    /// The phase of a span's own time in this context (calls aside).
    fn phase(self) -> Phase {
        match self {
            Context::Agent => Phase::Agent,
            Context::Tool => Phase::Tool,
            Context::Verify => Phase::Verify,
            Context::Model => Phase::Model,
        }
    }
}
