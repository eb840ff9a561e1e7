//! The in-flight inbound requests of each rollout, by process: what a call that names its
//! rollout (its `/ng-rollout/<id>` prefix, its body's `_ng_*` tail) is placed among, looked
//! up instead of scanned, so a call costs the same with 64 or 16,384 requests in flight.
//!
//! A request belongs to its own rollout, else to its caller's (carried down the edges). So
//! every event that can give a request a rollout re-indexes the requests in flight below it:
//! an edge drawn to it, a rollout named by its head, body or session, or lent to it by its
//! only call. An entry whose request has finished or changed rollout is skipped on use.

use super::{Role, Stitcher};
use crate::gym::rollout_id::RolloutId;
use crate::model::ids::SpanId;

/// Requests visited at most when re-indexing one subtree (a rollout's whole tree is about 20;
/// the bound keeps a corrupted graph from costing more).
const MAX_SUBTREE: usize = 4096;

impl Stitcher {
    /// Indexes the in-flight inbound requests at and below `top` under the rollout each
    /// belongs to now.
    pub(super) fn index_rollouts_below(&mut self, top: SpanId) {
        let mut stack = std::mem::take(&mut self.walk);
        stack.clear();
        stack.push(top);
        let mut visited = 0;
        while let Some(id) = stack.pop() {
            visited += 1;
            if visited > MAX_SUBTREE {
                break;
            }
            let Some(node) = self.nodes.get(&id) else {
                continue;
            };
            stack.extend(node.children.iter().copied());
            if node.role != Role::Server || node.finished {
                continue;
            }
            let pid = node.pid;
            let Some(rollout) = self.effective_rollout(id).cloned() else {
                continue;
            };
            let list = self.rollout_inbound.entry((pid, rollout)).or_default();
            if !list.contains(&id) {
                list.push(id);
            }
        }
        self.walk = stack;
    }

    /// A request of the index finished: out of its rollout's list.
    pub(super) fn unindex_rollout(&mut self, request: SpanId) {
        let Some(node) = self.nodes.get(&request) else {
            return;
        };
        let pid = node.pid;
        let Some(rollout) = self.effective_rollout(request).cloned() else {
            return;
        };
        let key = (pid, rollout);
        if let Some(list) = self.rollout_inbound.get_mut(&key) {
            list.retain(|id| *id != request);
            if list.is_empty() {
                self.rollout_inbound.remove(&key);
            }
        }
    }

    /// The in-flight inbound requests of `pid` that belong to `rollout`.
    pub(super) fn in_flight_of_rollout<'a>(
        &'a self,
        pid: u32,
        rollout: &'a RolloutId,
    ) -> impl Iterator<Item = SpanId> + 'a {
        self.rollout_inbound
            .get(&(pid, rollout.clone()))
            .into_iter()
            .flatten()
            .copied()
            .filter(move |id| {
                self.nodes.get(id).is_some_and(|n| !n.finished)
                    && self.effective_rollout(*id) == Some(rollout)
            })
    }
}
