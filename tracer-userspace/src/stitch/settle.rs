//! When a finished span may go: when nothing that could still change its parent or trace can
//! come, decided by events, never by a clock. A span is resolved (parent and trace fixed) as
//! soon as every request on its chain up to its root is *settled*; until then it is held,
//! filed under the first unsettled request on the chain, and looked at again when that
//! request settles. Per kind of evidence, the event that closes it:
//! - **the caller's end of a connection on this host** (a SERVER span's parent): a server
//!   request whose connection is a traced process's client connection here (both addresses:
//!   [`StartFacts::caller_seen_here`]; the client's connect was reported before it could
//!   write) waits for the client's start,
//!   however long the request sat in the socket buffer. It stops waiting when the connection
//!   ends (either end's close, or the table's eviction), when another request starts on the
//!   connection (HTTP/1.x: the client wrote this one before it read the answer to the next
//!   one's predecessor, so its start was reported first), or when the process exits; each
//!   counted as `callers_unseen`. A server request whose caller is not a traced socket waits
//!   for nothing (its caller is not traced, or attached after the connection was opened);
//! - **the call's own evidence** (a CLIENT span's parent: rollout id, cookie, task context,
//!   lineage, the echoed response id, the response's task context, the loop tail learned from
//!   a response): every item names a request that was in flight when the call started, and
//!   arrives before that request ends (its head, body and response come first). So an
//!   undecided call waits until every inbound request of its process that started before it
//!   has ended; then it is left undecided for good and counted by why (`parents_*`);
//! - **a placed edge** never changes after a span below it went out (`parents_decided_late`
//!   counts an edge found after that, which is not drawn): a request whose trace is fixed is
//!   settled.
//!
//! Connection keys wait for their other end by the same events: at most one per direction
//! per connection (HTTP/1.x answers in order), so their memory is bounded by the connection
//! table's. Every outbound request to an address of this host is counted once in
//! `local_calls` and ends in exactly one of `cross_process_links`,
//! `local_calls_parented_by_header` or a `local_calls_unlinked_*` reason.
//!
//! Memory, not time, bounds the rest: held spans (`--max-stitching-spans`, the oldest then
//! released early: `spans_released_early`), and finished requests, kept while anything needs
//! them (a span of theirs held, a request hanging under them, a key waiting) and then for
//! [`RETIRED_KEEP`] more requests, for calls that outlive their caller.
//!
//! [`StartFacts::caller_seen_here`]: super::StartFacts::caller_seen_here

use std::net::SocketAddr;

use super::{Held, Parent, RequestPosition, Stitcher};
use crate::model::exchange::Role;
use crate::model::ids::SpanId;
use crate::model::span::SpanRecord;

/// Finished requests nothing refers to any more, kept so that a call made after its caller
/// answered (a fire-and-forget task of a request root) still finds it: about 300 bytes each.
pub(super) const RETIRED_KEEP: usize = 16_384;

/// What a request's parent still waits for (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Awaiting {
    /// A server request: the start of its traced caller's request on this host.
    Caller,
    /// A call: evidence, while a request that was in flight at its start is still in flight.
    Evidence,
}

/// The two ends of one TCP connection, as both see it.
pub(super) type ConnectionPair = (SocketAddr, SocketAddr);

/// A request on a connection waiting for the other end's start.
#[derive(Clone, Copy, Debug)]
pub(super) struct Waiting {
    pub(super) position: RequestPosition,
    pub(super) request: SpanId,
}

/// Why a waiting connection key was given up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum GivenUp {
    /// Another request started on the connection first.
    NextRequest,
    /// The connection ended.
    Closed,
    /// Its process exited.
    ProcessExit,
    /// The agent is shutting down.
    Shutdown,
}

impl Stitcher {
    /// The first request on `id`'s chain whose parent may still change, if any.
    pub(super) fn unsettled_on_chain(&self, mut id: SpanId) -> Option<SpanId> {
        for _ in 0..super::MAX_DEPTH {
            let node = self.nodes.get(&id)?;
            if node.trace.is_some() {
                return None; // fixed: nothing above it changes any more
            }
            if node.awaiting.is_some() {
                return Some(id);
            }
            match node.parent {
                Parent::Local(parent) => id = parent,
                Parent::None | Parent::Remote(..) => return None,
            }
        }
        None
    }

    /// Holds a finished span until its chain is settled; resolves it at once if it is.
    pub fn hold(
        &mut self,
        request: SpanId,
        role: super::SpanRole,
        span: SpanRecord,
        out: &mut Vec<SpanRecord>,
    ) {
        let held = Held {
            node: request,
            role,
            span,
        };
        let Some(blocker) = self.unsettled_on_chain(request) else {
            out.push(self.resolve(held));
            return;
        };
        if self.held.len() >= self.config.max_pending {
            self.release_oldest(out);
        }
        let handle = self.next_held;
        self.next_held += 1;
        if let Some(node) = self.nodes.get_mut(&request) {
            node.held_spans += 1;
        }
        self.held.insert(handle, held);
        self.held_order.push_back(handle);
        self.blocked.entry(blocker).or_default().push(handle);
    }

    fn release_oldest(&mut self, out: &mut Vec<SpanRecord>) {
        while let Some(handle) = self.held_order.pop_front() {
            if let Some(held) = self.held.remove(&handle) {
                self.counters.spans_released_early += 1;
                out.push(self.resolve_held(held));
                return;
            }
        }
    }

    /// Resolves a span that was held: its request no longer needs to stay for it.
    fn resolve_held(&mut self, held: Held) -> SpanRecord {
        let request = held.node;
        let span = self.resolve(held);
        if let Some(node) = self.nodes.get_mut(&request) {
            node.held_spans = node.held_spans.saturating_sub(1);
        }
        self.maybe_retire(request);
        span
    }

    /// A request settled (its parent was drawn, or nothing can draw it any more): the spans
    /// filed under it are looked at again on the next [`Stitcher::release`].
    pub(super) fn wake(&mut self, request: SpanId) {
        if self.blocked.contains_key(&request) {
            self.woken.push(request);
        }
    }

    /// Releases the spans whose chains settled since the last call.
    pub(super) fn release_settled(&mut self, out: &mut Vec<SpanRecord>) {
        while let Some(request) = self.woken.pop() {
            let Some(handles) = self.blocked.remove(&request) else {
                continue;
            };
            for handle in handles {
                let Some(node) = self.held.get(&handle).map(|h| h.node) else {
                    continue; // released early
                };
                match self.unsettled_on_chain(node) {
                    None => {
                        let held = self.held.remove(&handle).expect("checked");
                        out.push(self.resolve_held(held));
                    }
                    Some(blocker) => self.blocked.entry(blocker).or_default().push(handle),
                }
            }
        }
        if self.held_order.len() > 2 * self.held.len() + 1024 {
            let held = &self.held;
            self.held_order.retain(|handle| held.contains_key(handle));
        }
    }

    /// Releases everything held, settled or not (at shutdown); keys still waiting are given
    /// up, counted.
    pub fn release_all(&mut self, out: &mut Vec<SpanRecord>) {
        let pairs: Vec<ConnectionPair> = self
            .waiting_clients
            .keys()
            .chain(self.waiting_servers.keys())
            .copied()
            .collect();
        for pair in pairs {
            self.give_up_pair(pair, GivenUp::Shutdown);
        }
        while let Some(handle) = self.held_order.pop_front() {
            if let Some(held) = self.held.remove(&handle) {
                out.push(self.resolve_held(held));
            }
        }
        self.blocked.clear();
    }

    /// The request's parent was drawn, or can no longer be: it awaits nothing.
    pub(super) fn settle(&mut self, request: SpanId) {
        let Some(node) = self.nodes.get_mut(&request) else {
            return;
        };
        let Some(awaiting) = node.awaiting.take() else {
            return;
        };
        let (own, started) = (node.pid, node.started);
        let pid = self.evidence_pid(request, own);
        if awaiting == Awaiting::Evidence
            && let Some(open) = self.open_calls.get_mut(&pid)
        {
            open.remove(&started);
        }
        self.wake(request);
        self.maybe_retire(request);
    }

    /// An undecided call waits while a request that could be its parent is in flight.
    pub(super) fn await_evidence(&mut self, call: SpanId) {
        let Some(node) = self.nodes.get_mut(&call) else {
            return;
        };
        if node.awaiting.is_some() || node.parent != Parent::None {
            return;
        }
        let candidates_in_flight = self
            .inbound
            .get(&node.pid)
            .and_then(|list| list.keys().next())
            .is_some_and(|oldest| *oldest < node.started);
        if candidates_in_flight {
            node.awaiting = Some(Awaiting::Evidence);
            self.open_calls
                .entry(node.pid)
                .or_default()
                .insert(node.started, call);
        }
    }

    /// An inbound request of `pid` ended: the calls that started before every request still
    /// in flight can get no more evidence.
    pub(super) fn close_evidence(&mut self, pid: u32) {
        let oldest = self
            .inbound
            .get(&pid)
            .and_then(|list| list.keys().next().copied())
            .unwrap_or(u64::MAX);
        let Some(open) = self.open_calls.get_mut(&pid) else {
            return;
        };
        let still_open = open.split_off(&oldest);
        let closed = std::mem::replace(open, still_open);
        if open.is_empty() {
            self.open_calls.remove(&pid);
        }
        for call in closed.into_values() {
            if let Some(node) = self.nodes.get_mut(&call) {
                node.awaiting = None;
            }
            self.evidence_pid(call, pid);
            self.wake(call);
            self.maybe_retire(call);
        }
    }

    /// A new waiting key on `pair` for `side`: the one it replaces is given up.
    pub(super) fn wait_for_other_end(
        &mut self,
        side: Role,
        pair: ConnectionPair,
        waiting: Waiting,
    ) {
        let map = match side {
            Role::Client => &mut self.waiting_clients,
            Role::Server => &mut self.waiting_servers,
        };
        if let Some(old) = map.insert(pair, waiting) {
            self.give_up(side, old, GivenUp::NextRequest);
        }
        if side == Role::Client
            && let Some(node) = self.nodes.get_mut(&waiting.request)
        {
            node.keyed = true;
        }
    }

    /// The waiting request of the other end (`side`) on `pair`, if it is the same request;
    /// one at another position was missed by this end and is given up.
    pub(super) fn take_other_end(
        &mut self,
        side: Role,
        pair: ConnectionPair,
        position: RequestPosition,
    ) -> Option<SpanId> {
        let map = match side {
            Role::Client => &mut self.waiting_clients,
            Role::Server => &mut self.waiting_servers,
        };
        let waiting = map.remove(&pair)?;
        if waiting.position == position {
            if side == Role::Client {
                self.unkey(waiting.request);
            }
            return Some(waiting.request);
        }
        self.give_up(side, waiting, GivenUp::NextRequest);
        None
    }

    /// One end of a connection ended (closed, evicted from the table): whatever waits on it
    /// waits for nothing more.
    pub fn connection_ended(&mut self, pair: ConnectionPair) {
        self.give_up_pair(pair, GivenUp::Closed);
    }

    fn give_up_pair(&mut self, pair: ConnectionPair, why: GivenUp) {
        if let Some(waiting) = self.waiting_clients.remove(&pair) {
            self.give_up(Role::Client, waiting, why);
        }
        if let Some(waiting) = self.waiting_servers.remove(&pair) {
            self.give_up(Role::Server, waiting, why);
        }
    }

    /// A process exited: its keys, its undecided calls and its requests in flight wait for
    /// nothing more.
    pub(super) fn process_gone(&mut self, pid: u32) {
        let nodes = &self.nodes;
        let of_pid = |(pair, waiting): (&ConnectionPair, &Waiting)| {
            let theirs = nodes.get(&waiting.request).is_some_and(|n| n.pid == pid);
            theirs.then_some(*pair)
        };
        let clients: Vec<ConnectionPair> = self.waiting_clients.iter().filter_map(of_pid).collect();
        let servers: Vec<ConnectionPair> = self.waiting_servers.iter().filter_map(of_pid).collect();
        for pair in clients {
            let waiting = self.waiting_clients.remove(&pair).expect("listed");
            self.give_up(Role::Client, waiting, GivenUp::ProcessExit);
        }
        for pair in servers {
            let waiting = self.waiting_servers.remove(&pair).expect("listed");
            self.give_up(Role::Server, waiting, GivenUp::ProcessExit);
        }
        let in_flight: Vec<SpanId> = self
            .inbound
            .remove(&pid)
            .map(|list| list.into_values().collect())
            .unwrap_or_default();
        for request in in_flight {
            self.unindex_rollout(request);
            if let Some(node) = self.nodes.get_mut(&request) {
                node.finished = true;
            }
            self.maybe_retire(request);
        }
        self.close_evidence(pid);
    }

    fn give_up(&mut self, side: Role, waiting: Waiting, why: GivenUp) {
        match side {
            Role::Client => {
                let counter = match why {
                    GivenUp::NextRequest => &mut self.counters.local_calls_unlinked_next_request,
                    GivenUp::Closed => &mut self.counters.local_calls_unlinked_closed,
                    GivenUp::ProcessExit => &mut self.counters.local_calls_unlinked_process_exit,
                    GivenUp::Shutdown => &mut self.counters.local_calls_unlinked_shutdown,
                };
                *counter += 1;
                self.unkey(waiting.request);
            }
            Role::Server => {
                let awaited = self
                    .nodes
                    .get(&waiting.request)
                    .is_some_and(|n| n.awaiting == Some(Awaiting::Caller));
                self.counters.callers_unseen += u64::from(awaited);
                self.settle(waiting.request);
            }
        }
    }

    fn unkey(&mut self, request: SpanId) {
        if let Some(node) = self.nodes.get_mut(&request) {
            node.keyed = false;
        }
        self.maybe_retire(request);
    }

    /// Queues a finished request nothing needs any more for removal.
    pub(super) fn maybe_retire(&mut self, request: SpanId) {
        if self.nodes.get(&request).is_some_and(|n| !n.pinned()) {
            self.retired.push_back(request);
        }
    }

    /// Removes retired requests past [`RETIRED_KEEP`]; true if any went.
    pub(super) fn trim_retired(&mut self, keep: usize) -> bool {
        let mut removed = false;
        while self.retired.len() > keep {
            let Some(request) = self.retired.pop_front() else {
                break;
            };
            removed |= self.remove_node(request);
        }
        removed
    }

    /// Removes a request nothing needs; its parent may then be free too.
    fn remove_node(&mut self, request: SpanId) -> bool {
        if self.nodes.get(&request).is_none_or(|n| n.pinned()) {
            return false; // needed again since it was retired, or gone
        }
        let node = self.nodes.remove(&request).expect("checked");
        if let Parent::Local(parent) = node.parent {
            self.release_child(parent, request);
        }
        true
    }

    /// `child` no longer hangs under `parent`.
    pub(super) fn release_child(&mut self, parent: SpanId, child: SpanId) {
        if let Some(node) = self.nodes.get_mut(&parent) {
            node.children.retain(|c| *c != child);
        }
        self.maybe_retire(parent);
    }

    /// Makes room for one request in a full graph: the retired request retired longest ago
    /// goes, counted. False when every request in the graph is still needed.
    pub(super) fn evict_one(&mut self) -> bool {
        while let Some(request) = self.retired.pop_front() {
            if self.remove_node(request) {
                self.counters.stitch_nodes_evicted += 1;
                self.forget_gone_calls();
                return true;
            }
        }
        false
    }
}
