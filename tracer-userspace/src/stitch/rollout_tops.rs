//! The last step of every release: a rollout's top waits for its whole tree. A `gym.rollout`
//! span (and its `/run` SERVER span, when released with it) goes out only once no span the
//! stitcher still holds could be below it: none held started before the rollout ended. Then
//! the insight stage, which reads what leaves, sees each rollout whole the moment its top
//! arrives, and a trace's top never precedes its spans. Decided by the spans held, not by a
//! clock: a saturated server that answers a call tens of seconds late keeps the rollout's top
//! back exactly that long.

use std::collections::VecDeque;

use foldhash::HashMap;

use super::Stitcher;
use crate::gym::ServerType;
use crate::model::ids::{SpanId, TraceId};
use crate::model::span::{SpanKind, SpanRecord};

/// The name of an agent server's rollout span (`gym.rollout`).
pub const GYM_ROLLOUT: &str = "gym.rollout";

/// Rollout tops kept back at once; past it the oldest goes out before its tree is known to be
/// whole (counted: `rollouts_completed_early`).
pub const MAX_WAITING_ROLLOUTS: usize = 65_536;

/// A `gym.rollout` span kept back, with its `/run` SERVER span when that came with it.
pub(super) type RolloutTop = (SpanRecord, Option<SpanRecord>);

/// An agent server's `gym.rollout` span: the top of a rollout's tree.
pub fn is_rollout_top(span: &SpanRecord) -> bool {
    span.kind == SpanKind::Internal
        && span.name == GYM_ROLLOUT
        && span.facts.server_type == Some(ServerType::Agent)
}

impl Stitcher {
    /// Takes the rollout tops out of `released` (what the stitcher let go of since the last
    /// call) and puts back, after the rest, every kept one whose tree is whole.
    pub fn hold_rollout_tops(&mut self, released: &mut Vec<SpanRecord>) {
        let tops: Vec<SpanRecord> = released
            .extract_if(.., |span| is_rollout_top(span))
            .collect();
        // Each top's `/run` (its parent, in its trace) when it came in the same batch.
        let parents: HashMap<SpanId, TraceId> = tops
            .iter()
            .filter_map(|top| Some((top.parent_span_id?, top.trace_id)))
            .collect();
        let mut runs: HashMap<SpanId, SpanRecord> = if parents.is_empty() {
            HashMap::default()
        } else {
            released
                .extract_if(.., |span| {
                    parents.get(&span.span_id) == Some(&span.trace_id)
                })
                .map(|run| (run.span_id, run))
                .collect()
        };
        for top in tops {
            let run = top.parent_span_id.and_then(|parent| runs.remove(&parent));
            if self.rollout_tops.len() >= MAX_WAITING_ROLLOUTS
                && let Some((oldest, run)) = self.rollout_tops.pop_front()
            {
                self.counters.rollouts_completed_early += 1;
                released.push(oldest);
                released.extend(run);
            }
            self.rollout_tops.push_back((top, run));
        }
        if self.rollout_tops.is_empty() {
            return;
        }
        let earliest_held = self.earliest_held_start();
        let mut still = VecDeque::with_capacity(self.rollout_tops.len());
        while let Some((top, run)) = self.rollout_tops.pop_front() {
            if earliest_held.is_some_and(|start| start < top.end_unix_ns) {
                still.push_back((top, run));
            } else {
                released.push(top);
                released.extend(run);
            }
        }
        self.rollout_tops = still;
    }

    /// Whether rollout tops are kept back (none should be once every span was released).
    pub fn rollout_tops_waiting(&self) -> bool {
        !self.rollout_tops.is_empty()
    }
}
