//! The id each CLIENT span goes out with, and the check that no two share one.
//!
//! Every span's id is random ([`SpanId::random`], given when its request starts) but for the
//! calls another agent must name without seeing them: a call to another host, whose callee's
//! agent names it as the SERVER span's parent, and any call the kernel may have written a
//! `traceparent` into (`--inject-traceparent`). Those go out as [`SpanId::of_call`] of their
//! trace and the TCP sequence number of their first byte, which both ends know. Two such
//! calls share an id only if they are in one trace and their first bytes have one number;
//! the first one released keeps it, a later one in the window goes out under its own random
//! id and is counted (its callee, if it names the shared id, then names the first call).

use std::collections::VecDeque;

use foldhash::{HashSet, HashSetExt};

use super::Stitcher;
use crate::model::ids::{SpanId, TraceId};

/// The id a call's CLIENT span goes out with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum CallId {
    /// The request's own random id: only this agent names the span (both ends are on this
    /// host; an inbound request; a request whose sequence number the kernel did not read).
    Own,
    /// Derived from its trace and this TCP sequence number once its trace is fixed: another
    /// agent, or a header the kernel wrote, names it too.
    Shared(u32),
    /// Decided, at the first release of a span that names it
    /// ([`Stitcher::exported_call_id`]).
    Fixed(SpanId),
}

impl CallId {
    /// A call's: [`CallId::Shared`] when its number is known and `named_elsewhere`.
    pub(super) fn of_call(tcp_seq: Option<u32>, named_elsewhere: bool) -> Self {
        match tcp_seq {
            Some(seq) if named_elsewhere => Self::Shared(seq),
            _ => Self::Own,
        }
    }
}

/// The shared ids given out lately, oldest first, at most `capacity`: a second call with one
/// of them goes out under its own id.
pub(super) struct SharedIds {
    given: HashSet<SpanId>,
    order: VecDeque<SpanId>,
    capacity: usize,
}

impl SharedIds {
    pub(super) fn new(capacity: usize) -> Self {
        Self {
            given: HashSet::new(),
            order: VecDeque::new(),
            capacity: capacity.max(1),
        }
    }

    /// Takes `id` if no call in the window has it; returns whether it did, and whether an
    /// older id left the window to make room.
    fn take(&mut self, id: SpanId) -> (bool, bool) {
        if self.given.contains(&id) {
            return (false, false);
        }
        let mut forgot = false;
        if self.order.len() >= self.capacity
            && let Some(oldest) = self.order.pop_front()
        {
            self.given.remove(&oldest);
            forgot = true;
        }
        self.given.insert(id);
        self.order.push_back(id);
        (true, forgot)
    }
}

impl Stitcher {
    /// The id the CLIENT span of call `id`, in `trace`, goes out with (the span itself, or a
    /// span below it that names it as parent): decided once, so that both agree.
    pub(super) fn exported_call_id(&mut self, id: SpanId, trace: TraceId) -> SpanId {
        let Some(node) = self.nodes.get(&id) else {
            return id;
        };
        let seq = match node.call_id {
            CallId::Own => return id,
            CallId::Fixed(exported) => return exported,
            CallId::Shared(seq) => seq,
        };
        let derived = SpanId::of_call(trace, seq);
        let (taken, forgot) = self.shared_ids.take(derived);
        self.counters.shared_call_ids_forgotten += u64::from(forgot);
        let exported = if taken {
            derived
        } else {
            self.counters.shared_call_ids_repeated += 1;
            id
        };
        if let Some(node) = self.nodes.get_mut(&id) {
            node.call_id = CallId::Fixed(exported);
        }
        exported
    }

    /// Whether `span`, in `trace`, is the id the kernel writes into call `client`'s
    /// `traceparent` (`--inject-traceparent`): the header is this agent's own.
    pub(super) fn is_injected_id(&self, client: SpanId, trace: TraceId, span: SpanId) -> bool {
        self.nodes
            .get(&client)
            .and_then(|c| c.tcp_seq)
            .is_some_and(|seq| SpanId::of_call(trace, seq) == span)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_repeated_id_is_refused_while_in_the_window() {
        let mut ids = SharedIds::new(2);
        let (a, b, c) = (SpanId([1; 8]), SpanId([2; 8]), SpanId([3; 8]));
        assert_eq!(ids.take(a), (true, false));
        assert_eq!(ids.take(a), (false, false));
        assert_eq!(ids.take(b), (true, false));
        assert_eq!(ids.take(c), (true, true));
        // `a` left the window: taken again, and counted as forgotten by the caller.
        assert_eq!(ids.take(a), (true, true));
    }
}
